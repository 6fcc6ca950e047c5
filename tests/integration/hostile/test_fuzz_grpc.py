"""Fuzzing a real sidecar over gRPC: random bytes as the serialized request of every
rlfeed.v1 method, and byte-mutated Arrow payloads as batches. Only OK, INVALID_ARGUMENT
or RESOURCE_EXHAUSTED come back (NOT_FOUND too for GetBatch: a released step), never
INTERNAL or UNKNOWN; the sidecar keeps answering health; a batch is accepted only if the
same bytes pass the in-process decode and validation (whose own fuzzing checks what they
let through: tests/service/codec/test_fuzz_ingest.py).

Default run: 40 inputs per method and 200 payloads (~10 s); `-m slow`: 10 times more.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.rollout_batch import decode_batch, validate_batch
from rlfeed.service.errors import InvalidBatchError
from rlfeed.service.testing import synthetic_groups

_METHODS = {
    "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch": pb.SubmitAck,
    "/rlfeed.v1.TaskSampling/RegisterTasks": pb.RegisterTasksResponse,
    "/rlfeed.v1.TaskSampling/SampleTasks": pb.SampleTasksResponse,
    "/rlfeed.v1.BatchServing/GetBatch": pb.GetBatchResponse,
    "/rlfeed.v1.BatchServing/ReportTrainerMetrics": pb.TrainerReportAck,
    "/rlfeed.v1.SidecarStatus/GetStatus": pb.StatusResponse,
}
_ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_SEEDS = [
    synthetic_groups(
        num_groups=1, group_size=2, rng=np.random.default_rng(s), tasks=["t4"], max_length=40
    ).encode()
    for s in range(3)
]
FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)
_counts: dict[str, int] = {}


@pytest.fixture(scope="module")
def channel(hostile):
    with grpc.insecure_channel(hostile.address) as channel:
        yield channel


def _code(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    stub = channel.unary_unary(
        method, request_serializer=None, response_deserializer=_METHODS[method].FromString
    )
    try:
        stub(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _healthy(channel: grpc.Channel) -> bool:
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def _random_requests(channel, method: str, data: bytes) -> None:
    code = _code(channel, method, data)
    allowed = _ALLOWED | ({grpc.StatusCode.NOT_FOUND} if method.endswith("GetBatch") else set())
    assert code in allowed, (method, data, code)
    _counts[method] = _counts.get(method, 0) + 1


def _payload_fuzz(channel, config, payload: bytes) -> None:
    code = _code(
        channel,
        "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch",
        pb.RolloutBatch(arrow_ipc=payload, sequence=7).SerializeToString(),
    )
    assert code in _ALLOWED, code
    if code == grpc.StatusCode.OK:  # accepted only what the in-process checks accept
        try:
            validate_batch(decode_batch(payload), config)
        except InvalidBatchError as exc:
            raise AssertionError(f"the sidecar accepted a batch it should refuse: {exc}") from exc
    _counts["payloads"] = _counts.get("payloads", 0) + 1


@st.composite
def _mutations(draw) -> bytes:
    payload = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        payload = payload[: draw(st.integers(0, len(payload)))]
    return bytes(payload)


def _property_tests(requests: int, payloads: int):
    """The two properties, with these many examples each."""

    @settings(max_examples=requests, **FAST)
    @given(method=st.sampled_from(sorted(_METHODS)), data=st.binary(max_size=64))
    def random_requests(channel, method, data):
        _random_requests(channel, method, data)

    @settings(max_examples=payloads, **FAST)
    @given(payload=_mutations())
    def mutated_payloads(channel, config, payload):
        _payload_fuzz(channel, config, payload)

    return random_requests, mutated_payloads


_fast_requests, _fast_payloads = _property_tests(240, 200)
_slow_requests, _slow_payloads = _property_tests(2400, 2000)


def test_random_request_bytes_get_only_ok_or_invalid_argument(hostile, channel) -> None:
    _fast_requests(channel)
    assert _healthy(channel)


def test_mutated_payloads_are_refused_or_valid_over_grpc(hostile, channel) -> None:
    _fast_payloads(channel, hostile.config)
    assert _healthy(channel)
    print(f"\ngRPC fuzz so far: {sum(_counts.values())} calls, {_counts}")


@pytest.mark.slow
def test_many_more_requests_and_payloads_over_grpc(hostile, channel) -> None:
    _slow_requests(channel)
    _slow_payloads(channel, hostile.config)
    assert _healthy(channel)
    print(f"\ngRPC fuzz: {sum(_counts.values())} calls, {_counts}")
