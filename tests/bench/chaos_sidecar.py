"""`bench_chaos.py`'s world: the Ray cluster (in this process), `rlfeed serve` on it, the
client processes (`chaos_clients.py`), and what is read back at the end (the faults done
to it: `chaos_faults.py`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from chaos_clients import rollout_ids
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

HERE = Path(__file__).parent
RESOURCE = "rlfeed_frontend"
FRONT_ENDS = 2
ACTOR_NAME, NAMESPACE = "rlfeed-scheduler", "rlfeed"  # the config's defaults


def _load_sidecar_memory():
    import importlib.util

    path = HERE.parent / "integration" / "sidecar_memory.py"
    spec = importlib.util.spec_from_file_location("sidecar_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _two_free_ports() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 now (`[frontends] ports = consecutive`)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def _status(address: str) -> pb.StatusResponse | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=3)
        except grpc.RpcError:
            return None


def until(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` holds; TimeoutError naming `what` after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} after {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


class World:
    def __init__(self, out: Path, args, config: str, world_size: int) -> None:
        self.out, self.args, self.world_size = out, args, world_size
        self.port = _two_free_ports()
        self.addresses = [f"127.0.0.1:{self.port + i}" for i in range(FRONT_ENDS)]
        self.config = out / "rlfeed.toml"
        self.config.write_text(config + '[frontends]\nports = "consecutive"\n')
        self.serve_log = out / "serve.log"
        self.serve: subprocess.Popen | None = None
        self.cluster = None
        self.workers: list = []
        self.clients: dict[str, subprocess.Popen] = {}
        self.unexpected_exits: list[str] = []
        self.memory_module = _load_sidecar_memory()

    # ---- start and stop ----------------------------------------------------------------

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                # Find a dead node within about a second, not Ray's default 15 s or so.
                "_system_config": {
                    "health_check_period_ms": 300,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.workers = [self.add_worker() for _ in range(self.args.workers)]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        self.start_serve(timeout_s=300)
        for index in range(self.args.producers):
            self.start_client(f"producer-{index}")
        for rank in range(self.world_size):
            self.start_client(f"rank-{rank}")

    def add_worker(self):
        return self.cluster.add_node(num_cpus=1, resources={RESOURCE: 1})

    def stop(self) -> None:
        for name in list(self.clients):
            self.kill_client(name)
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill_serve()
        if self.cluster is not None:
            import ray

            ray.shutdown()
            self.cluster.shutdown()

    # ---- the sidecar -------------------------------------------------------------------

    def start_serve(self, timeout_s: float) -> None:
        """Start `rlfeed serve` and return once it says it listens; started again while it
        exits (a driver killed a moment ago: its actors and ports not released yet)."""
        command = [
            sys.executable, "-m", "rlfeed", "serve", "--config", str(self.config),
            "--ray-address", self.cluster.address, "--port", str(self.port),
            "--journal-dir", str(self.out / "journal"),
            "--frontends", str(FRONT_ENDS), "--frontend-resource", RESOURCE,
        ]  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            listening = self._listening_lines()
            with self.serve_log.open("a") as log:
                self.serve = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            while self.serve.poll() is None:
                if self._listening_lines() > listening:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rlfeed serve not listening after {timeout_s:.0f} s")
                time.sleep(0.2)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rlfeed serve kept exiting ({self.serve.returncode})")
            time.sleep(2.0)

    def _listening_lines(self) -> int:
        log = self.serve_log
        return log.read_text(errors="replace").count("listening on") if log.exists() else 0

    def kill_serve(self) -> None:
        os.killpg(self.serve.pid, signal.SIGKILL)
        self.serve.wait()

    def serving(self, new_ids: dict[str, str] | None = None) -> bool:
        """Every front-end answers, and the scheduler knows each one as serving (with
        `new_ids`: under another id than that, i.e. a new incarnation)."""
        statuses = [_status(address) for address in self.addresses]
        if any(status is None for status in statuses):
            return False
        serving = {f.slot: f.id for f in statuses[0].front_end_list if f.state == "serving"}
        if len(serving) < FRONT_ENDS:
            return False
        return not new_ids or all(serving.get(slot) != old for slot, old in new_ids.items())

    def front_ends(self) -> dict[str, pb.FrontEnd]:
        status = _status(self.addresses[0]) or _status(self.addresses[1])
        return {f.slot: f for f in status.front_end_list} if status is not None else {}

    # ---- the clients -------------------------------------------------------------------

    def start_client(self, name: str) -> None:
        role, index = name.rsplit("-", 1)
        addresses = ",".join(self.addresses)
        if role == "producer":
            rest = [index, str(self.args.seed), str(self.args.pace)]
        else:
            rest = [index, str(self.world_size)]
        command = [sys.executable, str(HERE / "chaos_clients.py"),
                   "producer" if role == "producer" else "trainer", addresses, str(self.out),
                   *rest]  # fmt: skip
        with (self.out / f"{name}.log").open("a") as log:
            self.clients[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill_client(self, name: str) -> None:
        process = self.clients.pop(name)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def supervise_for(self, seconds: float) -> None:
        """Wait `seconds`, restarting a client that exited without being told to (its
        log names why; counted in `unexpected_exits`)."""
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            self._supervise()
            time.sleep(0.5)

    def _supervise(self) -> None:
        for name, process in list(self.clients.items()):
            done = name.startswith("producer") and (self.out / f"{name}.done").exists()
            if process.poll() is not None and not done:
                self.unexpected_exits.append(f"{name} exited {process.returncode}")
                print(f"chaos: {name} exited {process.returncode} by itself", flush=True)
                self.kill_client(name)
                self.start_client(name)

    def log_lines(self, name: str) -> int:
        path = self.out / name
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def wait_for_first_steps(self, timeout_s: float = 600.0) -> None:
        def served() -> bool:
            self._supervise()
            return all(self.log_lines(f"rank-{r}.served") for r in range(self.world_size))

        until(served, timeout_s, "no step served to every rank")

    # ---- what is read back -------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """RSS in MiB of the sidecar's processes by role: the driver, the scheduler actor,
        the front-end actors, and Ray's own (raylets, GCS, idle workers; every process
        under this one that is no client)."""
        memory, mib = self.memory_module, self.memory_module.MIB
        clients = {pid for p in self.clients.values() for pid in memory.process_tree(p.pid)}
        driver = set(memory.process_tree(self.serve.pid))
        roles = {"driver": 0, "scheduler_actor": 0, "front_ends": 0, "ray": 0}
        for pid in memory.process_tree(os.getpid())[1:]:
            if pid in clients:
                continue
            figures = memory.memory_of(pid)
            name, rss = figures.get("name", ""), figures.get("VmRSS", 0)
            if pid in driver:
                roles["driver"] += rss
            elif name.startswith("ray::SchedulerActor"):
                roles["scheduler_actor"] += rss
            elif name.startswith("ray::FrontendActor"):
                roles["front_ends"] += rss
            else:
                roles["ray"] += rss
        roles["total"] = sum(roles.values())
        return {role: round(rss / mib) for role, rss in roles.items()}

    def drain(self, timeout_s: float = 900.0) -> int:
        """Stop the producers at a group boundary, wait until every rank was served every
        step; the number of steps (2 groups each, every group complete)."""
        (self.out / "stop-producers").write_text("")
        producers = [f"producer-{i}" for i in range(self.args.producers)]

        def stopped() -> bool:
            self._supervise()
            return all((self.out / f"{name}.done").exists() for name in producers)

        until(stopped, timeout_s, "the producers did not stop")
        groups = sum(int((self.out / f"{name}.done").read_text()) for name in producers)
        steps = groups // 2

        def all_served() -> bool:
            self._supervise()
            return all(len(self._served(r)) >= steps for r in range(self.world_size))

        until(all_served, timeout_s, "the ranks were not served every step")
        return steps

    def _served(self, rank: int) -> set[int]:
        path = self.out / f"rank-{rank}.served"
        return {json.loads(line)["step"] for line in path.read_text().splitlines()}

    def served_times(self) -> list[float]:
        return [
            json.loads(line)["t"]
            for rank in range(self.world_size)
            for line in (self.out / f"rank-{rank}.served").read_text().splitlines()
        ]

    def history(self, history):
        """The checker's History from the clients' files, and every rollout written."""
        written = []
        for index in range(self.args.producers):
            groups = int((self.out / f"producer-{index}.done").read_text())
            written += [i for group in range(groups) for i in rollout_ids(index, group)]
            for line in (self.out / f"producer-{index}.acked").read_text().splitlines():
                first, end = map(int, line.split())
                history.ack([i for group in range(first, end) for i in rollout_ids(index, group)])
        for rank in range(self.world_size):
            for line in (self.out / f"rank-{rank}.served").read_text().splitlines():
                served = json.loads(line)
                history.serve_content(served["step"], rank, served["digest"], served["ids"])
        return history, written
