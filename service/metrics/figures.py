"""The figures the metrics publish for one step, and their price in GPU time.

`StepFigures` wraps the scheduler's `StepRecord` with the run's shape and derives the shares
(padding, fill, zero-advantage); `price_step` prices it with the scheduling core's roofline
(`sched.throughput.step_cost_from_tokens`) under the run's `[accounting]` assumptions, the
train and log-prob passes divided by the step's compute lockstep efficiency.
Pure arithmetic: no Prometheus, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfeed.sched.assembly import share

if TYPE_CHECKING:
    from rlfeed.service.config import AccountingConfig
    from rlfeed.service.scheduler.records import StepRecord

SECONDS_PER_HOUR = 3600.0


@dataclass(kw_only=True, frozen=True)
class StepFigures:
    """One assembled step's record with what the shares need: the run's world size and
    token budget, and (when the producer says) the tokens generated for it."""

    record: StepRecord  # rank figures in tokens, and compute_* in predicted compute
    world_size: int
    token_budget: int
    generated_policy_tokens: int | None = None  # decode-priced tokens; None = policy tokens
    generated_tokens: int | None = None  # total tokens of those rollouts; None = real tokens

    @property
    def microbatches(self) -> int:
        return self.record.microbatches_per_rank * self.world_size

    @property
    def padding_ratio(self) -> float:
        r = self.record
        return share(r.computed_positions - r.real_tokens, r.computed_positions)

    @property
    def padded_alternative_padding_ratio(self) -> float:
        r = self.record
        return share(r.padded_positions - r.real_tokens, r.padded_positions)

    @property
    def fill_ratio(self) -> float:
        """real tokens / (world_size x microbatches_per_rank x token_budget): the share of
        the step's microbatch slots, no-op microbatches included, holding real tokens."""
        return share(self.record.real_tokens, self.microbatches * self.token_budget)

    @property
    def groups_considered(self) -> int:
        """Groups of the step plus those drop_zero_advantage discarded while it filled."""
        return self.record.num_groups + self.record.zero_advantage_groups_dropped

    @property
    def zero_advantage_groups_considered(self) -> int:
        return self.record.zero_advantage_groups + self.record.zero_advantage_groups_dropped


@dataclass(frozen=True)
class StepPrice:
    """Predicted GPU-seconds of one step by phase, and those of padding."""

    gpu_seconds: dict[str, float]  # phase -> GPU-seconds (decode, train, logprob)
    padding_gpu_seconds: float  # training + log-prob passes over the plan's padding
    padding_avoided_gpu_seconds: float  # the same over padded alternative - computed
    # Of train + logprob, the GPU-seconds ranks idle waiting for a lockstep slot's slowest
    # microbatch: (train + logprob) x (1 - compute lockstep efficiency).
    lockstep_idle_gpu_seconds: float = 0.0

    @property
    def total_gpu_seconds(self) -> float:
        return sum(self.gpu_seconds.values())


def price_step(figures: StepFigures, accounting: AccountingConfig) -> StepPrice:
    """Price a step with the scheduling core's accounting (see the module docstring)."""
    record = figures.record
    return price_tokens(
        accounting,
        policy_tokens=record.policy_token_count,
        real_tokens=record.real_tokens,
        computed_positions=record.computed_positions,
        padded_positions=record.padded_positions,
        generated_policy_tokens=figures.generated_policy_tokens,
        generated_tokens=figures.generated_tokens,
        lockstep_efficiency=record.compute_lockstep_efficiency,
    )


def price_tokens(
    accounting: AccountingConfig,
    *,
    policy_tokens: int,
    real_tokens: int,
    computed_positions: int,
    padded_positions: int,
    generated_policy_tokens: int | None = None,
    generated_tokens: int | None = None,
    lockstep_efficiency: float = 1.0,
) -> StepPrice:
    """The price of one step from its token counts alone (what `price_step` and the demo's
    summary use): decode on the policy tokens generated (`generated_policy_tokens`, default
    `policy_tokens`), training and log-prob passes on `computed_positions`, padding avoided
    against `padded_positions` (the padded alternative's padding GPU time minus the
    plan's). Ranks are paid for while they wait for a lockstep slot's slowest microbatch, so
    training and log-prob passes are divided by `lockstep_efficiency` (the step's compute
    lockstep efficiency, in (0, 1]). In GPU-seconds; stale rollouts are not priced."""
    if not 0.0 < lockstep_efficiency <= 1.0:
        raise ValueError(f"lockstep_efficiency must be in (0, 1], got {lockstep_efficiency}")
    from rlfeed.sched.models import GPUS, MODELS
    from rlfeed.sched.throughput import step_cost_from_tokens

    def priced(policy: int, total: int, computed: int | None = None):
        return step_cost_from_tokens(
            MODELS[accounting.model],
            GPUS[accounting.gpu],
            policy_tokens=policy,
            total_tokens=total,
            computed_positions=computed,
            decode_batch=accounting.decode_batch,
            decode_context=accounting.decode_context,
            busy_fraction=accounting.busy_fraction,
            mfu=accounting.mfu,
            logprob_forward_passes=accounting.logprob_forward_passes,
        )

    trained = priced(policy_tokens, real_tokens, computed_positions)
    decode_hours = trained.decode_gpu_hours
    if generated_policy_tokens is not None:
        total = max(generated_tokens or real_tokens, generated_policy_tokens)
        decode_hours = priced(generated_policy_tokens, total).decode_gpu_hours
    padded = priced(policy_tokens, real_tokens, max(padded_positions, computed_positions))
    hours = {
        "decode": decode_hours,
        "train": trained.train_gpu_hours / lockstep_efficiency,
        "logprob": trained.logprob_gpu_hours / lockstep_efficiency,
    }
    busy_hours = trained.train_gpu_hours + trained.logprob_gpu_hours
    return StepPrice(
        gpu_seconds={phase: h * SECONDS_PER_HOUR for phase, h in hours.items()},
        lockstep_idle_gpu_seconds=(hours["train"] + hours["logprob"] - busy_hours)
        * SECONDS_PER_HOUR,
        padding_gpu_seconds=trained.padding_gpu_hours * SECONDS_PER_HOUR,
        padding_avoided_gpu_seconds=(padded.padding_gpu_hours - trained.padding_gpu_hours)
        * SECONDS_PER_HOUR,
    )
