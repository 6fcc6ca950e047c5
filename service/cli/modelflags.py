"""The model flags `rlfeed estimate` and `rlfeed plan` share: a preset or a full architecture.

`--model NAME` picks a preset of `rlfeed.sched.models.MODELS` (default qwen3-8b, as
`[accounting] model`); the architecture flags describe any other dense decoder, and then
every one of them is needed. Standard library only at import time (see `rlfeed.service.cli`).
"""

from __future__ import annotations

import argparse

from rlfeed.service.cli.argtypes import UsageError, positive_int

DEFAULT_MODEL = "qwen3-8b"

# flag dest -> ModelArch field, for a custom architecture.
ARCH_FLAGS: dict[str, str] = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
}


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_model_arguments(parser: argparse.ArgumentParser, *, purpose: str) -> None:
    """The model group: --model, or every architecture flag (+ --tied-embeddings)."""
    model = parser.add_argument_group(f"model (a preset, or every architecture flag): {purpose}")
    model.add_argument("--model", help=f"preset name (default {DEFAULT_MODEL})")
    model.add_argument("--layers", type=positive_int, help="number of transformer blocks")
    model.add_argument("--hidden", type=positive_int, help="hidden size")
    model.add_argument("--heads", type=positive_int, help="query heads")
    model.add_argument("--kv-heads", type=positive_int, help="key/value heads")
    model.add_argument("--head-dim", type=positive_int, help="per-head dimension")
    model.add_argument("--intermediate", type=positive_int, help="MLP intermediate size")
    model.add_argument("--vocab", type=positive_int, help="vocabulary size")
    model.add_argument(
        "--tied-embeddings", action="store_true", help="LM head shares the embedding matrix"
    )


def preset_unless_custom(args, option: str, presets: dict, default: str, given, what: str):
    """The preset `--option` names (else `default`) when no custom flag is `given`; None when
    some are (the caller builds the custom one). A usage error for both, or a bad name."""
    name = getattr(args, option)
    if name is not None and given:
        flags = ", ".join(flag(dest) for dest in given)
        raise UsageError(f"argument --{option}: not allowed with {what.format(flags)}")
    if given:
        return None
    name = name or default
    if name not in presets:
        raise UsageError(
            f"argument --{option}: invalid choice {name!r} (choose from {', '.join(presets)})"
        )
    return presets[name]


def resolve_arch(args: argparse.Namespace):
    """The `ModelArch` the flags name; a `UsageError` naming the bad flag."""
    from rlfeed.sched.models import MODELS, ModelArch

    given = [dest for dest in ARCH_FLAGS if getattr(args, dest) is not None]
    if args.tied_embeddings:
        given.append("tied_embeddings")
    preset = preset_unless_custom(
        args, "model", MODELS, DEFAULT_MODEL, given, "architecture flags ({})"
    )
    if preset is not None:
        return preset
    missing = [flag(dest) for dest in ARCH_FLAGS if getattr(args, dest) is None]
    if missing:
        raise UsageError(
            f"a custom architecture needs every architecture flag; missing: {', '.join(missing)}"
        )
    fields = {field: getattr(args, dest) for dest, field in ARCH_FLAGS.items()}
    return ModelArch(name="custom", tie_word_embeddings=args.tied_embeddings, **fields)
