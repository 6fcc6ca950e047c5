"""The figures the metrics publish for one step, and their price in GPU time.

`StepFigures` reads a step's statistics from the service's records and derives the shares
(padding, fill, zero-advantage); `price_step` prices them with the scheduling core's
roofline accounting (`rlfeed.sched.throughput.step_cost_from_tokens`) under
`CostAssumptions`. Pure arithmetic: no Prometheus, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SECONDS_PER_HOUR = 3600.0


@dataclass(kw_only=True, frozen=True)
class CostAssumptions:
    """How steps are priced (arguments of `sched.throughput.step_cost_from_tokens`)."""

    model: str = "qwen3-8b"  # preset of sched.models.MODELS; default "qwen3-8b"
    gpu: str = "h200"  # preset of sched.models.GPUS; default "h200"
    mfu: float = 0.4  # model-FLOPs utilisation of training and log-prob passes; 0.4
    decode_batch: int = 64  # sequences one inference GPU decodes at once; default 64
    decode_context: int = 16_384  # context (tokens) while decoding, for KV reads; 16,384
    busy_fraction: float = 0.5  # share of wall time decode GPUs generate; default 0.5
    logprob_forward_passes: int = 2  # extra forward passes per trained position; default 2

    def __post_init__(self) -> None:
        from rlfeed.sched.models import GPUS, MODELS

        if self.model not in MODELS:
            raise ValueError(f"CostAssumptions.model: {self.model!r} not in {sorted(MODELS)}")
        if self.gpu not in GPUS:
            raise ValueError(f"CostAssumptions.gpu: {self.gpu!r} not in {sorted(GPUS)}")


@dataclass(kw_only=True, frozen=True)
class StepFigures:
    """The figures of one assembled step the metrics need, with the derived shares.

    `from_record` reads them from anything with the fields of `service.scheduler.StepRecord`
    (or the proto's `StepStats`, which has the same names)."""

    step: int
    num_rollouts: int  # rollouts in the step, all ranks
    num_groups: int  # groups in the step
    zero_advantage_groups: int  # of those, groups whose rewards are all equal
    zero_advantage_groups_dropped: int = 0  # discarded by drop_zero_advantage while filling
    policy_token_count: int  # global policy-token count N
    real_tokens: int  # tokens of the step's sequences
    computed_positions: int  # positions the ranks compute
    padded_positions: int  # positions of the padded alternative (count x longest)
    largest_microbatch_positions: int
    rank_imbalance: float  # max rank tokens / mean rank tokens (1.0 = balanced), as recorded
    # tokens / (world_size x sum over lockstep slots of the slot's largest microbatch tokens)
    lockstep_efficiency: float
    # The same two in predicted compute (tokens + attention_weight x sum(L^2)), what trainer
    # time follows; GPU-hours are priced with compute_lockstep_efficiency.
    compute_rank_imbalance: float
    compute_lockstep_efficiency: float
    microbatches_per_rank: int
    world_size: int
    token_budget: int
    generated_policy_tokens: int | None = None  # decode-priced tokens; None = policy tokens
    generated_tokens: int | None = None  # total tokens of those rollouts; None = real tokens

    @classmethod
    def from_record(cls, record: Any, *, world_size: int, token_budget: int, **extra: Any):
        names = set(cls.__dataclass_fields__) - {"world_size", "token_budget", *extra}
        values = {n: getattr(record, n) for n in names if hasattr(record, n)}
        return cls(**values, world_size=world_size, token_budget=token_budget, **extra)

    @property
    def microbatches(self) -> int:
        return self.microbatches_per_rank * self.world_size

    @property
    def padding_ratio(self) -> float:
        return share(self.computed_positions - self.real_tokens, self.computed_positions)

    @property
    def padded_alternative_padding_ratio(self) -> float:
        return share(self.padded_positions - self.real_tokens, self.padded_positions)

    @property
    def rank_imbalance_excess(self) -> float:
        """max rank cost / mean rank cost - 1: 0 when balanced (the exported figure)."""
        return self.rank_imbalance - 1.0

    @property
    def compute_rank_imbalance_excess(self) -> float:
        """The same in predicted compute."""
        return self.compute_rank_imbalance - 1.0

    @property
    def fill_ratio(self) -> float:
        return share(self.real_tokens, self.microbatches * self.token_budget)

    @property
    def groups_considered(self) -> int:
        return self.num_groups + self.zero_advantage_groups_dropped

    @property
    def zero_advantage_groups_considered(self) -> int:
        return self.zero_advantage_groups + self.zero_advantage_groups_dropped


def share(part: float, whole: float) -> float:
    """part / whole, 0 when whole is 0."""
    return float(part) / float(whole) if whole else 0.0


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


def price_step(figures: StepFigures, cost: CostAssumptions) -> StepPrice:
    """Price a step with the scheduling core's accounting (see the module docstring)."""
    return price_tokens(
        cost,
        policy_tokens=figures.policy_token_count,
        real_tokens=figures.real_tokens,
        computed_positions=figures.computed_positions,
        padded_positions=figures.padded_positions,
        generated_policy_tokens=figures.generated_policy_tokens,
        generated_tokens=figures.generated_tokens,
        lockstep_efficiency=figures.compute_lockstep_efficiency,
    )


def price_tokens(
    cost: CostAssumptions,
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
    against `padded_positions`. Every rank is paid for while it waits for a lockstep slot's
    slowest microbatch, so the training and log-prob passes are divided by
    `lockstep_efficiency` (the step's compute lockstep efficiency, in (0, 1])."""
    if not 0.0 < lockstep_efficiency <= 1.0:
        raise ValueError(f"lockstep_efficiency must be in (0, 1], got {lockstep_efficiency}")
    from rlfeed.sched.models import GPUS, MODELS
    from rlfeed.sched.throughput import step_cost_from_tokens

    def priced(policy: int, total: int, computed: int | None = None):
        return step_cost_from_tokens(
            MODELS[cost.model],
            GPUS[cost.gpu],
            policy_tokens=policy,
            total_tokens=total,
            computed_positions=computed,
            decode_batch=cost.decode_batch,
            decode_context=cost.decode_context,
            busy_fraction=cost.busy_fraction,
            mfu=cost.mfu,
            logprob_forward_passes=cost.logprob_forward_passes,
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
