"""End-to-end throughput: producers submit, trainer ranks pull, next to a bare gRPC stream.

Run:  .venv/bin/python tests/bench/bench_e2e_throughput.py [--case long|short|both]
      [--producers 2] [--in-flight 1] [--rollouts N] [--batch-rollouts N] [--repeats 1]
      [--replicas 1] [--stages] [--cpu] [--cold] [--client-env NAME=VALUE ...]
      [--journal group|always|none]
Cost: about 30 s on 2 cores (Ray start-up included), both cases, one repeat; each further
repeat about 10-15 s per case.

What runs, all on loopback in one invocation, per repeat:

1. **End to end.** `start_server` on an embedded local Ray (the real sidecar). `--producers`
   processes submit pre-generated complete groups with `RolloutWriter` (generation is
   outside the timed region; each keeps `--in-flight` batches in flight, and stays up
   until the window ends, as an inference server would); two trainer-rank
   processes iterate `BatchLoader` over every step and read each microbatch's loss mask (no
   model). Before the start signal, producers and ranks run the same workload once, untimed,
   under other rollout and group ids (the steps before the timed ones; `--cold` skips it),
   as the raw baseline's client does: a sidecar serves for hours, and a process's first
   pass pays for its heap and its allocator's thresholds, which the steady state does not.
   Wall time runs from the start signal to the last rank's last timed step. With
   `--replicas N`, N-1 more front-ends (`rlfeed serve --join` processes, as `rlfeed serve
   --replicas N` starts them) share the port; each client connection lands on one of them. The ranks
   import torch and set one torch thread before the start signal: a trainer has torch
   loaded long before its first step, and OpenMP workers spinning after each mask count
   would take the cores the sidecar and producers share on a small machine.
2. **Raw baseline**, right after, so both see the same (shared, noisy) machine. A trivial
   gRPC service (generic handlers, bytes in and out, no parsing) in a process of its own
   (so it owes nothing to the sidecar's heap or allocator state); a client process streams
   the producers' exact Arrow payloads to a sink (client streaming), then receives from a
   source (server streaming) messages of exactly the sizes the sidecar sent to the ranks
   (counted where they are sent, in the sidecar's `on_served` hook, so the ranks' timed
   loop does no measuring; with replicas, whose hooks run in other processes, each step's
   stored size from the actor, split evenly over the ranks). The client does all of it
   twice and the second pass is timed: both ends are warm, as every end-to-end process is
   unless `--cold`. The server's malloc settings are the sidecar front-end's own and the
   client's a trainer rank's (see `client.allocator`); the client's environment is the
   end-to-end clients' (`--client-env`). Raw time = both transfers, one after the other.

Reported per repeat: end-to-end seconds, rollouts/s and tokens/s (all tokens, prompt and
policy); bytes moved = ingest payloads + served responses, each counted once, per second
end to end and for the raw stream carrying the same bytes; ratio = raw seconds / end-to-end
seconds (= e2e bytes rate / raw bytes rate). With `--repeats N` the median ratio and
rollouts/s decide the targets: >= 50% of the raw bytes rate for 8k-token rollouts (`long`),
>= 20,000 rollouts/s for 100-token rollouts (`short`). `--stages` first times each stage
alone, in one process on one step of the case's data (client encode, server decode +
validate, plan + materialize + encode, client decode). `--cpu` prints the CPU seconds
and minor page faults (fresh memory touched: ~1 us each in this VM) each process of this
run used in the end-to-end window (front-end, scheduler actor, producers, ranks, Ray's
daemons; other users' processes on a shared machine are left out), the front-end's per
thread (event loop, pool, assembler, gRPC's and Ray's threads), and those of the raw
stream's two ends: on a machine with few cores the sum, not one process, bounds the rate,
and the CPU ratio (raw CPU / end-to-end CPU) shifts less with other users' load than the
wall-clock ratio does. To see more, run it under a sampling profiler, e.g.
`py-spy record --subprocesses --format raw -o stacks.txt -- .venv/bin/python tests/bench/...`
(py-spy samples threads that released the GIL as busy: read CPU seconds from `--cpu`).

Seen on the 2-core dev machine (`--case long --cpu`, 32 steps, the writer's default 8 MiB
batches of 114 rollouts, every process warm; two sets of 9 runs): the raw stream takes
0.19-0.24 s and 0.30-0.37 CPU-s (both ends; it already fills both cores). End to end takes
0.37-0.47 s and 0.66-0.81 CPU-s: front-end 0.32-0.39 (gRPC receive + send about as the raw
server, 0.14-0.17; its assembler thread ~0.1, materializing the steps), ranks 2 x
0.10-0.14, scheduler actor 0.05-0.07, producers 2 x 0.03-0.06, Ray's daemons < 0.03. Both
cores stay busy, so the ratio is about raw CPU / end-to-end CPU: medians of 9 runs 51.5%
and 51.1% (single runs 44-63%; the machine is shared). Every process keeps its freed memory
for the next step's buffers (`client.allocator`: the front-end by `[server]
retained_free_mib`, a rank by `BatchLoader`'s `retained_free_mib`, the raw ends likewise);
without it the front-end took 20-46k page faults per run and each rank 2-28k, at ~2 us each.
The front-end's count still jumps now and then (to ~45k in one run of 9): every repeat's
front-end runs in this one process, whose heap has held the earlier repeats' (a deployed
sidecar runs one). `--cold` (clients timed on their first pass): median of 5 runs 32.7%,
with older code (no allocator setting in the ranks, writer-framed microbatches). Smaller writer
batches cost more actor calls and Python per byte (`--batch-rollouts 16`, 1.1 MiB: ~30-34%,
cold); two batches in flight (`--in-flight 2`) did not help (median 39%, cold);
`--replicas 2` on 2 cores is slower (~25%, cold): the front-ends fetch each other's batches
and responses and no core is free for the second interpreter. (`--stages` times one
step's 64 rollouts, sent as one batch.)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator
    from multiprocessing.queues import Queue

WORLD_SIZE = 2
# The ranks opt in to glibc keeping freed memory (BatchLoader's default is off), as the
# figures in the README were measured; the raw client takes the same setting.
RANK_RETAINED_FREE_MIB = 256
CASES = {
    # name: (tokens per rollout, rollouts, prompts_per_step, group_size, writer batch, budget)
    # A writer batch of None keeps RolloutWriter's defaults (256 rollouts or 8 MiB: 114
    # rollouts of 8k tokens); 256 rollouts of 100 tokens would be only 230 KiB, so the
    # short case's producers raise the count, as such a producer would.
    "long": (8192, 2048, 8, 8, None, 65536),
    "short": (100, 40_960, 64, 8, 2048, 65536),
}


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    rollouts: int
    prompts_per_step: int
    group_size: int
    batch_rollouts: int | None  # None: RolloutWriter's default
    token_budget: int

    @property
    def steps(self) -> int:
        return self.rollouts // (self.prompts_per_step * self.group_size)

    def writer_limits(self) -> dict[str, int]:
        """The RolloutWriter batch limits the producers use: the writer's defaults, or
        exactly `batch_rollouts` rollouts per batch, whatever their bytes."""
        from rlfeed.client.producer import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_BATCH_ROLLOUTS

        if self.batch_rollouts is None:
            return {
                "max_batch_rollouts": DEFAULT_MAX_BATCH_ROLLOUTS,
                "max_batch_bytes": DEFAULT_MAX_BATCH_BYTES,
            }
        return {"max_batch_rollouts": self.batch_rollouts, "max_batch_bytes": 1 << 62}


@dataclass(frozen=True)
class Options:
    """How the end-to-end run is set up (the command line's flags)."""

    producers: int = 2
    in_flight: int = 1  # batches each producer keeps in flight
    cpu: bool = False  # print CPU seconds per process in the window
    replicas: int = 1  # front-ends on the sidecar's port
    client_env: dict[str, str] = field(default_factory=dict)  # every client's environment
    warm_up: bool = True  # producers and ranks run the workload once untimed first
    journal: str | None = None  # [journal] sync policy, journal in a fresh temp dir; None: off

    def first_timed_step(self, case: Case) -> int:
        """The first step in the timed window: the warm-up pass has the steps before it."""
        return case.steps if self.warm_up else 0


def make_rows(case: Case, producer: int, producers: int) -> list[dict]:
    """This producer's share of complete groups, as RolloutWriter.write keyword dicts."""
    rng = np.random.default_rng(producer)
    groups = case.rollouts // case.group_size
    rows = []
    mask = np.ones(case.tokens, np.uint8)
    mask[: case.tokens // 4] = 0  # a prompt, then policy tokens
    for g in range(producer, groups, producers):
        for k in range(case.group_size):
            rows.append(
                {
                    "rollout_id": f"g{g}/{k}",
                    "task_id": f"task-{g % 64}",
                    "group_id": f"g{g}",
                    "policy_version": 0,
                    "reward": float(rng.random() < 0.5),
                    "token_ids": rng.integers(0, 32000, case.tokens, dtype=np.int32),
                    "action_mask": mask,
                    "sampler_logprobs": np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                }
            )
    return rows


def warm_up_rows(rows: list[dict]) -> list[dict]:
    """The same rollouts under other ids (new groups, not duplicates): the untimed pass."""
    return [
        {**row, "rollout_id": f"warm-{row['rollout_id']}", "group_id": f"warm-{row['group_id']}"}
        for row in rows
    ]


def writer_batches(case: Case, rows: list[dict]) -> list[list[dict]]:
    """These rows split as RolloutWriter splits them: a batch is sealed at
    `max_batch_rollouts` rollouts or `max_batch_bytes` bytes (as `append` counts them)."""
    from rlfeed.client.arrow_codec import RolloutColumns

    limits = case.writer_limits()
    batches, batch, batch_bytes = [], [], 0
    for row in rows:
        batch.append(row)
        batch_bytes += RolloutColumns.empty().append(**row)
        if len(batch) >= limits["max_batch_rollouts"] or batch_bytes >= limits["max_batch_bytes"]:
            batches.append(batch)
            batch, batch_bytes = [], 0
    if batch:
        batches.append(batch)
    return batches


def payloads(case: Case, rows: list[dict]) -> list[bytes]:
    """The Arrow payloads RolloutWriter sends for these rows (same batch boundaries)."""
    from rlfeed.client.arrow_codec import RolloutColumns, encode_rollouts

    out = []
    for batch in writer_batches(case, rows):
        columns = RolloutColumns.empty()
        for row in batch:
            columns.append(**row)
        out.append(encode_rollouts(columns))
    return out


# -- end to end ---------------------------------------------------------------------------


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


def producer_main(
    case: Case,
    address: str,
    producer: int,
    options: Options,
    go,
    results,
    finished,
) -> None:
    from rlfeed.client.producer import RolloutWriter

    rows = make_rows(case, producer, options.producers)
    # Room for every row: a full writer buffer would seal a partial batch early, and the
    # raw stream could no longer carry the same batches (`writer_batches`). The writer
    # requires room for at least one full batch too (fewer rows than that: `--rollouts`).
    limits = case.writer_limits()
    writer = RolloutWriter(
        address,
        **limits,
        max_buffered_rollouts=max(len(rows), limits["max_batch_rollouts"]),
        max_in_flight=options.in_flight,
    )
    if options.warm_up:
        for row in warm_up_rows(rows):
            writer.write(**row)
        writer.flush()  # the timed rows then start a batch, as `writer_batches` splits them
    results.put(("ready", producer, None))
    go.wait()
    started = time.perf_counter()
    for row in rows:
        writer.write(**row)
    writer.close()
    results.put(("producer", producer, time.perf_counter() - started))
    # An inference server does not exit after its rollouts: stay up until the window ends,
    # so this process's teardown (a full GC of the interpreter) is not timed.
    finished.wait(timeout=600)


def trainer_main(case: Case, address: str, rank: int, options: Options, go, results) -> None:
    import torch
    from rlfeed.client.loader import BatchLoader

    # A trainer has torch loaded long before its first step: the import (seconds here) is
    # not the loader's cost. Counting the mask stands in for a model that runs elsewhere (a
    # GPU): one thread, so OpenMP workers spinning after each count do not take the cores the
    # sidecar, the producers and the other rank share on a small machine.
    torch.set_num_threads(1)

    first_timed = options.first_timed_step(case)
    loader = BatchLoader(
        address,
        rank,
        WORLD_SIZE,
        stop_step=first_timed + case.steps,
        timeout_s=300,
        retained_free_mib=RANK_RETAINED_FREE_MIB,
    )
    steps = iter(loader)
    for _ in range(first_timed):  # the warm-up pass: the same work, untimed
        sum(mb.policy_tokens for mb in next(steps))
    policy_tokens = 0
    results.put(("ready", rank, 0))
    go.wait()
    for step in steps:
        for mb in step:
            policy_tokens += mb.policy_tokens
    loader.close()
    results.put(("trainer", rank, (time.perf_counter(), policy_tokens)))


def run_e2e(case: Case, options: Options) -> dict:
    import ray
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.events import ServerEvents
    from rlfeed.service.frontend.server import start_server
    from rlfeed.service.scaleout.processes import start_replicas

    first_timed = options.first_timed_step(case)
    replicas = options.replicas
    cpu_seconds = float("nan")

    class ServedSizes(ServerEvents):
        """Sizes of the timed steps' GetBatch responses as sent, counted where they are
        sent, so the trainer ranks' timed loop does no extra work (re-serializing to
        measure it)."""

        def __init__(self) -> None:
            self.sizes: list[int] = []

        def on_served(self, step: int, rank: int, response: bytes) -> None:
            if step >= first_timed:
                self.sizes.append(len(response))

    served = ServedSizes()
    journal_dir = tempfile.mkdtemp(prefix="rlfeed-bench-journal-") if options.journal else ""
    disk_rate = disk_write_rate(journal_dir) if journal_dir else 0.0
    config = with_overrides(
        SidecarConfig(),
        journal={"dir": journal_dir, "sync": options.journal or "group"},
        server={"port": 0, "replicas": replicas},
        batching={"token_budget": case.token_budget, "world_size": WORLD_SIZE},
        rollouts={
            "prompts_per_step": case.prompts_per_step,
            "group_size": case.group_size,
            "max_buffered_rollouts": max(2 * case.rollouts, 200_000),
        },
    )
    sidecar = start_server(config, events=served)
    joined = start_replicas(config, sidecar.port, sidecar.actor) if replicas > 1 else None
    ctx = mp.get_context("spawn")
    go, results, finished = ctx.Event(), ctx.Queue(), ctx.Event()
    from rlfeed.client.producer import RolloutWriter

    with RolloutWriter(sidecar.address) as writer:
        writer.register_tasks([f"task-{t}" for t in range(64)])
    processes = [
        ctx.Process(
            target=producer_main,
            args=(case, sidecar.address, p, options, go, results, finished),
        )
        for p in range(options.producers)
    ] + [
        ctx.Process(target=trainer_main, args=(case, sidecar.address, r, options, go, results))
        for r in range(WORLD_SIZE)
    ]
    try:
        with environment(options.client_env):
            for process in processes:
                process.start()
        for _ in processes:
            results.get(timeout=300)  # ready
        cpu_before = cpu_snapshot() if options.cpu else {}
        io_before = journal_io(sidecar.actor) if journal_dir else (0, 0)
        threads_before = thread_cpu() if options.cpu else {}
        started = time.perf_counter()
        go.set()
        ends, policy_tokens, producer_seconds = [], 0, []
        for _ in processes:
            kind, _, value = results.get(timeout=600)
            if kind == "trainer":
                ends.append(value[0])
                policy_tokens += value[1]
            else:
                producer_seconds.append(value)
        seconds = max(ends) - started
        io_after = journal_io(sidecar.actor) if journal_dir else (0, 0)
        if replicas > 1:  # the other front-ends' hooks ran elsewhere: sizes from the actor
            records = []
            for _ in range(600):  # the last steps' store notes may still be on their way
                records = ray.get(sidecar.actor.step_records.remote(first_timed))
                if len(records) == case.steps:
                    break
                time.sleep(0.05)
            served.sizes = [
                size
                for record in records
                for size in np.diff(np.linspace(0, record.response_bytes, WORLD_SIZE + 1))
                .round()
                .astype(int)
            ]
        if options.cpu:
            producers = options.producers
            roles = {os.getpid(): "front-end (gRPC server; this process)"}
            roles.update({p.pid: f"producer {i}" for i, p in enumerate(processes[:producers])})
            roles.update({p.pid: f"trainer rank {r}" for r, p in enumerate(processes[producers:])})
            cpu_seconds = report_cpu(cpu_before, cpu_snapshot(), seconds, roles)
            report_threads(threads_before, thread_cpu())
    finally:
        finished.set()
        reap(processes)
        if joined is not None:
            joined.stop()
        sidecar.stop(grace=1.0)
        if journal_dir:
            shutil.rmtree(journal_dir, ignore_errors=True)
    expected_policy = case.rollouts * (case.tokens - case.tokens // 4)
    assert policy_tokens == expected_policy, (policy_tokens, expected_policy)
    assert len(served.sizes) == case.steps * WORLD_SIZE, "a (step, rank) served twice?"
    return {
        "seconds": seconds,
        "served_sizes": list(served.sizes),
        "producer_seconds": max(producer_seconds),
        "journal_bytes": io_after[0] - io_before[0],
        "journal_syncs": io_after[1] - io_before[1] if io_after[1] >= 0 else -1,
        "disk_rate": disk_rate,
        "cpu_seconds": cpu_seconds,
    }


def disk_write_rate(directory: str, nbytes: int = 64 << 20) -> float:
    """Bytes/s of one sequential write of `nbytes` into `directory`, fdatasync'd: what the
    journal's disk takes right now (a shared VM's disk varies several-fold from minute to
    minute, so each run measures its own). The ingest bytes / this rate is the floor a
    journal that syncs before each ack puts under the end-to-end time."""
    path = os.path.join(directory, "disk-probe")
    chunk = os.urandom(8 << 20)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / (time.perf_counter() - started)


def _process_journal_io(_actor=None) -> tuple[int, int]:
    """(bytes, syncs) this process's journals wrote; an rlfeed older than that count (the
    bench run against an old commit) gives the bytes the process wrote to disk at all
    (/proc/self/io write_bytes: its journals, and little else) and syncs -1."""
    try:
        from rlfeed.service.journal.files import JOURNAL_IO
    except ImportError:
        with open("/proc/self/io") as io:
            fields = dict(line.split(": ") for line in io.read().splitlines())
        return int(fields["write_bytes"]), -1
    return JOURNAL_IO.bytes_written, JOURNAL_IO.syncs


def journal_io(actor) -> tuple[int, int]:
    """(bytes written, syncs) so far by the journals of this process (the front-end) and
    of the scheduler actor's (the replicas' processes, with --replicas, are not counted)."""
    import ray

    here = _process_journal_io()
    there = ray.get(actor.__ray_call__.remote(_process_journal_io))
    syncs = -1 if min(here[1], there[1]) < 0 else here[1] + there[1]
    return here[0] + there[0], syncs


# -- raw baseline -------------------------------------------------------------------------


_RAW_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def raw_client_main(
    address: str, sink_payloads: list[bytes], source_sizes: list[int], out: Queue
) -> None:
    """Stream the payloads in, then the messages out: once to warm up, once timed. Its
    allocator is set as the ranks' (`retained_free_mib`)."""
    import grpc
    from rlfeed.client.allocator import retain_freed_memory

    retain_freed_memory(RANK_RETAINED_FREE_MIB * 2**20)

    channel = grpc.insecure_channel(address, options=_RAW_OPTIONS)
    sink = channel.stream_unary("/raw.Raw/Sink")
    source = channel.unary_stream("/raw.Raw/Source")
    sizes = np.asarray(source_sizes, np.int64).tobytes()
    for _pass in ("warm-up", "timed"):
        sink(iter([b"start"]))  # the server starts (or stops) counting its CPU here
        cpu_started = time.process_time()
        started = time.perf_counter()
        sink(iter(sink_payloads))
        middle = time.perf_counter()
        received = sum(len(m) for m in source(sizes))
        ended = time.perf_counter()
        cpu = time.process_time() - cpu_started
    sink(iter([b"start"]))
    channel.close()
    out.put((middle - started, ended - middle, received, cpu))


def raw_server_main(largest: int, out: Queue) -> None:
    """A trivial gRPC service in a process of its own (generic handlers, bytes in and out,
    no parsing): Sink counts what it is sent, Source sends messages of the sizes asked for.
    Puts its port, then the CPU seconds between the client's last two "start" marks. Its
    allocator is set as the sidecar's front-end sets its own (`[server] retained_free_mib`)."""
    import grpc
    from rlfeed.client.allocator import retain_freed_memory
    from rlfeed.service.config import ServerConfig

    retain_freed_memory(ServerConfig().retained_free_mib * 2**20, single_arena=True)

    blob = os.urandom(largest)
    marks: list[float] = []

    def sink(request_iterator, context):
        total = 0
        for message in request_iterator:
            if message == b"start":
                marks.append(time.process_time())
            total += len(message)
        return str(total).encode()

    def source(request, context):
        for size in np.frombuffer(request, np.int64).tolist():
            yield blob[:size]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_RAW_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "raw.Raw",
                {
                    "Sink": grpc.stream_unary_rpc_method_handler(sink),
                    "Source": grpc.unary_stream_rpc_method_handler(source),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out.put(port)
    deadline = time.monotonic() + 600  # the client's own limit; the parent kills us anyway
    while len(marks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    out.put(marks[2] - marks[1] if len(marks) == 3 else float("nan"))
    server.stop(0)


def run_raw(
    sink_payloads: list[bytes],
    source_sizes: list[int],
    cpu: bool = False,
    client_env: dict[str, str] | None = None,
) -> tuple[float, float, float]:
    """(seconds to stream the payloads in, seconds to stream messages of `source_sizes` out,
    CPU seconds both ends used), the second of two passes (the first warms both ends up);
    with `cpu`, also prints the CPU seconds of each end (the floor e2e is compared to).

    Both ends are fresh processes of their own, so the baseline owes nothing to the state
    of the sidecar's process (its heap, its threads); the server takes the front-end's
    allocator settings and the client a rank's (`raw_server_main`, `raw_client_main`)."""
    ctx = mp.get_context("spawn")
    server_out, client_out = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=raw_server_main, args=(max(source_sizes), server_out))
    server.start()
    client = None
    try:
        port = server_out.get(timeout=120)
        client = ctx.Process(
            target=raw_client_main,
            args=(f"127.0.0.1:{port}", sink_payloads, source_sizes, client_out),
        )
        with environment(client_env or {}):
            client.start()
        sink_seconds, source_seconds, received, client_cpu = client_out.get(timeout=600)
        server_cpu = server_out.get(timeout=60)
        assert received == sum(source_sizes)
        if cpu:
            print(
                f"  CPU of the raw stream: client {client_cpu:.2f} s + server {server_cpu:.2f} s "
                f"= {client_cpu + server_cpu:.2f} s"
            )
    finally:
        reap([process for process in (client, server) if process is not None])
    return sink_seconds, source_seconds, client_cpu + server_cpu


# -- stages -------------------------------------------------------------------------------


def _best(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def run_stages(case: Case) -> None:
    """Seconds per MiB of ingest payload for each stage of one step, each timed alone."""
    from rlfeed.client.arrow_codec import (
        RolloutColumns,
        decode_step,
        encode_rollout_batch,
        parse_get_batch_response,
    )
    from rlfeed.service.codec.materialize import materialize_work
    from rlfeed.service.codec.messages import decode_rollout_batch, parse_rollout_batch
    from rlfeed.service.codec.rollout_batch import batch_meta
    from rlfeed.service.codec.validation import validate_rollout_batch
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.scheduler.state import Scheduler

    per_step = case.prompts_per_step * case.group_size
    step_case = Case(case.name, case.tokens, per_step, *CASES[case.name][2:])
    batches = writer_batches(case, make_rows(step_case, 0, 1))
    config = with_overrides(
        SidecarConfig(),
        batching={"token_budget": case.token_budget, "world_size": WORLD_SIZE},
        rollouts={"prompts_per_step": case.prompts_per_step, "group_size": case.group_size},
    )

    def encode_all() -> list[bytes]:  # what RolloutWriter sends, rows appended anew each time
        out = []
        for sequence, batch in enumerate(batches):
            columns = RolloutColumns.empty()
            for row in batch:
                columns.append(**row)
            out.append(encode_rollout_batch(columns, sequence))
        return out

    wire = encode_all()
    mib = sum(map(len, wire)) / (1 << 20)

    def decode_validate():
        out = []
        for request in wire:
            arrays = decode_rollout_batch(parse_rollout_batch(request).arrow_ipc)
            validate_rollout_batch(arrays, token_budget=case.token_budget)
            out.append((batch_meta(arrays), arrays.columns))
        return out

    decoded = decode_validate()

    def assemble() -> list[bytes]:
        scheduler = Scheduler(config)
        scheduler.register_tasks([f"task-{t}" for t in range(64)])
        for meta, columns in decoded:
            scheduler.ingest_batch(meta, columns)
        (work,) = scheduler.plan_ready_steps()
        return materialize_work(work, resolve=lambda columns: columns)

    responses = assemble()
    served_mib = sum(map(len, responses)) / (1 << 20)

    def client_decode():
        for payload in responses:
            decode_step(parse_get_batch_response(payload))  # what BatchLoader does

    timings = {
        "client: rollouts -> Arrow batches (RolloutColumns + encode)": _best(encode_all),
        "server: decode + validate + metadata": _best(decode_validate),
    }
    timings["server: plan + materialize + encode all ranks"] = _best(assemble)
    timings["client: parse GetBatchResponse in place + decode_step"] = _best(client_decode)
    print(
        f"  stages, one step ({per_step} rollouts, {mib:.1f} MiB in, {served_mib:.1f} MiB "
        "out), each alone, best of 3:"
    )
    for name, seconds in timings.items():
        print(f"    {name:<58} {seconds * 1e3:8.2f} ms  {mib / seconds:9.1f} MiB/s of ingest")
    total = sum(timings.values())
    print(f"    {'sum (one core, no overlap)':<58} {total * 1e3:8.2f} ms  {mib / total:9.1f} MiB/s")


# -- report -------------------------------------------------------------------------------


def run_case(case: Case, options: Options, stages: bool, repeats: int) -> None:
    producers, replicas = options.producers, options.replicas
    print(
        f"\n== {case.name}: {case.rollouts:,} rollouts x {case.tokens:,} tokens, "
        f"{case.steps} steps of {case.prompts_per_step} x {case.group_size}, "
        f"{producers} producer(s) with {options.in_flight} batch(es) in flight, "
        f"{WORLD_SIZE} trainer ranks"
        + (f", {replicas} front-ends" if replicas > 1 else "")
        + ("" if options.warm_up else ", timed cold (no warm-up pass)"),
        flush=True,
    )
    if stages:
        run_stages(case)
    sink_payloads = [
        p for i in range(producers) for p in payloads(case, make_rows(case, i, producers))
    ]
    ratios, rates, cpu_ratios = [], [], []
    for repeat in range(repeats):
        if repeats > 1:
            print(f"  -- run {repeat + 1} of {repeats}", flush=True)
        # Raw right after end to end, so both see the same machine (it is shared and noisy).
        e2e = run_e2e(case, options)
        e2e["ingest_bytes"] = sum(map(len, sink_payloads))  # the producers' Arrow payloads
        sink_seconds, source_seconds, raw_cpu = run_raw(
            sink_payloads, e2e["served_sizes"], options.cpu, options.client_env
        )
        ratio, rate = report(case, e2e, sink_seconds, source_seconds)
        ratios.append(ratio)
        rates.append(rate)
        if options.cpu:
            cpu_ratios.append(raw_cpu / e2e["cpu_seconds"])
            print(f"  CPU ratio        raw CPU / e2e CPU (this run's) = {cpu_ratios[-1]:.1%}")
    ratio, rate = float(np.median(ratios)), float(np.median(rates))
    if repeats > 1:
        print(
            f"  median of {repeats} runs: ratio {ratio:.1%} (runs: "
            f"{', '.join(f'{r:.1%}' for r in ratios)}), {rate:,.0f} rollouts/s"
            + (f"; CPU ratio {float(np.median(cpu_ratios)):.1%}" if cpu_ratios else "")
        )
    if case.name == "long":
        verdict = "met" if ratio >= 0.5 else "NOT met"
        print(f"  target >= 50% of the raw bytes rate: {verdict}")
    if case.name == "short":
        verdict = "met" if rate >= 20_000 else "NOT met"
        print(f"  target >= 20,000 rollouts/s: {verdict}")


def report(case: Case, e2e: dict, sink_seconds: float, source_seconds: float):
    """Print one run's figures; returns (ratio of bytes rates e2e / raw, rollouts/s)."""
    served = sum(e2e["served_sizes"])
    moved = e2e["ingest_bytes"] + served
    raw_seconds = sink_seconds + source_seconds
    tokens = case.rollouts * case.tokens
    seconds = e2e["seconds"]
    mib = 1 << 20
    print(
        f"  end to end       {seconds:8.2f} s   {case.rollouts / seconds:12,.0f} rollouts/s   "
        f"{tokens / seconds:14,.0f} tokens/s"
    )
    print(f"  producers alone  {e2e['producer_seconds']:8.2f} s (slowest producer, incl. waits)")
    print(
        f"  bytes moved      {moved / mib:8.1f} MiB = {e2e['ingest_bytes'] / mib:.1f} ingest "
        f"+ {served / mib:.1f} served   e2e {moved / mib / seconds:9.1f} MiB/s"
    )
    rate_in, rate_out = e2e["ingest_bytes"] / mib / sink_seconds, served / mib / source_seconds
    print(
        f"  raw gRPC stream  {raw_seconds:8.2f} s   in {rate_in:9.1f} MiB/s, out {rate_out:9.1f} "
        f"MiB/s, same bytes {moved / mib / raw_seconds:9.1f} MiB/s"
    )
    if e2e["journal_bytes"]:
        print(
            f"  journal          {e2e['journal_bytes'] / mib:8.1f} MiB written = "
            f"{e2e['journal_bytes'] / e2e['ingest_bytes']:.3f} per acknowledged ingest byte; "
            + (
                f"{e2e['journal_syncs']} syncs ({e2e['journal_syncs'] / seconds:,.0f}/s)"
                if e2e["journal_syncs"] >= 0
                else "syncs not counted by this rlfeed"
            )
        )
        floor = e2e["journal_bytes"] / e2e["disk_rate"]
        print(
            f"  disk             {e2e['disk_rate'] / mib:8.1f} MiB/s fdatasync'd just before; "
            f"writing the journal alone takes {floor:.2f} s at that rate "
            f"(caps the ratio at {raw_seconds / floor:.1%})"
        )
    print(f"  ratio            e2e / raw bytes rate = {raw_seconds / seconds:.1%}", flush=True)
    return raw_seconds / seconds, case.rollouts / seconds


def environment_item(text: str) -> tuple[str, str]:
    """NAME=VALUE (a `--client-env` argument) -> (NAME, VALUE)."""
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("long", "short", "both"), default="both")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, help="override the case's rollout count")
    parser.add_argument(
        "--batch-rollouts",
        type=int,
        help="exactly N rollouts per RolloutWriter batch, whatever their bytes (default: "
        "the writer's limits, 256 rollouts or 8 MiB, for long; 2048 rollouts for short)",
    )
    parser.add_argument("--stages", action="store_true", help="time each stage alone first")
    parser.add_argument(
        "--in-flight", type=int, default=1, help="batches each producer keeps in flight"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="end-to-end + raw pairs per case (median)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU seconds per process in the end-to-end window"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="front-end processes on the sidecar's port"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="time the end-to-end clients' first pass (no warm-up pass; the raw stream "
        "still warms up)",
    )
    parser.add_argument(
        "--client-env",
        action="append",
        default=[],
        type=environment_item,
        metavar="NAME=VALUE",
        help="environment of every client process, the raw client's too (e.g. "
        "MALLOC_ARENA_MAX=2); repeatable",
    )
    parser.add_argument(
        "--journal",
        choices=("group", "always", "none"),
        help="journal the sidecar's run in a fresh temp dir with this [journal] sync policy "
        "(default: no journal)",
    )
    args = parser.parse_args()
    options = Options(
        producers=args.producers,
        in_flight=args.in_flight,
        cpu=args.cpu,
        replicas=args.replicas,
        client_env=dict(args.client_env),
        warm_up=not args.cold,
        journal=args.journal,
    )
    names = ("long", "short") if args.case == "both" else (args.case,)
    for name in names:
        tokens, rollouts, prompts, group, batch, budget = CASES[name]
        if args.rollouts:
            per_step = prompts * group
            rollouts = max(per_step, args.rollouts // per_step * per_step)
        case = Case(name, tokens, rollouts, prompts, group, args.batch_rollouts or batch, budget)
        run_case(case, options, args.stages, args.repeats)


if __name__ == "__main__":
    main()
