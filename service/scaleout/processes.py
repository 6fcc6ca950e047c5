"""More front-ends for one sidecar: `[server] replicas` > 1 runs that many `rlfeed serve`
processes on one port (SO_REUSEPORT) and one scheduler actor; one front-end saturates
about one core. Replica i serves metrics on `metrics_port + i`.

A replica told to stop (SIGTERM) hands its data over and exits 0. One that exits
otherwise (killed, crashed) took along what it held in memory: with `[journal] dir` that is
in its journal slot, so the first process declares it dead at the actor (`orphan_slot`)
and starts a new replica on the same slot, which loads it (`restart`); without a journal
the first process stops the whole sidecar (exit 1). The first process stops its replicas
when it stops; a replica whose first process is gone (its parent changed: killed with
SIGKILL, nothing stopped it) exits on its own within a second, freeing the port.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import ray
from rlfeed.service.config import SidecarConfig, dump_config
from rlfeed.service.frontend.journaling import frontend_slot

_READY_POLL_SECONDS = 0.2
# A replica that exited with an error this many times within this window is not restarted.
_MAX_RESTARTS, _RESTART_WINDOW_SECONDS = 5, 120.0


@dataclass
class ReplicaProcesses:
    """The `rlfeed serve --join` processes this one started; `stop()` ends them."""

    processes: list[subprocess.Popen]
    config_file: str
    actor: ray.actor.ActorHandle
    commands: list[list[str]] = field(default_factory=list)  # replica i's is [i - 1]
    restarts: int = 0  # replicas restarted after dying (`restart`)
    _reported: set[int] = field(default_factory=set)  # replicas newly_left has named
    _restarted_at: dict[int, list[float]] = field(default_factory=dict)  # after errors

    def exited(self, clean_too: bool = False) -> str | None:
        """A description of the first replica that exited without handing its data over
        (exit code not 0; with `clean_too`, any exit), or None."""
        for index in self.died(clean_too):
            process = self.processes[index - 1]
            return f"replica {index} (pid {process.pid}) exited with code {process.returncode}"
        return None

    def died(self, clean_too: bool = False) -> list[int]:
        """The indices (from 1) of the replicas that exited without handing their data over
        (exit code not 0; with `clean_too`, any exit)."""
        return [
            index
            for index, process in enumerate(self.processes, start=1)
            if (code := process.poll()) is not None and (code != 0 or clean_too)
        ]

    def crash_looping(self, index: int) -> bool:
        """Whether replica `index` exited by itself (an error, not a signal) `_MAX_RESTARTS`
        times within the last `_RESTART_WINDOW_SECONDS`: a replica that cannot start, which
        restarting again only hides. A replica killed by a signal is always restarted."""
        now = time.monotonic()
        recent = [t for t in self._restarted_at.get(index, []) if now - t < _RESTART_WINDOW_SECONDS]
        self._restarted_at[index] = recent
        return len(recent) >= _MAX_RESTARTS

    def restart(self, index: int) -> str:
        """Replace replica `index`, which died, by a new process on its journal slot: the
        actor first forgets the dead one and keeps what it held for the slot
        (`SchedulerActor.orphan_slot`); the new one claims it when it registers. Returns
        the line to log. Raises what the actor call raises (the actor is gone)."""
        dead = self.processes[index - 1]
        slot = frontend_slot(index)
        ray.get(self.actor.orphan_slot.remote(slot), timeout=30)
        self.processes[index - 1] = _spawn(self.commands[index - 1])
        self.restarts += 1
        if dead.returncode > 0:
            self._restarted_at.setdefault(index, []).append(time.monotonic())
        return (
            f"replica {index} (pid {dead.pid}) exited with code {dead.returncode}; what it "
            f"acknowledged is in journal slot {slot}: restarted it as pid "
            f"{self.processes[index - 1].pid}"
        )

    def newly_left(self) -> list[str]:
        """Replicas that left cleanly (handed their data over, exit 0) since the last call."""
        left = []
        for index, process in enumerate(self.processes, start=1):
            if process.poll() == 0 and index not in self._reported:
                self._reported.add(index)
                left.append(f"replica {index} (pid {process.pid}) left")
        return left

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the whole sidecar's replicas: mark the sidecar stopping at the actor (so
        they have nothing to hand over), SIGTERM every replica, then kill those still
        running after `timeout_s`."""
        with contextlib.suppress(Exception):  # an actor already gone: nothing to hand to
            ray.get(self.actor.stop_sidecar.remote(), timeout=10)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config_file)


def start_replicas(
    config: SidecarConfig, port: int, actor: ray.actor.ActorHandle, timeout_s: float = 180.0
) -> ReplicaProcesses:
    """Start `config.server.replicas - 1` front-ends joining this process's Ray cluster and
    `actor` on `port`; returns once every one has registered with the actor. RuntimeError
    (the started ones stopped) if one exits first or `timeout_s` passes."""
    wanted = config.server.replicas
    resolved = replace(config, server=replace(config.server, port=port))
    handle, config_file = tempfile.mkstemp(prefix="rlfeed-replica-", suffix=".toml")
    with os.fdopen(handle, "w") as out:
        out.write(dump_config(resolved, "toml"))
    gcs_address = ray.get_runtime_context().gcs_address
    processes: list[subprocess.Popen] = []
    replicas = ReplicaProcesses(processes, config_file, actor)
    try:
        for index in range(1, wanted):
            metrics_port = config.server.metrics_port + index if config.server.metrics_port else 0
            command = [
                sys.executable, "-m", "rlfeed", "serve", "--join",
                "--config", config_file,
                "--ray-address", gcs_address,
                "--metrics-port", str(metrics_port),
                "--journal-slot", frontend_slot(index),
                "--first-pid", str(os.getpid()),
            ]  # fmt: skip
            replicas.commands.append(command)
            processes.append(_spawn(command))
        deadline = time.monotonic() + timeout_s
        while len(ray.get(actor.frontend_addresses.remote())) < wanted:
            problem = replicas.exited(clean_too=True)
            if problem is None and time.monotonic() > deadline:
                problem = f"replicas did not register within {timeout_s:.0f} s"
            if problem is not None:
                raise RuntimeError(f"cannot start the front-end replicas: {problem}")
            time.sleep(_READY_POLL_SECONDS)
    except BaseException:
        replicas.stop()
        raise
    return replicas


def _spawn(command: list[str]) -> subprocess.Popen:
    # The token of Ray's token authentication reaches a replica through the environment
    # ray.init set up (RAY_AUTH_MODE) and the token file it wrote.
    # A session of its own: Ctrl-C at a terminal reaches the first process only, which
    # marks the sidecar stopping before it stops the replicas (they then have nothing to
    # hand over).
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
