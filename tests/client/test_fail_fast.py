"""Clients fail fast and loud: an unreachable sidecar is named in a warning within seconds
and in a `SidecarUnreachableError` after `connect_timeout_s`, never a silent 600 s wait;
a trainer's wrong world size is a `WorldSizeMismatchError`, not an "invalid rollouts" one.

The network cases run real gRPC on loopback: a port nothing listens on, and a small gRPC
server (the in-process sidecar, `serve_in_process`) stopped mid-run.
"""

from __future__ import annotations

import logging
import socket
import time

import grpc
import numpy as np
import pytest
from rlfeed.client.loader import BatchLoader
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.transport import (
    InvalidRequestError,
    InvalidRolloutsError,
    SidecarError,
    SidecarUnreachableError,
    WorldSizeMismatchError,
    _sidecar_error,
)
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.inprocess_server import serve_in_process

CONNECT_TIMEOUT_S = 2.0
# Loose bounds: the error comes after the timeout, and well before the old 600 s.
FAIL_WITHIN_S = CONNECT_TIMEOUT_S + 8.0


def dead_address() -> str:
    """A loopback port that was free a moment ago and has nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def first_warning_after(caplog, address: str, started: float) -> float:
    warnings = [
        record
        for record in caplog.records
        if record.levelno == logging.WARNING
        and address in record.getMessage()
        and "retrying" in record.getMessage()
    ]
    assert warnings, "no warning named the address while retrying"
    return warnings[0].created - started


def test_a_loader_pointed_at_nothing_warns_at_once_and_fails_after_the_connect_timeout(caplog):
    address = dead_address()
    loader = BatchLoader(address, 0, 1, prefetch=0, connect_timeout_s=CONNECT_TIMEOUT_S)
    started = time.time()
    with caplog.at_level(logging.WARNING), pytest.raises(SidecarUnreachableError) as caught:
        loader.fetch(0)
    took = time.time() - started
    loader.close()
    assert CONNECT_TIMEOUT_S <= took < FAIL_WITHIN_S
    assert first_warning_after(caplog, address, started) < 1.0
    error = caught.value
    assert isinstance(error, SidecarError) and isinstance(error, ConnectionError)
    assert error.address == address and error.waited_s >= CONNECT_TIMEOUT_S
    assert f"cannot reach the sidecar at {address} (tried for" in str(error)


def test_the_connect_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLFEED_CONNECT_TIMEOUT_S", "0.5")
    loader = BatchLoader(dead_address(), 0, 1, prefetch=0)
    assert loader.connect_timeout_s == 0.5
    started = time.monotonic()
    with pytest.raises(SidecarUnreachableError):
        next(iter(loader))  # through the prefetch thread too
    assert time.monotonic() - started < 0.5 + 8.0
    loader.close()
    monkeypatch.setenv("RLFEED_CONNECT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="RLFEED_CONNECT_TIMEOUT_S='soon'"):
        BatchLoader(dead_address(), 0, 1)
    monkeypatch.delenv("RLFEED_CONNECT_TIMEOUT_S")
    with RolloutWriter(dead_address()) as writer:
        assert writer.reconnect_timeout_s == 120.0  # the default
    monkeypatch.setenv("RLFEED_RECONNECT_TIMEOUT_S", "45")
    with BatchLoader(dead_address(), 0, 1) as loader, RolloutWriter(dead_address()) as writer:
        assert loader.reconnect_timeout_s == writer.reconnect_timeout_s == 45.0


def test_a_writer_pointed_at_nothing_warns_and_fails_with_the_rollouts_to_resend(caplog):
    address = dead_address()
    writer = RolloutWriter(address, max_batch_rollouts=2, connect_timeout_s=CONNECT_TIMEOUT_S)
    started = time.time()
    with caplog.at_level(logging.WARNING), pytest.raises(SidecarUnreachableError) as caught:
        writer.register_tasks(["t0"])
    assert CONNECT_TIMEOUT_S <= time.time() - started < FAIL_WITHIN_S
    assert first_warning_after(caplog, address, started) < 1.0
    assert caught.value.address == address

    row = dict(task_id="t0", group_id="g0", policy_version=0, reward=1.0)
    row.update(token_ids=[1, 2, 3], action_mask=[0, 1, 1], sampler_logprobs=[0.0, -1.0, -2.0])
    writer.write(rollout_id="r0", **row)
    writer.write(rollout_id="r1", **row)  # a full batch: sent in the background
    started = time.time()
    with pytest.raises(SidecarUnreachableError) as caught:
        writer.flush(timeout_s=30)
    assert time.time() - started < FAIL_WITHIN_S
    assert caught.value.rollout_ids == ("r0", "r1")
    writer.close()


# ---------------------------------------------------------------------------------------
# A sidecar that goes away mid-run, and a trainer with the wrong world size


def make_transport(world_size: int) -> InProcessTransport:
    return InProcessTransport(
        config_from_dict(
            {
                "batching": {"token_budget": 256, "world_size": world_size},
                "rollouts": {"prompts_per_step": 1, "group_size": 2, "vocab_size": 100},
            }
        )
    )


def produce_steps(transport: InProcessTransport, steps: int) -> None:
    transport.register_tasks(["t0"])
    with RolloutWriter(transport, max_batch_rollouts=2) as writer:
        for i in range(2 * steps):
            writer.write(
                rollout_id=f"r{i}",
                task_id="t0",
                group_id=f"g{i // 2}",
                policy_version=0,
                reward=float(i % 2),
                token_ids=np.arange(1, 9, dtype=np.int32),
                action_mask=np.array([0, 0, 1, 1, 1, 1, 1, 1], np.uint8),
                sampler_logprobs=np.full(8, -0.5, np.float32),
            )


def serve_batches(transport: InProcessTransport) -> tuple[grpc.Server, str]:
    """A gRPC server answering from `transport`, on a free port, and its address."""
    server, port = serve_in_process(transport)
    return server, f"127.0.0.1:{port}"


def test_a_sidecar_that_stops_mid_run_is_reported_after_the_reconnect_timeout(caplog):
    """Once the sidecar has answered, an outage is waited out for `reconnect_timeout_s`
    (a restart), not `connect_timeout_s`; the warning names the setting that applies."""
    transport = make_transport(world_size=1)
    produce_steps(transport, steps=2)
    server, address = serve_batches(transport)
    try:
        loader = BatchLoader(
            address,
            0,
            1,
            prefetch=0,
            connect_timeout_s=0.1,  # would give up at once: it does not apply any more
            reconnect_timeout_s=CONNECT_TIMEOUT_S,
        )
        assert loader.fetch(0).step == 0
    finally:
        server.stop(0).wait()
    started = time.time()
    with caplog.at_level(logging.WARNING), pytest.raises(SidecarUnreachableError) as caught:
        loader.fetch(1)
    assert CONNECT_TIMEOUT_S <= time.time() - started < FAIL_WITHIN_S
    assert first_warning_after(caplog, address, started) < 1.0
    assert "(reconnect_timeout_s)" in caplog.text
    assert caught.value.address == address
    loader.close()


def test_a_rank_outside_the_sidecars_world_size_is_a_world_size_error_over_grpc():
    transport = make_transport(world_size=2)
    produce_steps(transport, steps=1)
    server, address = serve_batches(transport)
    try:
        # torchrun --nproc_per_node 3 against a world_size = 2 sidecar: rank 2 is refused.
        loader = BatchLoader(address, rank=2, world_size=3, prefetch=0)
        with pytest.raises(WorldSizeMismatchError) as caught:
            loader.fetch(0)
        loader.close()
    finally:
        server.stop(0).wait()
    error = caught.value
    assert not isinstance(error, InvalidRolloutsError)
    assert isinstance(error, InvalidRequestError) and isinstance(error, ValueError)
    assert (error.world_size, error.served_world_size) == (3, 2)
    assert "world_size=3 but the sidecar serves world_size=2" in str(error)


def test_a_rank_inside_the_sidecars_world_size_is_told_the_served_size():
    transport = make_transport(world_size=2)
    produce_steps(transport, steps=1)
    with pytest.raises(WorldSizeMismatchError) as caught:
        BatchLoader(transport, rank=0, world_size=1, prefetch=0).fetch(0)
    assert (caught.value.world_size, caught.value.served_world_size) == (1, 2)


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "step -1 is not a step"


def test_invalid_argument_means_invalid_rollouts_only_for_a_rollout_batch():
    ingest = _sidecar_error(_Refused(), "sidecar:50051", ingest=True)
    other = _sidecar_error(_Refused(), "sidecar:50051")
    assert isinstance(ingest, InvalidRolloutsError)
    assert isinstance(other, InvalidRequestError) and not isinstance(other, InvalidRolloutsError)
    assert other.code == "INVALID_ARGUMENT" and other.message == "step -1 is not a step"


def test_socket_closed_counts_as_a_tls_mistake_only_for_a_client_never_answered():
    """gRPC's "Socket closed" while connecting is a TLS mismatch for a client the sidecar
    never answered (raised once it says nothing else for SUSPECT_FOR_S); for one answered
    before it is a restart like any other, retried under the reconnect budget."""
    from rlfeed.client.handshake import SUSPECT_FOR_S
    from rlfeed.client.retry import RetryPolicy
    from rlfeed.client.transport import TLSHandshakeError

    closed = TLSHandshakeError("127.0.0.1:1", "TLS handshake ... Socket closed", certain=False)
    refused = SidecarError("UNAVAILABLE", "failed to connect ... Connection refused")
    for answered in (False, True):
        policy = RetryPolicy("127.0.0.1:1", connect_timeout_s=30, reconnect_timeout_s=30)
        policy.answered = answered
        outage = policy.outage()
        outage.failed(closed)  # the first one: retried either way
        outage.failed(refused)  # anything else in between starts the count again
        started = time.monotonic()
        raised = None
        while raised is None and time.monotonic() - started < SUSPECT_FOR_S + 1.0:
            try:
                outage.failed(closed)
            except TLSHandshakeError as exc:
                raised = exc
            time.sleep(0.05)
        if answered:
            assert raised is None
        else:
            assert raised is closed
            assert SUSPECT_FOR_S <= time.monotonic() - started < SUSPECT_FOR_S + 0.5
    certain = TLSHandshakeError("127.0.0.1:1", "TLS handshake ... CERTIFICATE_VERIFY_FAILED")
    with pytest.raises(TLSHandshakeError):  # never heals: at once, answered before or not
        RetryPolicy("127.0.0.1:1").outage().failed(certain)
