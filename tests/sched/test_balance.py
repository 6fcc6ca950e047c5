"""Data-parallel rank balancing: equal microbatch counts, budgets kept, figures exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.balance import (
    balance_ranks,
    equalize_microbatch_count,
    lockstep_figures,
    microbatch_cost,
    rank_imbalance,
)
from rlfeed.sched.budgets import token_budget_microbatches

FAST = settings(max_examples=150, deadline=None)


@st.composite
def step(draw):
    """Lengths, a budget, a cost model, a world size and an attention weight."""
    budget = draw(st.integers(min_value=1, max_value=200))
    length = st.integers(min_value=1, max_value=budget)
    kind = draw(st.sampled_from(["random", "all equal", "at budget", "tiny", "large"]))
    if kind == "all equal":
        length = st.just(draw(length))
    elif kind == "at budget":
        length = st.one_of(st.just(budget), length)
    elif kind == "tiny":
        length = st.integers(min_value=1, max_value=max(1, budget // 8))
    elif kind == "large":  # one sequence per microbatch: many lockstep rounds
        length = st.integers(min_value=budget // 2 + 1, max_value=budget)
    lengths = draw(st.lists(length, min_size=0, max_size=50))
    cost = draw(st.sampled_from(["packed", "padded"]))
    world_size = draw(st.integers(min_value=1, max_value=9))
    attention_weight = draw(st.sampled_from([0.0, 0.01, 1.0]))
    return lengths, budget, cost, world_size, attention_weight


def cost_of(lengths: list[int], members: list[int], cost: str, weight: float) -> float:
    """The straightforward cost of one microbatch."""
    sizes = [lengths[i] for i in members]
    if not sizes:
        return 0.0
    if cost == "padded":
        return len(sizes) * max(sizes) + weight * (len(sizes) * max(sizes) ** 2)
    return sum(sizes) + weight * sum(size**2 for size in sizes)


def plan(case):
    lengths, budget, cost, world_size, weight = case
    microbatches = token_budget_microbatches(lengths, budget, cost=cost)
    assignment = balance_ranks(
        lengths, microbatches, world_size, attention_weight=weight, cost=cost
    )
    return microbatches, assignment


@FAST
@given(step())
def test_every_rank_gets_same_microbatch_count(case):
    microbatches, assignment = plan(case)
    world_size = case[3]
    assert len(assignment.ranks) == world_size == assignment.world_size
    assert {len(slots) for slots in assignment.ranks} == {assignment.num_slots}
    assert assignment.num_slots == -(-len(microbatches) // world_size)
    # The ranks together run every microbatch exactly once.
    assert sorted(i for slots in assignment.ranks for i in slots) == list(
        range(len(assignment.microbatches))
    )


@FAST
@given(step())
def test_balancing_keeps_every_sequence_once_and_every_budget(case):
    lengths, budget, cost, _, _ = case
    _, assignment = plan(case)
    members = [i for m in assignment.microbatches for i in m.tolist()]
    assert sorted(members) == list(range(len(lengths)))
    for m in assignment.microbatches:
        member_lengths = [lengths[i] for i in m.tolist()]
        positions = sum(member_lengths) if cost == "packed" else len(m) * max(member_lengths or [0])
        assert positions <= budget


@FAST
@given(step())
def test_splits_come_first_and_empty_microbatches_only_when_nothing_splits(case):
    lengths, _, cost, world_size, weight = case
    microbatches, assignment = plan(case)
    result = assignment.microbatches
    if len(microbatches) % world_size == 0:
        assert [m.tolist() for m in result] == [m.tolist() for m in microbatches]
        return
    empties = sum(m.size == 0 for m in result)
    if empties:
        assert all(m.size <= 1 for m in result), "an empty slot while a split was possible"
    # Each split replaces a microbatch by a part of it and appends the other part.
    for original, kept in zip(microbatches, result, strict=False):
        assert set(kept.tolist()) <= set(original.tolist())
    costs = [cost_of(lengths, m.tolist(), cost, weight) for m in microbatches]
    split_costs = [
        c for c, m, kept in zip(costs, microbatches, result, strict=False) if kept.size < m.size
    ]
    unsplit_splittable = [
        c
        for c, m, kept in zip(costs, microbatches, result, strict=False)
        if kept.size == m.size and m.size >= 2
    ]
    # The costliest splittable microbatches are the ones split.
    if split_costs and unsplit_splittable:
        assert min(split_costs) >= max(unsplit_splittable)


@FAST
@given(step())
def test_figures_match_brute_force(case):
    lengths, _, cost, world_size, weight = case
    _, assignment = plan(case)
    costs = [cost_of(lengths, m.tolist(), cost, weight) for m in assignment.microbatches]
    rank_cost = [sum(costs[i] for i in slots) for slots in assignment.ranks]
    np.testing.assert_allclose(assignment.rank_cost, rank_cost, rtol=1e-12)
    total = sum(costs)
    if total == 0:
        assert assignment.rank_imbalance == assignment.lockstep_efficiency == 1.0
        return
    slowest_per_slot = [
        max(costs[slots[slot]] for slots in assignment.ranks)
        for slot in range(assignment.num_slots)
    ]
    assert assignment.rank_imbalance == pytest.approx(max(rank_cost) / (total / world_size))
    assert assignment.lockstep_efficiency == pytest.approx(
        total / (world_size * sum(slowest_per_slot))
    )
    assert 0 < assignment.lockstep_efficiency <= 1 + 1e-12
    assert 1 - 1e-12 <= assignment.rank_imbalance <= world_size + 1e-12


@FAST
@given(step())
def test_slot_mates_are_neighbours_in_cost_order(case):
    lengths, _, cost, world_size, weight = case
    _, assignment = plan(case)
    costs = [cost_of(lengths, m.tolist(), cost, weight) for m in assignment.microbatches]
    descending = sorted(costs, reverse=True)
    for slot in range(assignment.num_slots):
        slot_costs = sorted((costs[slots[slot]] for slots in assignment.ranks), reverse=True)
        expected = descending[slot * world_size : (slot + 1) * world_size]
        np.testing.assert_allclose(slot_costs, expected, rtol=1e-12)


@FAST
@given(step())
def test_assignment_follows_the_least_loaded_rule(case):
    lengths, _, cost, world_size, weight = case
    _, assignment = plan(case)
    costs = [cost_of(lengths, m.tolist(), cost, weight) for m in assignment.microbatches]
    # Written out: costliest first (ties by index), rounds of world_size, and in each round
    # the next costliest microbatch goes to the least-loaded rank (ties by rank id).
    by_cost = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load = [0.0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, len(by_cost), world_size):
        ranking = sorted(range(world_size), key=lambda r: (load[r], r))
        for rank, index in zip(ranking, by_cost[start : start + world_size], strict=True):
            ranks[rank].append(index)
            load[rank] += costs[index]
    assert assignment.ranks == ranks


@FAST
@given(step())
def test_rank_costs_differ_by_at_most_the_costliest_microbatch(case):
    lengths, _, cost, _, weight = case
    _, assignment = plan(case)
    costs = [cost_of(lengths, m.tolist(), cost, weight) for m in assignment.microbatches]
    spread = float(assignment.rank_cost.max() - assignment.rank_cost.min())
    assert spread <= max(costs, default=0.0) * (1 + 1e-12)


@FAST
@given(step())
def test_microbatch_cost_matches_the_straightforward_formula(case):
    lengths, budget, cost, _, weight = case
    microbatches = token_budget_microbatches(lengths, budget, cost=cost)
    microbatches.append(np.zeros(0, dtype=np.int64))
    expected = [cost_of(lengths, m.tolist(), cost, weight) for m in microbatches]
    got = microbatch_cost(lengths, microbatches, attention_weight=weight, cost=cost)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_split_halves_are_balanced():
    lengths = [40, 30, 20, 10, 10, 5, 5]
    result = equalize_microbatch_count(lengths, [np.arange(7)], 2)
    halves = [sum(lengths[i] for i in m.tolist()) for m in result]
    assert sorted(halves) == [60, 60]


def test_single_sequences_cannot_split_so_empty_microbatches_fill_the_ranks():
    assignment = balance_ranks([7, 5, 3], [np.array([0]), np.array([1]), np.array([2])], 4)
    assert [m.size for m in assignment.microbatches] == [1, 1, 1, 0]
    assert assignment.microbatches[3].dtype == np.int64
    assert assignment.rank_imbalance == pytest.approx(7 / (15 / 4))


def test_empty_step_is_perfectly_balanced():
    assignment = balance_ranks([], [], 3)
    assert assignment.ranks == [[], [], []]
    assert assignment.num_slots == 0
    assert assignment.rank_imbalance == 1.0
    assert assignment.lockstep_efficiency == 1.0
    rank_cost, imbalance, efficiency = lockstep_figures([0.0, 0.0], [[0], [1]])
    assert (imbalance, efficiency) == (1.0, 1.0)
    assert rank_cost.tolist() == [0.0, 0.0]
    assert rank_imbalance([0.0, 0.0]) == 1.0


def test_rank_imbalance_is_max_over_mean_one_when_balanced():
    assert rank_imbalance([3.0, 1.0]) == 1.5  # the step takes 1.5x a balanced one
    assert rank_imbalance([2.0, 2.0, 2.0]) == 1.0
    assert rank_imbalance([4.0, 0.0, 0.0, 0.0]) == 4.0  # at most the number of ranks


def test_balancing_is_deterministic():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 1000, size=400)
    microbatches = token_budget_microbatches(lengths, 4000)
    first = balance_ranks(lengths, microbatches, 6)
    second = balance_ranks(lengths.tolist(), [m.tolist() for m in microbatches], 6)
    assert first.ranks == second.ranks
    assert [m.tolist() for m in first.microbatches] == [m.tolist() for m in second.microbatches]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1"):
        balance_ranks([1, 2], [np.array([0, 1])], 0)
    with pytest.raises(ValueError, match="attention_weight must be finite and >= 0"):
        balance_ranks([1, 2], [np.array([0, 1])], 2, attention_weight=-1.0)
    with pytest.raises(ValueError, match="sequence 1 appears in more than one microbatch"):
        balance_ranks([1, 2], [np.array([0, 1]), np.array([1])], 2)
    with pytest.raises(ValueError, match="microbatch 1 holds sequence index 9"):
        balance_ranks([1, 2], [np.array([0]), np.array([9])], 2)
    with pytest.raises(ValueError, match="same number of microbatches"):
        lockstep_figures([1.0, 2.0, 3.0], [[0, 1], [2]])
