"""Throughput and GPU-hour accounting: the first-order roofline of the chapter's Section 14.6.

Generation is memory-bound: one decode step for `batch` sequences at `context` tokens reads
every weight once (2N bytes in bf16) and each sequence's KV cache (`context` x
`kv_bytes_per_token`), so it takes (2N + b·c·s_kv) / bandwidth seconds and yields b tokens.
Training is compute-bound: about 6N FLOPs per token (forward and backward) at some
model-FLOPs utilisation (MFU). The estimate ignores attention FLOPs, prefill, communication,
evaluation and failed runs; it says where the time goes, not what a run will cost to the
hour. Every input that is not a published specification is an assumption: a named,
documented field of `EpisodeShape` or a keyword argument here.

`step_gpu_hours` prices a hypothetical step from an episode shape; `step_cost_from_tokens`
prices an actual served step from its real token counts (and, when given, the positions the
trainer actually computed, so that the GPU-hours spent on padding can be reported).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from rlfeed.sched.models import (
    GPUS,
    MODELS,
    GpuSpec,
    ModelArch,
    kv_bytes_per_token,
    param_count,
)

__all__ = [
    "GPUS",
    "MODELS",
    "EpisodeShape",
    "GpuSpec",
    "ModelArch",
    "StepCost",
    "decode_memory_bytes",
    "decode_tokens_per_s",
    "kv_bytes_per_token",
    "param_count",
    "step_cost_from_tokens",
    "step_gpu_hours",
    "train_tokens_per_s",
]

SECONDS_PER_HOUR = 3600.0
# Forward + backward FLOPs per parameter per token (2 forward, 4 backward).
TRAIN_FLOPS_PER_PARAM_PER_TOKEN = 6
# Forward-only FLOPs per parameter per token, for the log-prob passes.
FORWARD_FLOPS_PER_PARAM_PER_TOKEN = 2


def _count(name: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _fraction(name: str, value: object) -> float:
    if not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def decode_memory_bytes(arch: ModelArch, *, batch: int, context: int) -> int:
    """Bytes one decode step reads, which is also what must sit in GPU memory: the weights
    (N x weight_bytes_per_param) plus `batch` KV caches of `context` tokens each."""
    batch = _count("batch", batch, minimum=1)
    context = _count("context", context)
    weights = param_count(arch) * arch.weight_bytes_per_param
    return weights + batch * context * kv_bytes_per_token(arch)


def decode_tokens_per_s(arch: ModelArch, gpu: GpuSpec, *, batch: int, context: int) -> float:
    """Upper bound on decode tokens/s per GPU: `batch` tokens per step of
    (weights + batch·context·kv_bytes_per_token) / bandwidth seconds. Qwen3-8B on an H200:
    about 8,600 at batch 64 and context 2,048, about 1,800 at context 16,384."""
    seconds_per_step = (
        decode_memory_bytes(arch, batch=batch, context=context) / gpu.memory_bandwidth_bytes_per_s
    )
    return batch / seconds_per_step


def train_tokens_per_s(arch: ModelArch, gpu: GpuSpec, *, mfu: float) -> float:
    """Training tokens/s per GPU: mfu x dense bf16 FLOP/s / (6N). Qwen3-8B on an H200 at
    40% MFU: about 8,000."""
    mfu = _fraction("mfu", mfu)
    flops_per_token = TRAIN_FLOPS_PER_PARAM_PER_TOKEN * param_count(arch)
    return mfu * gpu.dense_bf16_flops_per_s / flops_per_token


@dataclass(kw_only=True, frozen=True)
class EpisodeShape:
    """One RL step's workload, for a hypothetical run.

    The defaults are illustrative assumptions, inferred (not read) from the chapter's
    Section 14.6 example so that Qwen3-8B on an H200 gives its figures: about 1.6 GPU-hours
    a step (about 490 over 300 steps), decode about 59% of it, the training pass about a
    quarter, policy tokens a quarter of all tokens, and about +1 GPU-hour when the busy
    fraction drops from 0.5 to 0.25. Decode alone plus training cannot give that split
    (it gives about 69% / 31%), so a third, named term prices the log-prob forward passes.
    Replace every field with a measurement from a pilot run before planning a budget.
    """

    prompts_per_step: int = 64  # distinct tasks sampled per step; default 64
    group_size: int = 8  # episodes per task (GRPO group); default 8
    prompt_tokens: int = 2000  # tokens of system prompt + task per episode; default 2,000
    policy_tokens: int = 5900  # tokens the policy generates per episode; default 5,900
    tool_tokens: int = 15_700  # tool/environment output tokens per episode; default 15,700
    decode_batch: int = 64  # sequences one inference GPU decodes concurrently; default 64
    # Context length (tokens) a sequence has while being decoded, for the KV reads; default
    # 16,384 (the chapter's "16k, which is short for a coding agent").
    decode_context: int = 16_384
    # Share of wall time the decode GPUs spend generating; absorbs tool latency and the
    # straggler wait. Decode GPU-hours scale as 1/busy_fraction; default 0.5.
    busy_fraction: float = 0.5
    mfu: float = 0.4  # model-FLOPs utilisation of the trainer (and log-prob passes); 0.4
    # Extra forward passes over every trained position at 2N FLOPs per token, at `mfu`:
    # recomputing the old policy's log-probs and the reference model's (for a KL term).
    # Inferred to match the chapter's split; set 0 for a run that uses the sampler's
    # log-probs and no KL term; default 2.
    logprob_forward_passes: int = 2

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "group_size", "decode_batch"):
            _count(f"EpisodeShape.{name}", getattr(self, name), minimum=1)
        for name in ("prompt_tokens", "policy_tokens", "tool_tokens", "decode_context"):
            _count(f"EpisodeShape.{name}", getattr(self, name))
        _count("EpisodeShape.logprob_forward_passes", self.logprob_forward_passes)
        _fraction("EpisodeShape.busy_fraction", self.busy_fraction)
        _fraction("EpisodeShape.mfu", self.mfu)

    @property
    def episodes_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def policy_tokens_per_step(self) -> int:
        return self.episodes_per_step * self.policy_tokens

    @property
    def total_tokens_per_step(self) -> int:
        per_episode = self.prompt_tokens + self.policy_tokens + self.tool_tokens
        return self.episodes_per_step * per_episode


def mean_decode_context(*, prompt_tokens: int, policy_tokens: int, tool_tokens: int) -> int:
    """The mean context a generated token is decoded at, for an episode of this shape: the
    prompt plus half of what follows it, assuming policy and tool tokens interleave evenly
    over the episode (the KV cache grows from the prompt to the whole episode). What
    `rlfeed estimate` prices the decode at when given an episode's token counts but no
    context; `EpisodeShape`'s own default (16,384) is the chapter's figure instead."""
    for name, value in (
        ("prompt", prompt_tokens),
        ("policy", policy_tokens),
        ("tool", tool_tokens),
    ):
        _count(f"{name}_tokens", value)
    return prompt_tokens + (policy_tokens + tool_tokens) // 2


@dataclass(kw_only=True, frozen=True)
class StepCost:
    """GPU-hours of one step, by term, and the token counts they were priced on."""

    policy_tokens: int  # generated tokens, which decode pays for
    total_tokens: int  # real tokens of every trajectory (prompt + policy + tool)
    trained_positions: int  # positions the trainer computed (>= total_tokens with padding)
    decode_tokens_per_s: float  # roofline decode rate per GPU used for the decode term
    train_tokens_per_s: float  # training rate per GPU used for the training term
    decode_gpu_hours: float  # policy_tokens / (decode rate x busy_fraction)
    train_gpu_hours: float  # trained_positions / training rate (forward + backward)
    logprob_gpu_hours: float  # log-prob forward passes over trained_positions
    padding_gpu_hours: float  # share of train + logprob spent on positions beyond real tokens
    total_gpu_hours: float  # decode + train + logprob

    @property
    def total(self) -> float:
        """Alias of `total_gpu_hours`."""
        return self.total_gpu_hours


def step_cost_from_tokens(
    arch: ModelArch,
    gpu: GpuSpec,
    *,
    policy_tokens: int,
    total_tokens: int,
    computed_positions: int | None = None,
    decode_batch: int,
    decode_context: int,
    busy_fraction: float,
    mfu: float,
    logprob_forward_passes: int = EpisodeShape.logprob_forward_passes,
) -> StepCost:
    """Price one step from its token counts.

    Decode is paid on `policy_tokens` only (prompt and tool tokens are prefilled, which is
    compute-bound and ignored at first order), at the roofline rate for `decode_batch` and
    `decode_context`, divided by `busy_fraction`. Training and the log-prob passes are paid
    on every position the trainer computes: `computed_positions` when given (packed or
    padded layout), else `total_tokens`. `padding_gpu_hours` is the part of those two terms
    spent on `computed_positions - total_tokens`.
    """
    policy_tokens = _count("policy_tokens", policy_tokens)
    total_tokens = _count("total_tokens", total_tokens)
    if policy_tokens > total_tokens:
        raise ValueError(
            f"policy_tokens ({policy_tokens}) must not exceed total_tokens ({total_tokens})"
        )
    if computed_positions is None:
        trained_positions = total_tokens
    else:
        trained_positions = _count("computed_positions", computed_positions)
        if trained_positions < total_tokens:
            raise ValueError(
                f"computed_positions ({trained_positions}) must be >= total_tokens "
                f"({total_tokens}): every real token is computed at least once"
            )
    busy_fraction = _fraction("busy_fraction", busy_fraction)
    passes = _count("logprob_forward_passes", logprob_forward_passes)

    decode_rate = decode_tokens_per_s(arch, gpu, batch=decode_batch, context=decode_context)
    train_rate = train_tokens_per_s(arch, gpu, mfu=mfu)
    # A forward pass costs 2N of training's 6N FLOPs per token, at the same MFU.
    logprob_per_train = passes * FORWARD_FLOPS_PER_PARAM_PER_TOKEN / TRAIN_FLOPS_PER_PARAM_PER_TOKEN
    train_hours_per_position = 1.0 / (train_rate * SECONDS_PER_HOUR)

    decode_hours = policy_tokens / (decode_rate * busy_fraction * SECONDS_PER_HOUR)
    train_hours = trained_positions * train_hours_per_position
    logprob_hours = logprob_per_train * train_hours
    padding = trained_positions - total_tokens
    padding_hours = padding * train_hours_per_position * (1.0 + logprob_per_train)
    return StepCost(
        policy_tokens=policy_tokens,
        total_tokens=total_tokens,
        trained_positions=trained_positions,
        decode_tokens_per_s=decode_rate,
        train_tokens_per_s=train_rate,
        decode_gpu_hours=decode_hours,
        train_gpu_hours=train_hours,
        logprob_gpu_hours=logprob_hours,
        padding_gpu_hours=padding_hours,
        total_gpu_hours=decode_hours + train_hours + logprob_hours,
    )


def step_gpu_hours(arch: ModelArch, gpu: GpuSpec, shape: EpisodeShape) -> StepCost:
    """GPU-hours of one hypothetical step of `shape` (no padding: packed training)."""
    return step_cost_from_tokens(
        arch,
        gpu,
        policy_tokens=shape.policy_tokens_per_step,
        total_tokens=shape.total_tokens_per_step,
        decode_batch=shape.decode_batch,
        decode_context=shape.decode_context,
        busy_fraction=shape.busy_fraction,
        mfu=shape.mfu,
        logprob_forward_passes=shape.logprob_forward_passes,
    )
