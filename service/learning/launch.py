"""One learning run's processes, started and waited for: the shared part of `rlfeed demo`
(which prints as the run goes) and the curriculum experiment (which runs many).

`prepare` lays out the run directory (the spec, the warm-started weights as version
`start_step`); `run_workers` starts the trainer ranks and the producers against the
sidecar, waits for the ranks to train `spec.steps` steps, then stops the producers
(SIGTERM: they flush and exit).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlfeed.service.learning.processes import Running, start, start_ranks, terminate, wait_for
from rlfeed.service.learning.run_spec import WEIGHTS_DIR, RunSpec


def prepare(
    spec: RunSpec, run_dir: Path, cache_dir: Path | None = None, *, quiet: bool = False
) -> None:
    """The run directory: run.json, and the warm-started weights as version start_step."""
    from rlfeed.service.gym.splits import make_split
    from rlfeed.service.learning.policy import warm_started
    from rlfeed.service.learning.weights import WeightsPublisher

    began = time.monotonic()
    model, path = warm_started(spec.policy, make_split(spec.train_tasks, spec.gym_seed), cache_dir)
    if not quiet:
        print(f"warm-started policy {path} ({time.monotonic() - began:.1f} s)", flush=True)
    WeightsPublisher(Path(run_dir) / WEIGHTS_DIR).publish(spec.start_step, model.state_dict())
    spec.write(run_dir)


def run_workers(
    running: Running,
    spec: RunSpec,
    run_dir: Path,
    world_size: int,
    tick: Callable[[], None] | None = None,
) -> str | None:
    """Train `spec.steps` steps with `world_size` ranks and `spec.producers` producers;
    None once done, else what failed. `tick()` runs every 0.1 s while they work. Every
    process started is in `running.processes` (its `stop` kills what is left)."""
    arguments = [f"--run-dir={run_dir}"]
    trainers = start_ranks("rlfeed.service.learning.trainer", arguments, world_size)
    producer = [sys.executable, "-m", "rlfeed.service.learning.producer", *arguments]
    producers = [start([*producer, f"--index={i}"]) for i in range(spec.producers)]
    running.processes = trainers + producers
    failed = wait_for(trainers, watch=producers, tick=tick)
    codes = terminate(producers)
    if failed:
        return "a producer failed" if failed == [-1] else f"trainer rank(s) {failed} failed"
    if any(code != 0 for code in codes):
        return f"producer exit codes {codes}"
    return None
