"""Hostile requests get a clear status and cost bounded resources, while health answers
within 1 s: a compressed-body bomb, two Arrow streams in one payload, integers of odd
widths, a batch over the message size limit, a million ids, a 10 MiB id, n = 2**32 - 1,
NaN reports, bytes that are not protobuf. Figures: `-s` prints them."""

from __future__ import annotations

import gc
import struct
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest
from rlfeed.client import MessageTooLargeError, RolloutWriter
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import ROLLOUT_SCHEMA
from rlfeed.service.testing import synthetic_groups

# Memory one request of this file may add to the process running the front-end, MiB.
RSS_BOUND_MIB = 64

_METHODS = {  # method -> (request type, response type)
    "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch": (pb.RolloutBatch, pb.SubmitAck),
    "/rlfeed.v1.TaskSampling/RegisterTasks": (pb.RegisterTasksRequest, pb.RegisterTasksResponse),
    "/rlfeed.v1.TaskSampling/SampleTasks": (pb.SampleTasksRequest, pb.SampleTasksResponse),
    "/rlfeed.v1.BatchServing/GetBatch": (pb.GetBatchRequest, pb.GetBatchResponse),
    "/rlfeed.v1.BatchServing/ReportTrainerMetrics": (pb.TrainerReport, pb.TrainerReportAck),
    "/rlfeed.v1.SidecarStatus/GetStatus": (pb.GetStatusRequest, pb.StatusResponse),
}


def _call(sidecar, method: str, request, timeout: float = 10.0):
    """`request` (a message, or raw bytes) to `method`; the response message."""
    _, response_type = _METHODS[method]
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = channel.unary_unary(
            method, request_serializer=None, response_deserializer=response_type.FromString
        )
        data = request if isinstance(request, bytes) else request.SerializeToString()
        return stub(data, timeout=timeout)


def _refusal(sidecar, method: str, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _call(sidecar, method, request)
    return refused.value


def _status(sidecar) -> pb.StatusResponse:
    return _call(sidecar, "/rlfeed.v1.SidecarStatus/GetStatus", pb.GetStatusRequest())


def _submit(payload: bytes) -> pb.RolloutBatch:
    return pb.RolloutBatch(arrow_ipc=payload, sequence=1)


def _zstd_bomb(tokens: int) -> bytes:
    """One rollout of `tokens` zero tokens, Arrow IPC with zstd-compressed bodies."""
    offsets = pa.array([0, tokens], pa.int32())
    columns = [
        pa.array(["bomb"]),
        pa.array(["t0"]),
        pa.array(["g-bomb"]),
        pa.array([0], pa.int64()),
        pa.array([0.0], pa.float64()),
        pa.ListArray.from_arrays(offsets, pa.array(np.zeros(tokens, np.int32))),
        pa.ListArray.from_arrays(offsets, pa.array(np.zeros(tokens, np.uint8))),
        pa.ListArray.from_arrays(offsets, pa.array(np.zeros(tokens, np.float32))),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=ROLLOUT_SCHEMA)
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, ROLLOUT_SCHEMA, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_a_compressed_body_bomb_is_refused_before_it_inflates(hostile, under_attack) -> None:
    tokens = 16 * 2**20  # 144 MiB once inflated (the measured bomb: 1,152 MiB from 38 KiB)
    bomb = _zstd_bomb(tokens)
    gc.collect()
    rejected = _status(hostile).counters.batches_rejected
    started = time.monotonic()
    figures = under_attack(
        hostile,
        lambda: _refusal(hostile, "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch", _submit(bomb)),
    )
    seconds = time.monotonic() - started
    print(
        f"\nzstd bomb: {len(bomb):,} bytes on the wire, {tokens * 9 / 2**20:.0f} MiB "
        f"inflated; refused in {seconds:.2f} s, RSS +{figures.rss_growth_mib:.1f} MiB, "
        f"health worst {figures.worst_health_s * 1000:.0f} ms"
    )
    assert figures.result.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "compressed record batch bodies" in figures.result.details()
    assert figures.rss_growth_mib < RSS_BOUND_MIB
    assert _status(hostile).counters.batches_rejected == rejected + 1


def _valid_payload() -> bytes:
    rollouts = synthetic_groups(
        num_groups=1, group_size=2, rng=np.random.default_rng(3), tasks=["t1"], vocab_size=1000
    )
    return rollouts.encode()


def test_two_arrow_streams_in_one_payload_are_refused_and_nothing_is_buffered(hostile) -> None:
    payload = _valid_payload()
    before = _status(hostile)
    refused = _refusal(
        hostile, "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch", _submit(payload + payload)
    )
    after = _status(hostile)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one Arrow IPC stream" in refused.details()
    assert after.buffered_rollouts == before.buffered_rollouts
    assert after.counters.batches_rejected == before.counters.batches_rejected + 1


def _odd_width_payloads() -> list[bytes]:
    """The valid payload with policy_version's declared bit width (64) set to 4, 12 and
    128 bits: pyarrow refuses such a schema with ArrowNotImplementedError."""
    payload = _valid_payload()
    schema_end = 8 + struct.unpack_from("<i", payload, 4)[0]
    width = struct.pack("<i", 64)
    spots = [i for i in range(8, schema_end - 3) if payload[i : i + 4] == width]
    crafted = []
    for spot in spots:
        for bits in (4, 12, 128):
            mutated = payload[:spot] + struct.pack("<i", bits) + payload[spot + 4 :]
            try:
                pa.ipc.open_stream(mutated).read_all()
            except pa.ArrowNotImplementedError:
                crafted.append(mutated)
    return crafted


def test_integers_of_odd_widths_are_invalid_argument_and_counted(hostile, under_attack) -> None:
    crafted = _odd_width_payloads()
    assert len(crafted) == 3  # 4, 12 and 128 bits
    rejected = _status(hostile).counters.batches_rejected
    figures = under_attack(
        hostile,
        lambda: [
            _refusal(hostile, "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch", _submit(payload))
            for payload in crafted
        ],
    )
    for refused in figures.result:
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.details().startswith("arrow_ipc: ") and "not implemented" in (
            refused.details()
        )
    assert _status(hostile).counters.batches_rejected == rejected + 3


def test_a_batch_over_the_message_limit_reaches_the_writer_as_an_error_naming_it(
    hostile, under_attack
) -> None:
    rows = 600  # of 4,000 tokens: ~21 MB, over the sidecar's 16 MiB
    rng = np.random.default_rng(5)

    def send() -> tuple[BaseException | None, float]:
        started = time.monotonic()
        writer = RolloutWriter(
            hostile.address, max_batch_rollouts=rows, max_batch_bytes=2**30, connect_timeout_s=5
        )
        try:
            for i in range(rows):
                tokens = rng.integers(0, 1000, 4000, dtype=np.int32)
                mask = np.ones(4000, np.uint8)
                mask[0] = 0
                writer.write(
                    rollout_id=f"big/{i}",
                    task_id="t2",
                    group_id=f"big/{i // 2}",
                    policy_version=0,
                    reward=1.0,
                    token_ids=tokens,
                    action_mask=mask,
                    sampler_logprobs=np.full(4000, -0.5, np.float32),
                )
            writer.flush(timeout_s=30)
        except MessageTooLargeError as exc:
            return exc, time.monotonic() - started
        finally:
            writer.close()
        return None, time.monotonic() - started

    figures = under_attack(hostile, send)
    error, seconds = figures.result
    print(f"\noversized batch: {error} after {seconds:.1f} s")
    assert isinstance(error, MessageTooLargeError)
    assert error.limit == 16 * 2**20 and error.size > error.limit
    assert "max_message_bytes" in str(error) and "16,777,216" in str(error)
    assert len(error.rollout_ids) == rows
    assert seconds < 15  # not retried


def test_id_counts_and_sizes_are_capped(hostile, under_attack) -> None:
    register = "/rlfeed.v1.TaskSampling/RegisterTasks"
    million = pb.RegisterTasksRequest(task_ids=[f"x{i}" for i in range(1_000_000)])
    huge = pb.RegisterTasksRequest(task_ids=["y" * (10 * 2**20)])
    started = time.monotonic()
    figures = under_attack(
        hostile, lambda: (_refusal(hostile, register, million), _refusal(hostile, register, huge))
    )
    seconds = time.monotonic() - started
    too_many, too_long = figures.result
    print(
        f"\n1M task ids and a 10 MiB id: refused in {seconds:.1f} s in all, RSS "
        f"+{figures.rss_growth_mib:.1f} MiB, health worst {figures.worst_health_s * 1000:.0f} ms"
    )
    assert too_many.code() == too_long.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Both requests are parsed (~19 MB on the wire, 1M strings) and serialized by the
    # client, in this same process; the scheduler actor never sees them.
    assert figures.rss_growth_mib < 192
    assert "max_ids_per_call" in too_many.details() and "max_id_bytes" in too_long.details()
    limits = hostile.config.server
    total = _status(hostile).tasks_total
    names = [f"fill{i}" for i in range(limits.max_tasks - total - 1)]  # one place left
    for start in range(0, len(names), limits.max_ids_per_call):
        chunk = names[start : start + limits.max_ids_per_call]
        _call(hostile, register, pb.RegisterTasksRequest(task_ids=chunk))
    total = limits.max_tasks - 1
    fill = pb.RegisterTasksRequest(task_ids=["last", "one-too-many"])
    over = _refusal(hostile, register, fill)
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tasks" in over.details()
    assert _status(hostile).tasks_total == total  # all or nothing
    long_id = synthetic_groups(num_groups=1, group_size=2, rng=np.random.default_rng(1))
    long_id.rollout_ids[0] = "r" * (limits.max_id_bytes + 1)
    long_id.task_ids = ["t3", "t3"]
    refused = _refusal(
        hostile, "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch", _submit(long_id.encode())
    )
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout_id" in refused.details() and "max_id_bytes" in refused.details()


def test_sample_tasks_counts_n_only_up_to_the_pool(hostile, under_attack) -> None:
    before = _status(hostile)
    figures = under_attack(
        hostile,
        lambda: _call(
            hostile, "/rlfeed.v1.TaskSampling/SampleTasks", pb.SampleTasksRequest(n=2**32 - 1)
        ),
    )
    after = _status(hostile)
    requested = after.counters.tasks_requested - before.counters.tasks_requested
    assert 0 < len(figures.result.task_ids) <= after.tasks_total
    assert requested == after.tasks_total  # not 4,294,967,295
    saved = after.counters.rollouts_saved_by_filter - before.counters.rollouts_saved_by_filter
    assert 0 <= saved <= after.tasks_total * after.group_size


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss", float("nan")),
        ("ratio_outlier_share", float("inf")),
        ("tokens_per_second", float("-inf")),
        ("step_seconds", -1.0),
        ("ratio_outlier_share", -5.0),
    ],
)
def test_trainer_reports_must_be_finite_and_in_range(hostile, field, value) -> None:
    report = pb.TrainerReport(step=3, rank=1, loss=0.5, tokens_per_second=10.0)
    setattr(report, field, value)
    refused = _refusal(hostile, "/rlfeed.v1.BatchServing/ReportTrainerMetrics", report)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"field {field}" in refused.details()
    assert all(r.rank != 1 for r in _status(hostile).last_reports)


@pytest.mark.parametrize("method", sorted(_METHODS))
def test_bytes_that_are_not_the_request_message_are_invalid_argument(hostile, method) -> None:
    refused = _refusal(hostile, method, b"\xff\xff\xff\xff")  # a field number of 0: not protobuf
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert method in refused.details()


def test_stream_requests_that_are_not_protobuf_end_the_stream_invalid_argument(hostile) -> None:
    with grpc.insecure_channel(hostile.address) as channel:
        stream = channel.stream_stream(
            "/rlfeed.v1.RolloutIngest/SubmitRollouts",
            request_serializer=None,
            response_deserializer=pb.SubmitAck.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(stream(iter([b"\xff\xff\xff\xff"]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_not_ready_get_batch_echoes_step_and_rank_and_sets_nothing_else(hostile) -> None:
    request = pb.GetBatchRequest(step=2**64 - 1, rank=1, timeout_ms=0)
    response = _call(hostile, "/rlfeed.v1.BatchServing/GetBatch", request)
    assert response == pb.GetBatchResponse(ready=False, step=2**64 - 1, rank=1)
