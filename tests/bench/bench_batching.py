"""Chapter 14.2's microbatching comparison, and how fast rlfeed plans a step.

    .venv/bin/python tests/bench/bench_batching.py            # ~15 s on 2 cores
    .venv/bin/python tests/bench/bench_batching.py --quick    # skips the 1M timing

Part 1 reproduces 14.2 on its long-tailed workload: 512 trajectory lengths, log-normal
with a median of 8,192 tokens and sigma 0.85 (chosen so the padded figures land near the
chapter's), rounded and capped at a 65,536-token context, seed 0: the bundled
`service/cli/examples/lengths.txt`, which this script checks it reproduces. Four schemes: 8
trajectories per microbatch in random order (the same generator's next permutation), 8 in
length-sorted order, a padded token budget of 131,072 (count x longest <= budget) and a
packed one (sum <= budget, FFD). For each: microbatches, padding share of the computed
positions, the largest microbatch in computed positions (peak activation memory), and the
lower bound ceil(tokens / budget). It asserts that the packed count is within 1% of the
lower bound and never above the textbook FFD's, and that no budgeted microbatch exceeds
the budget; then it balances the budgeted plans over 8 ranks (packed: split to equal
counts, or spread evenly over the next multiple of 8 microbatches).

Part 2 times planning (token-budget packing + rank balancing over 8 ranks; median of 3)
at 10k, 100k and 1M sequences of the same distribution against the targets 0.3 s at 100k
and 3 s at 1M, and times the textbook O(n x bins) FFD at 10k to show the speed ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rlfeed.sched.balance import balance_ranks
from rlfeed.sched.budgets import (
    fixed_count_microbatches,
    microbatch_lower_bound,
    microbatch_positions,
    padding_share,
    token_budget_microbatches,
)
from rlfeed.sched.packing import naive_first_fit_decreasing, sorted_by_length
from rlfeed.sched.planning import SPREAD_MAX_SEQUENCES, plan_microbatches

MEDIAN = 8192
SIGMA = 0.85
CONTEXT = 65_536
BUDGET = 131_072
PER_MICROBATCH = 8
WORLD_SIZE = 8
TARGET_SECONDS = {100_000: 0.3, 1_000_000: 3.0}
EXAMPLE = Path(__file__).resolve().parents[2] / "service" / "cli" / "examples" / "lengths.txt"


def long_tailed_workload(n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal trajectory lengths (median 8,192, sigma 0.85, capped at 65,536 tokens)
    and a random order of them, both from one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(mean=np.log(MEDIAN), sigma=SIGMA, size=n))
    return np.clip(lengths, 1, CONTEXT).astype(np.int64), rng.permutation(n)


def read_example() -> np.ndarray:
    lines = EXAMPLE.read_text().splitlines()
    return np.array([int(line) for line in lines if line and not line.startswith("#")])


def compare_schemes() -> None:
    lengths, random_order = long_tailed_workload()
    assert np.array_equal(lengths, read_example()), f"{EXAMPLE} is not this workload"
    lower_bound = microbatch_lower_bound(lengths, BUDGET)
    print(
        f"14.2 workload: {lengths.size} trajectories, median {np.median(lengths):,.0f}, "
        f"max {lengths.max():,} ({int((lengths == CONTEXT).sum())} at the cap), "
        f"{lengths.sum():,} tokens; lower bound ceil(tokens / {BUDGET:,}) = {lower_bound}"
    )
    schemes = {
        "fixed 8, random order": (
            fixed_count_microbatches(random_order, PER_MICROBATCH),
            "padded",
        ),
        "fixed 8, length-sorted": (
            fixed_count_microbatches(sorted_by_length(lengths, descending=True), PER_MICROBATCH),
            "padded",
        ),
        f"padded budget {BUDGET:,}": (
            token_budget_microbatches(lengths, BUDGET, cost="padded"),
            "padded",
        ),
        f"packed budget {BUDGET:,} (FFD)": (
            token_budget_microbatches(lengths, BUDGET, cost="packed"),
            "packed",
        ),
    }
    print(f"{'scheme':<30} {'microbatches':>12} {'padding':>8} {'largest':>9} {'lower bd':>8}")
    for name, (microbatches, cost) in schemes.items():
        positions = microbatch_positions(lengths, microbatches, cost)
        share = padding_share(lengths, microbatches, cost)
        print(
            f"{name:<30} {len(microbatches):>12} {share:>8.1%} {positions.max():>9,} "
            f"{lower_bound:>8}"
        )
        if "budget" in name:
            assert positions.max() <= BUDGET, f"{name}: a microbatch exceeds the budget"
    packed = schemes[f"packed budget {BUDGET:,} (FFD)"][0]
    naive = naive_first_fit_decreasing(lengths, BUDGET)
    print(
        f"textbook FFD: {len(naive)} microbatches; packed / lower bound = "
        f"{len(packed) / lower_bound:.4f} (must be <= 1.01)"
    )
    assert len(packed) <= len(naive)
    assert len(packed) <= 1.01 * lower_bound, "packed count more than 1% above the bound"
    tokens = int(lengths.sum())
    print(f"packed fill: {tokens / (len(packed) * BUDGET):.1%} of {len(packed)} x {BUDGET:,}")
    plans = {
        "packed, split to equal counts": (packed, "packed"),
        "packed, spread (multiple_of=8)": (
            token_budget_microbatches(lengths, BUDGET, multiple_of=WORLD_SIZE),
            "packed",
        ),
        "padded, split to equal counts": (schemes[f"padded budget {BUDGET:,}"][0], "padded"),
    }
    print(f"\nbalanced over {WORLD_SIZE} ranks:")
    print(f"{'plan':<32} {'microbatches':>12} {'largest':>9} {'imbalance':>9} {'lockstep':>8}")
    for name, (microbatches, cost) in plans.items():
        assignment = balance_ranks(lengths, microbatches, WORLD_SIZE, cost=cost)
        positions = microbatch_positions(lengths, assignment.microbatches, cost)
        assert positions.max() <= BUDGET
        print(
            f"{name:<32} {len(assignment.microbatches):>12} {positions.max():>9,} "
            f"{assignment.rank_imbalance:>9.4f} {assignment.lockstep_efficiency:>8.1%}"
        )


def median_seconds(function: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def plan(lengths: np.ndarray) -> None:
    """Exactly what `rlfeed plan` and step assembly run (spreading included where it applies)."""
    plan_microbatches(lengths, BUDGET, WORLD_SIZE, cost="packed")


def time_planning(sizes: list[int]) -> None:
    print(
        f"\nplanning = plan_microbatches: packed budget {BUDGET:,} (FFD; spread up to "
        f"{SPREAD_MAX_SEQUENCES:,} sequences) + balancing over {WORLD_SIZE} ranks"
    )
    print(f"{'sequences':>10} {'packing s':>10} {'planning s':>11} {'target s':>9} {'ratio':>6}")
    for n in sizes:
        lengths, _ = long_tailed_workload(n, seed=n)
        packing = median_seconds(lambda: token_budget_microbatches(lengths, BUDGET))  # noqa: B023
        planning = median_seconds(lambda: plan(lengths))  # noqa: B023
        target = TARGET_SECONDS.get(n)
        ratio = f"{planning / target:>6.2f}" if target else f"{'-':>6}"
        print(
            f"{n:>10,} {packing:>10.3f} {planning:>11.3f} "
            f"{(f'{target:.1f}' if target else '-'):>9} {ratio}"
        )
    n = 10_000
    lengths, _ = long_tailed_workload(n, seed=n)
    fast = median_seconds(lambda: token_budget_microbatches(lengths, BUDGET), repeats=5)
    started = time.perf_counter()
    naive = naive_first_fit_decreasing(lengths, BUDGET)
    textbook = time.perf_counter() - started
    same = [m.tolist() for m in naive] == [
        m.tolist() for m in token_budget_microbatches(lengths, BUDGET)
    ]
    print(
        f"textbook O(n x bins) FFD at {n:,}: {textbook:.2f} s vs {fast:.4f} s "
        f"({textbook / fast:,.0f}x), identical bins: {same}"
    )
    assert same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1M-sequence timing")
    args = parser.parse_args()
    compare_schemes()
    time_planning([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])


if __name__ == "__main__":
    main()
