"""One client address naming several front-ends of a sidecar (`client/addressing.py`):
unary calls spread over all of them (round_robin), and when one goes away the clients
carry on through the others with no error, nothing lost and nothing served twice.

Real gRPC on loopback. The in-process tests put two ports in front of one in-process
sidecar (no Ray: they start in milliseconds); the Ray test runs two real front-ends of one
sidecar (`start_server`, then `start_server(join=True)`), each on its own port.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from rlfeed.client.loader import BatchLoader
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.retry import RetryPolicy
from rlfeed.client.transport import GrpcTransport
from rlfeed.service.config import config_from_dict
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.frontend.server import start_server
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.inprocess_server import serve_in_process

GROUP_SIZE = 4
PROMPTS_PER_STEP = 2
ROLLOUTS = {"prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE, "vocab_size": 100}
TASKS = [f"task-{i}" for i in range(4)]


class CountedCalls:
    """An in-process sidecar seen through one front-end: counts the calls it answers."""

    def __init__(self, inner: InProcessTransport) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def two_in_process_front_ends():
    """Two ports in front of one in-process sidecar: (servers, their counters, "a,b")."""
    sidecar = InProcessTransport(
        config_from_dict({"rollouts": ROLLOUTS, "batching": {"world_size": 1}})
    )
    counted = [CountedCalls(sidecar), CountedCalls(sidecar)]
    servers, ports = zip(*(serve_in_process(front_end) for front_end in counted), strict=True)
    return list(servers), counted, ",".join(f"127.0.0.1:{port}" for port in ports)


def test_unary_calls_alternate_between_front_ends_and_skip_one_that_stopped():
    servers, counted, address = two_in_process_front_ends()
    transport = GrpcTransport(address, call_timeout_s=10)
    retry = RetryPolicy(address, connect_timeout_s=10, reconnect_timeout_s=10)
    try:
        deadline = time.monotonic() + 10
        while not all(front_end.calls for front_end in counted):  # both connected
            assert time.monotonic() < deadline, "a front-end was never called"
            transport.status()
        before = [front_end.calls for front_end in counted]
        for _ in range(20):
            transport.status()
        after = [front_end.calls for front_end in counted]
        assert [calls - seen for calls, seen in zip(after, before, strict=True)] == [10, 10]
        servers[1].stop(None).wait(5)
        for _ in range(10):  # as the clients call: a call caught by the stop is asked again
            retry.call(transport.status)
        assert counted[1].calls == after[1] and counted[0].calls >= after[0] + 10
    finally:
        transport.close()
        for server in servers:
            server.stop(None)


@pytest.mark.slow  # the outage must outlast gRPC's default backoff to tell the two apart
def test_a_front_end_back_on_its_port_gets_calls_again_within_the_reconnect_backoff():
    """`RECONNECT_CHANNEL_OPTIONS` reach each front-end's connection (subchannel): after a
    10 s outage gRPC's default backoff (1 s growing 1.6x) would next try ~6 s after it
    (measured: 4.7 s); the client's, at most every 1 s, within about a second."""
    servers, counted, address = two_in_process_front_ends()
    transport = GrpcTransport(address, call_timeout_s=10)
    port = address.rsplit(":", 1)[1]
    try:
        transport.status()
        servers[1].stop(None).wait(5)
        outage_end = time.monotonic() + 10.0
        while time.monotonic() < outage_end:
            transport.status()  # all answered by the other front-end meanwhile
            time.sleep(0.05)
        servers[1] = serve_in_process(counted[1], f"127.0.0.1:{port}")[0]
        back, calls = time.monotonic(), counted[1].calls
        while counted[1].calls == calls and time.monotonic() - back < 10:
            transport.status()
            time.sleep(0.01)
        waited = time.monotonic() - back
        assert counted[1].calls > calls, "the restarted front-end was never called again"
        assert waited < 2.5, f"the restarted front-end was called again after {waited:.1f} s"
    finally:
        transport.close()
        for server in servers:
            server.stop(None)


class CallsSeen(ServerEvents):
    """One front-end's record of the rollout batches and task samples it answered."""

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0

    def on_ingest(self, result, *, tokens: int, seconds: float) -> None:
        self.batches += 1

    def on_task_sample(self, *, requested: int, result) -> None:
        self.samples += 1


def write_step(writer: RolloutWriter, step: int) -> list[str]:
    """PROMPTS_PER_STEP groups of tasks the sidecar samples (one batch each); their ids."""
    ids = []
    for task_id in writer.sample_tasks(PROMPTS_PER_STEP):
        group_id = f"s{step}/{task_id}"
        for k in range(GROUP_SIZE):
            ids.append(f"{group_id}/{k}")
            writer.write(
                rollout_id=ids[-1],
                task_id=task_id,
                group_id=group_id,
                policy_version=0,
                reward=float(k % 2),  # never a zero-advantage group (those are dropped)
                token_ids=np.arange(1, 9, dtype=np.int32),
                action_mask=np.array([0, 0, 1, 1, 1, 1, 1, 1], np.uint8),
                sampler_logprobs=np.full(8, -0.5, np.float32),
            )
    return ids


def test_producer_and_loader_spread_over_two_front_ends_and_lose_nothing_when_one_stops(
    make_sidecar,
):
    seen = {"primary": CallsSeen(), "replica": CallsSeen()}
    primary = make_sidecar(
        rollouts=ROLLOUTS,
        batching={"world_size": 1, "token_budget": 256},
        events=lambda config: seen["primary"],
    )
    replica = start_server(primary.config, join=True, events=seen["replica"])  # port 0 too
    assert replica.port != primary.port
    address = f"{primary.address},{replica.address}"
    writer = RolloutWriter(address, max_batch_rollouts=GROUP_SIZE)
    loader = BatchLoader(address, 0, 1, prefetch=1, poll_s=0.2, timeout_s=60)
    written: list[str] = []
    served: list[str] = []
    try:
        writer.register_tasks(TASKS)
        for step in range(4):  # both front-ends up
            written += write_step(writer, step)
        writer.flush(timeout_s=30)
        steps = iter(loader)
        for _ in range(4):
            served += [r for mb in next(steps) for r in mb.rollout_ids]
        assert all(s.batches > 0 and s.samples > 0 for s in seen.values()), {
            side: vars(s) for side, s in seen.items()
        }
        # The replica stops (it hands what it holds to the sidecar and leaves) while the
        # writer sends steps 4-7, one every 0.2 s, and the loader's prefetcher polls.
        later: list[str] = []
        failed: list[BaseException] = []
        sent_before = seen["replica"].batches

        def produce() -> None:
            try:
                for step in range(4, 8):
                    later.extend(write_step(writer, step))
                    writer.flush(timeout_s=30)  # raises whatever the writer met
                    time.sleep(0.2)
            except BaseException as exc:  # the test fails on it below
                failed.append(exc)

        producing = threading.Thread(target=produce, daemon=True)
        producing.start()
        deadline = time.monotonic() + 10
        while seen["replica"].batches == sent_before:  # the replica is in use
            assert time.monotonic() < deadline, "no batch of steps 4-7 reached the replica"
            time.sleep(0.01)
        replica.stop(grace=0.5)
        replica_seen = vars(seen["replica"]).copy()
        for _ in range(4):
            served += [r for mb in next(steps) for r in mb.rollout_ids]
        producing.join(timeout=30)
        assert not producing.is_alive() and not failed, failed
        written += later
    finally:
        writer.close()
        loader.close()
        replica.stop(grace=0.5)
    assert len(served) == len(set(served)) == 8 * PROMPTS_PER_STEP * GROUP_SIZE
    assert sorted(served) == sorted(written)
    assert vars(seen["replica"]) == replica_seen  # nothing reached it once it stopped
