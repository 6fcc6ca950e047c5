"""One planning function for everything that cuts sequences into rank-balanced microbatches.

`rlfeed plan` (users choosing a budget from their length logs) and step assembly (the
service) call this same function, so the figures a user sees are the ones the service
gets.

Memory is bounded by tokens, time by compute: microbatches are cut to the token budget,
and ranks and lockstep slots are balanced on the cost L + attention_weight x L^2 (with the
weight from the model being trained, `rlfeed.sched.compute`, that cost is proportional to
its FLOPs). The count is always the FFD count rounded up to a multiple of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from numpy.typing import ArrayLike
from rlfeed.sched.balance import BalanceFigures, RankAssignment, balance_figures, balance_ranks
from rlfeed.sched.budgets import CostModel, token_budget_microbatches
from rlfeed.sched.packing import PackingMethod, as_lengths
from rlfeed.sched.spreading import spread_by_cost

SPREAD_MAX_SEQUENCES = 50_000
"""Above this many sequences the default skips spreading: its heap steps per sequence would
dominate planning time, and with that many sequences per step the FFD bins, sorted by cost
into lockstep slots, already balance within ~0.1%."""


@dataclass(frozen=True)
class MicrobatchPlan:
    """Budgeted microbatches dealt out to ranks, and how even they are in both units."""

    assignment: RankAssignment
    num_budget_microbatches: int
    """Microbatches the budget needed (FFD count) before rounding up to the world size."""
    spread: bool
    """Whether sequences were re-dealt over the count (`spread_by_cost`) instead of kept in
    FFD bins."""
    attention_weight: float
    """The weight the ranks were balanced with; `assignment`'s figures are in this cost."""
    tokens: BalanceFigures
    """Cost per rank, rank imbalance and lockstep efficiency in tokens (positions when
    padded)."""
    compute: BalanceFigures
    """The same in predicted compute: tokens + compute_weight x sum(L^2)."""


def plan_microbatches(
    lengths: ArrayLike,
    token_budget: int,
    world_size: int,
    *,
    cost: CostModel = "packed",
    method: PackingMethod = "ffd",
    attention_weight: float = 0.0,
    compute_weight: float | None = None,
    spread: bool | None = None,
) -> MicrobatchPlan:
    """Token-budget microbatches of `lengths`, the same number for each of `world_size` ranks.

    The FFD bins are balanced over the ranks by cost (`balance_ranks`). With `spread`
    (default: on for the packed cost model up to SPREAD_MAX_SEQUENCES sequences), the
    sequences are also re-dealt over the same count, the FFD count rounded up to a multiple
    of world_size, by `spread_by_cost`, whether or not the FFD count already was one; the
    re-deal is kept when every microbatch fits the budget and its lockstep efficiency is
    higher. On the chapter's 512-sequence step this takes compute lockstep from 0.95 to
    0.995 for Qwen3-0.6B's weight; at attention_weight 0 it evens out tokens instead.

    compute_weight (default: attention_weight) is the weight the `compute` figures are
    counted with: the trained model's (`rlfeed.sched.compute.model_attention_weight`) shows
    what a plan balanced with any other weight costs in GPU time.
    """
    sizes = as_lengths(lengths)
    if spread is None:
        spread = cost == "packed" and sizes.size <= SPREAD_MAX_SEQUENCES
    spread = spread and cost == "packed"
    budget_microbatches = token_budget_microbatches(sizes, token_budget, cost=cost, method=method)
    assignment = balance_ranks(
        sizes, budget_microbatches, world_size, attention_weight=attention_weight, cost=cost
    )
    spread_used = False
    if spread:
        count = -(-len(budget_microbatches) // int(world_size)) * int(world_size)
        dealt = spread_by_cost(
            sizes, count, token_budget, world_size, attention_weight=attention_weight
        )
        if dealt is not None and dealt.lockstep_efficiency > assignment.lockstep_efficiency:
            assignment, spread_used = dealt, True
    balanced = BalanceFigures(
        rank_cost=assignment.rank_cost,
        rank_imbalance=float(assignment.rank_imbalance),
        lockstep_efficiency=float(assignment.lockstep_efficiency),
    )

    def figures(weight: float) -> BalanceFigures:
        if weight == attention_weight:
            return balanced
        return balance_figures(sizes, assignment, attention_weight=weight, cost=cost)

    compute = figures(attention_weight if compute_weight is None else compute_weight)
    tokens = figures(0.0)
    return MicrobatchPlan(
        assignment=assignment,
        num_budget_microbatches=len(budget_microbatches),
        spread=spread_used,
        attention_weight=float(attention_weight),
        tokens=tokens,
        compute=compute,
    )
