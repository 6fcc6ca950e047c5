"""Front-ends as Ray actors across nodes: a Ray cluster of four nodes on this machine (a
head, and three workers offering the custom resource `rlfeed_frontend`), `rlfeed serve
--frontends 2 --frontend-resource rlfeed_frontend --journal-dir` joining it. The
scheduler actor runs on the head, the two front-ends on two different workers; producer
i and trainer rank i talk to front-end i only. Mid-run the worker node of front-end 0 is
killed (all its processes, SIGKILL): Ray restarts the front-end on the spare worker, on
the same port, from its journal slot, and the clients ride through.

Checked over the whole history, as in `test_crash_loop.py`: every acknowledged rollout
served in exactly one step, nothing served that was not acknowledged, a (step, rank)
never served with two contents, and a step fetched again from the other front-end is
byte-identical.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from helpers import Lines, free_port
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config import ServerConfig

_spec = importlib.util.spec_from_file_location(
    "exactly_once", Path(__file__).with_name("exactly_once.py")
)
exactly_once = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exactly_once)

RESOURCE = "rlfeed_frontend"
# A Ray cluster of one head and three worker nodes, owned by this process; it removes the
# worker node named on each stdin line (SIGKILL to all its processes, as a machine loss).
_CLUSTER = f"""
import json, sys
from ray.cluster_utils import Cluster

cluster = Cluster(
    initialize_head=True,
    head_node_args={{
        "num_cpus": 1,
        # Find a dead node within about a second, not Ray's default 15 s or so.
        "_system_config": {{"health_check_period_ms": 300, "health_check_failure_threshold": 3}},
    }},
)
workers = [cluster.add_node(num_cpus=1, resources={{"{RESOURCE}": 1}}) for _ in range(3)]
cluster.wait_for_nodes()
print(json.dumps({{
    "address": cluster.address,
    "head": cluster.head_node.node_id,
    "workers": [node.node_id for node in workers],
}}), flush=True)
for line in sys.stdin:
    node = next(node for node in workers if node.node_id == line.strip())
    cluster.remove_node(node, allow_graceful=False)
    print("removed", flush=True)
cluster.shutdown()
"""


def _status(address: str) -> pb.StatusResponse | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=2)
        except grpc.RpcError:
            return None


def _serving_nodes(address: str) -> dict[str, str]:
    """slot -> Ray node id of every front-end the sidecar at `address` shows serving."""
    status = _status(address)
    if status is None:
        return {}
    return {f.slot: f.node_id for f in status.front_end_list if f.state == "serving"}


class NodeLoss:
    """Kill the worker node hosting front-end 0; return once it serves again elsewhere."""

    def __init__(self, cluster: Lines, addresses: list[str]) -> None:
        self.cluster, self.addresses = cluster, addresses
        self.back_after: list[float] = []
        self.moved: list[tuple[str, str]] = []  # (node before, node after)

    def __call__(self) -> None:
        before = _serving_nodes(self.addresses[1])["frontend-0"]
        self.cluster.process.stdin.write(before + "\n")
        self.cluster.process.stdin.flush()
        assert self.cluster.next(60, "removing the node").strip() == "removed"
        start = time.monotonic()
        while True:
            after = _serving_nodes(self.addresses[1]).get("frontend-0")
            if after not in (None, before) and _status(self.addresses[0]) is not None:
                break
            assert time.monotonic() - start < 120, "front-end 0 did not come back"
            time.sleep(0.2)
        self.back_after.append(time.monotonic() - start)
        self.moved.append((before, after))


def _fetch(address: str, step: int, rank: int) -> bytes:
    with grpc.insecure_channel(address) as channel:
        get = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,
        )
        return get(pb.GetBatchRequest(step=step, rank=rank, timeout_ms=1000), timeout=10)


@pytest.mark.timeout(600)
def test_front_ends_on_two_nodes_survive_the_loss_of_one(tmp_path: Path) -> None:
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    env = {**os.environ, **auth}
    cluster = subprocess.Popen(
        [sys.executable, "-c", _CLUSTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    serve = None
    log = tmp_path / "serve.err"
    try:
        cluster_lines = Lines(cluster)
        nodes = json.loads(cluster_lines.next(180, "starting the Ray cluster"))
        config = tmp_path / "rlfeed.toml"
        config.write_text(exactly_once.CONFIG + '[frontends]\nports = "consecutive"\n')
        port = free_port()
        serve = subprocess.Popen(
            [
                sys.executable, "-m", "rlfeed", "serve", "--config", str(config),
                "--ray-address", nodes["address"], "--port", str(port),
                "--journal-dir", str(tmp_path / "journal"),
                "--frontends", "2", "--frontend-resource", RESOURCE,
            ],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )  # fmt: skip
        serve_lines = Lines(serve)
        while "listening on" not in (line := serve_lines.next(180, "rlfeed serve")):
            pass
        addresses = line.split()[4].split(",")
        assert addresses == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], line

        placed = _serving_nodes(addresses[0])
        assert set(placed) == {"frontend-0", "frontend-1"}
        assert placed["frontend-0"] != placed["frontend-1"], "both front-ends on one node"
        assert set(placed.values()) <= set(nodes["workers"]), "a front-end on the head"

        loss = NodeLoss(cluster_lines, addresses)
        run = exactly_once.run_clients(addresses, loss, kills=1, num_groups=60, seed=11)
        exactly_once.check_exactly_once(run)
        exactly_once.report(run)
        assert run["mid_ingest"] >= 1, "the node was lost after the producers finished"
        ((before, after),) = loss.moved
        assert after in nodes["workers"] and after not in (before, placed["frontend-1"])
        print(f"front-end 0 back on another node after {loss.back_after[0]:.1f} s")

        # Any front-end serves any (step, rank), byte-identical to what the ranks got.
        last = run["steps"] - 1
        for rank in range(exactly_once.WORLD_SIZE):
            for address in addresses:
                digest = hashlib.sha256(_fetch(address, last, rank)).hexdigest()
                assert run["history"].served[(last, rank)] == {digest}
        _wait_for_log(log, "front-end 0 restarted by Ray")  # the driver asks every second
        assert serve.poll() is None, "rlfeed serve stopped"
        serve.terminate()
        assert serve.wait(timeout=60) == 0
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
            serve.wait()
        cluster.stdin.close()  # it shuts its Ray cluster down
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            cluster.kill()
            cluster.wait()


def _serve_embedded(tmp_path: Path, *flags: str, config: str = "") -> subprocess.Popen:
    """`rlfeed serve` on an embedded Ray, its stderr in tmp_path/serve.err."""
    path = tmp_path / "rlfeed.toml"
    path.write_text(exactly_once.CONFIG + config)
    return subprocess.Popen(
        [
            sys.executable, "-m", "rlfeed", "serve", "--config", str(path),
            "--port", str(free_port()), *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "serve.err").open("w"),
        text=True,
    )  # fmt: skip


def _wait_for_log(log: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def _frontend_pids(root: int, actor: str = "FrontendActor") -> list[int]:
    """The `actor` processes (FrontendActor, SchedulerActor) under `root` (its embedded
    Ray's workers are its descendants): another run on this host may have its own."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    command: dict[int, str] = {}
    for line in table.stdout.splitlines():
        pid, ppid, *args = line.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        command[int(pid)] = args[0] if args else ""
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            if command[child].startswith(f"ray::{actor}"):
                found.append(child)
    return found


@pytest.mark.timeout(300)
def test_two_front_ends_start_on_the_embedded_ray_with_the_default_config(tmp_path) -> None:
    """`rlfeed serve --frontends 2` with `[ray] num_cpus` at its default 2: the embedded
    Ray is sized for the scheduler and both front-ends (it used to place one, then wait
    120 s in silence)."""
    assert "num_cpus" not in exactly_once.CONFIG
    started = time.monotonic()
    serve = _serve_embedded(tmp_path, "--frontends", "2")
    try:
        lines = Lines(serve)
        while "listening on" not in (line := lines.next(90, "rlfeed serve")):
            pass
        seconds = time.monotonic() - started
        print(f"{line.strip()} after {seconds:.1f} s")
        assert "2 front-ends as Ray actors" in line, line
        assert seconds < 60  # Ray's start-up and two actors; never the 120 s placement wait
        # The sidecar's actors get the CPU as `rlfeed serve` does, not at Ray's nice 15 for
        # workers, below the producers and trainers they serve.
        actors = _frontend_pids(serve.pid) + _frontend_pids(serve.pid, "SchedulerActor")
        assert len(actors) == 3
        niceness = {os.getpriority(os.PRIO_PROCESS, pid) for pid in actors}
        assert niceness == {os.getpriority(os.PRIO_PROCESS, serve.pid)}
        # Their glibc malloc keeps freed memory for the next step's buffers from the
        # worker's start (one heap), as `rlfeed serve` sets up its own (client.allocator).
        retained = str(ServerConfig().retained_free_mib * 2**20)
        for pid in _frontend_pids(serve.pid):
            environ = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
            assert environ.get("MALLOC_ARENA_MAX") == "1"
            assert environ.get("MALLOC_TRIM_THRESHOLD_") == retained
        serve.terminate()
        assert serve.wait(timeout=60) == 0
    finally:
        serve.kill()
        serve.wait()


@pytest.mark.timeout(300)
def test_a_front_end_that_is_never_placed_stops_the_sidecar_naming_the_resource(tmp_path) -> None:
    serve = _serve_embedded(
        tmp_path,
        "--frontends", "1", "--frontend-resource", "no_such_node",
        config="[frontends]\nserving_timeout_s = 3\n",
    )  # fmt: skip
    try:
        assert serve.wait(timeout=120) == 1
    finally:
        serve.kill()
    errors = (tmp_path / "serve.err").read_text()
    assert "not serving after 3 s" in errors and "'no_such_node'" in errors, errors[-2000:]


@pytest.mark.timeout(300)
def test_a_crashed_front_end_is_restarted_with_a_journal_and_stops_the_sidecar_without(
    tmp_path,
) -> None:
    """SIGKILL to the front-end actor's process. With a journal Ray restarts it on its slot
    (the sidecar serves again at the same address); without one what it held is gone, so
    the sidecar stops (exit 1) instead of serving with a hole."""
    for journal in (True, False):
        flags = ("--journal-dir", str(tmp_path / "journal")) if journal else ()
        serve = _serve_embedded(tmp_path, "--frontends", "1", *flags)
        try:
            lines = Lines(serve)
            while "listening on" not in (line := lines.next(180, "rlfeed serve")):
                pass
            address = line.split()[4]
            (pid,) = _frontend_pids(serve.pid)
            os.kill(pid, 9)
            if journal:
                _wait_for_log(tmp_path / "serve.err", "front-end 0 restarted by Ray")
                assert _serving_nodes(address).get("frontend-0"), "not serving after restart"
                serve.terminate()
                assert serve.wait(timeout=60) == 0
            else:
                assert serve.wait(timeout=60) == 1
        finally:
            serve.kill()
            serve.wait()
        errors = (tmp_path / "serve.err").read_text()
        expected = "front-end 0 restarted by Ray" if journal else "no [journal] dir"
        assert expected in errors, errors[-2000:]
