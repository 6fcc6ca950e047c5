"""The end-to-end benchmark's processes: started in an environment, reaped, and their
CPU seconds and page faults accounted per role (also used by `bench_producers.py`).

On a machine with few cores the sum of every process's CPU, not one process, bounds the
rate, so the reports read /proc for all of this run's processes and threads."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """os.environ with `overrides` while processes are started in it (spawned processes
    take a copy at start), restored after."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def reap(processes: list[mp.Process], timeout_s: float = 30.0) -> None:
    """Wait for each process to exit; kill (and wait for) those still running after
    `timeout_s`."""
    for process in processes:
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


def cpu_snapshot() -> dict[int, tuple[str, float, int]]:
    """pid -> (command line, CPU seconds so far, minor page faults so far) of every process
    started by this one (children, their children, ...: the sidecar, Ray's daemons and
    workers, the clients), itself included. Only those: other users' processes on a shared
    machine (their Ray workers too) are not this run's."""
    tick = os.sysconf("SC_CLK_TCK")
    out, parents = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        out[int(entry)] = (command, (int(fields[11]) + int(fields[12])) / tick, int(fields[7]))
    return {pid: value for pid, value in out.items() if _descends(pid, os.getpid(), parents)}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """thread id -> (its Python thread name, trailing number dropped, or the OS name of a
    thread Python did not start: gRPC's, Ray's; CPU seconds so far) of this process."""
    import threading

    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{entry}/comm") as comm:
                name = names.get(int(entry), comm.read().strip())
        except OSError:
            continue
        out[int(entry)] = (name.rstrip("0123456789_-"), (int(fields[11]) + int(fields[12])) / tick)
    return out


def report_threads(before: dict, after: dict) -> None:
    """The front-end's CPU seconds per kind of thread in the window (the event loop of the
    public server, its pool, the assembler, gRPC's and Ray's own threads)."""
    used: dict[str, float] = {}
    for tid, (name, total) in after.items():
        used[name] = used.get(name, 0.0) + total - before.get(tid, (name, 0.0))[1]
    shown = [(name, spent) for name, spent in sorted(used.items(), key=lambda i: -i[1])]
    print("    front-end threads: " + ", ".join(f"{n} {t:.2f}" for n, t in shown if t >= 0.01))


def _descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    for _ in range(64):  # a bounded walk up the tree
        if pid == ancestor:
            return True
        if pid not in parents or pid <= 1:
            return False
        pid = parents[pid]
    return False


def _role(pid: int, command: str, roles: dict[int, str]) -> str:
    if pid in roles:
        return roles[pid]
    if "rlfeed serve --join" in command:
        return "front-end replica"
    for marker in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py"):
        if marker in command:
            return f"ray {marker}"
    if "ray::FrontendActor" in command:
        return "front-end actor"
    if "ray::SchedulerActor" in command:
        return "ray worker (the scheduler actor)"
    if "default_worker.py" in command or "ray::" in command:
        return "ray worker (idle or other)"
    return "other: " + command[:40]


def report_cpu(before: dict, after: dict, seconds: float, roles: dict[int, str]) -> float:
    """Print the CPU seconds and minor page faults (touching fresh memory, costly in a VM)
    of each process of this run (`cpu_snapshot`), grouped by role, in the end-to-end
    window; returns their sum."""
    used: dict[str, float] = {}
    faults: dict[str, int] = {}
    for pid, (command, total, faulted) in after.items():
        _, total_before, faulted_before = before.get(pid, (command, 0.0, 0))
        if total - total_before > 0:
            role = _role(pid, command, roles)
            used[role] = used.get(role, 0.0) + total - total_before
            faults[role] = faults.get(role, 0) + faulted - faulted_before
    print(f"  CPU in the end-to-end window ({seconds:.2f} s wall, {os.cpu_count()} cores):")
    for role, spent in sorted(used.items(), key=lambda item: -item[1]):
        print(f"    {role:<44} {spent:6.2f} s  {faults[role]:8,} page faults")
    print(f"    {'all':<44} {sum(used.values()):6.2f} s  {sum(faults.values()):8,} page faults")
    return sum(used.values())
