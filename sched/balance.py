"""Data-parallel rank balancing: deal a step's microbatches out to `world_size` ranks.

Data-parallel ranks run in lockstep: every optimizer step (and, with per-microbatch
collectives, every microbatch slot) waits for the slowest rank. Two things therefore
matter: each rank's total cost (`rank_imbalance`) and, slot by slot, how alike the
microbatches running side by side are (`lockstep_efficiency`).

Every rank must also run the *same number* of microbatches, or a collective hangs. When the
microbatch count K is not a multiple of the world size, the costliest microbatches holding
two or more sequences are split into balanced halves (each half is a subset, so it stays
within the token budget under either cost model); only when nothing is left to split are
empty microbatches appended. An empty microbatch (an empty int64 index array) is a no-op
for the trainer: it runs no forward/backward, contributes zero loss and zero tokens, and
still takes part in the step's collectives.

The cost of a microbatch is its computed positions plus `attention_weight` x the attention
term (sum of L^2 packed, count x max(L)^2 padded), since attention grows quadratically and
dominates at long contexts.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from rlfeed.sched.budgets import (
    CostModel,
    check_cost_model,
    flatten_microbatches,
    segment_max,
    segment_sum,
)
from rlfeed.sched.packing import as_lengths


@dataclass(frozen=True)
class RankAssignment:
    """Which microbatches each data-parallel rank runs, in which order.

    microbatches:        the step's microbatches (int64 index arrays); may differ from the
                         input by splits and appended empty microbatches.
    ranks:               ranks[r] = indices into `microbatches`, in the order rank r runs
                         them (slot order); all ranks have the same length.
    rank_cost:           [world_size] float64 total cost per rank (see `microbatch_cost`).
    rank_imbalance:      max rank cost / mean rank cost (`rank_imbalance`; 1.0 = perfect).
    lockstep_efficiency: total cost / (world_size x sum over slots of the slot's largest
                         cost): the share of rank-time spent working (1.0 if empty).
    """

    microbatches: list[np.ndarray]
    ranks: list[list[int]]
    rank_cost: np.ndarray
    rank_imbalance: float
    lockstep_efficiency: float

    @property
    def num_slots(self) -> int:
        """Microbatches per rank (lockstep slots per step)."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def _check_attention_weight(attention_weight: float) -> None:
    if not np.isfinite(attention_weight) or attention_weight < 0:
        raise ValueError(f"attention_weight must be finite and >= 0, got {attention_weight!r}")


def _segment_costs(
    member_lengths: np.ndarray, offsets: np.ndarray, attention_weight: float, cost: CostModel
) -> np.ndarray:
    """Costs of microbatches given flattened member lengths and [K + 1] offsets.

    Both terms are summed exactly in int64 and combined once in float64, so microbatches
    with the same lengths have bit-identical costs and ties break by index, not by rounding.
    """
    if cost == "padded":
        longest = segment_max(member_lengths, offsets)
        positions = np.diff(offsets) * longest
        return positions + attention_weight * (positions * longest).astype(np.float64)
    tokens = segment_sum(member_lengths, offsets)
    return tokens + attention_weight * segment_sum(member_lengths**2, offsets).astype(np.float64)


def microbatch_cost(
    lengths: ArrayLike,
    microbatches: list[np.ndarray],
    *,
    attention_weight: float = 0.0,
    cost: CostModel = "packed",
) -> np.ndarray:
    """[K] float64 cost per microbatch: tokens + attention_weight x sum(L^2).

    With cost="padded" the microbatch is padded to its longest member, so the terms become
    count x max(L) and count x max(L)^2. Empty microbatches cost 0. Sums are exact in
    int64 (fine while sum(L^2) < 9.2e18, i.e. any realistic token budget).
    """
    _check_attention_weight(attention_weight)
    check_cost_model(cost)
    sizes = as_lengths(lengths)
    members, offsets = flatten_microbatches(microbatches, sizes.size)
    return _segment_costs(sizes[members], offsets, attention_weight, cost)


def _split_in_two(
    members: np.ndarray, sizes: np.ndarray, attention_weight: float, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Two non-empty halves of a microbatch with costs as equal as a cheap rule gets them.

    packed: longest first, each sequence to the cheaper half (LPT). padded: the best cut of
    the length-sorted members, since a padded half costs count x its longest.
    """
    lengths = sizes[members].astype(np.float64)
    order = np.lexsort((members, -lengths))
    members, lengths = members[order], lengths[order]
    if cost == "padded":
        per_sequence = lengths + attention_weight * lengths**2
        cut_options = np.arange(1, members.size)
        first_cost = cut_options * per_sequence[0]
        second_cost = (members.size - cut_options) * per_sequence[cut_options]
        cut = int(cut_options[np.argmin(np.maximum(first_cost, second_cost))])
        return members[:cut], members[cut:]
    # Every length is >= 1, so the second sequence already goes to the empty half.
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0.0, 0.0]
    for index, length in zip(members.tolist(), lengths.tolist(), strict=True):
        side = 0 if load[0] <= load[1] else 1
        halves[side].append(index)
        load[side] += length + attention_weight * length * length
    return np.asarray(halves[0], dtype=np.int64), np.asarray(halves[1], dtype=np.int64)


def _equalize(
    sizes: np.ndarray,
    microbatches: list[np.ndarray],
    costs: list[float],
    world_size: int,
    attention_weight: float,
    cost: CostModel,
) -> None:
    """Split / pad `microbatches` (and `costs`) in place to a multiple of `world_size`."""
    missing = -len(microbatches) % world_size
    if missing == 0:
        return
    # At most `missing` splits happen, so only the `missing` costliest candidates matter.
    cost_array = np.asarray(costs)
    candidates = np.flatnonzero(np.fromiter(map(len, microbatches), np.int64) >= 2)
    candidates = candidates[np.lexsort((candidates, -cost_array[candidates]))[:missing]]
    splittable = [(-costs[i], i) for i in candidates.tolist()]
    heapq.heapify(splittable)
    while missing and splittable:
        _, index = heapq.heappop(splittable)
        halves = _split_in_two(microbatches[index], sizes, attention_weight, cost)
        half_offsets = np.array([0, halves[0].size, halves[0].size + halves[1].size])
        half_costs = _segment_costs(
            sizes[np.concatenate(halves)], half_offsets, attention_weight, cost
        ).tolist()
        microbatches[index], costs[index] = halves[0], half_costs[0]
        microbatches.append(halves[1])
        costs.append(half_costs[1])
        missing -= 1
        for half_index in (index, len(microbatches) - 1):
            if microbatches[half_index].size >= 2:
                heapq.heappush(splittable, (-costs[half_index], half_index))
    microbatches.extend(np.zeros(0, dtype=np.int64) for _ in range(missing))
    costs.extend(0.0 for _ in range(missing))


def _prepare(
    lengths: ArrayLike,
    microbatches: list[np.ndarray],
    world_size: int,
    attention_weight: float,
    cost: CostModel,
) -> tuple[list[np.ndarray], list[float]]:
    """Validated int64 microbatches with a count divisible by world_size, and their costs."""
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    _check_attention_weight(attention_weight)
    check_cost_model(cost)
    sizes = as_lengths(lengths)
    members, offsets = flatten_microbatches(microbatches, sizes.size)
    repeated = np.flatnonzero(np.bincount(members, minlength=sizes.size) > 1)
    if repeated.size:
        raise ValueError(f"sequence {int(repeated[0])} appears in more than one microbatch")
    costs = _segment_costs(sizes[members], offsets, attention_weight, cost).tolist()
    if all(isinstance(m, np.ndarray) and m.dtype == np.int64 for m in microbatches):
        result = list(microbatches)  # already validated 1-D int64 arrays: share them
    else:  # views into one int64 array: normalizes the dtype without a copy each
        result = [members[a:b] for a, b in itertools.pairwise(offsets.tolist())]
    _equalize(sizes, result, costs, int(world_size), attention_weight, cost)
    return result, costs


def equalize_microbatch_count(
    lengths: ArrayLike,
    microbatches: list[np.ndarray],
    world_size: int,
    *,
    attention_weight: float = 0.0,
    cost: CostModel = "packed",
) -> list[np.ndarray]:
    """Microbatches whose count is a multiple of `world_size` (see the module docstring).

    Splits the costliest microbatch holding >= 2 sequences into two halves (the first half
    replaces it, the second is appended), repeating until the count divides evenly; appends
    empty microbatches if nothing can be split. Never more than world_size - 1 changes.
    """
    return _prepare(lengths, microbatches, world_size, attention_weight, cost)[0]


def lockstep_figures(costs: ArrayLike, ranks: list[list[int]]) -> tuple[np.ndarray, float, float]:
    """(rank_cost, rank_imbalance, lockstep_efficiency) of an assignment; see RankAssignment.

    `costs[i]` is microbatch i's cost; `ranks` lists, per rank, microbatch indices by slot.
    """
    if not ranks:
        raise ValueError("an assignment needs at least one rank")
    if len({len(slots) for slots in ranks}) != 1:
        raise ValueError("every rank must run the same number of microbatches")
    table = np.asarray(ranks, dtype=np.int64).reshape(len(ranks), -1)
    return _figures(np.asarray(costs, dtype=np.float64), table)


def rank_imbalance(rank_cost: ArrayLike) -> float:
    """max rank cost / mean rank cost: 1.0 when balanced (and when nothing is to do), at most
    the number of ranks. The one definition: plans, `StepStats.rank_imbalance`, `rlfeed
    status` / `plan` and the `rlfeed_step_*rank_imbalance` metrics all carry this figure.
    The ratio rather than its excess over 1 because it is what a step costs: lockstep ranks
    wait for the slowest, so the step takes `rank_imbalance` x the balanced step's time."""
    cost = np.asarray(rank_cost, dtype=np.float64)
    total = float(cost.sum())
    if total <= 0.0:
        return 1.0
    return float(cost.max()) / (total / cost.size)


def _figures(costs: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, float, float]:
    """lockstep_figures for a [rank, slot] table of microbatch indices."""
    slot_costs = costs[table]
    rank_cost = slot_costs.sum(axis=1)
    total = float(rank_cost.sum())
    if total <= 0.0:
        return rank_cost, 1.0, 1.0
    imbalance = rank_imbalance(rank_cost)
    efficiency = total / (table.shape[0] * float(slot_costs.max(axis=0).sum()))
    return rank_cost, imbalance, efficiency


@dataclass(frozen=True)
class BalanceFigures:
    """How evenly an assignment loads its ranks, under one cost."""

    rank_cost: np.ndarray
    """[world_size] float64 cost per rank."""
    rank_imbalance: float
    """max rank cost / mean rank cost (1.0 = perfect)."""
    lockstep_efficiency: float
    """total cost / (world_size x sum of slot maxima): share of rank-time spent working."""


def balance_figures(
    lengths: ArrayLike,
    assignment: RankAssignment,
    *,
    attention_weight: float = 0.0,
    cost: CostModel = "packed",
) -> BalanceFigures:
    """`assignment`'s figures re-counted under `attention_weight` (0 = in tokens/positions)."""
    costs = microbatch_cost(
        lengths, assignment.microbatches, attention_weight=attention_weight, cost=cost
    )
    table = np.asarray(assignment.ranks, dtype=np.int64).reshape(assignment.world_size, -1)
    rank_cost, imbalance, efficiency = _figures(costs, table)
    return BalanceFigures(
        rank_cost=rank_cost, rank_imbalance=imbalance, lockstep_efficiency=efficiency
    )


def balance_ranks(
    lengths: ArrayLike,
    microbatches: list[np.ndarray],
    world_size: int,
    *,
    attention_weight: float = 0.0,
    cost: CostModel = "packed",
) -> RankAssignment:
    """Assign microbatches to `world_size` ranks, the same number to each.

    After `equalize_microbatch_count`, microbatches are sorted by cost (descending, ties by
    index) and dealt out in rounds of `world_size`; a round is one lockstep slot, so
    slot-mates have similar costs. Inside a round the costliest microbatch goes to the rank
    with the least accumulated cost (ties by rank id). Deterministic.
    """
    balanced, cost_list = _prepare(lengths, microbatches, world_size, attention_weight, cost)
    world_size = int(world_size)
    costs = np.asarray(cost_list, dtype=np.float64)
    by_cost = np.lexsort((np.arange(costs.size), -costs))
    rounds = by_cost.size // world_size
    round_costs = costs[by_cost].reshape(rounds, world_size).tolist()
    # The sequential part is tiny (world_size numbers per round); the table is filled at once.
    load = [0.0] * world_size
    least_loaded: list[int] = []  # per round, ranks from least to most loaded
    for row in round_costs:
        ranking = sorted(range(world_size), key=load.__getitem__)
        for rank, value in zip(ranking, row, strict=True):
            load[rank] += value
        least_loaded.extend(ranking)
    table = np.empty((world_size, rounds), dtype=np.int64)  # [rank, slot] microbatch index
    rank_of = np.array(least_loaded, dtype=np.int64).reshape(rounds, world_size)
    table[rank_of, np.arange(rounds)[:, None]] = by_cost.reshape(rounds, world_size)
    ranks: list[list[int]] = table.tolist()
    rank_cost, imbalance, efficiency = _figures(costs, table)
    return RankAssignment(
        microbatches=balanced,
        ranks=ranks,
        rank_cost=rank_cost,
        rank_imbalance=imbalance,
        lockstep_efficiency=efficiency,
    )
