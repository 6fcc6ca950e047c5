"""`rlfeed demo`: the sidecar with a synthetic inference fleet and two trainer ranks.

    rlfeed demo                          # embedded local Ray + sidecar, fleet, 2 trainer ranks
    rlfeed demo --steps 20 --config FILE # a longer run with your sidecar config
    rlfeed demo --address HOST:PORT      # drive a running sidecar (smoke test, load generator)

Without `--address` it starts the sidecar on an embedded local Ray (the config's
`[batching] world_size` is forced to 2). A synthetic fleet (`rlfeed.service.demo_fleet`:
300 tasks with hidden, improving pass rates, long-tailed episodes, binary rewards) asks the
sidecar for tasks and submits groups with `RolloutWriter`; two trainer processes
(`rlfeed.service.demo_trainer`, RANK/WORLD_SIZE set as torchrun would) pull their
microbatches with `BatchLoader` and run a GRPO step on a tiny transformer, all-reducing
gradients over gloo. One line per step, then a summary: steps, tokens, padding share vs the
padded alternative, zero-advantage share, rollouts saved by the filter, and predicted
GPU-hours per step for the configured model and GPU (`[accounting]`). Exit status 0 when
every step trained.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_STEPS = 4
# The demo's sidecar settings where they differ from `rlfeed serve`'s defaults: a token
# budget the tiny model handles on CPU, the fleet's vocabulary, two ranks, and dropping
# zero-advantage groups so every step carries gradient.
DEMO_OVERRIDES = {
    "server": {"port": 0},
    "batching": {"token_budget": 2048, "world_size": 2},
    "rollouts": {"prompts_per_step": 8, "group_size": 8, "vocab_size": 512},
    "advantages": {"drop_zero_advantage": True},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", help="drive a running sidecar at HOST:PORT instead of starting one"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"steps to train (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--config",
        help="sidecar TOML config (demo defaults otherwise; with --address only its "
        "[accounting] section is used)",
    )
    parser.add_argument("--seed", type=int, default=0, help="fleet and model seed (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("rlfeed demo: --steps must be >= 1", file=sys.stderr)
        return 2
    from rlfeed.service import demo_run

    return demo_run.run_demo(
        address=args.address, steps=args.steps, config_path=args.config, seed=args.seed
    )
