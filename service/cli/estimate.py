"""`rlfeed estimate`: roofline throughput and GPU-hour arithmetic (chapter Section 14.6).

    rlfeed estimate                                   # Qwen3-8B on an H200, batch 64, 2k
    rlfeed estimate --model qwen3-32b --gpu h100 --context 16384 --json
    rlfeed estimate --steps 300                       # + the default episode shape's step

Prints KV-cache bytes per token, parameters, decode and training tokens/s, and the model's
attention_weight (what `rlfeed plan` and `[batching]` balance ranks with by default; the
model flags are `rlfeed plan`'s). Any episode-shape flag adds one step's GPU-hours by phase
(missing fields: `EpisodeShape`'s defaults), its decode priced at the episode's mean
context when its token counts are given (printed with where it came from). Bad input exits
2 naming the flag and choices.
"""

from __future__ import annotations

import argparse
import sys

from rlfeed.service.cli.argtypes import (
    UsageError,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
    strict_json,
)
from rlfeed.service.cli.modelflags import (
    add_model_arguments,
    flag,
    preset_unless_custom,
    resolve_arch,
)

DEFAULT_GPU = "h200"
DEFAULT_BATCH = 64
DEFAULT_CONTEXT = 2048
DEFAULT_MFU = 0.4

# flag dest -> EpisodeShape field.
_SHAPE_FLAGS: dict[str, str] = {
    "prompts": "prompts_per_step",
    "group_size": "group_size",
    "prompt_tokens": "prompt_tokens",
    "policy_tokens": "policy_tokens",
    "tool_tokens": "tool_tokens",
    "busy_fraction": "busy_fraction",
    "logprob_passes": "logprob_forward_passes",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, purpose="whose throughput is estimated")
    gpu = parser.add_argument_group("GPU (a preset, or --bandwidth and --flops)")
    gpu.add_argument("--gpu", help=f"preset name (default {DEFAULT_GPU})")
    gpu.add_argument("--bandwidth", type=positive_float, help="memory bandwidth, TB/s")
    gpu.add_argument("--flops", type=positive_float, help="dense bf16 throughput, TFLOP/s")
    gpu.add_argument("--memory", type=positive_float, help="GPU memory, GB (optional)")
    rates = parser.add_argument_group("rates")
    rates.add_argument(
        "--batch",
        type=positive_int,
        help=f"decode batch (default {DEFAULT_BATCH}; the step's default is the shape's)",
    )
    rates.add_argument(
        "--context",
        type=non_negative_int,
        help=f"decode context, tokens (default {DEFAULT_CONTEXT}; the step's default: prompt + "
        "(policy + tool) / 2 when any episode token count is given, else the shape's 16384)",
    )
    rates.add_argument(
        "--mfu", type=fraction, default=DEFAULT_MFU, help=f"training MFU (default {DEFAULT_MFU})"
    )
    shape = parser.add_argument_group("episode shape (any of these adds the step's GPU-hours)")
    shape.add_argument("--prompts", type=positive_int, help="prompts (tasks) per step")
    shape.add_argument("--group-size", type=positive_int, help="episodes per prompt")
    shape.add_argument("--prompt-tokens", type=non_negative_int, help="prompt tokens per episode")
    shape.add_argument(
        "--policy-tokens", type=non_negative_int, help="generated tokens per episode"
    )
    shape.add_argument(
        "--tool-tokens", type=non_negative_int, help="tool-output tokens per episode"
    )
    shape.add_argument("--busy-fraction", type=fraction, help="decode GPUs' busy share")
    shape.add_argument("--logprob-passes", type=non_negative_int, help="log-prob forward passes")
    shape.add_argument("--steps", type=positive_int, help="steps in the run, for a run total")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _resolve_gpu(args: argparse.Namespace):
    from rlfeed.sched.models import GPUS, GpuSpec

    given = [d for d in ("bandwidth", "flops", "memory") if getattr(args, d) is not None]
    preset = preset_unless_custom(args, "gpu", GPUS, DEFAULT_GPU, given, "{}")
    if preset is not None:
        return preset
    missing = [flag(d) for d in ("bandwidth", "flops") if getattr(args, d) is None]
    if missing:
        raise UsageError(f"a custom GPU needs --bandwidth and --flops; missing: {missing[0]}")
    return GpuSpec(
        name="custom",
        memory_bandwidth_bytes_per_s=args.bandwidth * 1e12,
        dense_bf16_flops_per_s=args.flops * 1e12,
        memory_bytes=None if args.memory is None else args.memory * 1e9,
    )


# Where the step's decode context came from (printed with it, and in --json).
CONTEXT_SOURCES = {
    "flag": "--context",
    "episode": "prompt + (policy + tool) / 2 of the episode given",
    "default": "EpisodeShape's default; --context or the episode's token counts change it",
}
_EPISODE_TOKEN_FLAGS = ("prompt_tokens", "policy_tokens", "tool_tokens")


def _resolve_shape(args: argparse.Namespace):
    """(EpisodeShape, where its decode context came from: a CONTEXT_SOURCES key), or
    (None, None) without any episode-shape flag."""
    from dataclasses import replace

    from rlfeed.sched.throughput import EpisodeShape, mean_decode_context

    overrides = {
        field: getattr(args, dest)
        for dest, field in _SHAPE_FLAGS.items()
        if getattr(args, dest) is not None
    }
    if not overrides and args.steps is None:
        return None, None
    if args.batch is not None:
        overrides["decode_batch"] = args.batch
    if args.context is not None:
        return EpisodeShape(mfu=args.mfu, decode_context=args.context, **overrides), "flag"
    shape = EpisodeShape(mfu=args.mfu, **overrides)
    if not any(getattr(args, dest) is not None for dest in _EPISODE_TOKEN_FLAGS):
        return shape, "default"
    context = mean_decode_context(
        prompt_tokens=shape.prompt_tokens,
        policy_tokens=shape.policy_tokens,
        tool_tokens=shape.tool_tokens,
    )
    return replace(shape, decode_context=context), "episode"


def _estimate(args: argparse.Namespace) -> dict:
    from dataclasses import asdict

    from rlfeed.sched import throughput as tp
    from rlfeed.sched.compute import sequence_cost

    arch, gpu = resolve_arch(args), _resolve_gpu(args)
    shape, context_source = _resolve_shape(args)
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    context = DEFAULT_CONTEXT if args.context is None else args.context
    result: dict = {
        "model": arch.name,
        "gpu": gpu.name,
        "kv_bytes_per_token": tp.kv_bytes_per_token(arch),
        "params": tp.param_count(arch),
        "decode_batch": batch,
        "decode_context": context,
        "decode_tokens_per_s": tp.decode_tokens_per_s(arch, gpu, batch=batch, context=context),
        "decode_memory_bytes": tp.decode_memory_bytes(arch, batch=batch, context=context),
        "gpu_memory_bytes": gpu.memory_bytes,
        "mfu": args.mfu,
        "train_tokens_per_s": tp.train_tokens_per_s(arch, gpu, mfu=args.mfu),
        "attention_weight": sequence_cost(arch).attention_weight,
    }
    if shape is not None:
        cost = tp.step_gpu_hours(arch, gpu, shape)
        result["episode_shape"] = asdict(shape)
        result["step"] = {
            "policy_tokens": cost.policy_tokens,
            "total_tokens": cost.total_tokens,
            "decode_tokens_per_s": cost.decode_tokens_per_s,
            "decode_context": shape.decode_context,
            "decode_context_from": context_source,
            "decode_memory_bytes": tp.decode_memory_bytes(
                arch, batch=shape.decode_batch, context=shape.decode_context
            ),
        }
        result["step_gpu_hours"] = {
            "decode": cost.decode_gpu_hours,
            "train": cost.train_gpu_hours,
            "logprob": cost.logprob_gpu_hours,
            "total": cost.total_gpu_hours,
        }
        if args.steps is not None:
            result["steps"] = args.steps
            result["run_gpu_hours"] = cost.total_gpu_hours * args.steps
    return result


def _print_memory_note(needed: int, memory: float | None) -> None:
    if memory is not None and needed > memory:
        print(
            f"  note: weights + KV caches need {needed / 1e9:.0f} GB, more than the GPU's "
            f"{memory / 1e9:.0f} GB (the roofline ignores capacity)"
        )


def _print_text(r: dict) -> None:
    print(f"model                {r['model']}, {r['params'] / 1e9:.2f}B params, on {r['gpu']}")
    print(f"params               {r['params']:,}")
    kv = r["kv_bytes_per_token"]
    print(f"kv_bytes_per_token   {kv:,} B ({kv / 1e3:.0f} KB)")
    print(
        f"decode_tokens_per_s  {r['decode_tokens_per_s']:,.0f} per GPU "
        f"(batch {r['decode_batch']}, context {r['decode_context']:,})"
    )
    _print_memory_note(r["decode_memory_bytes"], r["gpu_memory_bytes"])
    print(f"train_tokens_per_s   {r['train_tokens_per_s']:,.0f} per GPU (MFU {r['mfu']:.2f})")
    weight = r["attention_weight"]
    print(
        f"attention_weight     {weight:.4g} (cost L + w L^2: attention = linear layers "
        f"at L = {1 / weight:,.0f})"
    )
    if "step_gpu_hours" not in r:
        return
    s, hours, step = r["episode_shape"], r["step_gpu_hours"], r["step"]
    episodes = s["prompts_per_step"] * s["group_size"]
    print(
        f"episode shape        {s['prompts_per_step']} prompts x {s['group_size']} = "
        f"{episodes} episodes of {s['prompt_tokens']:,} prompt + {s['policy_tokens']:,} "
        f"policy + {s['tool_tokens']:,} tool tokens"
    )
    print(
        f"step decode          {step['decode_tokens_per_s']:,.0f} tok/s per GPU (batch "
        f"{s['decode_batch']}, context {s['decode_context']:,}), busy {s['busy_fraction']:.2f}"
    )
    print(f"  context from: {CONTEXT_SOURCES[step['decode_context_from']]}")
    _print_memory_note(step["decode_memory_bytes"], r["gpu_memory_bytes"])
    total = hours["total"]
    parts = "  ".join(
        f"{name} {hours[name]:.2f} ({hours[name] / total:.0%})"
        for name in ("decode", "train", "logprob")
    )
    print(f"step_gpu_hours       {total:.2f}: {parts}")
    if "run_gpu_hours" in r:
        print(f"run_gpu_hours        {r['run_gpu_hours']:,.0f} over {r['steps']} steps")


def run(args: argparse.Namespace) -> int:
    try:
        result = _estimate(args)
    except (UsageError, ValueError) as exc:
        print(f"rlfeed estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(strict_json(result))
    else:
        _print_text(result)
    return 0
