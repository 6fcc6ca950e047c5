"""Token-budget microbatches (chapter 14.2): cap what memory depends on, not a count.

A fixed number of sequences per microbatch makes peak activation memory proportional to the
longest sequence that happens to land in it; with long-tailed agent trajectories that is
eventually count x context length. A token budget bounds the microbatch's *computed
positions* instead, under one of two cost models:

- ``"packed"``: the trainer packs each microbatch (variable-length attention or one packed
  row), so it computes sum(L) positions. Grouping is bin packing (FFD by default).
- ``"padded"``: the trainer pads each microbatch to its longest member, so it computes
  count x max(L) positions. Sequences are taken longest first and cut greedily into the
  largest groups that fit, so neighbours have similar lengths (little padding) and the
  longest trajectories end up in microbatches of their own.

Every function returns microbatches as int64 arrays of sequence indices, each sequence in
exactly one microbatch, deterministic in the lengths. A sequence longer than the budget is
an error: truncating it would silently change the task.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from rlfeed.sched.packing import (
    PackingMethod,
    as_lengths,
    check_fits,
    pack_sequences,
    sorted_by_length,
)

CostModel = Literal["packed", "padded"]
COST_MODELS: tuple[str, ...] = ("packed", "padded")


def check_cost_model(cost: str) -> None:
    if cost not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost!r}; expected 'packed' or 'padded'")


def token_budget_microbatches(
    lengths: ArrayLike,
    token_budget: int,
    *,
    cost: CostModel = "packed",
    method: PackingMethod = "ffd",
    multiple_of: int = 1,
) -> list[np.ndarray]:
    """Group sequences into microbatches of at most `token_budget` computed positions.

    packed: sum of lengths <= budget, by `pack_sequences(..., method)`; microbatch 0 holds
    the longest sequence. padded: count x longest <= budget, sequences sorted by length
    descending (ties by index) and cut greedily, so the result is the fewest microbatches
    any split of that sorted order can give. `method` only applies to "packed".

    multiple_of (packed only; default 1 = off): when the packed count K is not a multiple
    of it (the data-parallel world size), try to spread the sequences evenly over the next
    multiple K' instead (`spread_evenly`, LPT), so every rank gets microbatches of about
    total / K' tokens rather than some full ones plus split halves (see `balance_ranks`).
    Keeps the packed bins if a spread microbatch would exceed the budget. Costs a heap
    step per sequence: use it for a step's sequences, not millions.
    Raises ValueError naming the first sequence longer than the budget.
    """
    check_cost_model(cost)
    sizes = as_lengths(lengths)
    check_fits(sizes, token_budget, what="token budget")
    if int(multiple_of) != multiple_of or multiple_of < 1:
        raise ValueError(f"multiple_of must be a whole number >= 1, got {multiple_of!r}")
    if cost == "packed":
        bins = pack_sequences(sizes, int(token_budget), method=method)
        wanted = -(-len(bins) // int(multiple_of)) * int(multiple_of)
        if wanted > len(bins):
            spread = spread_evenly(sizes, wanted)
            if spread is not None and microbatch_tokens(sizes, spread).max() <= token_budget:
                return spread
        return bins
    order = sorted_by_length(sizes, descending=True)
    # Each group's first member is its longest, so it holds budget // that many sequences.
    capacity = (int(token_budget) // sizes[order]).tolist()
    cuts = [0]
    while cuts[-1] < sizes.size:
        cuts.append(cuts[-1] + capacity[cuts[-1]])
    cuts[-1] = sizes.size
    return [order[a:b] for a, b in itertools.pairwise(cuts)]


def spread_evenly(lengths: ArrayLike, count: int) -> list[np.ndarray] | None:
    """Deal sequences into `count` microbatches of near-equal tokens (no budget check).

    Longest-processing-time-first: longest sequence first (ties by index), each to the
    microbatch with the fewest tokens so far (ties by index); max load <= 4/3 of optimal.
    A heap step per sequence, about 3 s per million sequences, so meant for one step's
    sequences. Returns None if fewer sequences than `count` (a microbatch would be empty).
    Inside a microbatch, indices are by decreasing length.
    """
    sizes = as_lengths(lengths)
    if sizes.size < count:
        return None
    order = sorted_by_length(sizes, descending=True)
    heap = [(0, index) for index in range(int(count))]
    owner: list[int] = []
    for size in sizes[order].tolist():
        load, target = heap[0]
        heapq.heapreplace(heap, (load + size, target))
        owner.append(target)
    owner_of_sorted = np.asarray(owner, dtype=np.int64)
    # Stable by owner keeps each microbatch's members in decreasing-length order.
    placed = order[np.argsort(owner_of_sorted, kind="stable")]
    cuts = np.cumsum(np.bincount(owner_of_sorted, minlength=int(count))).tolist()
    return [placed[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]


def fixed_count_microbatches(order: ArrayLike, count: int) -> list[np.ndarray]:
    """The chapter's baseline: consecutive groups of `count` sequences in the given order.

    `order` is a permutation of sequence indices (random order, or sorted by length for
    "length-balanced" groups); the last group may be shorter.
    """
    if int(count) != count or count < 1:
        raise ValueError(f"count must be a whole number >= 1, got {count!r}")
    order = np.asarray(order, dtype=np.int64)
    return [order[start : start + int(count)] for start in range(0, order.size, int(count))]


def flatten_microbatches(
    microbatches: list[np.ndarray], num_sequences: int
) -> tuple[np.ndarray, np.ndarray]:
    """All member indices back to back ([sum of sizes] int64) and [K + 1] segment offsets.

    Raises ValueError naming the microbatch that holds an index outside 0..num_sequences-1.
    """
    counts = np.array(list(map(len, microbatches)), dtype=np.int64)
    offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] == 0:
        return np.zeros(0, dtype=np.int64), offsets
    members = np.concatenate(microbatches)
    if members.ndim != 1:
        raise ValueError("every microbatch must be a 1-D array of sequence indices")
    # An empty float array (np.array([])) mixed in is harmless; 1.5 is not an index.
    integral = members.dtype.kind in "iu" or (
        members.dtype.kind == "f" and bool(np.all(np.mod(members, 1) == 0))
    )
    if not integral:
        raise ValueError(f"microbatches must hold integer sequence indices, got {members.dtype}")
    members = members.astype(np.int64, copy=False)
    if members.min() < 0 or members.max() >= num_sequences:
        bad = int(np.flatnonzero((members < 0) | (members >= num_sequences))[0])
        microbatch = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise ValueError(
            f"microbatch {microbatch} holds sequence index {int(members[bad])}, outside "
            f"0..{num_sequences - 1}"
        )
    return members, offsets


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-segment sums of `values` cut at `offsets` ([K + 1]); empty segments give 0."""
    cumulative = np.zeros(values.size + 1, dtype=values.dtype)
    np.cumsum(values, out=cumulative[1:])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-segment maxima of `values` cut at `offsets`; empty segments give 0."""
    result = np.zeros(offsets.size - 1, dtype=values.dtype)
    nonempty = np.flatnonzero(offsets[1:] > offsets[:-1])
    if nonempty.size:
        result[nonempty] = np.maximum.reduceat(values, offsets[nonempty])
    return result


def microbatch_tokens(lengths: ArrayLike, microbatches: list[np.ndarray]) -> np.ndarray:
    """[K] int64 real tokens per microbatch (sum of member lengths)."""
    sizes = as_lengths(lengths)
    members, offsets = flatten_microbatches(microbatches, sizes.size)
    return segment_sum(sizes[members], offsets)


def microbatch_positions(
    lengths: ArrayLike, microbatches: list[np.ndarray], cost: CostModel
) -> np.ndarray:
    """[K] int64 computed positions per microbatch: packed = sum(L), padded = count x max(L)."""
    check_cost_model(cost)
    sizes = as_lengths(lengths)
    members, offsets = flatten_microbatches(microbatches, sizes.size)
    member_lengths = sizes[members]
    if cost == "packed":
        return segment_sum(member_lengths, offsets)
    return np.diff(offsets) * segment_max(member_lengths, offsets)


def padding_share(lengths: ArrayLike, microbatches: list[np.ndarray], cost: CostModel) -> float:
    """Share of computed positions that are padding: 1 - real tokens / computed positions."""
    positions = int(microbatch_positions(lengths, microbatches, cost).sum())
    if positions == 0:
        return 0.0
    return 1.0 - int(microbatch_tokens(lengths, microbatches).sum()) / positions


def microbatch_lower_bound(lengths: ArrayLike, token_budget: int) -> int:
    """ceil(total tokens / budget): no grouping under either cost model needs fewer."""
    total = int(as_lengths(lengths).sum())
    return -(-total // int(token_budget))
