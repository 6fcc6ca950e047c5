"""How the scheduler's per-step work grows with rollouts per step, from metadata alone.

    .venv/bin/python tests/bench/bench_scheduler_scale.py                   # 30-60 s on 2 cores
    .venv/bin/python tests/bench/bench_scheduler_scale.py --sizes 10000,100000   # ~10 s
    .venv/bin/python tests/bench/bench_scheduler_scale.py --no-gc   # what Python's GC adds

No token moves: what one scheduler actor does per step, at 10k, 100k and 1M rollouts a step
(peak RSS ~0.9 GB, at 1M). The workload is bench_batching's long-tailed one (log-normal,
median 8,192 tokens, sigma 0.85, capped at 65,536), in groups of 8 rollouts (one group per
task, rewards Bernoulli(p) with p per task), ingested in batches of 256 rollouts (the
producer's default cap), token budget 131,072, world size 8 / 64 / 256 ranks, compute
balanced with Qwen3-0.6B's attention weight (the config's default). Per size, twice: with
those lengths ("x10") and with a tenth of them ("x1"), same rollouts, 10x fewer tokens.

Timed on one core, best of 3 runs (1 at 1M):
- plan: `plan_microbatches` (token-budget packing and rank balancing; spreading only up
  to 50,000 sequences, so 10k pays for it and 100k does not);
- assemble: `assemble_step`, the pure planning in `sched/` (advantages, then plan);
- ingest: every `Scheduler.ingest_batch` of the step (grouping, dedup, backpressure checks,
  pass rates and the zero-advantage check of completed groups);
- step: `Scheduler.plan_ready_steps` (assemble_step plus the bookkeeping around it: arrival
  order, the work record, releasing rows, remembering closed groups);
- release: `store_step`, then a fetch and an acknowledgement per rank.
Then x10 / x1 (about 1 when the work follows rollouts, not tokens), the per-rollout cost
from one size to the next (1 = linear), and the memory the scheduler holds per buffered
rollout and per closed rollout it remembers for dedup (tracemalloc at 100k; ids are made
fresh, as decoding makes them).

Seen on the shared 2-core dev machine (quiet run; under other agents' load the same figures
came out up to 2.5x higher, so compare within a run). Per rollout, x10 tokens:
ingest 1.9 / 2.5 / 3.8-4.7 us at 10k / 100k / 1M, step 0.9 / 2.1 / 3.3 us, assemble 1.4 /
0.5 / 0.4 us (plan 0.25 s and assemble 0.4 s per 1M-rollout step), release 0.1 / 0.5 /
5-12 ms per step. x10 / x1: ingest 0.8-1.06, step 0.9-1.2; plan 1.3-3.7 (x1 is cheaper,
not x10 dearer: its lengths have a tenth of the distinct values, so FFD takes more equal
lengths per step, and it has a tenth of the microbatches; both are bounded by the rollout
count). The per-rollout growth of ingest and step from 10k to 1M is CPython's cyclic GC
walking the buffered state: with `--no-gc` ingest was 1.7 / 1.8 / 2.1 us and
plan_ready_steps 3.4 / 1.4 / 1.5 us per rollout. Memory: 388 bytes per buffered rollout,
151 bytes per remembered closed one. Before this script, ingest at 1M (x1) took 85 s (85 us
a rollout, against 4.7 s after): three per-batch costs grew with the task pool or the
buffered groups (see `AdmissionControl.admit`, `ranks_can_make_room`, `update_pass_rates`
in_place).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from bench_batching import BUDGET, long_tailed_workload
from bench_curriculum import best_of
from rlfeed.sched.assembly import StepRollouts, assemble_step
from rlfeed.sched.planning import plan_microbatches
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.scheduler.records import BatchMeta
from rlfeed.service.scheduler.state import Scheduler

GROUP_SIZE = 8
BATCH_ROLLOUTS = 256  # rlfeed.client.producer.DEFAULT_MAX_BATCH_ROLLOUTS
WORLD_SIZES = {10_000: 8, 100_000: 64, 1_000_000: 256}
MEMORY_SIZE = 100_000


@dataclass(frozen=True)
class Workload:
    """One step's rollouts, as producers would send them (group after group)."""

    lengths: np.ndarray  # int64 [n]
    policy_tokens: np.ndarray  # int64 [n]
    rewards: np.ndarray  # float64 [n]
    group_of: np.ndarray  # int64 [n]: group index = task index

    @property
    def size(self) -> int:
        return int(self.lengths.size)


def workload(n: int, token_scale: int) -> Workload:
    """n rollouts in groups of GROUP_SIZE; lengths the long-tailed ones / (10 / token_scale)."""
    lengths, _ = long_tailed_workload(n, seed=n)
    lengths = np.maximum(lengths * token_scale // 10, 2)
    rng = np.random.default_rng([n, 1])
    prompt = np.minimum(rng.integers(16, 512, size=n), lengths - 1)
    pass_rate = rng.random(n // GROUP_SIZE)
    group_of = np.arange(n) // GROUP_SIZE
    rewards = (rng.random(n) < pass_rate[group_of]).astype(np.float64)
    return Workload(lengths, lengths - prompt, rewards, group_of)


def batches(work: Workload, step: int = 0) -> Iterator[BatchMeta]:
    """The step's BatchMetas, ids made fresh (as decoding a batch makes them)."""
    for start in range(0, work.size, BATCH_ROLLOUTS):
        rows = range(start, min(start + BATCH_ROLLOUTS, work.size))
        groups = work.group_of[rows.start : rows.stop].tolist()
        yield BatchMeta(
            rollout_ids=[
                f"t{g:07d}@{step}/{r % GROUP_SIZE}" for g, r in zip(groups, rows, strict=True)
            ],
            task_ids=[f"t{g:07d}" for g in groups],
            group_ids=[f"t{g:07d}@{step}" for g in groups],
            policy_versions=np.full(len(rows), step, dtype=np.int64),
            rewards=work.rewards[rows.start : rows.stop],
            lengths=work.lengths[rows.start : rows.stop],
            policy_tokens=work.policy_tokens[rows.start : rows.stop],
        )


def make_scheduler(work: Workload, world_size: int) -> Scheduler:
    n = work.size
    config = with_overrides(
        SidecarConfig(),
        rollouts={
            "prompts_per_step": n // GROUP_SIZE,
            "group_size": GROUP_SIZE,
            "max_buffered_rollouts": 2 * n,
            "max_buffered_bytes": max(2 * 9 * int(work.lengths.sum()), 1 << 30),
            "dedup_window_groups": n // GROUP_SIZE,
        },
        batching={"token_budget": BUDGET, "world_size": world_size},
    )
    scheduler = Scheduler(config)
    scheduler.register_tasks([f"t{g:07d}" for g in range(n // GROUP_SIZE)])
    return scheduler


@dataclass
class Timing:
    """Seconds of one step's work."""

    plan: float = 0.0  # plan_microbatches
    assemble: float = 0.0  # assemble_step (includes plan)
    ingest: float = 0.0  # every ingest_batch of the step
    step: float = 0.0  # plan_ready_steps (assemble_step and the bookkeeping around it)
    release: float = 0.0  # store_step + a fetch and an ack per rank


def time_step(work: Workload, world_size: int, repeats: int, *, collect: bool) -> Timing:
    scheduler = make_scheduler(work, world_size)
    step_config = scheduler.config.step_config()
    rollouts = StepRollouts(
        lengths=work.lengths,
        policy_tokens=work.policy_tokens,
        rewards=work.rewards,
        group_ids=work.group_of,
    )
    timing = Timing(
        plan=best_of(
            repeats,
            lambda: plan_microbatches(
                work.lengths,
                BUDGET,
                world_size,
                attention_weight=step_config.attention_weight,
                compute_weight=step_config.compute_weight,
            ),
        ),
        assemble=best_of(repeats, lambda: assemble_step(rollouts, step_config)),
    )
    metas = list(batches(work))
    ingest, planning, release = [], [], []
    for _ in range(repeats):
        scheduler = make_scheduler(work, world_size)
        gc.collect()
        if not collect:
            gc.disable()
        started = time.perf_counter()
        for meta in metas:
            scheduler.ingest_batch(meta, payload=None)
        ingest.append(time.perf_counter() - started)
        started = time.perf_counter()
        (planned,) = scheduler.plan_ready_steps()
        planning.append(time.perf_counter() - started)
        assert planned.record.num_rollouts == work.size
        started = time.perf_counter()
        scheduler.store_step(planned.step, [b""] * world_size)
        for rank in range(world_size):
            scheduler.fetch_batch(planned.step, rank)
            scheduler.ack_steps(rank, planned.step)
        release.append(time.perf_counter() - started)
        gc.enable()
    timing.ingest, timing.step, timing.release = min(ingest), min(planning), min(release)
    return timing


PARTS = ("plan", "assemble", "ingest", "step")


def print_table(sizes: list[int], *, collect: bool) -> dict[tuple[int, int], Timing]:
    print(
        f"per step, seconds (per rollout, µs); groups of {GROUP_SIZE}, batches of "
        f"{BATCH_ROLLOUTS}, token budget {BUDGET:,}; Python's cyclic GC "
        f"{'on' if collect else 'OFF during the scheduler timings'}"
    )
    header = "".join(f"{part:>19}" for part in PARTS)
    print(f"{'rollouts':>9} {'ranks':>5} {'tokens':>6} {'mean len':>8}{header}{'release s':>10}")
    timings = {}
    for n in sizes:
        world_size = WORLD_SIZES.get(n, 64)
        repeats = 1 if n >= 1_000_000 else 3
        for scale in (1, 10):
            work = workload(n, scale)
            timing = timings[n, scale] = time_step(work, world_size, repeats, collect=collect)
            cells = "".join(
                f"{getattr(timing, p):>9.3f} ({getattr(timing, p) / n * 1e6:>5.2f})" for p in PARTS
            )
            print(
                f"{n:>9,} {world_size:>5} {f'x{scale}':>6} {work.lengths.mean():>8,.0f}{cells}"
                f"{timing.release:>10.4f}"
            )
            del work
            gc.collect()
    return timings


def print_ratios(sizes: list[int], timings: dict[tuple[int, int], Timing]) -> None:
    print("\nx10 / x1 (10x the tokens, same rollouts; 1 = proportional to rollouts):")
    for n in sizes:
        cells = "  ".join(
            f"{p} {getattr(timings[n, 10], p) / getattr(timings[n, 1], p):.2f}" for p in PARTS
        )
        print(f"  {n:>9,}: {cells}")
    print("per-rollout cost, size / previous size (x10 tokens; 1 = linear in rollouts):")
    for small, large in itertools.pairwise(sizes):

        def growth(part: str, small: int = small, large: int = large) -> float:
            per_rollout = [getattr(timings[n, 10], part) / n for n in (small, large)]
            return per_rollout[1] / per_rollout[0]

        cells = "  ".join(f"{p} {growth(p):.2f}" for p in PARTS)
        print(f"  {small:>9,} -> {large:,}: {cells}")


def print_memory(n: int) -> None:
    """Bytes the scheduler holds per buffered rollout, and per closed one it remembers."""
    work = workload(n, 10)
    scheduler = make_scheduler(work, WORLD_SIZES.get(n, 64))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for meta in batches(work):
        scheduler.ingest_batch(meta, payload=None)
    buffered = tracemalloc.get_traced_memory()[0] - before
    work_item = scheduler.plan_ready_steps()
    del work_item
    gc.collect()
    remembered = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(
        f"\nmemory at {n:,} rollouts (ids ~16 characters): {buffered / n:,.0f} bytes per "
        f"buffered rollout ({buffered / 2**20:,.0f} MiB), {remembered / n:,.0f} bytes per "
        f"closed rollout remembered for dedup (dedup_window_groups) once assembled"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help="rollouts per step, comma-separated (default 10000,100000,1000000)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory figures")
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help="disable Python's cyclic GC while the scheduler is timed (what GC costs)",
    )
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    started = time.perf_counter()
    timings = print_table(sizes, collect=not args.no_gc)
    print_ratios(sizes, timings)
    if not args.no_memory:
        print_memory(MEMORY_SIZE)
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
