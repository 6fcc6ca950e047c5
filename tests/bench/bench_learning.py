"""The chapter's pass-rate experiment (Section 14.5) through the real service.

Run:  .venv/bin/python tests/bench/bench_learning.py [--seeds 0 1 2 3] [--steps 60]
          [--train-tasks 20] [--arms ...] [--out DIR]
Cost: about 40-60 s per run on 2 cores (a sidecar on embedded Ray, two producer processes
sampling a Hugging Face policy, two DDP trainer ranks), so 4 arms x 4 seeds is 12-16
minutes; `--seeds 0` runs one seed per arm (the slow test does this).

Arms (`service/learning/experiment.py`): unfiltered, the chapter's last-group filter
(0, 1) with one revisit, EMA (0.5) filtering at (0.1, 0.9), soft p(1-p) sampling. Each
sidecar runs `[rollouts] step_groups = "sampled"`, so a step holds the groups one round of
`SampleTasks` handed out. Writes `curriculum.md` (the table), `curriculum.json` (every
figure, per run and per step) and `curriculum.png` (Figure 14.3's analogue) under --out,
prints the table and the verdict. The verdict is reported, not asserted: the issue asks
for what comes out, whichever way it falls.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from rlfeed.service.learning.experiment import (
    ARMS,
    MIN_SAVING,
    ExperimentConfig,
    results_json,
    run_experiment,
    summarize,
    table_markdown,
)
from rlfeed.service.learning.experiment_figure import draw


def main(argv: list[str] | None = None) -> int:
    defaults = ExperimentConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(defaults.seeds))
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--train-tasks", type=int, default=defaults.train_tasks)
    parser.add_argument("--arms", nargs="+", default=[arm.name for arm in ARMS])
    parser.add_argument("--out", type=Path, default=Path("curriculum-experiment"))
    args = parser.parse_args(argv)
    # gRPC's C core notes every fork of a producer or rank it sees; the figures are ours.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    arms = [arm for arm in ARMS if arm.name in args.arms]
    config = replace(
        defaults, seeds=tuple(args.seeds), steps=args.steps, train_tasks=args.train_tasks
    )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def progress(result) -> None:
        print(
            f"{result.arm:<20} seed {result.seed}: {result.episodes:>5} episodes, held-out "
            f"{result.held_out[0]:.3f} -> {result.final_held_out:.3f}, zero-advantage "
            f"(last 20) {result.zero_advantage_share_last():.2f}, {result.wall_s:.0f} s",
            flush=True,
        )

    results = run_experiment(config, arms, on_result=progress)
    rows = summarize(results)
    table = table_markdown(rows)
    seconds = time.monotonic() - started
    title = f"{config.train_tasks} training tasks, {config.steps} steps, seeds {list(config.seeds)}"
    (args.out / "curriculum.md").write_text(f"{title}\n\n{table}\n")
    document = {**results_json(config, results, rows), "wall_s": seconds}
    (args.out / "curriculum.json").write_text(json.dumps(document, indent=1, allow_nan=False))
    draw(results, args.out / "curriculum.png", title)
    print(f"\n{title} ({seconds:.0f} s)\n\n{table}\n")
    for row in rows:
        if row.keeps_shape is not None:
            verdict = "holds" if row.keeps_shape else "does not hold"
            print(
                f"{row.arm}: saves {row.saving:.1%} (>= {MIN_SAVING:.0%}?) at Δ held-out "
                f"{row.held_out_delta:+.3f}: the chapter's shape {verdict}"
            )
    print(f"wrote {args.out}/curriculum.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
