"""Calls cannot starve the sidecar: idle streams and unary calls whose message never comes
(each holding a thread) and long polls (holding none) are capped per kind and per client,
and answered RESOURCE_EXHAUSTED past the cap, while health (within 1 s), status and serving
go on; idle requests are cancelled and idle sockets closed. Figures: `-s` prints them."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from helpers import wait_until
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.frontend.call_guard import CallKind, CallLimits, client_address

# Memory an attack of this file may add to the process running the front-end (and the
# attacking client's own threads), MiB.
RSS_BOUND_MIB = 64


def _silent_calls(address: str, method: str, count: int, streaming_out: bool):
    """`count` calls of `method` whose request stream sends nothing until released."""
    channel = grpc.insecure_channel(address)
    release = threading.Event()

    def silent():
        release.wait()
        yield from ()

    make = channel.stream_stream if streaming_out else channel.stream_unary
    stub = make(method, request_serializer=None, response_deserializer=None)
    calls = [stub(silent()) if streaming_out else stub.future(silent()) for _ in range(count)]
    return channel, release, calls


def _wait_refused(calls, expected: int, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [call for call in calls if call.done()]
        if len(done) >= expected:
            return done
        time.sleep(0.02)
    raise AssertionError(f"{len([c for c in calls if c.done()])} of {expected} refused in time")


def _status_and_serving(address: str) -> tuple[float, pb.GetBatchResponse]:
    """GetStatus latency, and a GetBatch that answers at once (timeout_ms 0)."""
    with grpc.insecure_channel(address) as channel:
        started = time.monotonic()
        channel.unary_unary(
            "/rlfeed.v1.SidecarStatus/GetStatus",
            request_serializer=pb.GetStatusRequest.SerializeToString,
            response_deserializer=pb.StatusResponse.FromString,
        )(pb.GetStatusRequest(), timeout=1.0)
        status_s = time.monotonic() - started
        batch = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=pb.GetBatchResponse.FromString,
        )(pb.GetBatchRequest(step=10**6, rank=0, timeout_ms=0), timeout=1.0)
    return status_s, batch


def _hold(address, method, count, cap, streaming_out):
    """The attack: `count` silent calls; all but `cap` refused at once; status and
    serving answer while the rest are held."""
    channel, release, calls = _silent_calls(address, method, count, streaming_out)
    try:
        refused = _wait_refused(calls, count - cap)
        codes = {call.code() for call in refused}
        details = {call.details() for call in refused}
        status_s, batch = _status_and_serving(address)
        time.sleep(0.5)  # held a while longer, health probed meanwhile
        return codes, details, status_s, batch
    finally:
        release.set()
        channel.close()


@pytest.mark.parametrize(
    ("method", "count", "cap_name", "streaming_out"),
    [
        ("/rlfeed.v1.RolloutIngest/SubmitRollouts", 70, "max_streams", True),
        ("/rlfeed.v1.TaskSampling/RegisterTasks", 64, "max_unary_calls", False),
    ],
    ids=["idle-SubmitRollouts-streams", "unary-calls-whose-message-never-comes"],
)
def test_silent_calls_past_their_cap_are_refused_and_starve_nothing(
    hostile, under_attack, method, count, cap_name, streaming_out
) -> None:
    cap = getattr(hostile.config.server, cap_name)
    figures = under_attack(
        hostile, lambda: _hold(hostile.address, method, count, cap, streaming_out)
    )
    codes, details, status_s, batch = figures.result
    print(
        f"\n{count} silent {method}: {count - cap} refused; health checks "
        f"{figures.health_checks}, worst {figures.worst_health_s * 1000:.0f} ms; status "
        f"{status_s * 1000:.0f} ms; RSS +{figures.rss_growth_mib:.1f} MiB"
    )
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(cap_name in detail for detail in details), details
    assert status_s < 1.0 and not batch.ready
    assert figures.rss_growth_mib < RSS_BOUND_MIB
    wait_until(lambda: not hostile.guard.limits.in_flight())  # every slot given back


def _status_seconds(channel: grpc.Channel) -> float:
    started = time.monotonic()
    channel.unary_unary(
        "/rlfeed.v1.SidecarStatus/GetStatus",
        request_serializer=pb.GetStatusRequest.SerializeToString,
        response_deserializer=pb.StatusResponse.FromString,
    )(pb.GetStatusRequest(), timeout=1.0)
    return time.monotonic() - started


def _long_polls(address: str, count: int, cap: int, threads: dict[str, int]):
    """The attack: `count` GetBatch calls asking to wait 2**32 - 1 ms for a far step;
    `threads["waiting"]` is this process's thread count while they wait."""
    with grpc.insecure_channel(address) as channel:
        get_batch = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=pb.GetBatchResponse.FromString,
        )
        request = pb.GetBatchRequest(step=10**6, rank=1, timeout_ms=2**32 - 1)
        polls = [get_batch.future(request, timeout=30) for _ in range(count)]
        refused = _wait_refused(polls, count - cap)
        time.sleep(0.6)  # past POLL_SECONDS: the waits timed out once and re-asked
        threads["waiting"] = _threads()
        status_s = _status_seconds(channel)
        try:  # one more GetBatch meanwhile: refused at once (BatchLoader retries it)
            get_batch(request, timeout=1.0)
            busy = None
        except grpc.RpcError as exc:
            busy = exc
        waited = [poll.result() for poll in polls if poll not in refused]
        return refused, status_s, busy, waited


def _threads() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))


def test_hundreds_of_long_polls_hold_no_thread_are_capped_and_end_after_max_wait_seconds(
    make_sidecar, under_attack
) -> None:
    """A waiting GetBatch holds no thread (the asyncio server): 300 of them wait while the
    process's thread count stays flat and health answers; 20 more are refused."""
    sidecar = make_sidecar(
        server={
            "max_workers": 24,
            "max_streams": 4,
            "max_unary_calls": 6,
            "max_wait_seconds": 2.0,
            "max_long_polls": 300,
            "max_calls_per_client": 0,  # every call comes from 127.0.0.1
        },
        batching={"world_size": 2, "token_budget": 4096},
    )
    limits = sidecar.config.server
    threads = {"before": _threads()}

    def attack():
        with grpc.insecure_channel(sidecar.address) as channel:  # connected, then counted
            _status_seconds(channel)
            threads["before"] = _threads()
        return _long_polls(sidecar.address, 320, limits.max_long_polls, threads)

    figures = under_attack(sidecar, attack)
    refused, status_s, busy, waited = figures.result
    print(
        f"\n320 long polls: {len(refused)} refused, {len(waited)} waited "
        f"{limits.max_wait_seconds} s; threads {threads['before']} -> {threads['waiting']}; "
        f"health worst {figures.worst_health_s * 1000:.0f} ms over {figures.health_checks} "
        f"checks; status {status_s * 1000:.0f} ms; RSS +{figures.rss_growth_mib:.1f} MiB"
    )
    assert {poll.code() for poll in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert busy is not None and busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_long_polls" in busy.details()
    assert len(waited) == limits.max_long_polls and not any(r.ready for r in waited)
    assert status_s < 1.0
    # Flat: the calls' re-asks of the actor take a few pool threads, never one per call.
    assert threads["waiting"] - threads["before"] <= 8
    assert figures.rss_growth_mib < RSS_BOUND_MIB


def test_the_per_client_cap_counts_every_kind_but_status() -> None:
    limits = CallLimits(
        {CallKind.STREAM: 4, CallKind.LONG_POLL: 4, CallKind.UNARY: 4, CallKind.STATUS: 2}, 5
    )
    a, b = client_address("ipv4:10.0.0.7:50123"), client_address("ipv4:10.0.0.8:6")
    assert a == "ipv4:10.0.0.7" and client_address("ipv6:[::1]:5") == "ipv6:[::1]"
    for kind in (CallKind.STREAM,) * 3 + (CallKind.LONG_POLL,) * 2:
        assert limits.acquire(kind, a) is None
    refusal = limits.acquire(CallKind.UNARY, a)
    assert refusal is not None and "max_calls_per_client" in refusal and a in refusal
    assert limits.acquire(CallKind.UNARY, b) is None  # another client is not affected
    assert limits.acquire(CallKind.STATUS, a) is None  # status is never per-client
    assert limits.acquire(CallKind.STREAM, b) is None
    refusal = limits.acquire(CallKind.STREAM, b)  # the 5th stream in all
    assert refusal is not None and "max_streams" in refusal
    limits.release(CallKind.STREAM, a)
    assert limits.acquire(CallKind.UNARY, a) is None
    assert limits.refused == 2


def test_idle_requests_are_cancelled_and_idle_sockets_closed(make_sidecar) -> None:
    sidecar = make_sidecar(server={"request_idle_timeout_s": 1.0, "max_connection_idle_s": 1.0})
    started = time.monotonic()
    channel, release, calls = _silent_calls(
        sidecar.address, "/rlfeed.v1.RolloutIngest/SubmitRollouts", 2, True
    )
    unary_channel, unary_release, unary = _silent_calls(
        sidecar.address, "/rlfeed.v1.TaskSampling/SampleTasks", 1, False
    )
    raw = socket.create_connection(("127.0.0.1", sidecar.port))
    raw.settimeout(10)
    try:
        _wait_refused(calls + unary, 3)
        cancelled_after = time.monotonic() - started
        assert {call.code() for call in calls + unary} == {grpc.StatusCode.CANCELLED}
        assert sidecar.guard.idle.cancelled == 3
        wait_until(lambda: not sidecar.guard.limits.in_flight())
        received = b""
        while chunk := raw.recv(4096):  # the server's SETTINGS, then GOAWAY, then EOF
            received += chunk
        closed_after = time.monotonic() - started
    finally:
        release.set()
        unary_release.set()
        channel.close()
        unary_channel.close()
        raw.close()
    print(
        f"\nidle calls cancelled after {cancelled_after:.1f} s; raw socket closed after "
        f"{closed_after:.1f} s"
    )
    assert b"idle" in received and cancelled_after < 5 and closed_after < 5
