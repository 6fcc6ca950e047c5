"""`rlfeed plan`: token-budgeted, rank-balanced microbatches for a file of sequence lengths.

    rlfeed plan --bundled-lengths                      # the bundled 14.2 workload
    rlfeed plan --lengths lengths.txt --world-size 8 --model qwen3-0.6b
    rlfeed plan --lengths - --budget 65536 --cost padded --json < lengths.txt

FILE holds one length per line (`#` comments allowed). The plan is exactly a step's
(`sched.planning.plan_microbatches`): ranks balanced on tokens + W x sum(L^2), W from the
model (estimate's model flags; default qwen3-8b) unless --attention-weight. --json prints
the microbatches, ranks' slots and figures in tokens and compute (--help). Errors exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlfeed.service.cli.argtypes import (
    UsageError,
    add_renamed_flag,
    non_negative_float,
    positive_int,
    strict_json,
)
from rlfeed.service.cli.modelflags import add_model_arguments, resolve_arch

DEFAULT_BUDGET = 131_072  # the chapter's budget: two 64k-token trajectories
DEFAULT_WORLD_SIZE = 1
EXAMPLE = "examples/lengths.txt"  # inside the rlfeed.service.cli package


JSON_EPILOG = (
    "--json fields: microbatches (0-based sequence indices); ranks (microbatch indices per "
    "rank, in slot order); num_microbatches (after balancing, with splits and empty no-op "
    "ones) and num_budget_microbatches (before); lower_bound (ceil(tokens / budget)); "
    "padding_share; fill (tokens / (num_microbatches x budget)); largest_microbatch_tokens; "
    "rank_imbalance and lockstep_efficiency in tokens; compute_rank_imbalance and "
    "compute_lockstep_efficiency in the model's FLOPs (tokens + compute_weight x sum(L^2), "
    "whatever the plan was balanced with); per rank rank_tokens, rank_compute (token units), "
    "rank_compute_flops (forward FLOPs) and rank_cost (the balancing cost); plan_seconds; and "
    "the inputs (model, attention_weight as used, attention_weight_from: model or flag)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = JSON_EPILOG
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--lengths", metavar="FILE", help="one sequence length per line; '-' reads stdin"
    )
    source.add_argument(
        "--bundled-lengths",
        action="store_true",
        help="the bundled lengths file: 512 long-tailed trajectories (the 14.2 workload)",
    )
    add_renamed_flag(source, "--example", "--bundled-lengths", dest="bundled_lengths")
    parser.add_argument(
        "--budget",
        type=positive_int,
        default=DEFAULT_BUDGET,
        metavar="TOKENS",
        help=f"token budget per microbatch, in computed positions (default {DEFAULT_BUDGET})",
    )
    parser.add_argument(
        "--cost",
        choices=("packed", "padded"),
        default="packed",
        help="packed: sum of lengths; padded: count x longest (default packed)",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=DEFAULT_WORLD_SIZE,
        metavar="K",
        help=f"data-parallel ranks (default {DEFAULT_WORLD_SIZE})",
    )
    parser.add_argument(
        "--method",
        choices=("ffd", "bfd"),
        default="ffd",
        help="bin packing for --cost packed (default ffd)",
    )
    parser.add_argument(
        "--attention-weight",
        type=non_negative_float,
        default=None,
        metavar="W",
        help="rank-balancing cost = tokens + W x sum(L^2) (default: the model's FLOPs; "
        "0 balances tokens)",
    )
    parser.add_argument(
        "--spread",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="packed: spread sequences evenly over a multiple of K microbatches (LPT) "
        "instead of splitting full ones (default: on for --cost packed, as the service does)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_model_arguments(parser, purpose="whose FLOPs set the default --attention-weight")


def example_path() -> Path:
    """Path of the bundled example lengths file (package data of rlfeed.service)."""
    from importlib import resources

    return Path(str(resources.files("rlfeed.service.cli").joinpath(EXAMPLE)))


def parse_lengths(text: str, source: str) -> tuple[list[int], list[int]]:
    """(lengths, line numbers) from one-length-per-line text; `#` starts a comment."""
    lengths: list[int] = []
    line_numbers: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        try:
            value = int(content)
        except ValueError:
            raise UsageError(
                f"{source}:{number}: expected one whole number of tokens, got {content!r}"
            ) from None
        if value < 1:
            raise UsageError(f"{source}:{number}: length must be >= 1, got {value}")
        lengths.append(value)
        line_numbers.append(number)
    return lengths, line_numbers


def _read(args: argparse.Namespace) -> tuple[str, str]:
    if args.bundled_lengths:
        path = example_path()
        return path.read_text(), str(path)
    if args.lengths == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        return Path(args.lengths).read_text(), args.lengths
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --lengths {args.lengths}: {exc}") from None


def build_plan(lengths: list[int], args: argparse.Namespace) -> dict:
    """The JSON-ready plan of `lengths` under the flags in `args`."""
    import numpy as np
    from rlfeed.sched.budgets import (
        microbatch_lower_bound,
        microbatch_positions,
        microbatch_tokens,
    )
    from rlfeed.sched.compute import sequence_cost
    from rlfeed.sched.planning import plan_microbatches

    arch = resolve_arch(args)
    rates = sequence_cost(arch)
    from_model = args.attention_weight is None
    weight = rates.attention_weight if from_model else args.attention_weight
    sizes = np.asarray(lengths, dtype=np.int64)
    started = time.perf_counter()
    planned = plan_microbatches(
        sizes,
        args.budget,
        args.world_size,
        cost=args.cost,
        method=args.method,
        attention_weight=weight,
        compute_weight=rates.attention_weight,
        spread=args.spread,
    )
    assignment = planned.assignment
    plan_seconds = time.perf_counter() - started
    microbatches = assignment.microbatches
    tokens = microbatch_tokens(sizes, microbatches)
    positions = microbatch_positions(sizes, microbatches, args.cost)
    total_tokens = int(sizes.sum())
    total_positions = int(positions.sum())
    return {
        "num_sequences": int(sizes.size),
        "total_tokens": total_tokens,
        "token_budget": args.budget,
        "cost": args.cost,
        "method": args.method,
        "world_size": args.world_size,
        "model": arch.name,
        "attention_weight": weight,
        "attention_weight_from": "model" if from_model else "flag",
        "compute_weight": rates.attention_weight,
        "spread": planned.spread,
        "num_microbatches": len(microbatches),
        "num_budget_microbatches": planned.num_budget_microbatches,
        "num_empty_microbatches": int(sum(m.size == 0 for m in microbatches)),
        "num_slots": assignment.num_slots,
        "lower_bound": microbatch_lower_bound(sizes, args.budget),
        "padding_share": 1.0 - total_tokens / total_positions if total_positions else 0.0,
        "fill": total_tokens / (len(microbatches) * args.budget) if microbatches else 0.0,
        "largest_microbatch_tokens": int(positions.max()) if positions.size else 0,
        "rank_imbalance": planned.tokens.rank_imbalance,
        "lockstep_efficiency": planned.tokens.lockstep_efficiency,
        "compute_rank_imbalance": planned.compute.rank_imbalance,
        "compute_lockstep_efficiency": planned.compute.lockstep_efficiency,
        "rank_tokens": planned.tokens.rank_cost.astype(np.int64).tolist(),
        "rank_compute": planned.compute.rank_cost.tolist(),
        "rank_compute_flops": (planned.compute.rank_cost * rates.unit_flops).tolist(),
        "rank_cost": assignment.rank_cost.tolist(),
        "plan_seconds": plan_seconds,
        "microbatch_tokens": tokens.tolist(),
        "microbatch_positions": positions.tolist(),
        "microbatches": [m.tolist() for m in microbatches],
        "ranks": assignment.ranks,
    }


def _print_table(plan: dict, source: str) -> None:
    print(
        f"rlfeed plan: {plan['num_sequences']:,} sequences, {plan['total_tokens']:,} tokens "
        f"from {source}"
    )
    print(
        f"budget {plan['token_budget']:,} positions ({plan['cost']}, {plan['method']}), "
        f"world size {plan['world_size']}, attention weight {plan['attention_weight']:.4g} "
        + (f"({plan['model']}'s FLOPs)" if plan["attention_weight_from"] == "model" else "(flag)")
        + (", spread" if plan["spread"] else "")
    )
    empty = f", {plan['num_empty_microbatches']} empty" if plan["num_empty_microbatches"] else ""
    rows = [
        ("microbatches", f"{plan['num_microbatches']:,} ({plan['num_slots']} per rank{empty})"),
        ("lower bound", f"{plan['lower_bound']:,} (ceil(tokens / budget))"),
        ("fill", f"{plan['fill']:.1%}"),
        ("padding share", f"{plan['padding_share']:.1%}"),
        ("largest microbatch", f"{plan['largest_microbatch_tokens']:,} positions"),
        (
            "rank imbalance",
            f"{plan['rank_imbalance']:.4f} in tokens, {plan['compute_rank_imbalance']:.4f} "
            "in compute (max / mean rank)",
        ),
        (
            "lockstep efficiency",
            f"{plan['lockstep_efficiency']:.1%} in tokens, "
            f"{plan['compute_lockstep_efficiency']:.1%} in compute",
        ),
        ("planned in", f"{plan['plan_seconds'] * 1e3:.1f} ms"),
    ]
    for name, value in rows:
        print(f"  {name:<20} {value}")
    print(f"  {'rank':>4}  {'microbatches':>12}  {'sequences':>9}  {'tokens':>12}  {'compute':>14}")
    sequences_per_microbatch = [len(m) for m in plan["microbatches"]]
    per_rank = zip(plan["ranks"], plan["rank_tokens"], plan["rank_compute"], strict=True)
    for rank, (slots, tokens, cost) in enumerate(per_rank):
        sequences = sum(sequences_per_microbatch[i] for i in slots)
        print(f"  {rank:>4}  {len(slots):>12}  {sequences:>9}  {tokens:>12,}  {cost:>14,.0f}")
    print(f"(compute: tokens + {plan['compute_weight']:.4g} x sum(L^2), {plan['model']}'s FLOPs)")
    print("(--json prints the microbatches and the per-rank slot order)")


def run(args: argparse.Namespace) -> int:
    try:
        text, source = _read(args)
        lengths, line_numbers = parse_lengths(text, source)
        too_long = [i for i, length in enumerate(lengths) if length > args.budget]
        if too_long:
            index = too_long[0]
            raise UsageError(
                f"{source}:{line_numbers[index]}: sequence {index} has length "
                f"{lengths[index]}, longer than the token budget {args.budget} "
                f"({len(too_long)} sequence(s) too long); raise --budget or drop them"
            )
        plan = build_plan(lengths, args)
    except (UsageError, ValueError) as exc:
        print(f"rlfeed plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(strict_json(plan))
    else:
        _print_table(plan, source)
    return 0
