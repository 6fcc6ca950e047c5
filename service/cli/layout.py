"""`rlfeed layout`: the chapter's Figure 14.1 for a step, as a picture.

    rlfeed layout -o step.png                          # newest step every rank fetched
    rlfeed layout --step 12 -o step.jpg --address host:50051
    rlfeed layout --synthetic-step -o example.svg      # no server: a demo-fleet step
    rlfeed layout --lengths lengths.txt --budget 65536 --world-size 8 -o plan.pdf

From a sidecar it fetches the step with GetBatch for every rank, as trainers do (so by
default only steps every rank fetched; `--force` draws a waiting one). The format follows
the file's extension (`IMAGE_FORMATS`; none: PNG). Needs matplotlib. Exit status 2 on bad
input (an unknown extension included, before any work), 1 when the sidecar cannot give
the step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfeed.service.cli.argtypes import (
    ADDRESS_HELP,
    UsageError,
    add_renamed_flag,
    default_address,
    non_negative_int,
    positive_int,
    sidecar_address,
    unreachable,
)

DEFAULT_BUDGET = 2048  # the demo's token budget
EXAMPLE_GROUPS = 8  # x 8 episodes: one demo step
# File extension -> matplotlib format (the Agg canvas writes these; JPEG through Pillow, a
# matplotlib dependency).
IMAGE_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}


class _SidecarError(Exception):
    """The sidecar cannot give the step: reported on stderr, exit status 1."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help=f"picture to write, in the format of its extension: {', '.join(IMAGE_FORMATS)} "
        "(none: PNG)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--lengths", metavar="FILE", help="plan these lengths offline (text or JSON)"
    )
    source.add_argument(
        "--synthetic-step",
        action="store_true",
        help="plan one synthetic demo-fleet step (64 episodes) offline",
    )
    add_renamed_flag(source, "--example", "--synthetic-step", dest="synthetic_step")
    parser.add_argument(
        "--step", type=non_negative_int, help="served step to draw (default: newest fully fetched)"
    )
    parser.add_argument(
        "--address", type=sidecar_address, default=default_address(), help=ADDRESS_HELP
    )
    parser.add_argument(
        "--force", action="store_true", help="draw a step some rank has not fetched yet"
    )
    parser.add_argument(
        "--budget",
        type=positive_int,
        default=DEFAULT_BUDGET,
        metavar="TOKENS",
        help=f"offline: token budget per microbatch (default {DEFAULT_BUDGET})",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=2,
        metavar="K",
        help="offline: data-parallel ranks (default 2)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="--synthetic-step: fleet seed (default 0)"
    )


def read_lengths(text: str, source: str) -> tuple[list[int], list[list[int]] | None]:
    """(lengths, action masks or None) from one-length-per-line text or JSON."""
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{source}: not valid JSON: {exc}") from None
        if isinstance(data, list):
            data = {"lengths": data}
        lengths, masks = data.get("lengths"), data.get("action_masks")
        if not isinstance(lengths, list):
            raise UsageError(f'{source}: expected a list or {{"lengths": [...]}}')
    else:
        lengths, masks = [], None
        for number, line in enumerate(text.splitlines(), start=1):
            content = line.split("#", 1)[0].strip()
            if content:
                try:
                    lengths.append(int(content))
                except ValueError:
                    raise UsageError(
                        f"{source}:{number}: expected a length, got {content!r}"
                    ) from None
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise UsageError(f"{source}: lengths[{index}] must be an integer >= 1, got {length!r}")
    if not lengths:
        raise UsageError(f"{source}: no lengths")
    return lengths, masks


def _example_layout(args: argparse.Namespace):
    import numpy as np
    from rlfeed.service.demo.fleet import FleetConfig, SyntheticTasks
    from rlfeed.service.metrics.layout_plot import layout_from_lengths

    tasks = SyntheticTasks(FleetConfig(seed=args.seed, max_tokens=min(args.budget, 2048)))
    rng = np.random.default_rng(args.seed)
    episodes = [e for t in tasks.task_ids[:EXAMPLE_GROUPS] for e in tasks.roll_group(t, rng)]
    return layout_from_lengths(
        [e.token_ids.size for e in episodes],
        token_budget=args.budget,
        world_size=args.world_size,
        action_masks=[e.action_mask for e in episodes],
    )


def _offline_layout(args: argparse.Namespace):
    from rlfeed.service.metrics.layout_plot import layout_from_lengths

    try:
        text = sys.stdin.read() if args.lengths == "-" else Path(args.lengths).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --lengths {args.lengths}: {exc}") from None
    lengths, masks = read_lengths(text, args.lengths)
    too_long = [i for i, length in enumerate(lengths) if length > args.budget]
    if too_long:
        raise UsageError(
            f"{args.lengths}: lengths[{too_long[0]}] = {lengths[too_long[0]]} is longer than "
            f"--budget {args.budget}"
        )
    try:
        return layout_from_lengths(
            lengths, token_budget=args.budget, world_size=args.world_size, action_masks=masks
        )
    except ValueError as exc:
        raise UsageError(f"{args.lengths}: {exc}") from None


def _served_layout(args: argparse.Namespace):
    from rlfeed.client.transport import (
        GrpcTransport,
        SidecarError,
        StepReleasedError,
        TLSHandshakeError,
    )
    from rlfeed.service.metrics.layout_plot import layout_from_batch_responses

    transport = GrpcTransport(args.address, call_timeout_s=10.0)
    try:
        status = transport.status()
        waiting = {w.step: list(w.ranks_missing) for w in status.steps_waiting}
        step = args.step
        if step is None:
            done = [s for s in range(status.next_step) if s not in waiting]
            if not done:
                raise _SidecarError(f"{args.address}: no step has been fetched by every rank yet")
            step = done[-1]
        if step >= status.next_step:
            raise _SidecarError(f"step {step} is not assembled yet (next step: {status.next_step})")
        if step in waiting and not args.force:
            raise _SidecarError(
                f"step {step} is still waiting for ranks {waiting[step]}; drawing it would "
                "count as their fetch (use --force to draw it anyway)"
            )
        responses = [transport.get_batch(step, r, 0.0) for r in range(status.world_size)]
        return layout_from_batch_responses(
            responses, token_budget=int(status.token_budget), step=step
        )
    except StepReleasedError as exc:
        raise _SidecarError(str(exc)) from None
    except TLSHandshakeError as exc:
        raise _SidecarError(exc.message) from None
    except SidecarError as exc:
        if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            raise _SidecarError(unreachable(args.address, exc.message)) from None
        raise _SidecarError(f"{args.address}: {exc}") from None
    finally:
        transport.close()


def image_format(path: str) -> str:
    """The matplotlib format `path`'s extension names (PNG without one); a usage error
    naming the supported ones otherwise."""
    suffix = Path(path).suffix.lower()
    if not suffix:
        return "png"
    if suffix not in IMAGE_FORMATS:
        raise UsageError(
            f"cannot write {path}: {suffix} is not a format it writes (use one of "
            f"{', '.join(IMAGE_FORMATS)})"
        )
    return IMAGE_FORMATS[suffix]


def run(args: argparse.Namespace) -> int:
    try:
        image = image_format(args.output)
        if args.step is not None and (args.lengths or args.synthetic_step):
            raise UsageError(
                "--step draws a served step; it cannot go with --lengths/--synthetic-step"
            )
        try:
            import matplotlib  # noqa: F401  (the `plot` extra)
            from rlfeed.service.metrics.layout_plot import figure_size_px, render_layout
        except ImportError:
            raise UsageError("matplotlib is not installed: pip install 'rlfeed[plot]'") from None
        if args.synthetic_step:
            layout = _example_layout(args)
        elif args.lengths:
            layout = _offline_layout(args)
        else:
            layout = _served_layout(args)
        Path(args.output).write_bytes(render_layout(layout, image))
    except UsageError as exc:
        print(f"rlfeed layout: {exc}", file=sys.stderr)
        return 2
    except _SidecarError as exc:
        print(f"rlfeed layout: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rlfeed layout: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    width, height = figure_size_px(layout)
    real, padded = layout.real_tokens, layout.padded_positions
    step = "" if layout.step is None else f"step {layout.step}, "
    print(
        f"wrote {args.output} ({width}x{height} px): {step}{layout.lengths.size} sequences, "
        f"{real:,} tokens; padded {padded:,} positions "
        f"({(padded - real) / max(padded, 1):.0%} padding) vs packed {len(layout.rows)} "
        f"microbatches of <= {layout.token_budget:,} tokens"
    )
    return 0
