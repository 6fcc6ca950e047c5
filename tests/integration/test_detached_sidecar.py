"""The data plane outlives its driver: `rlfeed serve --ray-address ADDR --frontends 1` on a
Ray cluster this module owns (`ray.cluster_utils.Cluster` in a child process, on loopback,
shut down at the end). Each test names its sidecar with a `[ray] namespace` of its own.

- SIGKILL to the driver while a producer writes and two trainer ranks fetch: no call
  fails, steps are served while no driver runs, and a restarted `rlfeed serve` with the
  same config adopts the same actors (same ids) instead of starting new ones;
- a second `rlfeed serve` of a live sidecar is refused (exit 2, naming it) and changes
  nothing; SIGTERM to the owner leaves no actor of the sidecar in the cluster;
- a start-up that fails (a front-end never placed) leaves none either;
- slow: a restart with another config replaces the actors instead of adopting them; a
  driver stalled (SIGSTOP) past its lease loses the sidecar to the next one and exits 1,
  leaving it serving; a front-end killed while no driver runs is restarted by Ray.

Clients are raw gRPC stubs, each call made once: an error is a failure, never retried.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import Lines, free_port, wait_until
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

_spec = importlib.util.spec_from_file_location(
    "exactly_once", Path(__file__).with_name("exactly_once.py")
)
exactly_once = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exactly_once)

# A one-node Ray cluster owned by this child; each stdin line names a namespace, answered
# with one JSON line: name -> actor id of every named actor alive in it. EOF shuts it down.
_CLUSTER = """
import json, sys
import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 4})
print(json.dumps({"address": cluster.address}), flush=True)
for line in sys.stdin:
    namespace, ids = line.strip(), {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != namespace:
            continue
        try:
            handle = ray.get_actor(actor["name"], namespace=namespace)
        except ValueError:  # gone since listed
            continue
        ids[actor["name"]] = handle._actor_id.hex()  # the id `ray list actors` shows
    print(json.dumps(ids), flush=True)
ray.shutdown()
cluster.shutdown()
"""
_ACTOR_PROCESSES = ("ray::SchedulerActor", "ray::FrontendActor", "ray::DriverLeaseActor")


class RayCluster:
    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CLUSTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**env, "RAY_SCHEDULER_EVENTS": "0"},
        )
        self.lines = Lines(self.process)
        self.address = self._answer(180, "starting the Ray cluster")["address"]

    def _answer(self, timeout_s: float, what: str) -> dict:
        """The child's next JSON line; lines Ray's driver prints to stdout (the
        autoscaler's tips, as "(autoscaler +37s) ...") are skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.next(max(0.1, deadline - time.monotonic()), what)
            if line.startswith("{"):
                return json.loads(line)

    def actors(self, namespace: str) -> dict[str, str]:
        """Name -> actor id of every named actor alive in `namespace`."""
        self.process.stdin.write(namespace + "\n")
        self.process.stdin.flush()
        return self._answer(60, "listing the actors")

    def actor_processes(self) -> list[str]:
        """The actor worker processes of rlfeed under this cluster (any sidecar)."""
        table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
        children: dict[int, list[tuple[int, str]]] = {}
        for line in table.stdout.splitlines():
            pid, ppid, *args = line.split(None, 2)
            children.setdefault(int(ppid), []).append((int(pid), args[0] if args else ""))
        found, stack = [], [self.process.pid]
        while stack:
            for pid, command in children.get(stack.pop(), []):
                stack.append(pid)
                if command.startswith(_ACTOR_PROCESSES):
                    found.append(f"{pid} {command}")
        return found

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def cluster():
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    ray_cluster = RayCluster(env)
    ray_cluster.env = env
    try:
        yield ray_cluster
    finally:
        ray_cluster.close()


class Sidecar:
    """`rlfeed serve --ray-address --frontends 1` runs of one config (one sidecar name)."""

    def __init__(self, cluster: RayCluster, tmp_path: Path, config: str = "") -> None:
        self.cluster, self.tmp_path = cluster, tmp_path
        self.namespace = f"rlfeed-test-{uuid.uuid4().hex[:8]}"
        self.config = tmp_path / "rlfeed.toml"
        self.config.write_text(
            exactly_once.CONFIG + f'[ray]\nnamespace = "{self.namespace}"\n' + config
        )
        self.port = free_port()
        self.runs: list[subprocess.Popen] = []

    def start(self, *flags: str) -> subprocess.Popen:
        err = self.tmp_path / f"serve-{len(self.runs)}.err"
        serve = subprocess.Popen(
            [
                sys.executable, "-m", "rlfeed", "serve", "--config", str(self.config),
                "--ray-address", self.cluster.address, "--port", str(self.port),
                "--frontends", "1", *flags,
            ],
            stdout=subprocess.PIPE, stderr=err.open("w"), text=True, env=self.cluster.env,
        )  # fmt: skip
        serve.err, serve.lines = err, Lines(serve)
        self.runs.append(serve)
        return serve

    def listening(self, serve: subprocess.Popen) -> list[str]:
        """Its stdout up to its `listening on` line (the last)."""
        lines = [serve.lines.next(180, "rlfeed serve")]
        while "listening on" not in lines[-1]:
            lines.append(serve.lines.next(180, "rlfeed serve"))
        return lines

    def stop(self, serve: subprocess.Popen) -> int:
        serve.send_signal(signal.SIGTERM)
        return serve.wait(timeout=60)

    def actors(self) -> dict[str, str]:
        return self.cluster.actors(self.namespace)

    def close(self) -> None:
        for serve in self.runs:
            if serve.poll() is None:
                serve.kill()
                serve.wait()


def _assert_nothing_left(sidecar: Sidecar) -> None:
    assert sidecar.actors() == {}, f"actors left in {sidecar.namespace}"
    wait_until(
        lambda: not sidecar.cluster.actor_processes(),
        f"actor processes left: {sidecar.cluster.actor_processes()}",
        timeout_s=30,
        interval_s=0.2,
    )


class StrictClients:
    """A producer the test drives batch by batch, and trainer ranks fetching every step in
    threads; each call is made once, and an error is recorded as a failure."""

    def __init__(self, address: str, steps: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.history = exactly_once.History()
        self.failures: list[str] = []
        self.served_at: list[float] = []  # when each (step, rank) was served
        self.stop = threading.Event()
        tasks = pb_grpc.TaskSamplingStub(self.channel)
        tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=exactly_once.TASKS), timeout=30)
        self.ingest = pb_grpc.RolloutIngestStub(self.channel)
        self.ranks = [
            threading.Thread(target=self._rank, args=(rank, steps), daemon=True)
            for rank in range(exactly_once.WORLD_SIZE)
        ]
        for thread in self.ranks:
            thread.start()

    def submit(self, batches: list[tuple[bytes, list[str]]]) -> None:
        for payload, ids in batches:
            try:
                ack = self.ingest.SubmitRolloutBatch(pb.RolloutBatch(arrow_ipc=payload), timeout=30)
            except grpc.RpcError as exc:
                self.failures.append(f"SubmitRolloutBatch: {exc.code()} {exc.details()}")
                continue
            assert ack.accepted == len(ids), ack
            self.history.ack(ids)
            time.sleep(0.02)

    def _rank(self, rank: int, steps: int) -> None:
        get = self.channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,
        )
        for step in range(steps):
            while not self.stop.is_set():
                request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=500)
                try:
                    response = get(request, timeout=30)
                except grpc.RpcError as exc:
                    self.failures.append(f"GetBatch({step}, {rank}): {exc.code()} {exc.details()}")
                    time.sleep(0.2)
                    continue
                if pb.GetBatchResponse.FromString(response).ready:
                    self.history.serve(step, rank, response)
                    self.served_at.append(time.monotonic())
                    break

    def served_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in list(self.served_at))

    def close(self) -> None:
        self.stop.set()
        for thread in self.ranks:
            thread.join(timeout=10)
        self.channel.close()


@pytest.mark.timeout(420)
def test_a_killed_driver_leaves_the_sidecar_serving_and_a_restarted_one_adopts_it(
    cluster, tmp_path
) -> None:
    """Without a journal: a restarted driver that started a new scheduler instead of
    adopting would serve from an empty one, and the ranks would never get the last steps."""
    sidecar = Sidecar(cluster, tmp_path)
    first = sidecar.start()
    clients = None
    try:
        address = sidecar.listening(first)[-1].split()[4]
        before = sidecar.actors()
        assert sorted(before) == [
            "rlfeed-scheduler", "rlfeed-scheduler-driver", "rlfeed-scheduler-frontend-0"
        ]  # fmt: skip
        rollouts, work = exactly_once._workload(24, np.random.default_rng(5))
        batches = work[0] + work[1]
        steps = 24 // exactly_once.PROMPTS_PER_STEP
        clients = StrictClients(address, steps)
        third = len(batches) // 3
        clients.submit(batches[:third])

        first.kill()  # SIGKILL: nothing of it runs its teardown
        assert first.wait(timeout=30) == -signal.SIGKILL
        killed_at = time.monotonic()
        second = sidecar.start()  # same config; takes the lease once it lapses
        clients.submit(batches[third : 2 * third])  # while no driver runs
        started = sidecar.listening(second)
        adopted_at, line = time.monotonic(), started[-1]
        assert "adopted 1 front-ends" in line, line
        assert line.split()[4] == address
        assert sidecar.actors() == before, "the restarted driver started new actors"

        clients.submit(batches[2 * third :])
        wait_until(
            lambda: len(clients.history.served) == steps * exactly_once.WORLD_SIZE,
            "the ranks did not get every step",
            timeout_s=120,
            interval_s=0.1,
        )
        assert clients.failures == [], clients.failures[:5]
        driverless = clients.served_between(killed_at, adopted_at)
        assert driverless > 0, "nothing was served while no driver ran"
        exactly_once.check_exactly_once(
            {"history": clients.history, "rollouts": rollouts, "steps": steps}
        )
        print(
            f"{driverless} (step, rank)s served in the {adopted_at - killed_at:.1f} s without "
            f"a driver; {line.strip()}"
        )

        adopting = (
            f"rlfeed serve: adopting sidecar 'rlfeed-scheduler' in Ray namespace "
            f"'{sidecar.namespace}' left running by pid {first.pid} on host "
        )
        assert any(printed.startswith(adopting) for printed in started), started

        assert sidecar.stop(second) == 0  # the adopting driver tears everything down
        _assert_nothing_left(sidecar)
    finally:
        if clients is not None:
            clients.close()
        sidecar.close()


@pytest.mark.timeout(300)
def test_a_second_driver_of_a_live_sidecar_is_refused_and_a_stop_leaves_no_actor(
    cluster, tmp_path
) -> None:
    sidecar = Sidecar(cluster, tmp_path)
    first = sidecar.start()
    try:
        address = sidecar.listening(first)[-1].split()[4]
        before = sidecar.actors()
        second = sidecar.start()
        assert second.wait(timeout=120) == 2
        errors = second.err.read_text()  # Ray's own connection lines, then rlfeed's
        refusal = [line for line in errors.splitlines() if line.startswith("rlfeed")]
        assert len(refusal) == 1, errors
        assert refusal[0].startswith(
            f"rlfeed serve: sidecar 'rlfeed-scheduler' in Ray namespace '{sidecar.namespace}' "
            f"is owned by a running rlfeed serve (pid {first.pid} on host "
        ), refusal
        assert sidecar.actors() == before, "the refused driver changed the sidecar"
        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert [f.state for f in status.front_end_list] == ["serving"]

        assert sidecar.stop(first) == 0
        _assert_nothing_left(sidecar)
    finally:
        sidecar.close()


@pytest.mark.timeout(300)
def test_a_failed_start_leaves_no_actor(cluster, tmp_path) -> None:
    sidecar = Sidecar(cluster, tmp_path, config="[frontends]\nserving_timeout_s = 3\n")
    serve = sidecar.start("--frontend-resource", "no_such_node")
    try:
        assert serve.wait(timeout=120) == 1
        assert "not serving after 3 s" in serve.err.read_text()
        _assert_nothing_left(sidecar)
    finally:
        sidecar.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_restart_with_another_config_replaces_what_the_killed_driver_left(
    cluster, tmp_path
) -> None:
    sidecar = Sidecar(cluster, tmp_path)
    first = sidecar.start()
    try:
        sidecar.listening(first)
        before = sidecar.actors()
        first.kill()
        first.wait(timeout=30)
        config = sidecar.config.read_text()
        server = '[server]\nhost = "127.0.0.1"\n'
        assert server in config
        sidecar.config.write_text(config.replace(server, server + "max_wait_seconds = 7\n"))
        second = sidecar.start()
        assert "adopted" not in sidecar.listening(second)[-1]
        after = sidecar.actors()
        assert sorted(after) == sorted(before)
        renewed = [name for name in after if after[name] == before[name]]
        assert renewed == ["rlfeed-scheduler-driver"], "the old scheduler or front-end runs on"
        assert (
            f"rlfeed serve: replacing sidecar 'rlfeed-scheduler' in Ray namespace "
            f"'{sidecar.namespace}' left running by pid {first.pid} on host "
        ) in second.err.read_text()
        assert "(its driver ran another config; no journal: it starts empty)" in (
            second.err.read_text()
        )
        assert sidecar.stop(second) == 0
        _assert_nothing_left(sidecar)
    finally:
        sidecar.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stalled_driver_whose_lease_was_taken_over_leaves_the_sidecar_running(
    cluster, tmp_path
) -> None:
    """SIGSTOP stalls the owner past its lease; the next driver adopts the sidecar. The
    stalled one, continued, finds it lost the lease and exits 1 without stopping anything."""
    sidecar = Sidecar(cluster, tmp_path)
    first = sidecar.start()
    try:
        address = sidecar.listening(first)[-1].split()[4]
        before = sidecar.actors()
        os.kill(first.pid, signal.SIGSTOP)
        second = sidecar.start()
        assert "adopted 1 front-ends" in sidecar.listening(second)[-1]
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=60) == 1
        assert (
            f"was taken over by the rlfeed serve of pid {second.pid} on host "
            in first.err.read_text()
        )
        assert sidecar.actors() == before
        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert [f.state for f in status.front_end_list] == ["serving"]
        assert sidecar.stop(second) == 0
        _assert_nothing_left(sidecar)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first.pid, signal.SIGCONT)
        sidecar.close()


def _frontend_pids(cluster: RayCluster) -> list[int]:
    return [
        int(line.split()[0]) for line in cluster.actor_processes() if "ray::FrontendActor" in line
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_front_end_crashing_while_no_driver_runs_is_restarted_by_ray(cluster, tmp_path) -> None:
    """Nothing the dead driver owned is needed to restart a detached actor (its arguments
    travel inside its creation task): with a journal, Ray restarts the front-end process
    killed after its driver, on its slot, and the next driver adopts it."""
    sidecar = Sidecar(cluster, tmp_path)
    journal = ("--journal-dir", str(tmp_path / "journal"))
    first = sidecar.start(*journal)
    try:
        address = sidecar.listening(first)[-1].split()[4]
        before = sidecar.actors()
        first.kill()
        first.wait(timeout=30)
        (pid,) = _frontend_pids(cluster)
        os.kill(pid, signal.SIGKILL)

        def serving_again() -> bool:
            if _frontend_pids(cluster) in ([], [pid]):
                return False
            with grpc.insecure_channel(address) as channel:
                try:
                    status = pb_grpc.SidecarStatusStub(channel).GetStatus(
                        pb.GetStatusRequest(), timeout=2
                    )
                except grpc.RpcError:
                    return False
            return any(f.state == "serving" for f in status.front_end_list)

        wait_until(serving_again, "the front-end was not restarted", timeout_s=120, interval_s=0.5)
        assert sidecar.actors() == before  # restarted by Ray, not created anew
        second = sidecar.start(*journal)
        assert "adopted 1 front-ends" in sidecar.listening(second)[-1]
        assert sidecar.stop(second) == 0
        _assert_nothing_left(sidecar)
    finally:
        sidecar.close()
