"""End-to-end throughput: producers submit, trainer ranks pull, next to a bare gRPC stream.

Run:  .venv/bin/python tests/bench/bench_e2e_throughput.py [--case long|short|both]
      [--producers 2] [--in-flight 1] [--rollouts N] [--batch-rollouts N] [--repeats 1]
      [--replicas 1] [--stages] [--cpu] [--cold] [--client-env NAME=VALUE ...]
      [--journal group|always|none] [--page-cache]
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
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np
from e2e_cases import CASES, WORLD_SIZE, Case, Options, make_rows, payloads
from e2e_clients import producer_main, trainer_main
from e2e_journal import disk_write_rate, journal_io
from e2e_processes import cpu_snapshot, environment, reap, report_cpu, report_threads, thread_cpu
from e2e_raw import run_raw
from e2e_stages import run_stages

# -- end to end ---------------------------------------------------------------------------


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
        # direct_io only when turned off: older trees, which the bench also runs, lack it.
        journal={"dir": journal_dir, "sync": options.journal or "group"}
        | ({} if options.direct_io else {"direct_io": False}),
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
    parser.add_argument(
        "--page-cache",
        action="store_true",
        help="with --journal: [journal] direct_io = false (every record through the page cache)",
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
        direct_io=not args.page_cache,
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
