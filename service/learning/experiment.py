"""The chapter's pass-rate experiment (Section 14.5) through the real service.

Each run is a real learning run: an embedded sidecar (Ray, gRPC), two producer processes
sampling the Hugging Face policy, two DDP trainer ranks, weights handed back after every
step. Arms differ only in the sidecar's `[curriculum]` section. Every arm runs with
`[rollouts] step_groups = "sampled"`: a step holds as many groups as one `SampleTasks`
round handed out, so when few tasks pass the filter the step samples fewer episodes (the
chapter's point); each producer asks for `prompts_per_step` tasks per round. Zero-advantage
groups are trained (not dropped), as in the chapter, so they count as sampled and wasted.

Figures per run: episodes sampled over the trained steps (the rollouts of their groups),
the zero-advantage share of the last 20 steps' groups, and the held-out pass rate (the
exact temperature-1 pass probability on the held-out split, `evaluation.py`) before
training and every `eval_every` steps. `summarize` turns runs into the chapter's table
(mean ± std across seeds; seeds are paired: seed s has the same tasks and initial weights
in every arm) and the verdict: a filtered arm keeps the chapter's shape when it samples at
least `MIN_SAVING` fewer episodes at a held-out pass rate within one seed standard
deviation (of the unfiltered arm) of the unfiltered arm's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

UNFILTERED = "unfiltered"
# The chapter's saving was 43-46%; the bar for "the same shape".
MIN_SAVING = 0.35
# Zero-advantage share is measured over the last this many steps, as in the chapter.
LAST_STEPS = 20


@dataclass(frozen=True)
class Arm:
    """One way of choosing tasks: the `[curriculum]` values it sets."""

    name: str
    curriculum: dict


ARMS: tuple[Arm, ...] = (
    # low = -1, high = 2: every task is inside the filter, 8 tasks per step.
    Arm(UNFILTERED, {"estimator": "last", "low": -1.0, "high": 2.0, "revisits": 0}),
    # The chapter's: the last group's mean, drop tasks whose last group was all-fail or
    # all-pass, one revisit of an excluded task per round.
    Arm("last-group (0, 1)", {"estimator": "last", "low": 0.0, "high": 1.0, "revisits": 1}),
    # A running average over visits never reaches 0 or 1: filter at (0.1, 0.9).
    Arm("EMA 0.5 (0.1, 0.9)", {"estimator": "ema", "ema_decay": 0.5, "low": 0.1, "high": 0.9}),
    # Probability ∝ p(1 - p) + floor: always a full round, weighted to informative tasks.
    Arm("soft p(1-p)", {"estimator": "last", "sampling": "soft", "low": -1.0, "high": 2.0}),
)


@dataclass(kw_only=True, frozen=True)
class ExperimentConfig:
    """The experiment's shape (defaults: the chapter's)."""

    train_tasks: int = 20  # training split (the chapter's 20 tasks)
    steps: int = 60  # steps per run
    seeds: tuple[int, ...] = (0, 1, 2, 3)  # per arm; a seed fixes tasks and initial weights
    prompts_per_step: int = 8  # tasks per round (= per step when all pass the filter)
    group_size: int = 8  # episodes per task
    lr: float = 1e-3  # Adam; the learning notes' setting for 8 x 8 episodes per step
    eval_every: int = 5  # held-out evaluation every this many steps
    producers: int = 2
    world_size: int = 2


@dataclass
class RunResult:
    """One run's figures (what `summarize` and the figure need; JSON-able)."""

    arm: str
    seed: int
    episodes_per_step: list[int]  # rollouts of each trained step's groups
    zero_advantage_groups: list[int]  # per step
    groups: list[int]  # per step
    held_out: dict[int, float]  # steps trained -> held-out pass rate after them
    train_pass_rate: dict[int, float]  # the same, on the training split
    episodes_sampled_all: int  # every episode the producers sampled (some never trained)
    tasks_sampled: int = 0  # the sidecar's counters
    revisits_sampled: int = 0
    wall_s: float = 0.0
    max_abs_logprob_diff_step0: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def episodes(self) -> int:
        return sum(self.episodes_per_step)

    def zero_advantage_share_last(self, steps: int = LAST_STEPS) -> float:
        zero, groups = self.zero_advantage_groups[-steps:], self.groups[-steps:]
        return sum(zero) / max(sum(groups), 1)

    @property
    def final_held_out(self) -> float:
        return self.held_out[max(self.held_out)]


def sidecar_overrides(arm: Arm, seed: int, config: ExperimentConfig) -> dict:
    """The `[section] key = value` changes of an arm's sidecar over `rlfeed serve`'s."""
    from rlfeed.service.gym.tasks import VOCAB_SIZE

    return {
        "server": {"port": 0},
        "batching": {"token_budget": 4096, "world_size": config.world_size},
        "rollouts": {
            "prompts_per_step": config.prompts_per_step,
            "group_size": config.group_size,
            "vocab_size": VOCAB_SIZE,
            "step_groups": "sampled",
        },
        "advantages": {"drop_zero_advantage": False},
        "curriculum": {**arm.curriculum, "seed": seed},
    }


def run_one(
    arm: Arm, seed: int, config: ExperimentConfig, cache_dir: Path | None = None
) -> RunResult:
    """One arm at one seed, through a sidecar of its own (started and stopped here)."""
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.server import start_server
    from rlfeed.service.learning.launch import prepare, run_workers
    from rlfeed.service.learning.policy import PolicyConfig
    from rlfeed.service.learning.processes import Running
    from rlfeed.service.learning.run_records import RunRecords
    from rlfeed.service.learning.run_spec import RunSpec

    started = time.monotonic()
    sidecar = start_server(with_overrides(SidecarConfig(), **sidecar_overrides(arm, seed, config)))
    running = Running()
    try:
        with tempfile.TemporaryDirectory(prefix="rlfeed-experiment-") as run_dir:
            spec = RunSpec(
                address=sidecar.address,
                start_step=0,
                steps=config.steps,
                train_tasks=config.train_tasks,
                gym_seed=seed,
                seed=seed,
                group_size=config.group_size,
                tasks_per_round=config.prompts_per_step,
                producers=config.producers,
                lr=config.lr,
                eval_every=config.eval_every,
                policy=PolicyConfig(seed=seed),
            )
            prepare(spec, Path(run_dir), cache_dir, quiet=True)
            failure = run_workers(running, spec, Path(run_dir), config.world_size)
            if failure is not None:
                raise RuntimeError(f"{arm.name}, seed {seed}: {failure}")
            records = RunRecords.load(Path(run_dir), spec.producers)
        counters = _counters(sidecar)
    finally:
        running.stop()
        sidecar.stop(grace=1.0)
    return _result(arm, seed, config, records, counters, time.monotonic() - started)


def _counters(sidecar):
    import ray

    return ray.get(sidecar.actor.status.remote()).counters


def _result(arm, seed, config, records, counters, wall_s) -> RunResult:
    figures = records.all_step_figures()
    if len(figures) != config.steps:
        raise RuntimeError(f"{arm.name}, seed {seed}: {len(figures)} of {config.steps} steps")
    groups = [f["rollouts_trained"] // config.group_size for f in figures]
    held_out = {0: records.evals[0]["held_out"]["all"]}
    train = {0: records.evals[0]["train"]["all"]}
    for index, f in enumerate(figures, start=1):
        if f["held_out_pass_rate"] is not None:
            held_out[index], train[index] = f["held_out_pass_rate"], f["train_pass_rate"]
    return RunResult(
        arm=arm.name,
        seed=seed,
        episodes_per_step=[f["rollouts_trained"] for f in figures],
        zero_advantage_groups=[
            round(f["zero_advantage_share"] * n) for f, n in zip(figures, groups, strict=True)
        ],
        groups=groups,
        held_out=held_out,
        train_pass_rate=train,
        episodes_sampled_all=sum(len(g["rewards"]) for g in records.groups.values()),
        tasks_sampled=int(counters.tasks_sampled),
        revisits_sampled=int(counters.revisits_sampled),
        wall_s=wall_s,
        max_abs_logprob_diff_step0=figures[0]["max_abs_logprob_diff"],
    )


def run_experiment(
    config: ExperimentConfig,
    arms: Sequence[Arm] = ARMS,
    *,
    cache_dir: Path | None = None,
    on_result: Callable[[RunResult], None] = lambda result: None,
) -> list[RunResult]:
    """Every arm at every seed, seed by seed (a partial experiment stays paired)."""
    results = []
    for seed in config.seeds:
        for arm in arms:
            result = run_one(arm, seed, config, cache_dir)
            on_result(result)
            results.append(result)
    return results


@dataclass(frozen=True)
class ArmRow:
    """One line of the chapter's table: mean and std across seeds."""

    arm: str
    seeds: int
    episodes: float
    episodes_std: float
    saving: float  # 1 - episodes / the unfiltered arm's (paired means)
    zero_share_last: float
    zero_share_last_std: float
    held_out: float
    held_out_std: float
    held_out_delta: float  # paired mean of (arm - unfiltered) final held-out
    keeps_shape: bool | None  # None for the unfiltered arm itself


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(results: Sequence[RunResult]) -> list[ArmRow]:
    """The table, one row per arm in the order first seen. Needs the unfiltered arm."""
    by_arm: dict[str, dict[int, RunResult]] = {}
    for result in results:
        by_arm.setdefault(result.arm, {})[result.seed] = result
    if UNFILTERED not in by_arm:
        raise ValueError(f"summarize needs the {UNFILTERED!r} arm to compare against")
    base = by_arm[UNFILTERED]
    base_held_out = [r.final_held_out for r in base.values()]
    noise = _std(base_held_out)  # one seed's standard deviation, the chapter's yardstick
    rows = []
    for arm, runs in by_arm.items():
        seeds = sorted(set(runs) & set(base))
        if not seeds:
            continue
        episodes = [runs[s].episodes for s in seeds]
        held_out = [runs[s].final_held_out for s in seeds]
        delta = statistics.mean(runs[s].final_held_out - base[s].final_held_out for s in seeds)
        saving = 1.0 - statistics.mean(episodes) / statistics.mean(base[s].episodes for s in seeds)
        zero = [runs[s].zero_advantage_share_last() for s in seeds]
        rows.append(
            ArmRow(
                arm=arm,
                seeds=len(seeds),
                episodes=statistics.mean(episodes),
                episodes_std=_std(episodes),
                saving=saving,
                zero_share_last=statistics.mean(zero),
                zero_share_last_std=_std(zero),
                held_out=statistics.mean(held_out),
                held_out_std=_std(held_out),
                held_out_delta=delta,
                keeps_shape=None
                if arm == UNFILTERED
                else (saving >= MIN_SAVING and -delta <= noise),
            )
        )
    return rows


def table_markdown(rows: Sequence[ArmRow]) -> str:
    """The chapter's table as Markdown."""
    lines = [
        "| arm | seeds | episodes sampled | saved vs unfiltered | zero-advantage share, "
        f"last {LAST_STEPS} steps | held-out pass rate | Δ held-out (paired) | shape |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        shape = {None: "—", True: "holds", False: "does not hold"}[row.keeps_shape]
        lines.append(
            f"| {row.arm} | {row.seeds} | {row.episodes:,.0f} ± {row.episodes_std:,.0f} | "
            f"{row.saving:.1%} | {row.zero_share_last:.2f} ± {row.zero_share_last_std:.2f} | "
            f"{row.held_out:.3f} ± {row.held_out_std:.3f} | {row.held_out_delta:+.3f} | "
            f"{shape} |"
        )
    return "\n".join(lines)


def results_json(config: ExperimentConfig, results, rows) -> dict:
    """Everything as strict-JSON-able values (held-out keys as strings, as JSON has)."""
    return {
        "config": asdict(config),
        "min_saving": MIN_SAVING,
        "table": [asdict(row) for row in rows],
        "runs": [
            {
                **asdict(r),
                "held_out": {str(k): v for k, v in r.held_out.items()},
                "train_pass_rate": {str(k): v for k, v in r.train_pass_rate.items()},
                "episodes": r.episodes,
                "zero_advantage_share_last": r.zero_advantage_share_last(),
            }
            for r in results
        ],
    }
