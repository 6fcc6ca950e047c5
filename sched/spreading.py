"""Spread a step's sequences over a fixed number of microbatches, alike in cost slot by slot.

Ranks run their microbatches in lockstep slots, so a slot lasts as long as its costliest
microbatch. FFD fills microbatches to the token budget but leaves their *compute* far apart:
a bin holding two 64k-token sequences costs Qwen3-0.6B about 4x a bin of thirty 4k ones
with the same tokens (attention grows with L^2, see `rlfeed.sched.compute`). This module
re-deals the sequences over the same count, every microbatch still within the budget.

The deal is longest-processing-time-first (LPT) with a token cap: sequences by cost
descending (ties by index), each to the microbatch whose cost is furthest below its target
among those with room for it (ties by index). With all targets 0 this evens out every
microbatch. That is not always possible: when a few sequences cost more than the average
microbatch, their microbatches stand out, and a slot that mixes them with ordinary ones
idles most of its ranks. So the deal is repeated with targets taken from the previous
result, slot by slot (the `world_size` costliest microbatches share the highest target, the
next `world_size` the next, ...): the microbatches sharing a slot with a heavy one are then
built up to match it from the longer sequences, and the rest even out among themselves.
The round whose rank balance (`balance_ranks`) has the best lockstep efficiency is kept.

A heap step per sequence and round (a few ms per thousand sequences), so meant for one
step's sequences; `rlfeed.sched.planning` skips it for very large inputs.
"""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import ArrayLike
from rlfeed.sched.balance import RankAssignment, balance_ranks
from rlfeed.sched.packing import as_lengths, check_fits, sorted_by_length

TARGET_ROUNDS = 3
"""Deals at most: one with flat targets, then refinements (a 4th rarely gains 0.1%)."""
GOOD_ENOUGH = 0.999
"""Lockstep efficiency at which refinement stops."""


def _capped_deal(
    sizes: np.ndarray,
    costs: np.ndarray,
    order: np.ndarray,
    count: int,
    token_budget: int,
    targets: np.ndarray,
) -> np.ndarray | None:
    """Owner microbatch of each sequence, or None when one finds no microbatch with room."""
    heap = [(-float(target), index) for index, target in enumerate(targets.tolist())]
    heapq.heapify(heap)
    # Microbatches too full for the current length wait, by room, for a short enough one
    # (lengths only decrease), so each is passed over at most once per sequence it gets.
    waiting: list[tuple[int, float, int]] = []
    room = [int(token_budget)] * count
    smallest = int(sizes.min())
    owner = np.empty(sizes.size, dtype=np.int64)
    for index, length, cost in zip(
        order.tolist(), sizes[order].tolist(), costs[order].tolist(), strict=True
    ):
        while waiting and -waiting[0][0] >= length:
            _, key, target = heapq.heappop(waiting)
            heapq.heappush(heap, (key, target))
        while heap:
            key, target = heapq.heappop(heap)
            if room[target] >= length:
                break
            if room[target] >= smallest:
                heapq.heappush(waiting, (-room[target], key, target))
        else:
            return None
        owner[index] = target
        room[target] -= length
        heapq.heappush(heap, (key + cost, target))
    return owner


def _microbatches(owner: np.ndarray, order: np.ndarray, count: int) -> list[np.ndarray]:
    """Members of each microbatch, in deal order (by decreasing cost)."""
    placed = order[np.argsort(owner[order], kind="stable")]
    cuts = np.cumsum(np.bincount(owner, minlength=count)).tolist()
    return [placed[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]


def spread_by_cost(
    lengths: ArrayLike,
    count: int,
    token_budget: int,
    world_size: int,
    *,
    attention_weight: float = 0.0,
    rounds: int = TARGET_ROUNDS,
) -> RankAssignment | None:
    """`count` microbatches of at most `token_budget` tokens, balanced over `world_size` ranks.

    Cost of a sequence: L + attention_weight x L^2 (the packed cost of `balance_ranks`).
    Returns the best of up to `rounds` deals (see the module docstring) as a
    `balance_ranks` assignment, or None when a deal cannot place every sequence within the
    budget or there are fewer sequences than microbatches (one would be empty). `count`
    should be a multiple of `world_size`; otherwise `balance_ranks` splits as usual.
    Deterministic in the lengths.
    """
    sizes = as_lengths(lengths)
    check_fits(sizes, token_budget, what="token budget")
    count = int(count)
    if count < 1 or sizes.size < count:
        return None
    order = sorted_by_length(sizes, descending=True)  # cost is increasing in L
    costs = sizes + attention_weight * sizes.astype(np.float64) ** 2
    targets = np.zeros(count)
    best: RankAssignment | None = None
    for _ in range(max(1, int(rounds))):
        owner = _capped_deal(sizes, costs, order, count, token_budget, targets)
        if owner is None:
            break
        assignment = balance_ranks(
            sizes, _microbatches(owner, order, count), world_size, attention_weight=attention_weight
        )
        if best is None or assignment.lockstep_efficiency > best.lockstep_efficiency:
            best = assignment
        if best.lockstep_efficiency >= GOOD_ENOUGH:
            break
        loads = np.bincount(owner, weights=costs, minlength=count)
        slot_levels = np.sort(loads)[::-1][:: int(world_size)]
        targets = np.repeat(slot_levels, int(world_size))[:count]
    return best
