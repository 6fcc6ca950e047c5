"""The memory of a sidecar's processes, read from /proc: a process and every process under
it (an embedded Ray's raylet, GCS and workers), their VmRSS summed, sampled over a run.

Loaded by path (`importlib`) by the overload, slow-disk and chaos runs and the CLI tests
(which find a demo's or a sidecar's processes with it), as `exactly_once.py` is.
"""

from __future__ import annotations

from pathlib import Path

MIB = 2**20


def children_by_parent() -> dict[int, list[int]]:
    """Parent pid -> the pids of its children, every process now (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and every process under it."""
    children = children_by_parent()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS and its shared-memory part RssShmem, bytes, and the name of a process ({} if
    it exited meanwhile)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[-40:]
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    figures = {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssShmem")}
    return {**figures, "name": name}


def rss_bytes(pids: list[int]) -> int:
    """The sum of the processes' VmRSS (shared pages count in each process mapping them)."""
    return sum(memory_of(pid).get("VmRSS", 0) for pid in pids)


class Sampler:
    """The sidecar's memory: the sum of VmRSS over its process tree, sampled by phase."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.at_idle = {pid: memory_of(pid) for pid in process_tree(root)}
        self.idle = sum(figures.get("VmRSS", 0) for figures in self.at_idle.values())
        self.peak, self.at_peak = self.idle, []
        self.samples: list[tuple[int, int]] = []  # (phase, RSS)

    def sample(self, phase: int) -> None:
        tree = process_tree(self.root)
        rss = rss_bytes(tree)
        if rss > self.peak:
            self.peak, self.at_peak = rss, [{**memory_of(pid), "pid": pid} for pid in tree]
        self.samples.append((phase, rss))

    def report(self) -> str:
        phases = sorted({phase for phase, _ in self.samples})
        per_phase = [round(max(r for p, r in self.samples if p == n) / MIB) for n in phases]
        lines = [
            f"sidecar RSS idle {self.idle / MIB:.0f} MiB, peak {self.peak / MIB:.0f} MiB "
            f"(per phase {per_phase} MiB)"
        ]
        for figures in sorted(self.at_peak, key=lambda f: -f.get("VmRSS", 0))[:8]:
            if "VmRSS" in figures:
                idle = self.at_idle.get(figures["pid"], {}).get("VmRSS", 0)
                lines.append(
                    f"  at peak: {figures['name']}: VmRSS {figures['VmRSS'] / MIB:.0f} MiB "
                    f"(idle {idle / MIB:.0f} MiB; RssShmem {figures['RssShmem'] / MIB:.0f} MiB)"
                )
        return "\n".join(lines)
