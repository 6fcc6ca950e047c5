"""The step families: what each assembled step is (gauges of the newest, counters over all)
and what it costs in predicted GPU time.

The batching families are tables: each names its metric, its help text and the figure it
shows, so a figure is declared and set in one place (`StepFigures` says what each means).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlfeed.service.metrics.declare import Declare

if TYPE_CHECKING:
    from rlfeed.service.metrics.figures import StepFigures, StepPrice

PHASES: tuple[str, ...] = ("decode", "train", "logprob")

# The newest step, as gauges: (name, help, the figure).
NEWEST_STEP_GAUGES: tuple[tuple[str, str, Callable[[StepFigures], float]], ...] = (
    ("rlfeed_step", "Number of the newest assembled step.", lambda f: f.record.step),
    ("rlfeed_step_rollouts", "Rollouts in the newest step.", lambda f: f.record.num_rollouts),
    (
        "rlfeed_step_policy_tokens",
        "Policy tokens (action_mask 1) of the newest step, all ranks: the loss's N.",
        lambda f: f.record.policy_token_count,
    ),
    (
        "rlfeed_step_real_tokens",
        "Tokens of the newest step's rollouts, all ranks.",
        lambda f: f.record.real_tokens,
    ),
    (
        "rlfeed_step_computed_positions",
        "Token positions the newest step's packed microbatches compute, padding included.",
        lambda f: f.record.computed_positions,
    ),
    (
        "rlfeed_step_padded_positions",
        "Token positions the padded alternative would compute for the newest step "
        "(rollouts x longest rollout).",
        lambda f: f.record.padded_positions,
    ),
    (
        "rlfeed_step_padding_ratio",
        "Share of the newest step's computed positions that are padding.",
        lambda f: f.padding_ratio,
    ),
    (
        "rlfeed_step_padded_alternative_padding_ratio",
        "Padding share if every rollout were padded to the step's longest.",
        lambda f: f.padded_alternative_padding_ratio,
    ),
    (
        "rlfeed_step_fill_ratio",
        "Newest step's real tokens / (microbatches x token budget).",
        lambda f: f.fill_ratio,
    ),
    (
        "rlfeed_step_microbatches",
        "Microbatches of the newest step, all ranks.",
        lambda f: f.microbatches,
    ),
    (
        "rlfeed_step_microbatches_per_rank",
        "Microbatches each rank runs in the newest step.",
        lambda f: f.record.microbatches_per_rank,
    ),
    (
        "rlfeed_step_largest_microbatch_positions",
        "Token positions of the newest step's largest microbatch.",
        lambda f: f.record.largest_microbatch_positions,
    ),
    (
        "rlfeed_step_rank_imbalance",
        "Max rank tokens / mean rank tokens (1 = balanced; sched.balance.rank_imbalance, "
        "as rlfeed status and plan print it); positions when padded.",
        lambda f: f.record.rank_imbalance,
    ),
    (
        "rlfeed_step_lockstep_efficiency_ratio",
        "Share of rank-time spent working, counted in tokens: tokens / (ranks x sum of "
        "each lockstep slot's largest microbatch).",
        lambda f: f.record.lockstep_efficiency,
    ),
    (
        "rlfeed_step_compute_rank_imbalance",
        "Max rank compute / mean rank compute (1 = balanced); compute = tokens + "
        "attention_weight x sum(L^2), the trained model's predicted FLOPs by default.",
        lambda f: f.record.compute_rank_imbalance,
    ),
    (
        "rlfeed_step_compute_lockstep_efficiency_ratio",
        "Share of rank-time spent working, counted in predicted compute: what trainer "
        "time follows, and what predicted GPU-seconds are divided by.",
        lambda f: f.record.compute_lockstep_efficiency,
    ),
    (
        "rlfeed_step_token_budget",
        "Tokens each microbatch may hold ([batching] token_budget).",
        lambda f: f.token_budget,
    ),
)

# Every assembled step, added up: (name without `_total`, help, the step's amount).
STEP_COUNTERS: tuple[tuple[str, str, Callable[[StepFigures], float]], ...] = (
    ("rlfeed_steps_assembled", "Steps assembled from complete groups.", lambda f: 1),
    (
        "rlfeed_rollouts_trained",
        "Rollouts placed in assembled steps.",
        lambda f: f.record.num_rollouts,
    ),
    (
        "rlfeed_policy_tokens",
        "Policy tokens (action_mask 1) in assembled steps.",
        lambda f: f.record.policy_token_count,
    ),
    (
        "rlfeed_real_tokens",
        "Tokens of the rollouts in assembled steps.",
        lambda f: f.record.real_tokens,
    ),
    (
        "rlfeed_computed_positions",
        "Token positions the packed microbatches of assembled steps compute.",
        lambda f: f.record.computed_positions,
    ),
    (
        "rlfeed_padded_alternative_positions",
        "Token positions the padded alternative would compute for assembled steps.",
        lambda f: f.record.padded_positions,
    ),
    (
        "rlfeed_microbatches",
        "Microbatches in assembled steps, all ranks.",
        lambda f: f.microbatches,
    ),
    (
        "rlfeed_microbatch_budget_tokens",
        "Microbatches x token budget in assembled steps, in tokens (fill denominator).",
        lambda f: f.microbatches * f.token_budget,
    ),
)


class StepFamilies:
    """The batching families: `NEWEST_STEP_GAUGES`, then `STEP_COUNTERS`."""

    def __init__(self, declare: Declare) -> None:
        self._gauges = [(declare.gauge(n, doc), figure) for n, doc, figure in NEWEST_STEP_GAUGES]
        self._counters = [(declare.counter(n, doc), amount) for n, doc, amount in STEP_COUNTERS]

    def observe(self, figures: StepFigures) -> None:
        """Set the newest-step gauges and add the step to the counters."""
        for gauge, figure in self._gauges:
            gauge.set(figure(figures))
        for counter, amount in self._counters:
            counter.inc(amount(figures))


class CostFamilies:
    """Predicted GPU time, by phase, of the newest step and of all steps; what padding and
    lockstep waits cost, and what packing saved against padding."""

    def __init__(self, declare: Declare) -> None:
        self.step_gpu_seconds = declare.gauge(
            "rlfeed_step_predicted_gpu_seconds",
            "Predicted GPU-seconds of the newest step, by phase.",
            "phase",
            PHASES,
        )
        self.gpu_seconds = declare.counter(
            "rlfeed_predicted_gpu_seconds",
            "Predicted GPU-seconds of all assembled steps, by phase.",
            "phase",
            PHASES,
        )
        self.padding_gpu_seconds = declare.counter(
            "rlfeed_padding_gpu_seconds",
            "Predicted GPU-seconds the packed plans spend computing padding.",
        )
        self.lockstep_idle_gpu_seconds = declare.counter(
            "rlfeed_lockstep_idle_gpu_seconds",
            "Of the train and logprob phases, predicted GPU-seconds ranks wait for a lockstep "
            "slot's slowest microbatch: (train + logprob) x (1 - compute lockstep efficiency).",
        )
        self.avoided_gpu_seconds = declare.counter(
            "rlfeed_padding_avoided_gpu_seconds",
            "Predicted GPU-seconds the padded alternative would spend on padding beyond the plan.",
        )
        self.step_avoided_gpu_seconds = declare.gauge(
            "rlfeed_step_padding_avoided_gpu_seconds",
            "Predicted GPU-seconds of padding the newest step's plan avoids against the padded "
            "alternative.",
        )

    def observe(self, price: StepPrice) -> None:
        """The newest step's price, and the step's price added to the totals."""
        self.step_avoided_gpu_seconds.set(price.padding_avoided_gpu_seconds)
        self.padding_gpu_seconds.inc(price.padding_gpu_seconds)
        self.lockstep_idle_gpu_seconds.inc(price.lockstep_idle_gpu_seconds)
        self.avoided_gpu_seconds.inc(price.padding_avoided_gpu_seconds)
        for phase, seconds in price.gpu_seconds.items():
            self.step_gpu_seconds.labels(phase=phase).set(seconds)
            self.gpu_seconds.labels(phase=phase).inc(seconds)
