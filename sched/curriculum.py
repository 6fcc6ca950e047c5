"""Per-task pass-rate estimates and pass-rate-filtered task selection (chapter 14.5).

A group whose G rewards are all equal has zero advantage: G rollouts, no gradient. Late in
training most groups are like that, so the curriculum keeps a running estimate p_j of each
task's pass rate and samples task j only while ``low < p_j < high`` (mode "filter"), plus
`revisits` tasks from outside the filter so that a stale estimate is refreshed and a task
the policy forgets can come back. When few tasks pass the filter, fewer episodes are
sampled: that is the point. Mode "soft" instead samples tasks with probability
proportional to p_j (1 - p_j), the Bernoulli reward variance, plus a small floor.

Estimators (the estimates cost no extra rollouts; they reuse the training groups):

- ``last``: the last group's mean reward. The crudest: with G = 8 and a true pass rate of
  0.9 a group is all-pass 43% of the time, and one such group drops the task.
- ``ema``:  exponential moving average, seeded by the first visit (the initial 0.5 carries
  no weight once a task is seen), then p <- p + ema_decay * (x - p). A task whose every
  visit had the same mean x keeps exactly x, so a (0, 1) filter drops a task only when all
  its visits were all-pass (or all all-fail); one mixed visit keeps it strictly inside for
  a while, so pair ema with interior thresholds (e.g. 0.05 / 0.95) to drop it again.
- ``beta``: Beta-Bernoulli posterior mean alpha / (alpha + beta) with prior
  (prior_alpha, prior_beta); a group of size G with mean x adds x G successes and
  (1 - x) G failures. Optionally each visit first discounts the old evidence (not the
  prior) by `beta_forgetting`, so the estimate follows a policy that changes. The posterior
  mean never reaches 0 or 1: use interior thresholds (one all-pass group of 8 on the
  uniform prior gives 0.9).

Rewards are treated as pass fractions: group means must lie in [0, 1].

All state is a `PassRates` of numpy arrays; every function is pure (returns a new state) and
vectorized over tasks and groups (sorting, `reduceat`, `Generator.choice`), no Python loop
per task or group. With 1,000,000 tasks, a step of 8,192 groups updates in 10-20 ms
(mostly copying the [T] arrays, the price of purity), 1,000,000 groups in 0.2-0.4 s, and
selecting 8,192 tasks takes 4-8 ms filtered, 20-50 ms soft (one shared core;
`tests/bench/bench_curriculum.py` prints the figures).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

Estimator = Literal["last", "ema", "beta"]
Sampling = Literal["filter", "soft"]

_ESTIMATORS = ("last", "ema", "beta")
_SAMPLINGS = ("filter", "soft")


@dataclass(kw_only=True, frozen=True)
class CurriculumConfig:
    """How pass rates are estimated and tasks selected. Defaults follow the chapter."""

    # Pass-rate estimator: "last" (last group's mean), "ema" or "beta" (see module doc).
    estimator: Estimator = "ema"
    # Keep-filter bounds, exclusive: a task is sampled while low < estimate < high.
    # low=0, high=1 drops tasks estimated all-fail / all-pass; low=-1, high=2 keeps all.
    low: float = 0.0
    high: float = 1.0
    # EMA weight of the newest visit, in (0, 1]; 0.5 halves an old visit's weight per visit.
    ema_decay: float = 0.5
    # Beta prior pseudo-counts (> 0); 1, 1 is uniform, so an unvisited task's estimate is 0.5.
    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    # Per-visit discount of old Beta evidence, in (0, 1]; 1.0 = exact posterior (no
    # forgetting), 0.8 = a visit's evidence counts 0.8x at the next visit of that task.
    beta_forgetting: float = 1.0
    # Tasks drawn uniformly from OUTSIDE the filter per request (filter mode), >= 0.
    revisits: int = 1
    # "filter": uniform over tasks inside the filter; "soft": probability ∝ p (1 - p).
    sampling: Sampling = "filter"
    # Soft mode: added to p (1 - p) (max 0.25) so no task is impossible; 0.01 makes a
    # saturated task 26x less likely than a p = 0.5 one. > 0.
    soft_floor: float = 0.01

    def __post_init__(self) -> None:
        if self.estimator not in _ESTIMATORS:
            raise ValueError(f"estimator must be one of {_ESTIMATORS}, got {self.estimator!r}")
        if self.sampling not in _SAMPLINGS:
            raise ValueError(f"sampling must be one of {_SAMPLINGS}, got {self.sampling!r}")
        if not (np.isfinite(self.low) and np.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"need finite low < high, got low={self.low}, high={self.high}")
        if not 0.0 < self.ema_decay <= 1.0:
            raise ValueError(f"ema_decay must be in (0, 1], got {self.ema_decay}")
        if not (self.prior_alpha > 0 and self.prior_beta > 0):
            raise ValueError(
                f"prior_alpha and prior_beta must be > 0, got {self.prior_alpha}, {self.prior_beta}"
            )
        if not 0.0 < self.beta_forgetting <= 1.0:
            raise ValueError(f"beta_forgetting must be in (0, 1], got {self.beta_forgetting}")
        if int(self.revisits) != self.revisits or self.revisits < 0:
            raise ValueError(f"revisits must be a whole number >= 0, got {self.revisits!r}")
        if not (np.isfinite(self.soft_floor) and self.soft_floor > 0):
            raise ValueError(f"soft_floor must be finite and > 0, got {self.soft_floor}")

    @property
    def initial_estimate(self) -> float:
        """Estimate of an unvisited task: 0.5, or the prior mean for the beta estimator."""
        if self.estimator == "beta":
            return self.prior_alpha / (self.prior_alpha + self.prior_beta)
        return 0.5


@dataclass(frozen=True)
class PassRates:
    """Curriculum state over T tasks (all arrays [T]); treat as immutable (its owner may
    update it with `update_pass_rates(..., in_place=True)`).

    estimate:   float64, the pass rate used by the filter (initial_estimate until visited).
    visits:     int64, groups seen per task.
    alpha:      float64, Beta posterior success parameter (prior + discounted successes);
    beta:       float64, Beta posterior failure parameter; maintained for every estimator.
    last_visit: int64, the update number (1-based call count) of the last visit; 0 = never.
    num_updates: calls to `update_pass_rates` so far.
    prior_alpha, prior_beta, initial_estimate: fixed at init, used by `grow`.
    """

    estimate: np.ndarray
    visits: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    last_visit: np.ndarray
    num_updates: int
    prior_alpha: float
    prior_beta: float
    initial_estimate: float

    @property
    def num_tasks(self) -> int:
        return int(self.estimate.size)


def _fresh(num_tasks: int, prior_alpha: float, prior_beta: float, initial: float) -> tuple:
    return (
        np.full(num_tasks, initial, dtype=np.float64),
        np.zeros(num_tasks, dtype=np.int64),
        np.full(num_tasks, prior_alpha, dtype=np.float64),
        np.full(num_tasks, prior_beta, dtype=np.float64),
        np.zeros(num_tasks, dtype=np.int64),
    )


def _check_count(value: int, name: str) -> int:
    if int(value) != value or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(value)


def init_pass_rates(num_tasks: int, config: CurriculumConfig) -> PassRates:
    """State for `num_tasks` unvisited tasks (estimate = config.initial_estimate, 0.5)."""
    num_tasks = _check_count(num_tasks, "num_tasks")
    arrays = _fresh(num_tasks, config.prior_alpha, config.prior_beta, config.initial_estimate)
    return PassRates(
        *arrays,
        num_updates=0,
        prior_alpha=config.prior_alpha,
        prior_beta=config.prior_beta,
        initial_estimate=config.initial_estimate,
    )


def grow(state: PassRates, num_tasks: int) -> PassRates:
    """State with `num_tasks` tasks in total (>= current); new tasks are unvisited."""
    num_tasks = _check_count(num_tasks, "num_tasks")
    if num_tasks < state.num_tasks:
        raise ValueError(f"num_tasks={num_tasks} is below the current {state.num_tasks} tasks")
    extra = _fresh(
        num_tasks - state.num_tasks, state.prior_alpha, state.prior_beta, state.initial_estimate
    )
    old = (state.estimate, state.visits, state.alpha, state.beta, state.last_visit)
    grown = [np.concatenate([a, b]) for a, b in zip(old, extra, strict=True)]
    return replace(
        state,
        estimate=grown[0],
        visits=grown[1],
        alpha=grown[2],
        beta=grown[3],
        last_visit=grown[4],
    )


def _validated_groups(
    state: PassRates, task_index: ArrayLike, group_mean_reward: ArrayLike, group_size: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tasks = np.atleast_1d(np.asarray(task_index))
    means = np.atleast_1d(np.asarray(group_mean_reward, dtype=np.float64))
    if tasks.ndim != 1 or means.ndim != 1:
        raise ValueError("task_index and group_mean_reward must be 1-D (one entry per group)")
    if tasks.size != means.size:
        raise ValueError(
            f"task_index has {tasks.size} entries but group_mean_reward has {means.size}"
        )
    if tasks.size and not np.issubdtype(tasks.dtype, np.integer):
        raise ValueError(f"task_index must be integers, got dtype {tasks.dtype}")
    tasks = tasks.astype(np.int64, copy=False)
    out_of_range = np.flatnonzero((tasks < 0) | (tasks >= state.num_tasks))
    if out_of_range.size:
        i = int(out_of_range[0])
        raise ValueError(f"task_index[{i}]={int(tasks[i])} is out of range [0, {state.num_tasks})")
    bad = np.flatnonzero(~np.isfinite(means) | (means < 0) | (means > 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"group_mean_reward[{i}]={means[i]!r} (task {int(tasks[i])}) must be a finite "
            "pass fraction in [0, 1]"
        )
    try:
        sizes = np.broadcast_to(np.asarray(group_size), tasks.shape)
    except ValueError:
        raise ValueError(
            f"group_size must be a scalar or have one entry per group ({tasks.size}), "
            f"got shape {np.shape(group_size)}"
        ) from None
    bad = np.flatnonzero(~(np.equal(np.mod(sizes, 1), 0) & (sizes >= 1)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"group_size[{i}]={sizes[i]!r} must be a whole number >= 1")
    return tasks, means, sizes.astype(np.float64)


def _stable_order(tasks: np.ndarray, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, tasks[order]): tasks ascending, occurrences of a task in call order.

    One unstable sort of the combined key task * m + position (several times faster than a
    stable argsort of 1e6 entries); falls back to the stable argsort if the key could
    overflow int64.
    """
    m = tasks.size
    if num_tasks < np.iinfo(np.int64).max // (m + 1):
        key = np.sort(tasks * m + np.arange(m, dtype=np.int64))
        return key % m, key // m
    order = np.argsort(tasks, kind="stable")
    return order, tasks[order]


def update_pass_rates(
    state: PassRates,
    task_index: ArrayLike,
    group_mean_reward: ArrayLike,
    group_size: ArrayLike,
    config: CurriculumConfig,
    *,
    in_place: bool = False,
) -> PassRates:
    """New state after observing groups (one call per training step).

    task_index:        [m] ints in [0, T); a task may appear several times.
    group_mean_reward: [m] pass fractions in [0, 1] (the group's mean reward).
    group_size:        scalar or [m] whole numbers >= 1 (rollouts per group; used by beta).

    Repeated tasks in one call are applied in the given order, exactly as m sequential
    single-group updates would be: "last" keeps the last occurrence; "ema" and "beta" use
    the closed form of the sequential recursion (p_m = (1-w)^m p_0 + w sum (1-w)^(m-i) x_i),
    so the cost is one sort, not a loop. alpha/beta are updated for every estimator.

    in_place: write into `state`'s arrays instead of copies, so a call costs O(m log m)
    rather than O(T): for a caller that owns `state` and updates it often (the scheduler,
    once per ingest batch, over pools of up to a million tasks). The result is identical;
    `state` itself then holds the new arrays (only its num_updates stays old).
    """
    if (config.prior_alpha, config.prior_beta) != (state.prior_alpha, state.prior_beta):
        raise ValueError(
            f"config prior ({config.prior_alpha}, {config.prior_beta}) differs from the "
            f"state's ({state.prior_alpha}, {state.prior_beta}); the prior is fixed at init"
        )
    tasks, means, sizes = _validated_groups(state, task_index, group_mean_reward, group_size)
    num_updates = state.num_updates + 1
    if tasks.size == 0:
        return replace(state, num_updates=num_updates)

    def own(array: np.ndarray) -> np.ndarray:
        return array if in_place else array.copy()

    order, sorted_tasks = _stable_order(tasks, state.num_tasks)
    x = means[order]
    starts = np.flatnonzero(np.r_[True, sorted_tasks[1:] != sorted_tasks[:-1]])
    counts = np.diff(np.r_[starts, sorted_tasks.size])
    task = sorted_tasks[starts]
    # How many later occurrences of the same task follow each occurrence in this call.
    later = np.repeat(starts + counts, counts) - 1 - np.arange(sorted_tasks.size)

    def discounted_sum(values: np.ndarray, decay: float) -> np.ndarray:
        return np.add.reduceat(values * np.power(decay, later), starts)

    gamma = config.beta_forgetting
    decay_all = np.power(gamma, counts)
    successes = x * sizes[order]
    alpha = own(state.alpha)
    beta = own(state.beta)
    alpha[task] = state.prior_alpha + decay_all * (alpha[task] - state.prior_alpha)
    alpha[task] += discounted_sum(successes, gamma)
    beta[task] = state.prior_beta + decay_all * (beta[task] - state.prior_beta)
    beta[task] += discounted_sum(sizes[order] - successes, gamma)

    estimate = own(state.estimate)
    if config.estimator == "last":
        estimate[task] = x[starts + counts - 1]
    elif config.estimator == "ema":
        w = config.ema_decay
        seeded = state.visits[task] == 0
        start_value = np.where(seeded, x[starts], state.estimate[task])
        # A first visit seeds the average: applying x_1 to a start of x_1 is a no-op.
        value = np.power(1.0 - w, counts) * start_value + w * discounted_sum(x, 1.0 - w)
        # A convex combination; clip to its inputs' range so rounding cannot leave it, and a
        # task whose visits all had the same mean keeps exactly that mean.
        low = np.minimum(start_value, np.minimum.reduceat(x, starts))
        high = np.maximum(start_value, np.maximum.reduceat(x, starts))
        estimate[task] = np.clip(value, low, high)
    else:
        estimate[task] = alpha[task] / (alpha[task] + beta[task])

    visits = own(state.visits)
    visits[task] += counts
    last_visit = own(state.last_visit)
    last_visit[task] = num_updates
    return replace(
        state,
        estimate=estimate,
        visits=visits,
        alpha=alpha,
        beta=beta,
        last_visit=last_visit,
        num_updates=num_updates,
    )


def inside_filter(state: PassRates, config: CurriculumConfig) -> np.ndarray:
    """bool [T]: low < estimate < high (the tasks the filter keeps for sampling)."""
    return (state.estimate > config.low) & (state.estimate < config.high)


def select_tasks(
    state: PassRates,
    n: int,
    config: CurriculumConfig,
    rng: np.random.Generator | int,
) -> np.ndarray:
    """Task indices to sample this step; int64, distinct, deterministic given `rng`.

    filter: min(n, #inside) tasks drawn uniformly without replacement from those inside the
        filter (fewer when fewer pass: no batch padding with uninformative tasks), followed
        by min(config.revisits, #outside) tasks drawn uniformly from those outside it.
    soft:   min(n, T) tasks without replacement, each draw with probability proportional to
        estimate (1 - estimate) + soft_floor among the tasks not yet drawn, returned in draw
        order; `revisits` is not used (the floor plays its role).
    """
    n = _check_count(n, "n")
    generator = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if config.sampling == "soft":
        p = np.clip(state.estimate, 0.0, 1.0)
        weight = p * (1.0 - p) + config.soft_floor
        # Exponential race (Efraimidis-Spirakis): the n smallest E_j / w_j, E_j ~ Exp(1),
        # are a weighted draw without replacement (each next pick ∝ w among those left).
        # O(T) with argpartition, against O(n T) for repeated cumulative sums.
        keys = generator.exponential(size=state.num_tasks) / weight
        size = min(n, state.num_tasks)
        if size == 0:
            return np.zeros(0, dtype=np.int64)
        if size < state.num_tasks:
            chosen = np.argpartition(keys, size - 1)[:size]
        else:
            chosen = np.arange(state.num_tasks)
        return chosen[np.argsort(keys[chosen], kind="stable")].astype(np.int64)
    keep = inside_filter(state, config)
    inside = np.flatnonzero(keep)
    outside = np.flatnonzero(~keep)
    chosen = generator.choice(inside, size=min(n, inside.size), replace=False)
    revisit = generator.choice(outside, size=min(int(config.revisits), outside.size), replace=False)
    return np.concatenate([chosen, revisit]).astype(np.int64)
