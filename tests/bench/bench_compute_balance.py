"""Attention-aware plans: lockstep in each model's own FLOPs, before and after.

    .venv/bin/python tests/bench/bench_compute_balance.py           # ~5 s on 2 cores
    .venv/bin/python tests/bench/bench_compute_balance.py --quick   # skips the 1M timing

Ranks wait for the slowest microbatch of every lockstep slot, and attention makes a
microbatch's time grow with sum(L^2), not with its tokens. For each workload and each model
preset this plans a step (packed budget 131,072 tokens, 8 ranks) two ways and counts the
result in that model's forward FLOPs (`rlfeed.sched.compute`: 2N per token plus causal
attention, layers x heads x head_dim):

- today: the planner before attention-aware plans: FFD bins, spread over the next multiple
  of 8 by tokens when that fits (up to 50,000 sequences), ranks balanced by tokens;
- default: `plan_microbatches` with the model's attention weight, as the service now runs.

Workloads: the chapter's 14.2 step (512 sequences, log-normal median 8,192, sigma 0.85,
capped at 65,536, seed 0) and 10k / 100k sequences with sigma 1.0. It asserts that the
microbatch count is unchanged, that no microbatch exceeds the budget, and that compute
lockstep is >= 0.98; then sweeps 40 seeds of the 512-sequence step (token balance with
weight 0, compute balance with each model's weight) and times both planners at 100k and 1M
sequences in the same run, asserting the new one takes <= 2x as long.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from rlfeed.sched.balance import RankAssignment, balance_ranks, lockstep_figures, microbatch_cost
from rlfeed.sched.budgets import microbatch_tokens, token_budget_microbatches
from rlfeed.sched.compute import model_attention_weight
from rlfeed.sched.models import MODELS
from rlfeed.sched.planning import SPREAD_MAX_SEQUENCES, plan_microbatches

BUDGET = 131_072
WORLD_SIZE = 8
CONTEXT = 65_536
# name: (sequences, sigma, seed)
WORKLOADS = {
    "chapter 512": (512, 0.85, 0),
    "10k": (10_000, 1.0, 10_000),
    "100k": (100_000, 1.0, 100_000),
}


def lognormal_lengths(n: int, sigma: float, seed: int) -> np.ndarray:
    """Log-normal lengths, median 8,192, rounded and capped at 65,536 tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(mean=np.log(8192), sigma=sigma, size=n))
    return np.clip(lengths, 1, CONTEXT).astype(np.int64)


def todays_plan(lengths: np.ndarray) -> RankAssignment:
    """The planner before this change: token spreading and token balance."""
    spread = WORLD_SIZE if lengths.size <= SPREAD_MAX_SEQUENCES else 1
    microbatches = token_budget_microbatches(lengths, BUDGET, multiple_of=spread)
    return balance_ranks(lengths, microbatches, WORLD_SIZE)


def default_plan(lengths: np.ndarray, model: str) -> RankAssignment:
    weight = model_attention_weight(model)
    return plan_microbatches(lengths, BUDGET, WORLD_SIZE, attention_weight=weight).assignment


def figures(lengths: np.ndarray, assignment: RankAssignment, weight: float) -> tuple[float, float]:
    """(rank imbalance, lockstep efficiency) with cost tokens + weight x L^2."""
    costs = microbatch_cost(lengths, assignment.microbatches, attention_weight=weight)
    _, imbalance, efficiency = lockstep_figures(costs, assignment.ranks)
    return imbalance, efficiency


def over_budget(lengths: np.ndarray, assignment: RankAssignment) -> int:
    return int((microbatch_tokens(lengths, assignment.microbatches) > BUDGET).sum())


def compare_workloads() -> None:
    print(
        f"{'workload':<12} {'model':<11} {'count':>5} {'over':>4} {'compute lockstep':>21} "
        f"{'compute imbal':>15} {'token lockstep':>15}"
    )
    print(f"{'':<12} {'':<11} {'':>5} {'':>4} {'today':>10} {'default':>10} {'default':>15}")
    for name, (n, sigma, seed) in WORKLOADS.items():
        lengths = lognormal_lengths(n, sigma, seed)
        before = todays_plan(lengths)
        fill = lengths.sum() / (len(before.microbatches) * BUDGET)
        for model in MODELS:
            weight = model_attention_weight(model)
            after = default_plan(lengths, model)
            _, today_lockstep = figures(lengths, before, weight)
            imbalance, lockstep = figures(lengths, after, weight)
            _, token_lockstep = figures(lengths, after, 0.0)
            assert len(after.microbatches) == len(before.microbatches), "count changed"
            assert over_budget(lengths, before) == over_budget(lengths, after) == 0
            print(
                f"{name:<12} {model:<11} {len(after.microbatches):>5} "
                f"{over_budget(lengths, after):>4} {today_lockstep:>10.4f} {lockstep:>10.4f} "
                f"{imbalance:>15.4f} {token_lockstep:>15.4f}"
            )
            assert lockstep >= 0.98, f"{name} {model}: compute lockstep {lockstep:.4f}"
        print(
            f"{'':<12} {len(before.microbatches) // WORLD_SIZE} microbatches per rank, "
            f"token fill {fill:.1%}"
        )


def sweep(seeds: int = 40) -> None:
    print(f"\n{seeds} seeds of the 512-sequence step, {WORLD_SIZE} ranks (min / max over seeds):")
    token_before, token_after = [], []
    for seed in range(seeds):
        lengths = lognormal_lengths(512, 0.85, seed)
        before = todays_plan(lengths)
        after = plan_microbatches(lengths, BUDGET, WORLD_SIZE).assignment
        assert len(after.microbatches) == len(before.microbatches)
        assert over_budget(lengths, after) == 0
        token_before.append(figures(lengths, before, 0.0))
        token_after.append(figures(lengths, after, 0.0))
    for label, rows in (("today, tokens", token_before), ("weight 0, tokens", token_after)):
        imbalances, locksteps = zip(*rows, strict=True)
        misses = sum(i > 1.02 or e < 0.98 for i, e in rows)
        print(
            f"  {label:<26} imbalance max {max(imbalances):.4f}, lockstep min "
            f"{min(locksteps):.4f}; {misses} seed(s) miss 1.02 / 0.98"
        )
        if label.startswith("weight"):
            assert misses == 0
    for model in MODELS:
        weight = model_attention_weight(model)
        rows, misses = [], []
        for seed in range(seeds):
            lengths = lognormal_lengths(512, 0.85, seed)
            imbalance, lockstep = figures(lengths, default_plan(lengths, model), weight)
            _, today = figures(lengths, todays_plan(lengths), weight)
            rows.append((imbalance, lockstep, today))
            if lockstep < 0.98:
                fill = lengths.sum() / (len(todays_plan(lengths).microbatches) * BUDGET)
                misses.append(f"seed {seed} {lockstep:.4f} (fill {fill:.1%})")
        imbalances, locksteps, todays = zip(*rows, strict=True)
        print(
            f"  {model + ', compute':<26} imbalance max {max(imbalances):.4f}, lockstep min "
            f"{min(locksteps):.4f} median {statistics.median(locksteps):.4f} (today min "
            f"{min(todays):.4f} median {statistics.median(todays):.4f}); under 0.98: "
            f"{', '.join(misses) or 'none'}"
        )


def median_seconds(function: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_planning(sizes: list[int]) -> None:
    print("\nplanning time (median of 3, both planners in this run):")
    print(f"{'sequences':>10} {'today s':>8} {'default s':>10} {'ratio':>6}")
    for n in sizes:
        lengths = lognormal_lengths(n, 1.0, n)
        today = median_seconds(lambda: todays_plan(lengths))  # noqa: B023
        default = median_seconds(lambda: default_plan(lengths, "qwen3-8b"))  # noqa: B023
        print(f"{n:>10,} {today:>8.3f} {default:>10.3f} {default / today:>6.2f}")
        if n >= 1_000_000:
            assert default <= 2 * today, "planning more than 2x slower at 1M sequences"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1M-sequence timing")
    args = parser.parse_args()
    compare_workloads()
    sweep()
    time_planning([100_000] if args.quick else [100_000, 1_000_000])


if __name__ == "__main__":
    main()
