"""Pass-rate curriculum simulation (chapter 14.5): episodes saved against pass rate reached.

Run:  .venv/bin/python tests/bench/bench_curriculum.py [--seeds 8]
Cost: about 10 s on one core (4 tables x 7 arms x 8 seeds, plus the 1,000,000-task timing).

A synthetic gym, not an LLM. Training task j passes with probability
sigmoid(base_j + skill + own_j), base_j ~ N(-0.8, 0.8) (so at first almost every group is
mixed, as in the chapter); `skill` is shared by all tasks, `own_j` is what training on
task j taught about it and decays by 1% per step while j is not visited (forgetting). A
held-out task passes with probability sigmoid(base_h + skill + 0.5 mean_j own_j), so the
held-out rate tracks training. Pass rates are the exact expected rates (no evaluation
noise). Each step asks the real `rlfeed.sched.curriculum.select_tasks` for 8 tasks, plays a
group of 8 Bernoulli episodes per task, computes the real group advantages
(`rlfeed.sched.advantages`, mode "mean") and feeds the group means to `update_pass_rates`.
Learning comes from the advantages only, so a zero-advantage group teaches nothing: a
group's signal is its mean squared advantage k/G (1 - k/G), and its share of the step's
gradient is set by the loss normalizer, the one modelling choice that decides the result:

- ``constant``   (Dr. GRPO-style constant normalizer): each group counts 1/8 however many
  were sampled; every informative group skipped is progress lost.
- ``batch_mean`` (token/sequence mean over the step's batch): each group counts
  1/(groups sampled); zero-advantage groups dilute the step, so a step of 2 informative
  groups moves as far as a step of 8. There is no gradient noise in the model, so this
  bounds the filter's cost from below, as ``constant`` bounds it from above.

Arms: unfiltered (estimator "last", low=-1, high=2: every task always in the pool), the
chapter's last-group filter (0, 1) with 1 or 2 revisits per step, EMA (decay 0.5) and Beta
(forgetting 0.7) estimators filtering at (0.1, 0.9), an oracle filtering the hidden true
pass rates at (0.1, 0.9) (a perfect estimator), and soft p(1-p) sampling. Every arm runs
the same seeds (same tasks per seed), so Δheld-out is paired by seed (± its standard
error). Tables: 20 tasks x 60 steps (the chapter's pool, where the filter saves rollouts)
and 200 tasks x 100 steps (a pool that never empties: the filter only changes which tasks
fill the batch, and revisits come on top). The last lines time update and select at
1,000,000 tasks (best of 3).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from rlfeed.sched.advantages import group_advantages, zero_advantage_group_share
from rlfeed.sched.curriculum import (
    CurriculumConfig,
    init_pass_rates,
    inside_filter,
    select_tasks,
    update_pass_rates,
)


@dataclass(kw_only=True, frozen=True)
class Gym:
    """The synthetic gym and learning model of one table (see the module docstring)."""

    num_tasks: int = 20  # training tasks (the chapter used 20)
    steps: int = 60  # training steps per run
    num_held_out: int = 200  # held-out tasks
    group_size: int = 8  # episodes per task per step
    prompts_per_step: int = 8  # tasks requested per step
    base_mean: float = -0.8  # base logits ~ N(base_mean, base_std): p0 mostly 0.15-0.6
    base_std: float = 0.8
    lr_skill: float = 0.2  # shared-skill gain per unit of the step's advantage signal
    lr_own: float = 2.0  # task-specific gain per unit of a group's signal (at share 1/8)
    forget: float = 0.01  # per-step decay of own_j while task j is not visited
    transfer: float = 0.5  # weight of mean task-specific progress in held-out logits
    normalizer: str = "constant"  # "constant" or "batch_mean" (see the module docstring)


LAST_STEPS = 20  # window of the zero-advantage share

# (name, config, oracle): an oracle arm filters on the hidden true pass rates.
ARMS: tuple[tuple[str, CurriculumConfig, bool], ...] = (
    ("unfiltered", CurriculumConfig(estimator="last", low=-1.0, high=2.0, revisits=0), False),
    ("last (0,1) r1", CurriculumConfig(estimator="last", low=0.0, high=1.0, revisits=1), False),
    ("last (0,1) r2", CurriculumConfig(estimator="last", low=0.0, high=1.0, revisits=2), False),
    (
        "ema .5 (.1,.9)",
        CurriculumConfig(estimator="ema", ema_decay=0.5, low=0.1, high=0.9, revisits=1),
        False,
    ),
    (
        "beta .7 (.1,.9)",
        CurriculumConfig(estimator="beta", beta_forgetting=0.7, low=0.1, high=0.9, revisits=1),
        False,
    ),
    ("oracle (.1,.9)", CurriculumConfig(estimator="last", low=0.1, high=0.9, revisits=1), True),
    ("soft p(1-p)", CurriculumConfig(estimator="ema", sampling="soft", soft_floor=0.01), False),
)


@dataclass
class RunResult:
    episodes: int
    informative_groups: int  # groups with a non-zero advantage
    zero_advantage_share: float  # share of groups, last LAST_STEPS steps
    train_pass_rate: float  # exact expected pass rate at the end
    held_out_pass_rate: float
    pool: int  # tasks inside the filter at the end


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def simulate(gym: Gym, config: CurriculumConfig, seed: int, *, oracle: bool = False) -> RunResult:
    world = np.random.default_rng(seed)  # the gym: same tasks for every arm of a seed
    base = world.normal(gym.base_mean, gym.base_std, size=gym.num_tasks)
    base_held_out = world.normal(gym.base_mean, gym.base_std, size=gym.num_held_out)
    rng = np.random.default_rng([seed, 1])  # task selection and rewards
    skill = 0.0
    own = np.zeros(gym.num_tasks)
    state = init_pass_rates(gym.num_tasks, config)
    episodes = informative = zero_groups = late_groups = 0
    for step in range(gym.steps):
        if oracle:  # filter on the hidden true pass rates: a perfect estimator
            truth = sigmoid(base + skill + own)
            tasks = select_tasks(replace(state, estimate=truth), gym.prompts_per_step, config, rng)
        else:
            tasks = select_tasks(state, gym.prompts_per_step, config, rng)
        visited = np.zeros(gym.num_tasks, dtype=bool)
        visited[tasks] = True
        if tasks.size:
            pass_rate = sigmoid(base[tasks] + skill + own[tasks])
            draws = rng.random((tasks.size, gym.group_size))
            rewards = (draws < pass_rate[:, None]).astype(np.float64).reshape(-1)
            group_ids = np.repeat(tasks, gym.group_size)  # select_tasks returns distinct tasks
            advantages = group_advantages(rewards, group_ids, mode="mean").astype(np.float64)
            # A group's signal: mean squared advantage = its reward variance k/G (1 - k/G).
            signal = (advantages.reshape(tasks.size, gym.group_size) ** 2).mean(axis=1)
            informative += int(np.count_nonzero(signal))
            # Each group's share of the step's gradient: 1/prompts with a constant
            # normalizer, 1/(groups sampled) with a batch mean, where zero-advantage
            # groups dilute the step.
            groups = gym.prompts_per_step if gym.normalizer == "constant" else tasks.size
            np.add.at(own, tasks, gym.lr_own * gym.prompts_per_step / groups * signal)
            skill += gym.lr_skill * signal.sum() / groups
            group_means = rewards.reshape(tasks.size, gym.group_size).mean(axis=1)
            state = update_pass_rates(state, tasks, group_means, gym.group_size, config)
            episodes += rewards.size
            if step >= gym.steps - LAST_STEPS:
                share = zero_advantage_group_share(rewards, group_ids)
                zero_groups += round(share * tasks.size)
                late_groups += tasks.size
        own[~visited] *= 1.0 - gym.forget
    train = sigmoid(base + skill + own).mean()
    held_out = sigmoid(base_held_out + skill + gym.transfer * own.mean()).mean()
    return RunResult(
        episodes=episodes,
        informative_groups=informative,
        zero_advantage_share=zero_groups / max(late_groups, 1),
        train_pass_rate=float(train),
        held_out_pass_rate=float(held_out),
        pool=int(inside_filter(state, config).sum()),
    )


def fmt(values: list[float], digits: int) -> str:
    array = np.asarray(values, dtype=float)
    return f"{array.mean():.{digits}f} ± {array.std(ddof=1) if array.size > 1 else 0:.{digits}f}"


def best_of(repeats: int, run) -> float:
    """Fastest of `repeats` wall times of run(), in seconds (the machine is shared)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def time_million_tasks() -> None:
    num_tasks, groups = 1_000_000, 8_192
    rng = np.random.default_rng(0)
    every_task = np.arange(num_tasks)
    every_mean = rng.integers(0, 9, num_tasks) / 8
    tasks = rng.integers(0, num_tasks, size=groups)
    means = rng.integers(0, 9, groups) / 8
    for estimator in ("last", "ema", "beta"):
        config = CurriculumConfig(estimator=estimator, low=0.1, high=0.9, revisits=64)
        soft = CurriculumConfig(estimator=estimator, sampling="soft")
        fresh = init_pass_rates(num_tasks, config)
        state = update_pass_rates(fresh, every_task, every_mean, 8, config)
        full = best_of(3, partial(update_pass_rates, fresh, every_task, every_mean, 8, config))
        step = best_of(3, partial(update_pass_rates, state, tasks, means, 8, config))
        select = best_of(3, partial(select_tasks, state, groups, config, rng))
        select_soft = best_of(3, partial(select_tasks, state, groups, soft, rng))
        print(
            f"  {estimator:5s} update: 1e6 groups {full * 1e3:5.0f} ms, {groups} groups "
            f"{step * 1e3:4.1f} ms | select {groups}: filter {select * 1e3:4.1f} ms, "
            f"soft {select_soft * 1e3:4.1f} ms"
        )


GYMS = (
    Gym(num_tasks=20, steps=60, normalizer="constant"),
    Gym(num_tasks=20, steps=60, normalizer="batch_mean"),
    Gym(num_tasks=200, steps=100, normalizer="constant"),
    Gym(num_tasks=200, steps=100, normalizer="batch_mean"),
)


def print_table(gym: Gym, seeds: list[int]) -> None:
    print(
        f"\n{gym.num_tasks} training tasks, {gym.steps} steps, {gym.normalizer} normalizer "
        f"({gym.num_held_out} held-out tasks, group {gym.group_size}, "
        f"{gym.prompts_per_step} prompts/step, {len(seeds)} seeds, mean ± std over seeds)"
    )
    print(
        f"{'arm':16s} {'episodes':>12s} {'saved':>6s} {'informative':>11s} "
        f"{'zero-adv@last20':>15s} {'train pass':>13s} {'held-out pass':>13s} "
        f"{'Δheld-out±SE':>14s} {'pool@end':>8s}"
    )
    baseline = None
    for name, config, oracle in ARMS:
        results = [simulate(gym, config, seed, oracle=oracle) for seed in seeds]
        held_out = np.array([r.held_out_pass_rate for r in results])
        if baseline is None:
            baseline = (np.mean([r.episodes for r in results]), held_out)
        saved = 1.0 - np.mean([r.episodes for r in results]) / baseline[0]
        # Paired by seed: the same tasks and held-out set in every arm.
        difference = held_out - baseline[1]
        se = difference.std(ddof=1) / np.sqrt(difference.size) if difference.size > 1 else 0.0
        print(
            f"{name:16s} {fmt([r.episodes for r in results], 0):>12s} {saved:6.1%} "
            f"{np.mean([r.informative_groups for r in results]):11.0f} "
            f"{fmt([r.zero_advantage_share for r in results], 2):>15s} "
            f"{fmt([r.train_pass_rate for r in results], 3):>13s} "
            f"{fmt(held_out.tolist(), 3):>13s} "
            f"{f'{difference.mean():+.3f}±{se:.3f}':>14s} "
            f"{np.mean([r.pool for r in results]):8.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8, help="seeds per arm (default 8)")
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    start = time.perf_counter()
    for gym in GYMS:
        print_table(gym, seeds)
    print(f"\nsimulation wall time {time.perf_counter() - start:.1f} s")
    print("1,000,000 tasks (one core):")
    time_million_tasks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
