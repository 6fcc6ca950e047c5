"""Token-budget microbatches under the packed and padded cost models."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.budgets import (
    fixed_count_microbatches,
    microbatch_lower_bound,
    microbatch_positions,
    microbatch_tokens,
    padding_share,
    spread_evenly,
    token_budget_microbatches,
)
from rlfeed.sched.packing import naive_first_fit_decreasing

FAST = settings(max_examples=150, deadline=None)
COSTS = st.sampled_from(["packed", "padded"])


@st.composite
def lengths_and_budget(draw):
    budget = draw(st.integers(min_value=1, max_value=300))
    length = st.integers(min_value=1, max_value=budget)
    kind = draw(st.sampled_from(["random", "all equal", "at budget", "tiny"]))
    if kind == "all equal":
        length = st.just(draw(length))
    elif kind == "at budget":
        length = st.one_of(st.just(budget), length)
    elif kind == "tiny":
        length = st.integers(min_value=1, max_value=max(1, budget // 10))
    return draw(st.lists(length, min_size=0, max_size=60)), budget


def computed_positions(lengths: list[int], members: list[int], cost: str) -> int:
    """The straightforward cost of one microbatch."""
    member_lengths = [lengths[i] for i in members]
    if cost == "packed":
        return sum(member_lengths)
    return len(member_lengths) * max(member_lengths, default=0)


@FAST
@given(lengths_and_budget(), COSTS)
def test_every_sequence_in_exactly_one_microbatch_within_budget(case, cost):
    lengths, budget = case
    microbatches = token_budget_microbatches(lengths, budget, cost=cost)
    members = [i for m in microbatches for i in m.tolist()]
    assert sorted(members) == list(range(len(lengths)))
    for m in microbatches:
        assert m.dtype == np.int64 and m.size >= 1
        assert computed_positions(lengths, m.tolist(), cost) <= budget
    assert len(microbatches) >= microbatch_lower_bound(lengths, budget)


@FAST
@given(lengths_and_budget())
def test_packed_microbatches_are_ffd_bins(case):
    lengths, budget = case
    packed = token_budget_microbatches(lengths, budget, cost="packed")
    naive = naive_first_fit_decreasing(lengths, budget)
    assert [m.tolist() for m in packed] == [m.tolist() for m in naive]
    bfd = token_budget_microbatches(lengths, budget, cost="packed", method="bfd")
    assert sorted(i for m in bfd for i in m.tolist()) == list(range(len(lengths)))


def fewest_contiguous_groups(sorted_lengths: list[int], budget: int) -> int:
    """Dynamic programme over cut points of the sorted order: the padded optimum."""
    n = len(sorted_lengths)
    best = [0] + [n + 1] * n  # best[j]: fewest groups covering the first j sequences
    for end in range(1, n + 1):
        for start in range(end):
            if (end - start) * sorted_lengths[start] <= budget:
                best[end] = min(best[end], best[start] + 1)
    return best[n]


@FAST
@given(lengths_and_budget())
def test_padded_microbatches_are_the_fewest_cuts_of_the_length_sorted_order(case):
    lengths, budget = case
    microbatches = token_budget_microbatches(lengths, budget, cost="padded")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    assert [i for m in microbatches for i in m.tolist()] == order
    sorted_lengths = [lengths[i] for i in order]
    assert len(microbatches) == fewest_contiguous_groups(sorted_lengths, budget)


def test_padded_budget_gives_the_longest_trajectories_microbatches_of_their_own():
    lengths = [64, 8, 64, 8, 70, 8, 8, 8, 8]
    microbatches = token_budget_microbatches(lengths, 128, cost="padded")
    assert [m.tolist() for m in microbatches][:2] == [[4], [0, 2]]


@FAST
@given(lengths_and_budget(), COSTS)
def test_tokens_and_positions_match_the_straightforward_sums(case, cost):
    lengths, budget = case
    microbatches = token_budget_microbatches(lengths, budget, cost="packed")
    microbatches.append(np.zeros(0, dtype=np.int64))  # an empty microbatch counts 0
    tokens = microbatch_tokens(lengths, microbatches)
    positions = microbatch_positions(lengths, microbatches, cost)
    assert tokens.tolist() == [sum(lengths[i] for i in m.tolist()) for m in microbatches]
    expected_positions = [computed_positions(lengths, m.tolist(), cost) for m in microbatches]
    assert positions.tolist() == expected_positions
    total_positions = sum(positions.tolist())
    expected_share = 1 - sum(lengths) / total_positions if total_positions else 0.0
    assert padding_share(lengths, microbatches, cost) == pytest.approx(expected_share)


@pytest.mark.parametrize("cost", ["packed", "padded"])
def test_too_long_sequence_error_names_index_and_length(cost):
    with pytest.raises(ValueError, match="sequence 3 has length 101, longer than the token budget"):
        token_budget_microbatches([5, 100, 7, 101], 100, cost=cost)


def test_bad_budget_cost_and_indices_are_rejected():
    with pytest.raises(ValueError, match="token budget must be a whole number >= 1"):
        token_budget_microbatches([1, 2], 0)
    with pytest.raises(ValueError, match="unknown cost model 'dense'"):
        token_budget_microbatches([1, 2], 8, cost="dense")
    with pytest.raises(ValueError, match=r"microbatch 1 holds sequence index 5, outside 0\.\.2"):
        microbatch_tokens([1, 2, 3], [np.array([0, 1]), np.array([5])])
    with pytest.raises(ValueError, match="microbatch 0 holds sequence index -1"):
        microbatch_tokens([1, 2, 3], [np.array([-1])])
    with pytest.raises(ValueError, match="integer sequence indices"):
        microbatch_tokens([1, 2, 3], [np.array([0.5])])


def test_empty_input_gives_no_microbatches():
    for cost in ("packed", "padded"):
        assert token_budget_microbatches([], 10, cost=cost) == []
    assert microbatch_tokens([], []).size == 0
    assert padding_share([], [], "padded") == 0.0
    assert microbatch_lower_bound([], 10) == 0


@FAST
@given(st.lists(st.integers(1, 9), max_size=40), st.integers(1, 10), st.randoms())
def test_fixed_count_microbatches_cut_the_given_order(lengths, count, random):
    order = list(range(len(lengths)))
    random.shuffle(order)
    groups = fixed_count_microbatches(order, count)
    assert [i for g in groups for i in g.tolist()] == order
    assert all(g.size == count for g in groups[:-1])
    assert all(1 <= g.size <= count for g in groups)


def test_fixed_count_rejects_a_zero_count():
    with pytest.raises(ValueError, match="count must be a whole number >= 1"):
        fixed_count_microbatches([0, 1], 0)


def test_budgets_are_deterministic():
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 500, size=300)
    for cost in ("packed", "padded"):
        first = token_budget_microbatches(lengths, 1000, cost=cost)
        second = token_budget_microbatches(lengths.tolist(), 1000, cost=cost)
        assert [m.tolist() for m in first] == [m.tolist() for m in second]


@FAST
@given(lengths_and_budget(), st.integers(1, 9))
def test_multiple_of_spreads_to_the_next_multiple_or_keeps_the_packed_bins(case, multiple):
    lengths, budget = case
    packed = token_budget_microbatches(lengths, budget)
    result = token_budget_microbatches(lengths, budget, multiple_of=multiple)
    assert sorted(i for m in result for i in m.tolist()) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in m.tolist()) <= budget for m in result)
    next_multiple = -(-len(packed) // multiple) * multiple
    spread = spread_evenly(lengths, next_multiple) if next_multiple > len(packed) else None
    fits = spread is not None and all(sum(lengths[i] for i in m.tolist()) <= budget for m in spread)
    expected = spread if fits else packed
    assert [m.tolist() for m in result] == [m.tolist() for m in expected]


@FAST
@given(st.lists(st.integers(1, 100), min_size=0, max_size=60), st.integers(1, 12))
def test_spread_evenly_is_textbook_lpt(lengths, count):
    spread = spread_evenly(lengths, count)
    if len(lengths) < count:
        assert spread is None
        return
    loads = [0] * count
    expected: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(count), key=lambda b: (loads[b], b))
        loads[target] += lengths[index]
        expected[target].append(index)
    assert [m.tolist() for m in spread] == expected
    # List scheduling's guarantee: loads differ by at most the longest sequence.
    assert max(loads) - min(loads) <= max(lengths)


def test_multiple_of_must_be_positive():
    with pytest.raises(ValueError, match="multiple_of must be a whole number >= 1"):
        token_budget_microbatches([1, 2], 8, multiple_of=0)
