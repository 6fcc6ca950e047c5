"""Fixtures of the hostile-input tests: one real sidecar on loopback for the directory, and
a probe that keeps asking it for health while an attack runs.

- `hostile` (package): a `start_server` sidecar with small caps, so that each attack
  reaches them with a few dozen calls (see `LIMITS`); 2 ranks, steps of 2 groups of 2,
  token budget 4096, vocabulary 1000, a 16 MiB message limit, GetBatch waits at most 2 s.
  Tasks `t0` .. `t9` are registered.
- `under_attack` (function): `under_attack(sidecar, attack)` runs `attack()` in a thread
  while the test's thread checks gRPC health (1 s deadline) and samples this process's
  RSS (the sidecar's front-end runs in it) every 50 ms; returns the attack's result and
  the figures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

LIMITS = {
    "max_workers": 24,
    "max_streams": 4,
    "max_long_polls": 4,
    "max_unary_calls": 6,
    "max_calls_per_client": 8,
    "max_message_bytes": 16 * 2**20,
    "max_wait_seconds": 2.0,
    "max_ids_per_call": 1000,
    "max_id_bytes": 64,
    "max_tasks": 2000,
}
HEALTH_DEADLINE_S = 1.0


@pytest.fixture(scope="package")
def hostile(ray_local):
    from rlfeed.proto import rlfeed_pb2 as pb
    from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.server import start_server

    config = with_overrides(
        SidecarConfig(),
        server={"host": "127.0.0.1", "port": 0, **LIMITS},
        ray={"actor_name": "rlfeed-scheduler-hostile"},
        batching={"world_size": 2, "token_budget": 4096},
        rollouts={"prompts_per_step": 2, "group_size": 2, "vocab_size": 1000},
    )
    sidecar = start_server(config)
    with grpc.insecure_channel(sidecar.address) as channel:
        tasks = pb_grpc.TaskSamplingStub(channel)
        tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=[f"t{i}" for i in range(10)]))
    try:
        yield sidecar
    finally:
        sidecar.stop(grace=0.5)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


@dataclass
class AttackFigures:
    result: Any
    health_checks: int
    worst_health_s: float
    rss_before: int
    rss_peak: int

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_peak - self.rss_before) / 2**20


def health_seconds(channel: grpc.Channel) -> float:
    """One health check's latency; it must answer SERVING within HEALTH_DEADLINE_S."""
    started = time.monotonic()
    answer = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=HEALTH_DEADLINE_S
    )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - started


def _under_attack(sidecar, attack: Callable[[], Any], min_checks: int = 3) -> AttackFigures:
    """`attack()` in a thread; health checked (each within 1 s, or the test fails) and RSS
    sampled until it ends, and at least `min_checks` times."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = attack()
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    before = peak = rss_bytes()
    worst, checks = 0.0, 0
    thread = threading.Thread(target=run, name="attack")
    with grpc.insecure_channel(sidecar.address) as channel:
        health_seconds(channel)  # connected before the attack starts
        thread.start()
        while thread.is_alive() or checks < min_checks:
            worst = max(worst, health_seconds(channel))
            checks += 1
            peak = max(peak, rss_bytes())
            time.sleep(0.05)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return AttackFigures(outcome.get("result"), checks, worst, before, peak)


@pytest.fixture
def under_attack():
    """`under_attack(sidecar, attack)` (module docstring) -> AttackFigures."""
    return _under_attack
