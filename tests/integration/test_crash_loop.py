"""Crash loop: `rlfeed serve --journal-dir` killed with SIGKILL (its whole process group:
the server, Ray and the scheduler actor) at random points while producers stream rollouts
and two trainer ranks fetch steps, restarted on the same port and journal each time. The
same with only the scheduler actor killed (Ray restarts it), and with only the replica of
`--replicas 2` killed (the first process restarts it on its journal slot).

Over the whole history: every acknowledged rollout is served, in exactly one step; nothing
is served that was not acknowledged; a (step, rank) is never served with two different
contents (the clients and this check: `exactly_once.py`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


exactly_once, serve_process = _load("exactly_once"), _load("serve_process")
CONFIG = exactly_once.CONFIG


def _sidecar(workdir: Path, *flags: str):
    """`rlfeed serve` on the exactly-once clients' config."""
    return serve_process.ServeProcess(workdir, *flags, config=CONFIG)


GROUP_SIZE, PROMPTS_PER_STEP = exactly_once.GROUP_SIZE, exactly_once.PROMPTS_PER_STEP
WORLD_SIZE = exactly_once.WORLD_SIZE
_run_crash_loop, _check, _report = (
    exactly_once.run_clients,
    exactly_once.check_exactly_once,
    exactly_once.report,
)


def _serve_crash_loop(tmp_path: Path, kills: int, num_groups: int, seed: int) -> dict:
    sidecar = _sidecar(tmp_path)
    sidecar.start()
    back_after: list[float] = []  # seconds from the SIGKILL until it answers again

    def crash() -> None:
        killed = time.monotonic()
        sidecar.kill()
        sidecar.start()
        back_after.append(time.monotonic() - killed)

    try:
        return _run_crash_loop(sidecar.address, crash, kills, num_groups, seed)
    finally:
        sidecar.stop()
        print(f"sidecar back after {', '.join(f'{s:.1f}' for s in back_after)} s")


@pytest.mark.timeout(600)
def test_crash_loop_short(tmp_path) -> None:
    run = _serve_crash_loop(tmp_path, kills=2, num_groups=60, seed=0)
    _check(run)
    _report(run)
    assert run["mid_ingest"] >= 1  # the kills hit a live run, not a finished one


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_crash_loop(tmp_path, seed: int) -> None:
    run = _serve_crash_loop(tmp_path, kills=8, num_groups=240, seed=seed)
    _check(run)
    _report(run)


def replica_pids(serve_pid: int) -> list[int]:
    """The `rlfeed serve --join` children of the first process `serve_pid`."""
    children = subprocess.run(
        ["pgrep", "-P", str(serve_pid), "-f", "rlfeed serve --join"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return [int(pid) for pid in children]


def _front_ends(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        status = pb_grpc.SidecarStatusStub(channel)
        try:
            return status.GetStatus(pb.GetStatusRequest(), timeout=2).front_ends
        except grpc.RpcError:
            return 0


def _wait_for_two_front_ends(sidecar: serve_process.ServeProcess, deadline: float) -> None:
    while _front_ends(sidecar.address) != 2:
        assert sidecar.process.poll() is None, "the sidecar stopped"
        assert time.monotonic() < deadline, "no second front-end registered"
        time.sleep(0.2)


class ReplicaCrash:
    """SIGKILL the replica of `rlfeed serve --replicas 2` (never the first process); return
    once the first process has started a new one and it has registered."""

    def __init__(self, sidecar: serve_process.ServeProcess, timeout_s: float = 120.0) -> None:
        self.sidecar, self.timeout_s = sidecar, timeout_s
        self.back_after: list[float] = []  # seconds until two front-ends served again

    def __call__(self) -> None:
        serve = self.sidecar.process
        (replica,) = replica_pids(serve.pid)
        os.kill(replica, signal.SIGKILL)
        start = time.monotonic()
        deadline = start + self.timeout_s
        while replica_pids(serve.pid) in ([], [replica]):
            assert serve.poll() is None, "the sidecar stopped with its replica"
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.1)
        _wait_for_two_front_ends(self.sidecar, deadline)
        self.back_after.append(time.monotonic() - start)


def _serve_replica_crash_loop(tmp_path: Path, kills: int, num_groups: int, seed: int) -> dict:
    sidecar = _sidecar(tmp_path, "--replicas", "2")
    sidecar.start()
    _wait_for_two_front_ends(sidecar, time.monotonic() + 120)
    crash = ReplicaCrash(sidecar)
    try:
        run = _run_crash_loop(sidecar.address, crash, kills, num_groups, seed)
        assert sidecar.process.poll() is None, "the sidecar stopped"
    finally:
        sidecar.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert log.count("what it acknowledged is in journal slot frontend-1") == kills, log[-3000:]
    print(f"replica back after {', '.join(f'{s:.1f}' for s in crash.back_after)} s")
    return run


@pytest.mark.timeout(600)
def test_a_replica_killed_mid_run_is_restarted_and_loses_nothing(tmp_path) -> None:
    run = _serve_replica_crash_loop(tmp_path, kills=1, num_groups=60, seed=5)
    _check(run)
    _report(run)
    assert run["mid_ingest"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("seed", [6, 7])
def test_replicas_killed_again_and_again_lose_nothing(tmp_path, seed: int) -> None:
    run = _serve_replica_crash_loop(tmp_path, kills=6, num_groups=240, seed=seed)
    _check(run)
    _report(run)


def _actor_crash(sidecar, timeout_s: float = 60.0):
    """Kill the scheduler actor (Ray restarts it: the journal rebuilds it) and return once
    the front-end has rejoined the new one."""
    import ray

    def crash() -> None:
        rejoins = sidecar.watch.rejoins
        ray.kill(sidecar.actor, no_restart=False)
        deadline = time.monotonic() + timeout_s
        while sidecar.watch.rejoins == rejoins:
            assert time.monotonic() < deadline, "the front-end did not rejoin the new actor"
            time.sleep(0.05)

    return crash


def _sections(journal_dir: Path) -> dict:
    return {
        "rollouts": {"group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP},
        "batching": {"world_size": WORLD_SIZE, "token_budget": 512},
        "advantages": {"drop_zero_advantage": False},
        "journal": {"dir": str(journal_dir), "snapshot_every_records": 40},
    }


@pytest.mark.timeout(600)
def test_scheduler_actor_killed_mid_run_loses_nothing(make_sidecar, tmp_path) -> None:
    sidecar = make_sidecar(**_sections(tmp_path))
    run = _run_crash_loop(sidecar.address, _actor_crash(sidecar), kills=2, num_groups=60, seed=4)
    _check(run)
    _report(run)
    assert run["mid_ingest"] >= 1


@pytest.mark.timeout(120)
def test_without_a_journal_a_dead_actor_stops_the_front_end(make_sidecar) -> None:
    import ray
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sidecar = make_sidecar()
    killed = time.monotonic()
    ray.kill(sidecar.actor)
    with grpc.insecure_channel(sidecar.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
            assert time.monotonic() - killed < 5, "health still SERVING with the actor dead"
            time.sleep(0.05)
        not_serving_after = time.monotonic() - killed
    assert sidecar.lost.wait(timeout=15), "the front-end lingers with its actor dead"
    assert "journal" in sidecar.lost_reason
    print(f"NOT_SERVING after {not_serving_after:.1f} s, lost after "
          f"{time.monotonic() - killed:.1f} s")  # fmt: skip
