"""A front-end whose journal's disk fails (full, I/O errors; injected with
`tests/service/journal/faulty_disk.py`, a fault-injecting layer under the journal's
writes and fsyncs in this process, where the front-end runs) acknowledges nothing it
could not journal: the producer gets RESOURCE_EXHAUSTED naming the cause with a retry
hint, ingest's health says NOT_SERVING and the rejection is counted by reason, already
journaled steps are served on, and once the disk takes writes again the sidecar goes on
by itself: the waiting `RolloutWriter` gets its acks, and a restart from the journal
finds every acknowledged rollout. A slow disk (200 ms fsyncs) slows the acks, nothing else.

Real gRPC on loopback, real local Ray; the scheduler actor's own journal (in a Ray worker)
is not faulted here.
"""

from __future__ import annotations

import errno
import importlib.util
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rlfeed.client.producer import RolloutWriter
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.proto.metadata import RETRY_AFTER_MS
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.testing import check_served_step, fetch_served_bytes, synthetic_groups

_spec = importlib.util.spec_from_file_location(
    "faulty_disk", Path(__file__).parents[1] / "service" / "journal" / "faulty_disk.py"
)
faulty_disk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faulty_disk)

GROUPS = {"prompts_per_step": 2, "group_size": 4}
BATCHING = {"world_size": 2, "token_budget": 512, "retained_steps": 8}


class Rejections(ServerEvents):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_reject(self, error: BaseException, *, rollouts: int, tokens: int) -> None:
        self.reasons.append(error.reason.value)


def _sections(journal_dir: Path) -> dict:
    return {"rollouts": GROUPS, "batching": BATCHING, "journal": {"dir": str(journal_dir)}}


def _write_rows(writer: RolloutWriter, rollouts, rows) -> None:
    for i in rows:
        writer.write(
            rollout_id=rollouts.rollout_ids[i],
            task_id=rollouts.task_ids[i],
            group_id=rollouts.group_ids[i],
            policy_version=rollouts.policy_versions[i],
            reward=rollouts.rewards[i],
            token_ids=rollouts.token_ids[i],
            action_mask=rollouts.action_mask[i],
            sampler_logprobs=rollouts.sampler_logprobs[i],
        )


def _ingest_health(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest(service="rlfeed.v1.RolloutIngest")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def _wait_for(condition, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("code", "on"), [(errno.ENOSPC, "write"), (errno.EIO, "sync")])
def test_a_failing_disk_refuses_ingest_serves_on_and_recovers_by_itself(
    make_sidecar, tmp_path, monkeypatch, code, on
) -> None:
    disk = faulty_disk.FaultyDisk(monkeypatch)
    events = Rejections()
    sidecar = make_sidecar(events=lambda config: events, **_sections(tmp_path))
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=np.random.default_rng(4))
    serving = health_pb2.HealthCheckResponse.SERVING
    with (
        grpc.insecure_channel(sidecar.address) as channel,
        RolloutWriter(sidecar.address, max_batch_rollouts=4) as writer,
    ):
        writer.register_tasks(sorted(set(rollouts.task_ids)))
        _write_rows(writer, rollouts, range(8))  # step 0, acknowledged and journaled
        writer.flush(timeout_s=30)
        step_0 = [fetch_served_bytes(channel, 0, rank) for rank in range(2)]

        disk.fail(code, on=on)
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(list(range(8, 12))), sequence=7)
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30)
        name = faulty_disk.errno_names[code]
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert name in refused.value.details() and "not taken" in refused.value.details()
        hint = dict(refused.value.trailing_metadata())[RETRY_AFTER_MS]
        assert int(hint) >= 500
        assert events.reasons == ["journal_unwritable"]
        _wait_for(lambda: _ingest_health(channel) != serving, "ingest health still SERVING")
        overall = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert overall.status == serving  # the process serves on
        assert [fetch_served_bytes(channel, 0, rank) for rank in range(2)] == step_0

        # A producer meanwhile waits (backpressure), holding its rollouts, and is
        # acknowledged once the disk takes writes again.
        _write_rows(writer, rollouts, range(8, 24))
        acks: list = []
        flushing = threading.Thread(target=lambda: acks.extend(writer.flush(timeout_s=120)))
        flushing.start()
        time.sleep(1.5)
        assert flushing.is_alive() and not acks  # nothing acknowledged on a failing disk
        disk.heal()
        healed = time.monotonic()
        flushing.join(timeout=60)
        assert not flushing.is_alive()
        print(f"{name}: the waiting writer acknowledged {time.monotonic() - healed:.2f} s after")
        assert sum(ack.accepted for ack in acks) == 16
        _wait_for(lambda: _ingest_health(channel) == serving, "ingest health not back")
        served = [[fetch_served_bytes(channel, s, r) for r in range(2)] for s in range(3)]
        status = pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    ids = [rid for step in served for rid in check_served_step(step, rollouts)]
    assert sorted(ids) == sorted(rollouts.rollout_ids)  # every acknowledged rollout, once
    sidecar.stop()

    again = make_sidecar(**_sections(tmp_path))  # nothing lost: the journal has it all
    with grpc.insecure_channel(again.address) as channel:
        restarted = pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert restarted.next_step == status.next_step == 3
        assert [[fetch_served_bytes(channel, s, r) for r in range(2)] for s in range(3)] == served


@pytest.mark.timeout(240)
def test_a_slow_disk_slows_the_acks_and_nothing_else(make_sidecar, tmp_path, monkeypatch) -> None:
    disk = faulty_disk.FaultyDisk(monkeypatch)
    sidecar = make_sidecar(**_sections(tmp_path))
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(5))
    with grpc.insecure_channel(sidecar.address) as channel:
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids))), timeout=10
        )
        ingest = pb_grpc.RolloutIngestStub(channel)

        def submit(rows: list[int]) -> float:
            batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows))
            started = time.monotonic()
            assert ingest.SubmitRolloutBatch(batch, timeout=30).accepted == len(rows)
            return time.monotonic() - started

        fast = submit(list(range(4)))
        disk.sync_delay_s = 0.2
        slow = [submit(list(range(4 * g, 4 * g + 4))) for g in range(1, 4)]
        assert min(slow) >= 0.2, (fast, slow)  # acknowledged only once on disk
        print(f"ack seconds: fast disk {fast:.3f}, 200 ms fsyncs {[round(s, 3) for s in slow]}")
        disk.sync_delay_s = 0.0
        served = [[fetch_served_bytes(channel, s, r) for r in range(2)] for s in range(2)]
    ids = [rid for step in served for rid in check_served_step(step, rollouts)]
    assert sorted(ids) == sorted(rollouts.rollout_ids)
