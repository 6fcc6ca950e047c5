"""What every process of one learning run agrees on, written once as `run.json` in the run
directory: the orchestrator writes it, producers and trainer ranks read it.

The run directory holds everything the processes share:

    run.json              this spec
    weights/              the published policy versions (`weights.py`)
    producer-<i>.jsonl    each producer's groups: rewards, versions, decode and ack times
    steps.jsonl           trainer rank 0's per-step records (all ranks' rollout ids and times)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from rlfeed.service.learning.policy import PolicyConfig

SPEC_FILE = "run.json"
STEPS_FILE = "steps.jsonl"
WEIGHTS_DIR = "weights"


def producer_log(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / f"producer-{index}.jsonl"


@dataclass(kw_only=True, frozen=True)
class RunSpec:
    """One learning run (all fields required unless a default is shown)."""

    address: str  # the sidecar's HOST:PORT
    start_step: int  # first step to train (the sidecar's next step at start)
    steps: int  # steps to train
    train_tasks: int  # size of the training split (the gym's 20 or 200)
    gym_seed: int = 0  # seed of the gym's splits
    seed: int = 0  # seed of the producers' sampling (the policy's is `policy.seed`)
    group_size: int = 8  # episodes per sampled task (the sidecar's [rollouts] group_size)
    tasks_per_round: int = 4  # tasks each producer asks the curriculum for per round
    producers: int = 2  # producer processes
    steps_ahead: int = 2  # producers stop sampling while this many steps are queued
    lr: float = 5e-4  # the trainer's Adam learning rate
    eval_every: int = 5  # held-out evaluation every this many steps (and before, after)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "train_tasks", "group_size", "tasks_per_round", "producers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.start_step < 0 or self.steps_ahead < 1 or self.eval_every < 1:
            raise ValueError(
                "RunSpec: start_step must be >= 0, steps_ahead and eval_every >= 1, got "
                f"{self.start_step}, {self.steps_ahead}, {self.eval_every}"
            )

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / SPEC_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> RunSpec:
        values = json.loads((Path(run_dir) / SPEC_FILE).read_text())
        values["policy"] = PolicyConfig(**values["policy"])
        return cls(**values)
