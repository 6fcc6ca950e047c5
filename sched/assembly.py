"""Step assembly: from a step's completed groups to what every trainer rank runs.

This is the single place the service calls to turn rollouts into a training step. It is a
pure, deterministic function of its inputs (the rollouts' metadata in arrival order and the
config), so a journal that replays the inputs reproduces every step byte for byte. Bulk
token data is touched only by `materialize_microbatch`, with vectorized gathers over flat
columns; nothing loops per token in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from rlfeed.sched.advantages import AdvantageMode, group_advantages, zero_advantage_groups
from rlfeed.sched.budgets import CostModel, microbatch_positions
from rlfeed.sched.layout import next_token_targets, row_layout
from rlfeed.sched.planning import plan_microbatches


@dataclass(kw_only=True, frozen=True)
class StepConfig:
    """How a step is cut into microbatches and ranks."""

    token_budget: int = 65536
    """Tokens per microbatch: sum of lengths (packed) or count x longest (padded)."""
    world_size: int = 1
    """Data-parallel ranks; every rank gets the same number of microbatches."""
    cost_model: CostModel = "packed"
    """'packed' for varlen/block-mask attention, 'padded' for rows padded to the longest."""
    packing_method: Literal["ffd", "bfd"] = "ffd"
    """Bin-packing heuristic for the packed cost model."""
    attention_weight: float = 0.0
    """Rank-balancing cost = tokens + attention_weight * sum(L^2): predicted compute. The
    service sets it from the trained model (`rlfeed.sched.compute.model_attention_weight`);
    0 balances tokens."""
    compute_weight: float | None = None
    """Weight of sum(L^2) in the step's compute figures (the trained model's, so they are
    predicted FLOPs whatever the plan was balanced with); None = attention_weight."""
    advantage_mode: AdvantageMode = "mean_std"
    """'mean' baseline, 'mean_std' (GRPO) or 'constant' (Dr. GRPO, divide by advantage_scale)."""
    advantage_scale: float = 1.0
    """Divisor of the advantage in 'constant' mode."""
    drop_zero_advantage: bool = False
    """Leave groups whose rewards are all equal out of the step (they carry no gradient)."""

    def __post_init__(self) -> None:
        for name in ("token_budget", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"StepConfig.{name} must be an integer >= 1, got {value!r}")
        choices = {
            "cost_model": ("packed", "padded"),
            "packing_method": ("ffd", "bfd"),
            "advantage_mode": ("mean", "mean_std", "constant"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"StepConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if not self.attention_weight >= 0:
            raise ValueError(
                f"StepConfig.attention_weight must be >= 0, got {self.attention_weight}"
            )
        if self.compute_weight is not None and not self.compute_weight >= 0:
            raise ValueError(f"StepConfig.compute_weight must be >= 0, got {self.compute_weight}")
        if not self.advantage_scale > 0:
            raise ValueError(f"StepConfig.advantage_scale must be > 0, got {self.advantage_scale}")


@dataclass(frozen=True)
class StepRollouts:
    """Per-rollout metadata of a step's candidate rollouts, n rows, in arrival order."""

    lengths: np.ndarray
    """int64 [n] tokens per rollout."""
    policy_tokens: np.ndarray
    """int64 [n] action-mask (policy) tokens per rollout; a rollout's first token is never one
    (nothing predicts it), so this is also the count of its served loss-mask entries."""
    rewards: np.ndarray
    """float64 [n]."""
    group_ids: np.ndarray
    """int64 [n]; equal ids = same group."""

    def __post_init__(self) -> None:
        n = len(self.lengths)
        for name in ("policy_tokens", "rewards", "group_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"StepRollouts.{name} has {len(getattr(self, name))} rows, not {n}"
                )


@dataclass(frozen=True)
class StepPlan:
    """What every rank runs in one step, plus the figures the metrics report."""

    advantages: np.ndarray
    """float32 [n] per rollout; 0 for dropped rollouts."""
    zero_advantage: np.ndarray
    """bool [n]: the rollout's group has all-equal rewards."""
    kept: np.ndarray
    """int64 [k] indices of the rollouts in the step."""
    microbatches: list[np.ndarray]
    """Each an int64 array of indices into the n input rollouts; empty = no-op microbatch."""
    ranks: list[list[int]]
    """ranks[r]: microbatch indices rank r runs, in order; all ranks have the same count."""
    policy_token_count: int
    """Global N: action-mask tokens over all kept rollouts, ranks and microbatches."""
    num_groups: int
    zero_advantage_groups: int
    real_tokens: int
    computed_positions: int
    """Positions the plan computes (= real tokens for packed varlen rows)."""
    padded_positions: int
    """The padded alternative: every kept rollout padded to the step's longest."""
    largest_microbatch_positions: int
    rank_imbalance: float
    """Max / mean rank tokens (computed positions when padded); 1.0 = even."""
    lockstep_efficiency: float
    """Share of rank-time at work, slot by slot, counted in tokens (positions when padded)."""
    compute_rank_imbalance: float
    """As rank_imbalance, counted in predicted compute (tokens + compute_weight x L^2)."""
    compute_lockstep_efficiency: float
    """As lockstep_efficiency, counted in predicted compute; what GPU time follows."""

    @property
    def microbatches_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def padding_share(self) -> float:
        return share(self.computed_positions - self.real_tokens, self.computed_positions)

    def policy_version_range(self, policy_versions: np.ndarray) -> tuple[int, int]:
        """(newest, oldest) policy version of the step's kept rollouts, of all its rollouts
        when every one was dropped, (0, 0) for none; `policy_versions`: int64 per step
        rollout, in the order the plan indexes."""
        versions = policy_versions[self.kept] if self.kept.size else policy_versions
        return (int(versions.max()), int(versions.min())) if versions.size else (0, 0)

    @property
    def padded_alternative_padding_share(self) -> float:
        return share(self.padded_positions - self.real_tokens, self.padded_positions)


def share(part: float, whole: float) -> float:
    """part / whole, 0 when whole is 0."""
    return float(part) / float(whole) if whole else 0.0


def assemble_step(rollouts: StepRollouts, config: StepConfig) -> StepPlan:
    """Advantages, global token count and rank-balanced microbatches for one step."""
    lengths = np.asarray(rollouts.lengths, dtype=np.int64)
    policy_tokens = np.asarray(rollouts.policy_tokens, dtype=np.int64)
    group_ids = np.asarray(rollouts.group_ids, dtype=np.int64)
    rewards = np.asarray(rollouts.rewards, dtype=np.float64)

    zero_advantage = zero_advantage_groups(rewards, group_ids)
    advantages = group_advantages(
        rewards, group_ids, mode=config.advantage_mode, scale=config.advantage_scale
    ).astype(np.float32)
    keep = ~zero_advantage if config.drop_zero_advantage else np.ones(lengths.size, dtype=bool)
    kept = np.flatnonzero(keep)
    advantages = np.where(keep, advantages, np.float32(0.0)).astype(np.float32)

    plan = plan_microbatches(
        lengths[kept],
        config.token_budget,
        config.world_size,
        cost=config.cost_model,
        method=config.packing_method,
        attention_weight=config.attention_weight,
        compute_weight=config.compute_weight,
    )
    assignment = plan.assignment
    # Microbatches index into the kept subset; re-express them over the input rollouts.
    microbatches = [kept[m] for m in assignment.microbatches]
    positions = microbatch_positions(lengths[kept], assignment.microbatches, config.cost_model)

    unique_groups, group_index = np.unique(group_ids, return_inverse=True)
    zero_groups = np.zeros(unique_groups.size, dtype=bool)
    zero_groups[group_index] = zero_advantage
    kept_lengths = lengths[kept]
    return StepPlan(
        advantages=advantages,
        zero_advantage=zero_advantage,
        kept=kept,
        microbatches=microbatches,
        ranks=assignment.ranks,
        policy_token_count=int(policy_tokens[kept].sum()),
        num_groups=int(unique_groups.size),
        zero_advantage_groups=int(zero_groups.sum()),
        real_tokens=int(kept_lengths.sum()),
        computed_positions=int(positions.sum()),
        padded_positions=int(kept_lengths.size * kept_lengths.max()) if kept.size else 0,
        largest_microbatch_positions=int(positions.max()) if positions.size else 0,
        rank_imbalance=plan.tokens.rank_imbalance,
        lockstep_efficiency=plan.tokens.lockstep_efficiency,
        compute_rank_imbalance=plan.compute.rank_imbalance,
        compute_lockstep_efficiency=plan.compute.lockstep_efficiency,
    )


# int32 token id + uint8 action mask + float32 sampler log-prob, per token
TOKEN_BYTES = 9


@dataclass(frozen=True)
class TokenColumns:
    """Flat per-token arrays of many rollouts: what an Arrow list<> column holds
    (`TOKEN_BYTES` per token)."""

    offsets: np.ndarray
    """int64 [n+1]; rollout i owns [offsets[i], offsets[i+1])."""
    token_ids: np.ndarray
    """int32 [total]."""
    action_mask: np.ndarray
    """uint8 [total]; 1 on policy (sampled) tokens."""
    sampler_logprobs: np.ndarray
    """float32 [total]; sampler log-prob of token t given its prefix, 0 where mask is 0."""

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class Microbatch:
    """One packed row of T tokens in the next-token layout aligned with the inputs."""

    input_ids: np.ndarray
    """int32 [T]."""
    position_ids: np.ndarray
    """int32 [T], restarting at 0 per sequence."""
    cu_seqlens: np.ndarray
    """int32 [n+1]."""
    max_seqlen: int
    target_ids: np.ndarray
    """int32 [T]: token t+1 of the same sequence; 0 at each sequence's last position."""
    loss_mask: np.ndarray
    """uint8 [T]: action mask of the target token; 0 at sequence ends."""
    sampler_logprobs: np.ndarray
    """float32 [T]: the sampler's log-prob of the target token."""
    advantages: np.ndarray
    """float32 [T]: the sequence's advantage where loss_mask is 1, else 0."""
    rollout_index: np.ndarray
    """int64 [n]: which input rollout each sequence is."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)


def gather_token_ranges(offsets: np.ndarray, rollout_index: np.ndarray) -> np.ndarray:
    """Flat token positions of the given rollouts, back to back, without a per-token loop."""
    starts = offsets[rollout_index]
    lengths = offsets[rollout_index + 1] - starts
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    row_starts = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + row_starts


def materialize_microbatch(
    columns: TokenColumns, rollout_index: np.ndarray, advantages: np.ndarray
) -> Microbatch:
    """Gather one microbatch's tokens from flat columns into a packed, shifted row.

    advantages: float32 [n_rollouts] per rollout (indexed by `rollout_index`).
    """
    rollout_index = np.asarray(rollout_index, dtype=np.int64)
    # Served loss masks drop each rollout's first token; a policy token there would make the
    # step's global count N disagree with what the trainer sums.
    first_is_policy = columns.action_mask[columns.offsets[rollout_index]] > 0
    if np.any(first_is_policy):
        bad = int(rollout_index[np.argmax(first_is_policy)])
        raise ValueError(
            f"rollout {bad}: action_mask[0] is 1, but nothing predicts a rollout's first token"
        )
    positions = gather_token_ranges(np.asarray(columns.offsets, dtype=np.int64), rollout_index)
    lengths = columns.lengths[rollout_index]
    layout = row_layout(lengths)
    input_ids = columns.token_ids[positions].astype(np.int32, copy=False)
    loss_mask = next_token_targets(columns.action_mask[positions].astype(np.uint8), layout)
    per_token_advantage = np.repeat(np.asarray(advantages, np.float32)[rollout_index], lengths)
    return Microbatch(
        input_ids=input_ids,
        position_ids=layout.position_ids.astype(np.int32),
        cu_seqlens=layout.cu_seqlens,
        max_seqlen=layout.max_seqlen,
        target_ids=next_token_targets(input_ids, layout),
        loss_mask=loss_mask,
        sampler_logprobs=next_token_targets(
            columns.sampler_logprobs[positions].astype(np.float32), layout, fill=0.0
        ),
        advantages=np.where(loss_mask > 0, per_token_advantage, np.float32(0.0)).astype(np.float32),
        rollout_index=rollout_index,
    )
