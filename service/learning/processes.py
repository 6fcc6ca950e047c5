"""The child processes of a learning run or a demo: trainer ranks with torchrun's variables,
producers, and the record of everything started so that every path stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# How long a producer asked to stop (SIGTERM) may take to flush before it is killed.
STOP_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(module: str, arguments: list[str], world_size: int) -> list[subprocess.Popen]:
    """`python -m module arguments` once per rank with torchrun's variables. Rank 0's
    output goes to our stdout; the others stay quiet unless they fail (stderr is kept)."""
    master_port = str(free_port())
    processes = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=master_port,
            OMP_NUM_THREADS="1",
        )
        output = None if rank == 0 else subprocess.DEVNULL
        processes.append(start([sys.executable, "-m", module, *arguments], env, output))
    return processes


def start(command: list[str], env: dict | None = None, stdout=None) -> subprocess.Popen:
    # A session of their own: a terminal's Ctrl-C reaches only `rlfeed demo`, which stops
    # them (no traceback from each child); `Running.stop` kills them on every path.
    return subprocess.Popen(
        command,
        env=env or dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=stdout,
        start_new_session=True,
    )


def wait_for(
    processes: list[subprocess.Popen],
    abort: threading.Event | None = None,
    watch: list[subprocess.Popen] = (),
    tick=None,
) -> list[int]:
    """Wait until every process in `processes` exits; stop early if one fails, `abort` is
    set, or a process in `watch` (expected to outlive them) exits at all. `tick()` runs
    every 0.1 s. Returns the indices of failed `processes` (or [-1] for a watched one)."""
    while True:
        if tick is not None:
            tick()
        codes = [p.poll() for p in processes]
        failed = [index for index, code in enumerate(codes) if code not in (None, 0)]
        if any(p.poll() is not None for p in watch):
            failed = failed or [-1]
        if failed or (abort is not None and abort.is_set()):
            return failed
        if all(code == 0 for code in codes):
            return []
        time.sleep(0.1)


def terminate(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM each running process, wait up to `grace_s` for all, kill the rest. Returns
    the exit codes (a killed process's is negative)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return [p.returncode for p in processes]


@dataclass
class Running:
    """What the demo started beside the sidecar, stopped on every path by `stop`."""

    stop_fleet: threading.Event = field(default_factory=threading.Event)
    processes: list[subprocess.Popen] = field(default_factory=list)
    fleet_thread: threading.Thread | None = None
    transport: Any = None

    def stop(self) -> None:
        self.stop_fleet.set()
        # Every kill before any wait: a rank outliving its peer by a wait would print the
        # peer's lost connection as a traceback.
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        if self.fleet_thread is not None:
            self.fleet_thread.join(timeout=10)
        if self.transport is not None:
            self.transport.close()
