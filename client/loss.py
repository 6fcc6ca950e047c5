"""Loss aggregation that survives gradient accumulation, and the clipped policy loss.

Chapter 14.4: a batch split into microbatches (and data-parallel ranks) must produce the
gradient of the whole batch's loss. `token_mean` computed per microbatch does not: a
token's weight becomes 1 / (K * n_k) instead of 1 / N, so tokens in small microbatches
count more, and a length-sorted or token-budget scheduler makes n_k vary most. The fix is
`mode="constant"` with the step's global policy-token count: every rlfeed microbatch carries
`policy_token_count` (N, over the whole step and all ranks) for exactly this.

How N and the data-parallel world size combine. Each rank sums (never averages) the
backward passes of its microbatches; then DDP/FSDP all-reduce the gradient with a *mean*
over `world_size` ranks. For the result to be grad(sum over all tokens / N), each rank must
divide its token sums by N / world_size: `rank_norm_const(N, world_size)`. With a sum
all-reduce, divide by N. Do not also divide the loss by the number of microbatches.

Sequence membership for the `seq_mean_*` modes, by input layout:

* `[R, L]` padded rows, no ids: each row is one sequence.
* packed rows `[..., L]` (or one `[T]` stream) with `segment_ids` of the same shape: a
  sequence is a (row, segment id) pair; segment id -1 marks padding, which the mask must
  not select.
* one packed `[T]` row with `cu_seqlens` [n + 1]: sequences are the `cu_seqlens` spans;
  tokens past `cu_seqlens[-1]` are padding.

Sequences with no selected token are not counted. `norm_const`, when given to a
`seq_mean_*` mode, replaces the local count of sequences (pass the step's global sequence
count to make sequence means exact under accumulation too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from rlfeed.client.attention import segment_ids_from_cu_seqlens

__all__ = [
    "LOSS_MODES",
    "LossMode",
    "PolicyLossStats",
    "aggregate_loss",
    "policy_loss",
    "rank_norm_const",
]

LossMode = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
LOSS_MODES: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "constant",
)


def rank_norm_const(
    policy_token_count: float, world_size: int = 1, *, grad_reduction: str = "mean"
) -> float:
    """Per-rank `norm_const` for `mode="constant"` given the step's global token count N.

    grad_reduction: "mean" for DDP/FSDP's averaging all-reduce (returns N / world_size),
    "sum" for a summing reduction (returns N). A step with no policy token (N = 0) selects
    no token, so its loss is exactly 0 whatever the divisor: it is normalized by 1.
    """
    if not policy_token_count >= 0:
        raise ValueError(f"policy_token_count must be >= 0, got {policy_token_count}")
    policy_token_count = max(float(policy_token_count), 1.0)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if grad_reduction == "mean":
        return float(policy_token_count) / world_size
    if grad_reduction == "sum":
        return float(policy_token_count)
    raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")


def _check_norm_const(norm_const: Any, mode: str) -> None:
    if norm_const is None:
        raise ValueError(
            f"mode={mode!r} needs norm_const (for accumulation: rank_norm_const(N, world_size))"
        )
    if not bool(torch.as_tensor(norm_const) > 0):
        raise ValueError(f"norm_const must be > 0, got {norm_const}")


def _sequence_index(
    shape: torch.Size,
    device: torch.device,
    segment_ids: Any | None,
    cu_seqlens: Any | None,
) -> torch.Tensor:
    """Flat [numel] int64 sequence index per token (-1 for padding)."""
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("pass segment_ids or cu_seqlens, not both")
    if cu_seqlens is not None:
        if len(shape) != 1:
            raise ValueError(f"cu_seqlens describes one [T] row; per_token_loss is {tuple(shape)}")
        segment_ids = segment_ids_from_cu_seqlens(cu_seqlens, shape[0])
    if segment_ids is None:
        if len(shape) < 2:
            return torch.zeros(shape.numel(), dtype=torch.int64, device=device)
        # Each row (all leading dims flattened) is one sequence.
        rows = shape.numel() // shape[-1]
        return torch.arange(rows, device=device).repeat_interleave(shape[-1])
    segment = torch.as_tensor(segment_ids, device=device)
    if tuple(segment.shape) != tuple(shape):
        raise ValueError(
            f"segment_ids shape {tuple(segment.shape)} must equal per_token_loss shape "
            f"{tuple(shape)}"
        )
    segment = segment.to(torch.int64).reshape(-1, shape[-1] if len(shape) else 1)
    per_row = int(segment.max()) + 1 if segment.numel() else 1
    row = torch.arange(segment.shape[0], device=device)[:, None]
    index = torch.where(segment >= 0, row * per_row + segment, -1)
    return index.reshape(-1)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossMode,
    norm_const: float | torch.Tensor | None = None,
    *,
    segment_ids: Any | None = None,
    cu_seqlens: Any | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the tokens `mask` selects.

    per_token_loss: any shape ([T], [R, L], ...); mask: same shape, bool or float weights
    (policy tokens). Values at unselected positions are ignored even if not finite.
    Modes (m = mask, l = per-token loss):

    * token_mean: sum(m * l) / sum(m)  (0 when nothing is selected). Local: not exact under
      accumulation.
    * constant: sum(m * l) / norm_const. Exact under accumulation with the global count.
    * seq_mean_token_sum: mean over sequences of sum_t(m * l)  (Dr. GRPO-like per sequence).
    * seq_mean_token_mean: mean over sequences of sum_t(m * l) / sum_t(m).

    See the module docstring for sequence membership (`segment_ids`, `cu_seqlens`) and for
    `norm_const` in the sequence modes.
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"unknown loss mode {mode!r}; expected one of {LOSS_MODES}")
    mask = torch.as_tensor(mask, device=per_token_loss.device)
    if tuple(mask.shape) != tuple(per_token_loss.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal per_token_loss shape "
            f"{tuple(per_token_loss.shape)}"
        )
    weight = mask.to(per_token_loss.dtype)
    selected = mask != 0
    weighted = torch.where(selected, per_token_loss * weight, 0.0)
    if mode == "token_mean":
        count = weight.sum()
        return weighted.sum() / torch.where(count > 0, count, torch.ones_like(count))
    if mode == "constant":
        _check_norm_const(norm_const, mode)
        return weighted.sum() / norm_const

    index = _sequence_index(per_token_loss.shape, per_token_loss.device, segment_ids, cu_seqlens)
    flat_selected = selected.reshape(-1)
    if bool((flat_selected & (index < 0)).any()):
        position = int(torch.nonzero(flat_selected & (index < 0))[0])
        raise ValueError(f"mask selects padding (segment id -1) at flat position {position}")
    slots = int(index.max()) + 1 if index.numel() else 0
    safe_index = index.clamp_min(0)
    token_sum = weighted.new_zeros(slots).index_add(0, safe_index, weighted.reshape(-1))
    token_count = weight.new_zeros(slots).index_add(
        0, safe_index, torch.where(flat_selected, weight.reshape(-1), 0.0)
    )
    has_tokens = token_count > 0
    if mode == "seq_mean_token_mean":
        token_sum = token_sum / torch.where(has_tokens, token_count, torch.ones_like(token_count))
    total = torch.where(has_tokens, token_sum, 0.0).sum()
    if norm_const is not None:
        _check_norm_const(norm_const, mode)
        return total / norm_const
    sequences = has_tokens.sum()
    return total / torch.where(sequences > 0, sequences, torch.ones_like(sequences))


@dataclass(kw_only=True, frozen=True)
class PolicyLossStats:
    """Detached 0-d tensors over the policy tokens of one call (local, for logging)."""

    clip_fraction: torch.Tensor  # share of tokens whose clipped term is active (zero gradient)
    ratio_mean: torch.Tensor  # mean of exp(logprobs - sampler_logprobs)
    approx_kl: (
        torch.Tensor
    )  # mean of (ratio - 1) - log ratio, the k3 estimator of KL(sampler||policy)
    policy_tokens: torch.Tensor  # number of selected tokens (sum of mask weights)


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mode: LossMode = "constant",
    norm_const: float | torch.Tensor | None = None,
    segment_ids: Any | None = None,
    cu_seqlens: Any | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO/GRPO clipped surrogate against the sampler's log-probs, aggregated by `mode`.

    All inputs share one shape ([T] packed, or [R, L]), aligned on the *target* token:
    `logprobs` from the trainer (with grad), `sampler_logprobs` and per-token `advantages`
    as served (treated as constants). Per token, with r = exp(logprobs - sampler_logprobs):

        loss_t = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    (clip_high = 0.28 gives DAPO's clip-higher). The default `mode="constant"` needs
    `norm_const`: `rank_norm_const(policy_token_count, world_size)`. Returns the scalar loss
    and `PolicyLossStats`.
    """
    shape = tuple(logprobs.shape)
    for name, tensor in (
        ("sampler_logprobs", sampler_logprobs),
        ("advantages", advantages),
        ("mask", mask),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} must equal logprobs shape {shape}"
            )
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    selected = mask != 0
    # Unselected positions may hold anything (fill values, -inf); keep them out of exp().
    log_ratio = torch.where(selected, logprobs - sampler_logprobs.detach(), 0.0)
    ratio = log_ratio.exp()
    advantages = advantages.detach().to(ratio.dtype)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate_loss(
        per_token, mask, mode, norm_const, segment_ids=segment_ids, cu_seqlens=cu_seqlens
    )
    with torch.no_grad():
        weight = torch.where(selected, mask.to(ratio.dtype), 0.0)
        count = weight.sum()
        denominator = torch.where(count > 0, count, torch.ones_like(count))
        stats = PolicyLossStats(
            clip_fraction=((clipped < unclipped).to(ratio.dtype) * weight).sum() / denominator,
            ratio_mean=(ratio * weight).sum() / denominator,
            approx_kl=((ratio - 1.0 - log_ratio) * weight).sum() / denominator,
            policy_tokens=count,
        )
    return loss, stats
