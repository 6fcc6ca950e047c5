"""The sidecar end to end: real gRPC on loopback, real local Ray, real `rlfeed serve`.

Clients here use only the generated `rlfeed_pb2` / `rlfeed_pb2_grpc` modules (and pyarrow
or the test helpers to build payloads), never rlfeed's client library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import SyntheticRollouts, check_served_step, synthetic_groups

GROUPS = {"prompts_per_step": 2, "group_size": 4}


class Client:
    """Stubs of one channel, plus GetBatch as raw response bytes."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.ingest = pb_grpc.RolloutIngestStub(self.channel)
        self.tasks = pb_grpc.TaskSamplingStub(self.channel)
        self.batches = pb_grpc.BatchServingStub(self.channel)
        self.status = pb_grpc.SidecarStatusStub(self.channel)
        self.get_batch_bytes = self.channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,  # keep the exact bytes the server sent
        )

    def submit(self, rollouts: SyntheticRollouts, rows=None, sequence: int = 0) -> pb.SubmitAck:
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows), sequence=sequence)
        return self.ingest.SubmitRolloutBatch(batch, timeout=30)

    def step_bytes(self, step: int, world_size: int) -> list[bytes]:
        request = lambda rank: pb.GetBatchRequest(step=step, rank=rank, timeout_ms=10_000)  # noqa: E731
        return [self.get_batch_bytes(request(rank), timeout=30) for rank in range(world_size)]

    def get_status(self) -> pb.StatusResponse:
        return self.status.GetStatus(pb.GetStatusRequest(), timeout=10)


@pytest.fixture
def client_for():
    clients = []

    def make(sidecar) -> Client:
        clients.append(Client(sidecar.address))
        return clients[-1]

    yield make
    for client in clients:
        client.channel.close()


def _register(client: Client, rollouts: SyntheticRollouts) -> None:
    client.tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids))))


def test_proto_only_client_streams_rollouts_and_reads_packed_microbatches(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "token_budget": 64})
    client = client_for(sidecar)
    client.tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=["add", "sort"]))
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 40, size=8)
    tokens = [rng.integers(0, 500, n).astype(np.int32) for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.uint8) for n in lengths]
    logprobs = [np.where(m == 1, -0.5, 0.0).astype(np.float32) for m in masks]
    ids = [f"raw-{i}" for i in range(8)]
    table = pa.table(
        {
            "rollout_id": ids,
            "task_id": ["add"] * 4 + ["sort"] * 4,
            "group_id": ["ga"] * 4 + ["gs"] * 4,
            "policy_version": pa.array([0] * 8, pa.int64()),
            "reward": pa.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], pa.float64()),
            "token_ids": pa.array(tokens, pa.list_(pa.int32())),
            "action_mask": pa.array(masks, pa.list_(pa.uint8())),
            "sampler_logprobs": pa.array(logprobs, pa.list_(pa.float32())),
        }
    )

    def batches():
        for sequence, rows in enumerate((range(0, 5), range(5, 8))):
            sink = pa.BufferOutputStream()
            part = table.take(list(rows))
            with pa.ipc.new_stream(sink, part.schema) as writer:
                writer.write_table(part)
            yield pb.RolloutBatch(arrow_ipc=sink.getvalue().to_pybytes(), sequence=sequence)

    acks = list(client.ingest.SubmitRollouts(batches(), timeout=30))
    assert [(a.sequence, a.accepted) for a in acks] == [(0, 5), (1, 3)]

    served: dict[str, np.ndarray] = {}
    global_count = None
    for rank in range(2):
        response = client.batches.GetBatch(
            pb.GetBatchRequest(step=0, rank=rank, timeout_ms=10_000), timeout=30
        )
        assert response.ready and len(response.microbatches) == response.microbatches_per_rank
        global_count = response.policy_token_count
        for microbatch in response.microbatches:
            row = pa.ipc.open_stream(microbatch.arrow_ipc).read_all()
            input_ids = row.column("input_ids").to_numpy()
            position_ids = row.column("position_ids").to_numpy()
            loss_mask = row.column("loss_mask").to_numpy()
            cu = np.asarray(microbatch.cu_seqlens)
            assert cu[-1] == row.num_rows
            for k, rollout_id in enumerate(microbatch.rollout_ids):
                span = slice(cu[k], cu[k + 1])
                np.testing.assert_array_equal(position_ids[span], np.arange(cu[k + 1] - cu[k]))
                assert rollout_id not in served
                served[rollout_id] = input_ids[span]
                np.testing.assert_array_equal(
                    loss_mask[span], np.r_[masks[ids.index(rollout_id)][1:], 0]
                )
    assert sorted(served) == sorted(ids)
    for i, rollout_id in enumerate(ids):
        np.testing.assert_array_equal(served[rollout_id], tokens[i])
    assert global_count == sum(int(m.sum()) for m in masks)


def test_every_policy_token_is_served_once_per_step_and_refetches_are_identical(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 3, "token_budget": 300})
    client = client_for(sidecar)
    rng = np.random.default_rng(1)
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=rng, max_length=300)
    _register(client, rollouts)
    order = rng.permutation(len(rollouts))
    for sequence, start in enumerate(range(0, len(order), 5)):
        client.submit(rollouts, order[start : start + 5], sequence)
    served = []
    for step in range(3):
        first = client.step_bytes(step, 3)
        served += check_served_step(first, rollouts)
        assert client.step_bytes(step, 3) == first  # a restarted trainer sees the same bytes
    assert sorted(served) == sorted(rollouts.rollout_ids)
    status = client.get_status()
    assert status.next_step == 3 and status.buffered_rollouts == 0
    assert status.counters.policy_tokens_assembled == sum(
        int(m.sum()) for m in rollouts.action_mask
    )


def test_duplicates_stale_rollouts_and_zero_advantage_groups_are_counted(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(
        rollouts={**GROUPS, "max_policy_lag": 1}, advantages={"drop_zero_advantage": True}
    )
    client = client_for(sidecar)
    rng = np.random.default_rng(2)
    old = synthetic_groups(num_groups=1, group_size=4, rng=rng, prefix="old", policy_version=0)
    new = synthetic_groups(num_groups=3, group_size=4, rng=rng, prefix="new", policy_version=2)
    new.rewards[:] = [1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0]  # new-g1 is all-pass: no gradient
    _register(client, old)
    _register(client, new)
    assert client.submit(old, range(2)).accepted == 2
    first = client.submit(new, range(6))
    assert (first.accepted, first.duplicate) == (6, 0)
    again = client.submit(new, range(12))
    assert (again.accepted, again.duplicate) == (6, 6)
    late = client.submit(old, range(2, 4))
    assert (late.accepted, late.stale) == (0, 2)
    served = check_served_step(client.step_bytes(0, 1), new)
    assert {r.split("-")[0] for r in served} == {"newg0", "newg2"}
    counters = client.get_status().counters
    assert counters.rollouts_duplicate == 6 and counters.rollouts_stale == 4
    assert counters.zero_advantage_groups == 1 and counters.zero_advantage_rollouts_dropped == 4


def _corrupt(rollouts: SyntheticRollouts, row: int, field: str, value) -> SyntheticRollouts:
    broken = rollouts.subset(range(len(rollouts)))
    if field in ("rewards", "task_ids", "rollout_ids", "group_ids"):
        getattr(broken, field)[row] = value
    else:
        array = getattr(broken, field)[row].copy()
        if value == "grow":
            array = np.r_[array, 0].astype(array.dtype)
        else:
            array[0 if field == "action_mask" else -1] = value
        getattr(broken, field)[row] = array
    return broken


BAD_INPUTS = [
    ("action_mask", "grow", "action_mask"),
    ("sampler_logprobs", "grow", "sampler_logprobs"),
    ("rewards", float("nan"), "reward"),
    ("sampler_logprobs", float("inf"), "sampler_logprobs"),
    ("token_ids", 5000, "token_ids"),
    ("token_ids", -3, "token_ids"),
    ("task_ids", "never-registered", "task_id"),
    ("action_mask", 1, "action_mask"),
    ("rollout_ids", "bad-g1-r0", "rollout_id"),  # same id as row 0 of the batch
]


def test_bad_batches_get_invalid_argument_and_leave_the_service_intact(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(
        rollouts={**GROUPS, "vocab_size": 1000}, batching={"world_size": 2, "token_budget": 120}
    )
    client = client_for(sidecar)
    rollouts = synthetic_groups(
        num_groups=2, group_size=4, rng=np.random.default_rng(3), prefix="bad-", max_length=100
    )
    _register(client, rollouts)
    assert client.submit(rollouts, range(4)).accepted == 4  # group bad-g0, before the errors
    tail = list(range(4, 8))
    for field, value, named in BAD_INPUTS:
        broken = _corrupt(rollouts, 5, field, value)
        with pytest.raises(grpc.RpcError) as error:
            client.submit(broken, tail)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value)
        assert f"rollout '{broken.rollout_ids[5]}': field {named}" in error.value.details()
    too_long = rollouts.subset(range(8))
    for name in ("token_ids", "action_mask", "sampler_logprobs"):
        array = getattr(too_long, name)[5]
        getattr(too_long, name)[5] = np.resize(array, 121).astype(array.dtype)
    too_long.action_mask[5][0] = 0
    for payload, message in (
        (too_long.encode(tail), "rollout 'bad-g1-r1': field token_ids: 121 tokens"),
        (b"not arrow at all", "not a readable Arrow IPC stream"),
    ):
        with pytest.raises(grpc.RpcError) as error:
            client.ingest.SubmitRolloutBatch(pb.RolloutBatch(arrow_ipc=payload), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
    assert client.get_status().counters.batches_rejected == len(BAD_INPUTS) + 2
    assert client.submit(rollouts, tail).accepted == 4
    served = check_served_step(client.step_bytes(0, 2), rollouts)
    assert sorted(served) == sorted(rollouts.rollout_ids)


def test_a_rejected_batch_ends_its_stream_but_keeps_the_batches_acknowledged_before(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts=GROUPS)
    client = client_for(sidecar)
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(5))
    _register(client, rollouts)
    broken = _corrupt(rollouts, 5, "rewards", float("nan"))
    stream = client.ingest.SubmitRollouts(
        iter(
            [
                pb.RolloutBatch(arrow_ipc=rollouts.encode(range(4)), sequence=1),
                pb.RolloutBatch(arrow_ipc=broken.encode(range(4, 8)), sequence=2),
                pb.RolloutBatch(arrow_ipc=rollouts.encode(range(4, 8)), sequence=3),
            ]
        ),
        timeout=30,
    )
    assert next(stream).accepted == 4
    with pytest.raises(grpc.RpcError) as error:
        next(stream)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout 'g1-r1': field reward" in error.value.details()
    assert client.get_status().buffered_rollouts == 4  # batch 3 was never read
    assert client.submit(rollouts, range(4, 8)).accepted == 4
    check_served_step(client.step_bytes(0, 1), rollouts)


def test_a_full_buffer_answers_resource_exhausted_until_ranks_fetch(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts={**GROUPS, "max_buffered_rollouts": 8})
    client = client_for(sidecar)
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(6))
    _register(client, rollouts)
    assert client.submit(rollouts, range(8)).accepted == 8  # step 0, not fetched yet
    with pytest.raises(grpc.RpcError) as error:
        client.submit(rollouts, range(8, 12))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_buffered_rollouts" in error.value.details()
    assert client.get_status().counters.batches_rejected == 0  # backpressure, not rejection
    client.step_bytes(0, 1)
    assert client.submit(rollouts, range(8, 16)).accepted == 8


def test_get_batch_waits_for_its_step_and_answers_not_ready_after_the_timeout(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"retained_steps": 1})
    client = client_for(sidecar)
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(4))
    _register(client, rollouts)
    started = time.monotonic()
    early = client.batches.GetBatch(pb.GetBatchRequest(step=0, rank=0, timeout_ms=200), timeout=10)
    assert not early.ready and 0.15 <= time.monotonic() - started < 5
    result = {}
    waiter = threading.Thread(
        target=lambda: result.setdefault("bytes", client.step_bytes(0, 1)), daemon=True
    )
    waiter.start()
    time.sleep(0.3)
    client.submit(rollouts, range(8))
    waiter.join(timeout=10)
    check_served_step(result["bytes"], rollouts)
    with pytest.raises(grpc.RpcError) as error:
        client.batches.GetBatch(pb.GetBatchRequest(step=0, rank=1), timeout=10)
    assert (
        error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 1" in error.value.details()
    )
    client.submit(rollouts, range(8, 16))
    client.step_bytes(1, 1)  # step 0 was fetched; with retained_steps=1 it is now released
    with pytest.raises(grpc.RpcError) as error:
        client.batches.GetBatch(pb.GetBatchRequest(step=0, rank=0), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_step_is_released_once_every_rank_acknowledged_it_not_when_fetched(
    make_sidecar, client_for
) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "retained_steps": 1})
    client = client_for(sidecar)
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=np.random.default_rng(6))
    _register(client, rollouts)
    client.submit(rollouts)

    def ack(rank: int, through_step: int | None) -> int:
        request = pb.AckStepsRequest(rank=rank, through_step=through_step)
        return client.batches.AckSteps(request, timeout=10).acked_through

    assert [ack(0, None), ack(1, None)] == [-1, -1]  # "we acknowledge": fetches do not count
    served = {step: client.step_bytes(step, 2) for step in range(3)}  # every rank, every step
    with pytest.raises(grpc.RpcError) as error:
        ack(0, 3)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "through_step: step 3 has not been assembled" in error.value.details()
    assert [ack(0, 1), ack(0, 0), ack(1, 1)] == [1, 1, 1]  # cumulative, idempotent
    with pytest.raises(grpc.RpcError) as error:
        client.step_bytes(0, 2)  # acknowledged by every rank, and step 1 (retained) is newer
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "every rank acknowledged it" in error.value.details()
    # Fetched by every rank, as step 0 was: kept, byte-identical, until acknowledged.
    assert client.step_bytes(1, 2) == served[1] and client.step_bytes(2, 2) == served[2]


def test_health_reflection_sampling_and_trainer_reports(make_sidecar, client_for) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    sidecar = make_sidecar(
        rollouts=GROUPS, curriculum={"seed": 1}, security={"allow_reflection": True}
    )
    client = client_for(sidecar)
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "rlfeed.v1.BatchServing", "rlfeed.v1.RolloutIngest"):
        check = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(client.channel).get_services())
    assert {
        "rlfeed.v1.BatchServing",
        "rlfeed.v1.SidecarStatus",
        "grpc.health.v1.Health",
    } <= services

    added = client.tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=["a", "b", "c", "a"]))
    assert (added.added, added.total_tasks) == (3, 3)
    sample = client.tasks.SampleTasks(pb.SampleTasksRequest(n=0), timeout=10)
    assert len(sample.task_ids) == 2 and set(sample.task_ids) <= {"a", "b", "c"}
    assert list(sample.pass_rate) == [0.5, 0.5]
    client.batches.ReportTrainerMetrics(
        pb.TrainerReport(step=3, rank=0, loss=0.25, ratio_outlier_share=0.0, tokens_per_second=9e3),
        timeout=10,
    )
    with pytest.raises(grpc.RpcError) as error:
        client.batches.ReportTrainerMetrics(pb.TrainerReport(step=3, rank=4_000_000), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field rank" in error.value.details()
    status = client.get_status()
    assert status.tasks_total == 3 and status.tasks_inside_filter == 3
    assert status.counters.tasks_requested == 2 and status.counters.trainer_reports == 1
    assert status.last_reports[0].loss == 0.25 and status.last_reports[0].step == 3


def _rlfeed(*args: str, **kwargs) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "rlfeed", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
    if kwargs.pop("background", False):
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def _listening_line(server: subprocess.Popen) -> str:
    """The `rlfeed serve: listening on HOST:PORT (...)` line of a background `rlfeed serve`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        assert line or server.poll() is None, "rlfeed serve exited during start-up"
        if line.startswith("rlfeed serve: listening on "):
            return line
    raise AssertionError("rlfeed serve did not print its address")


def _listening_address(server: subprocess.Popen) -> str:
    """The HOST:PORT a background `rlfeed serve` prints once it is serving."""
    return _listening_line(server).split()[4]


def test_rlfeed_serve_answers_health_and_status_then_stops_on_sigterm(tmp_path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text('[batching]\nworld_size = 2\n[ray]\nactor_name = "serve-under-test"\n')
    server = _rlfeed("serve", "--config", str(config), "--port", "0", background=True)
    try:
        address = _listening_address(server)
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        shown = _rlfeed("status", "--address", address, "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        assert status["health"] == "SERVING" and status["world_size"] == 2
        assert status["next_step"] == 0 and status["steps_waiting"] == []
        stopping = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
        assert time.monotonic() - stopping < 10
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    gone = _rlfeed("status", "--address", address, "--timeout", "1")
    assert gone.returncode == 1 and "nothing answers at" in gone.stderr


def test_event_hooks_see_ingest_rejects_steps_fetches_samples_and_reports(
    ray_local, client_for
) -> None:
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.events import ServerEvents
    from rlfeed.service.frontend.server import start_server

    class Recorder(ServerEvents):
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def on_ingest(self, result, *, tokens, seconds):
            self.calls.append(("ingest", result.accepted, tokens))

        def on_reject(self, error, *, rollouts, tokens):
            self.calls.append(("reject", type(error).__name__, rollouts))

        def on_step(self, record, *, responses, ready_time):
            self.calls.append(("step", record.step, record.num_rollouts, len(responses)))

        def on_served(self, step, rank, response):
            self.calls.append(("served", step, rank))
            raise RuntimeError("a broken hook must not fail the call it observes")

        def on_task_sample(self, *, requested, result):
            self.calls.append(("sample", requested, len(result.task_ids)))

        def on_trainer_report(self, rank, report):
            self.calls.append(("report", rank, report["loss"]))

    recorder = Recorder()
    config = with_overrides(
        SidecarConfig(), server={"port": 0}, rollouts=GROUPS, ray={"actor_name": "events-test"}
    )
    sidecar = start_server(config, events=recorder)
    try:
        client = client_for(sidecar)
        rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(7))
        _register(client, rollouts)
        client.tasks.SampleTasks(pb.SampleTasksRequest(), timeout=10)
        with pytest.raises(grpc.RpcError):
            client.submit(_corrupt(rollouts, 1, "rewards", float("inf")), range(4))
        client.submit(rollouts)
        check_served_step(client.step_bytes(0, 1), rollouts)
        client.batches.ReportTrainerMetrics(pb.TrainerReport(step=0, rank=0, loss=1.5), timeout=10)
    finally:
        sidecar.stop(grace=0.5)
    tokens = sum(t.size for t in rollouts.token_ids)
    calls = recorder.calls
    assert calls[:2] == [("sample", 2, 2), ("reject", "InvalidBatchError", 4)]
    # The ack does not wait for the step's assembly: these two may come in either order.
    assert sorted(calls[2:4]) == [("ingest", 8, tokens), ("step", 0, 8, 1)]
    assert calls[4:] == [("served", 0, 0), ("report", 0, 1.5)]


def test_a_failed_step_materialization_is_retried_not_lost(
    make_sidecar, client_for, monkeypatch
) -> None:
    from rlfeed.service.frontend import assembler

    real = assembler.materialize_work
    failures = []

    def fail_once(work, resolve):
        if not failures:
            failures.append(work.step)
            raise MemoryError("injected: materializing this step failed once")
        return real(work, resolve)

    monkeypatch.setattr(assembler, "materialize_work", fail_once)
    monkeypatch.setattr(assembler, "ASSEMBLY_RETRY_SECONDS", 0.05)
    sidecar = make_sidecar(rollouts=GROUPS)
    client = client_for(sidecar)
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(9))
    _register(client, rollouts)
    client.submit(rollouts)
    served = check_served_step(client.step_bytes(0, 1), rollouts)
    served += check_served_step(client.step_bytes(1, 1), rollouts)
    assert failures == [0]  # step 0 failed once, was retried, and nothing was lost
    assert sorted(served) == sorted(rollouts.rollout_ids)


_CLUSTER_HOLDER = """
import sys, ray
context = ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="held")
print(context.address_info["gcs_address"], flush=True)
sys.stdin.readline()  # the test joined the cluster with rlfeed serve and stopped it
print("alive", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
ray.shutdown()
"""


def test_rlfeed_serve_joins_a_running_ray_cluster_and_leaves_it_running(tmp_path) -> None:
    """`RAY_ADDRESS=HOST:PORT` (Ray's convention; `--ray-address` the same, and wins): the
    scheduler actor lives in that cluster (found by name from its own driver), and stopping
    the sidecar kills the actor but not the cluster.
    Ray (2.59+) authenticates every process that joins a cluster: like a deployment, every
    process here gets the cluster's token through RAY_AUTH_MODE / RAY_AUTH_TOKEN."""
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    holder = subprocess.Popen(
        [sys.executable, "-c", _CLUSTER_HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **auth},
    )
    server = None
    try:
        gcs_address = holder.stdout.readline().strip()
        assert gcs_address, "the Ray cluster did not start"
        config = tmp_path / "sidecar.toml"
        config.write_text('[ray]\nactor_name = "joined-sidecar"\nnamespace = "joined"\n')
        server = _rlfeed(
            "serve",
            "--config",
            str(config),
            "--port",
            "0",
            background=True,
            env={**auth, "RAY_ADDRESS": gcs_address},
        )
        listening = _listening_line(server)
        security = "TLS off, mTLS off, tokens off"
        assert f"(Ray at {gcs_address} from RAY_ADDRESS; {security})" in listening, listening
        address = listening.split()[4]
        shown = _rlfeed("status", "--address", address, "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["health"] == "SERVING"
        found = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import ray; ray.init(address={gcs_address!r}, namespace='joined'); "
                "print(ray.get(ray.get_actor('joined-sidecar').ping.remote()))",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **auth},
        )
        assert found.stdout.strip().endswith("True"), found.stderr[-2000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
        out, _ = holder.communicate("\n", timeout=60)
        assert "alive 42" in out, "stopping the sidecar took the cluster it joined down"
    finally:
        for process in (server, holder):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_concurrent_producers_get_every_step_materialized_once_and_served(
    make_sidecar, client_for
) -> None:
    """Many producers at once, one group per step: ingest replies (each planning a step)
    reach the assembler out of order, and batches share actor calls. Every step is still
    materialized exactly once and served with every rollout, and the front-end frees every
    ingest batch afterwards."""
    from rlfeed.service.frontend.events import ServerEvents

    class StepsSeen(ServerEvents):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step(self, record, **_) -> None:
            self.steps.append(record.step)

    seen = StepsSeen()
    sidecar = make_sidecar(
        rollouts={"prompts_per_step": 1, "group_size": 2, "max_buffered_rollouts": 100_000},
        batching={"world_size": 1, "token_budget": 4096},
        server={"max_workers": 20, "max_unary_calls": 12, "max_streams": 2, "max_long_polls": 2},
        events=lambda config: seen,
    )
    groups, producers = 240, 12
    rollouts = synthetic_groups(
        num_groups=groups, group_size=2, rng=np.random.default_rng(17), tasks=["t"]
    )
    payloads = [rollouts.encode(range(2 * g, 2 * g + 2)) for g in range(groups)]
    client = client_for(sidecar)
    _register(client, rollouts)
    errors: list = []

    def produce(first: int) -> None:
        for g in range(first, groups, producers):
            try:
                batch = pb.RolloutBatch(arrow_ipc=payloads[g], sequence=g)
                assert client.ingest.SubmitRolloutBatch(batch, timeout=60).accepted == 2
            except Exception as exc:  # reported below, with the group
                errors.append((g, exc))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors[:3]
    served = [
        rid
        for step in range(groups)
        for rid in check_served_step(client.step_bytes(step, 1), rollouts)
    ]
    assert sorted(served) == sorted(rollouts.rollout_ids)
    assert sorted(seen.steps) == list(range(groups))  # each step materialized exactly once
    deadline = time.monotonic() + 30
    while len(sidecar.frontend.payloads) or client.get_status().steps_waiting:
        assert time.monotonic() < deadline, "ingest batches or unfetched steps left over"
        time.sleep(0.01)
