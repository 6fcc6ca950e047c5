"""Crash loop: `rlfeed serve --journal-dir` killed with SIGKILL (its whole process group:
the server, Ray and the scheduler actor) at random points while producers stream rollouts
and two trainer ranks fetch steps, restarted on the same port and journal each time. The
same with only the scheduler actor killed (Ray restarts it), and with only the replica of
`--replicas 2` killed (the first process restarts it on its journal slot).

Over the whole history: every acknowledged rollout is served, in exactly one step; nothing
is served that was not acknowledged; a (step, rank) is never served with two different
contents. Producers retry a batch with the same rollout ids until it is acknowledged (the
idempotent-producer contract); ranks re-ask for the same (step, rank) until served.
Clients here are raw gRPC stubs from the .proto, so the test sees every byte.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import synthetic_groups

GROUP_SIZE, PROMPTS_PER_STEP, WORLD_SIZE = 4, 2, 2
TASKS = [f"task-{i}" for i in range(8)]
CONFIG = f"""
[server]
host = "127.0.0.1"
[batching]
world_size = {WORLD_SIZE}
token_budget = 512
[rollouts]
group_size = {GROUP_SIZE}
prompts_per_step = {PROMPTS_PER_STEP}
[advantages]
drop_zero_advantage = false
[journal]
sync = "group"
segment_bytes = 65536
snapshot_every_records = 40
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """`rlfeed serve` in a process group of its own, restartable on one port and journal."""

    def __init__(self, workdir: Path, *flags: str) -> None:
        self.flags = flags  # more `rlfeed serve` flags (`--replicas 2`)
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = workdir / "rlfeed.toml"
        self.config.write_text(CONFIG)
        self.journal = workdir / "journal"
        self.log = (workdir / "serve.log").open("ab")
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 120.0) -> None:
        command = [
            sys.executable, "-m", "rlfeed", "serve", "--config", str(self.config),
            "--port", str(self.port), "--journal-dir", str(self.journal), *self.flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            status = pb_grpc.SidecarStatusStub(channel)
            while time.monotonic() < deadline:
                assert self.process.poll() is None, f"rlfeed serve exited {self.process.returncode}"
                try:
                    status.GetStatus(pb.GetStatusRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    time.sleep(0.2)
        raise AssertionError(f"rlfeed serve did not answer within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL to the whole group: no handler runs, nothing is flushed or handed over."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _group_alive(self.process.pid):
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
        self.log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class History:
    """What the clients saw: acknowledged rollout ids, and every (step, rank) served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acknowledged: set[str] = set()
        self.served: dict[tuple[int, int], set[str]] = {}  # (step, rank) -> content digests
        self.rollouts_of: dict[int, list[str]] = {}  # step -> rollout ids (rank order)

    def ack(self, rollout_ids: list[str]) -> None:
        with self.lock:
            self.acknowledged.update(rollout_ids)

    def serve(self, step: int, rank: int, response: bytes) -> None:
        message = pb.GetBatchResponse.FromString(response)
        ids = [i for mb in message.microbatches for i in mb.rollout_ids]
        with self.lock:
            self.served.setdefault((step, rank), set()).add(hashlib.sha256(response).hexdigest())
            self.rollouts_of.setdefault(step, []).extend(ids)


def _retrying(call, stop: threading.Event):
    """`call()` until it answers; every gRPC error (the sidecar is down) is retried."""
    while not stop.is_set():
        try:
            return call()
        except grpc.RpcError:
            time.sleep(0.2)
    return None


def _producer(address: str, batches: list[tuple[bytes, list[str]]], history, stop) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RolloutIngestStub(channel)
        tasks = pb_grpc.TaskSamplingStub(channel)
        _retrying(lambda: tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=TASKS)), stop)
        for payload, ids in batches:
            request = pb.RolloutBatch(arrow_ipc=payload)
            if _retrying(lambda r=request: stub.SubmitRolloutBatch(r, timeout=10), stop):
                history.ack(ids)
            time.sleep(0.05)


def _trainer(address: str, rank: int, steps: int, history, stop) -> None:
    with grpc.insecure_channel(address) as channel:
        get = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,
        )
        for step in range(steps):
            while not stop.is_set():
                request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=1000)
                response = _retrying(lambda r=request: get(r, timeout=5), stop)
                if response is not None and pb.GetBatchResponse.FromString(response).ready:
                    history.serve(step, rank, response)
                    break


def _workload(num_groups: int, rng: np.random.Generator) -> tuple:
    """The rollouts, and two producers' batches of 3 (a group's rollouts span batches)."""
    rollouts = synthetic_groups(
        num_groups=num_groups, group_size=GROUP_SIZE, rng=rng, tasks=TASKS, max_length=120
    )
    order = np.arange(len(rollouts))
    halves = [order[: len(order) // 2], order[len(order) // 2 :]]
    work = [
        [(rollouts.encode(rows.tolist()), [rollouts.rollout_ids[r] for r in rows]) for rows in
         np.array_split(half, max(1, len(half) // 3))]
        for half in halves
    ]  # fmt: skip
    return rollouts, work


def _run_crash_loop(address: str, crash, kills: int, num_groups: int, seed: int) -> dict:
    """Producers and trainers against `address` while `crash()` is called `kills` times at
    random points (it returns once the sidecar answers again); then drain."""
    rng = np.random.default_rng(seed)
    rollouts, work = _workload(num_groups, rng)
    steps = num_groups // PROMPTS_PER_STEP
    history, stop = History(), threading.Event()
    threads = [
        threading.Thread(target=_producer, args=(address, w, history, stop)) for w in work
    ] + [
        threading.Thread(target=_trainer, args=(address, r, steps, history, stop))
        for r in range(WORLD_SIZE)
    ]
    try:
        for thread in threads:
            thread.start()
        mid_ingest = 0  # kills while producers were still sending
        for _ in range(kills):
            time.sleep(float(rng.uniform(0.5, 3.0)))
            mid_ingest += any(t.is_alive() for t in threads[: len(work)])
            crash()
        deadline = time.monotonic() + 240
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "clients did not finish draining"
    finally:
        stop.set()
    return {
        "history": history,
        "rollouts": rollouts,
        "steps": steps,
        "kills": kills,
        "mid_ingest": mid_ingest,
    }


def _serve_crash_loop(tmp_path: Path, kills: int, num_groups: int, seed: int) -> dict:
    sidecar = Sidecar(tmp_path)
    sidecar.start()

    def crash() -> None:
        sidecar.kill()
        sidecar.start()

    try:
        return _run_crash_loop(sidecar.address, crash, kills, num_groups, seed)
    finally:
        sidecar.stop()


def _check(run: dict) -> None:
    history: History = run["history"]
    served = [i for step in sorted(history.rollouts_of) for i in history.rollouts_of[step]]
    assert len(history.acknowledged) == len(run["rollouts"])  # every batch got its ack
    assert len(served) == len(set(served)), "a rollout was served twice"
    assert set(served) == history.acknowledged, (
        f"acknowledged but never served: {len(history.acknowledged - set(served))}, "
        f"served but never acknowledged: {len(set(served) - history.acknowledged)}"
    )
    assert len(history.served) == run["steps"] * WORLD_SIZE
    two_contents = {key for key, digests in history.served.items() if len(digests) > 1}
    assert not two_contents, f"(step, rank) served with two different contents: {two_contents}"


def _report(run: dict) -> None:
    print(
        f"crash loop: {run['kills']} kills ({run['mid_ingest']} during ingest), "
        f"{len(run['rollouts'])} rollouts, {run['steps']} steps"
    )


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


def _wait_for_two_front_ends(sidecar: Sidecar, deadline: float) -> None:
    while _front_ends(sidecar.address) != 2:
        assert sidecar.process.poll() is None, "the sidecar stopped"
        assert time.monotonic() < deadline, "no second front-end registered"
        time.sleep(0.2)


class ReplicaCrash:
    """SIGKILL the replica of `rlfeed serve --replicas 2` (never the first process); return
    once the first process has started a new one and it has registered."""

    def __init__(self, sidecar: Sidecar, timeout_s: float = 120.0) -> None:
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
    sidecar = Sidecar(tmp_path, "--replicas", "2")
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
