"""plan_microbatches: the FFD count, never over budget, balanced in tokens and in compute."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.balance import balance_ranks, lockstep_figures, microbatch_cost
from rlfeed.sched.budgets import token_budget_microbatches
from rlfeed.sched.compute import model_attention_weight
from rlfeed.sched.models import MODELS
from rlfeed.sched.planning import plan_microbatches

FAST = settings(max_examples=120, deadline=None)
BUDGET = 131_072
WORLD_SIZE = 8


@st.composite
def step(draw):
    """Lengths, a budget, a cost model, a world size and an attention weight."""
    budget = draw(st.integers(min_value=1, max_value=400))
    length = st.integers(min_value=1, max_value=budget)
    kind = draw(st.sampled_from(["random", "all equal", "at budget", "tiny", "long tail"]))
    if kind == "all equal":
        length = st.just(draw(length))
    elif kind == "at budget":
        length = st.one_of(st.just(budget), length)
    elif kind == "tiny":
        length = st.integers(min_value=1, max_value=max(1, budget // 10))
    elif kind == "long tail":
        length = st.one_of(st.integers(1, max(1, budget // 8)), st.just(budget), length)
    lengths = draw(st.lists(length, min_size=0, max_size=80))
    cost = draw(st.sampled_from(["packed", "padded"]))
    world_size = draw(st.integers(min_value=1, max_value=8))
    weight = draw(st.sampled_from([0.0, 0.001, 0.05]))
    return lengths, budget, cost, world_size, weight


def straightforward_figures(lengths, assignment, weight, cost):
    """(rank imbalance, lockstep efficiency, cost per rank) recounted sequence by sequence."""
    costs = []
    for m in assignment.microbatches:
        sizes = [lengths[i] for i in m.tolist()]
        if cost == "padded" and sizes:
            sizes = [max(sizes)] * len(sizes)
        costs.append(sum(size + weight * size * size for size in sizes))
    rank_cost = [sum(costs[i] for i in slots) for slots in assignment.ranks]
    total, world_size = sum(costs), len(assignment.ranks)
    if total == 0:
        return 1.0, 1.0, rank_cost
    slowest = [max(costs[r[s]] for r in assignment.ranks) for s in range(assignment.num_slots)]
    return (
        max(rank_cost) / (total / world_size),
        total / (world_size * sum(slowest)),
        rank_cost,
    )


@FAST
@given(step())
def test_count_is_the_ffd_count_rounded_up_and_no_microbatch_is_over_budget(case):
    lengths, budget, cost, world_size, weight = case
    plan = plan_microbatches(lengths, budget, world_size, cost=cost, attention_weight=weight)
    ffd = token_budget_microbatches(lengths, budget, cost=cost)
    assert plan.num_budget_microbatches == len(ffd)
    assert len(plan.assignment.microbatches) == -(-len(ffd) // world_size) * world_size
    members = [i for m in plan.assignment.microbatches for i in m.tolist()]
    assert sorted(members) == list(range(len(lengths)))
    for m in plan.assignment.microbatches:
        sizes = [lengths[i] for i in m.tolist()]
        assert (sum(sizes) if cost == "packed" else len(sizes) * max(sizes, default=0)) <= budget


@FAST
@given(step(), st.sampled_from([None, 0.0, 0.002]))
def test_figures_in_both_units_match_the_straightforward_count(case, compute_weight):
    lengths, budget, cost, world_size, weight = case
    plan = plan_microbatches(
        lengths,
        budget,
        world_size,
        cost=cost,
        attention_weight=weight,
        compute_weight=compute_weight,
    )
    counted_with = weight if compute_weight is None else compute_weight
    for figures, unit_weight in ((plan.tokens, 0.0), (plan.compute, counted_with)):
        imbalance, efficiency, rank_cost = straightforward_figures(
            lengths, plan.assignment, unit_weight, cost
        )
        assert figures.rank_imbalance == pytest.approx(imbalance, rel=1e-9)
        assert figures.lockstep_efficiency == pytest.approx(efficiency, rel=1e-9)
        np.testing.assert_allclose(figures.rank_cost, rank_cost, rtol=1e-12)


@FAST
@given(step())
def test_plan_is_at_least_as_even_as_balancing_the_ffd_bins(case):
    lengths, budget, cost, world_size, weight = case
    plan = plan_microbatches(lengths, budget, world_size, cost=cost, attention_weight=weight)
    ffd = token_budget_microbatches(lengths, budget, cost=cost)
    baseline = balance_ranks(lengths, ffd, world_size, attention_weight=weight, cost=cost)
    assert plan.compute.lockstep_efficiency >= baseline.lockstep_efficiency
    if plan.spread:  # a re-deal is kept only when it is strictly better
        assert plan.compute.lockstep_efficiency > baseline.lockstep_efficiency


def chapter_step(seed: int, n: int = 512, sigma: float = 0.85) -> np.ndarray:
    """The chapter's 14.2 workload: log-normal lengths, median 8,192, capped at 65,536."""
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(mean=np.log(8192), sigma=sigma, size=n))
    return np.clip(lengths, 1, 65_536).astype(np.int64)


def test_small_steps_balance_tokens_on_40_seeds_at_the_same_count():
    for seed in range(40):
        lengths = chapter_step(seed)
        plan = plan_microbatches(lengths, BUDGET, WORLD_SIZE)
        ffd_count = len(token_budget_microbatches(lengths, BUDGET))
        assert len(plan.assignment.microbatches) == -(-ffd_count // WORLD_SIZE) * WORLD_SIZE
        tokens = microbatch_cost(lengths, plan.assignment.microbatches)
        _, imbalance, efficiency = lockstep_figures(tokens, plan.assignment.ranks)
        assert imbalance <= 1.02, f"seed {seed}: rank imbalance {imbalance:.4f}"
        assert efficiency >= 0.98, f"seed {seed}: token lockstep {efficiency:.4f}"
        assert tokens.max() <= BUDGET


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chapter_step_reaches_098_compute_lockstep_with_the_model_weight(model):
    lengths = chapter_step(0)
    weight = model_attention_weight(model)
    plan = plan_microbatches(lengths, BUDGET, WORLD_SIZE, attention_weight=weight)
    costs = microbatch_cost(lengths, plan.assignment.microbatches, attention_weight=weight)
    _, _, efficiency = lockstep_figures(costs, plan.assignment.ranks)
    assert efficiency >= 0.98
    # Before attention-aware plans: token spreading to a multiple of 8, token balance.
    spread = token_budget_microbatches(lengths, BUDGET, multiple_of=WORLD_SIZE)
    today = balance_ranks(lengths, spread, WORLD_SIZE)
    _, _, today_efficiency = lockstep_figures(
        microbatch_cost(lengths, today.microbatches, attention_weight=weight), today.ranks
    )
    assert efficiency > today_efficiency
    assert len(plan.assignment.microbatches) == len(today.microbatches)
