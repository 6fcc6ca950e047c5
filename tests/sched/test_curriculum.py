"""Pass-rate curriculum: vectorized estimators against per-task loops, filter semantics."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.curriculum import (
    CurriculumConfig,
    PassRates,
    grow,
    init_pass_rates,
    inside_filter,
    select_tasks,
    update_pass_rates,
)

GROUP = 8


def loop_estimates(num_tasks, calls, config):
    """The straightforward computation: one group at a time, one task at a time."""
    estimate = [config.initial_estimate] * num_tasks
    visits = [0] * num_tasks
    a0, b0 = config.prior_alpha, config.prior_beta
    alpha, beta = [a0] * num_tasks, [b0] * num_tasks
    gamma, w = config.beta_forgetting, config.ema_decay
    for tasks, means, sizes in calls:
        for t, x, g in zip(tasks, means, sizes, strict=True):
            alpha[t] = a0 + gamma * (alpha[t] - a0) + x * g
            beta[t] = b0 + gamma * (beta[t] - b0) + (1 - x) * g
            if config.estimator == "last":
                estimate[t] = x
            elif config.estimator == "ema":
                estimate[t] = x if visits[t] == 0 else (1 - w) * estimate[t] + w * x
            else:
                estimate[t] = alpha[t] / (alpha[t] + beta[t])
            visits[t] += 1
    return np.array(estimate), np.array(visits), np.array(alpha), np.array(beta)


def run_calls(num_tasks, calls, config) -> PassRates:
    state = init_pass_rates(num_tasks, config)
    for tasks, means, sizes in calls:
        state = update_pass_rates(state, tasks, means, sizes, config)
    return state


def random_calls(rng, num_tasks, num_calls, max_groups):
    calls = []
    for _ in range(num_calls):
        m = int(rng.integers(0, max_groups + 1))
        tasks = rng.integers(0, num_tasks, size=m)  # repeats within a call are common
        sizes = rng.integers(1, 9, size=m)
        means = rng.integers(0, sizes + 1) / sizes
        calls.append((tasks, means, sizes))
    return calls


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    estimator=st.sampled_from(["last", "ema", "beta"]),
    ema_decay=st.sampled_from([1.0, 0.5, 0.3]),
    forgetting=st.sampled_from([1.0, 0.7]),
)
def test_estimators_match_sequential_per_group_loop(seed, estimator, ema_decay, forgetting):
    rng = np.random.default_rng(seed)
    config = CurriculumConfig(
        estimator=estimator,
        ema_decay=ema_decay,
        beta_forgetting=forgetting,
        prior_alpha=1.5,
        prior_beta=0.5,
    )
    calls = random_calls(rng, num_tasks=7, num_calls=4, max_groups=12)
    state = run_calls(7, calls, config)
    estimate, visits, alpha, beta = loop_estimates(7, calls, config)
    np.testing.assert_allclose(state.estimate, estimate, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(state.visits, visits)
    np.testing.assert_allclose(state.alpha, alpha, rtol=1e-12)
    np.testing.assert_allclose(state.beta, beta, rtol=1e-12)


ARRAYS = ("estimate", "visits", "alpha", "beta", "last_visit")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), estimator=st.sampled_from(["last", "ema", "beta"]))
def test_in_place_updates_give_exactly_the_copying_result(seed, estimator):
    rng = np.random.default_rng(seed)
    config = CurriculumConfig(estimator=estimator, ema_decay=0.5, beta_forgetting=0.7)
    calls = random_calls(rng, num_tasks=9, num_calls=5, max_groups=12)
    copying = run_calls(9, calls, config)
    state = init_pass_rates(9, config)
    for tasks, means, sizes in calls:
        state = update_pass_rates(state, tasks, means, sizes, config, in_place=True)
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(state, name), getattr(copying, name), err_msg=name)
    assert state.num_updates == copying.num_updates


@pytest.mark.parametrize("estimator", ["last", "ema", "beta"])
def test_an_update_that_is_not_in_place_leaves_the_given_state_as_it_was(estimator):
    config = CurriculumConfig(estimator=estimator)
    state = update_pass_rates(init_pass_rates(4, config), [0, 1], [0.5, 1.0], GROUP, config)
    before = {name: getattr(state, name).copy() for name in ARRAYS}
    after = update_pass_rates(state, [1, 2, 1], [0.25, 0.0, 0.75], GROUP, config)
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(state, name), before[name], err_msg=name)
    assert not np.array_equal(after.visits, before["visits"])


def test_last_keeps_the_last_occurrence_within_one_call():
    config = CurriculumConfig(estimator="last")
    state = init_pass_rates(3, config)
    state = update_pass_rates(state, [2, 0, 2, 2], [0.25, 1.0, 0.75, 0.5], GROUP, config)
    np.testing.assert_array_equal(state.estimate, [1.0, 0.5, 0.5])
    np.testing.assert_array_equal(state.visits, [1, 0, 3])
    np.testing.assert_array_equal(state.last_visit, [1, 0, 1])


def test_ema_keeps_an_exact_one_only_while_every_visit_was_all_pass():
    config = CurriculumConfig(estimator="ema", ema_decay=0.3)
    state = init_pass_rates(2, config)
    for _ in range(5):
        state = update_pass_rates(state, [0, 1, 1], [1.0, 1.0, 1.0], GROUP, config)
    assert state.estimate[0] == 1.0 and state.estimate[1] == 1.0
    state = update_pass_rates(state, [1, 1], [0.875, 1.0], GROUP, config)
    assert 0.875 < state.estimate[1] < 1.0
    np.testing.assert_array_equal(inside_filter(state, config), [False, True])


def test_beta_posterior_mean_starts_at_half_and_counts_pass_fractions():
    config = CurriculumConfig(estimator="beta")
    state = init_pass_rates(2, config)
    assert np.all(state.estimate == 0.5)
    state = update_pass_rates(state, [0, 1], [1.0, 0.25], [8, 4], config)
    # Uniform prior: 8/8 -> (1 + 8) / (2 + 8); 1/4 -> (1 + 1) / (2 + 4).
    np.testing.assert_allclose(state.estimate, [0.9, 2 / 6])


def test_last_group_filter_drops_exactly_all_fail_and_all_pass_tasks():
    rng = np.random.default_rng(7)
    config = CurriculumConfig(estimator="last", low=0.0, high=1.0)
    calls = random_calls(rng, num_tasks=50, num_calls=5, max_groups=40)
    state = run_calls(50, calls, config)
    last_mean = {}
    for tasks, means, _ in calls:
        last_mean.update(zip(tasks.tolist(), means.tolist(), strict=True))
    want = [last_mean.get(t, 0.5) not in (0.0, 1.0) for t in range(50)]
    np.testing.assert_array_equal(inside_filter(state, config), want)
    assert not all(want) and any(want)


def test_wide_bounds_keep_every_task():
    config = CurriculumConfig(estimator="last", low=-1.0, high=2.0, revisits=3)
    state = init_pass_rates(20, config)
    state = update_pass_rates(state, np.arange(20), np.arange(20) % 2, GROUP, config)
    assert inside_filter(state, config).all()
    chosen = select_tasks(state, 8, config, 0)
    assert chosen.size == 8  # no task is outside, so there is nothing to revisit


def test_filter_samples_fewer_when_fewer_pass_and_revisits_come_from_excluded():
    config = CurriculumConfig(estimator="last", revisits=2)
    state = init_pass_rates(100, config)
    state = update_pass_rates(state, np.arange(100), (np.arange(100) >= 3).astype(float), 8, config)
    state = update_pass_rates(state, [0, 1, 2], [0.5, 0.5, 0.5], GROUP, config)
    keep = inside_filter(state, config)
    assert keep.sum() == 3
    rng = np.random.default_rng(0)
    for _ in range(50):
        chosen = select_tasks(state, 8, config, rng)
        assert chosen.size == 3 + 2
        assert np.unique(chosen).size == chosen.size
        assert keep[chosen[:3]].all()
        assert not keep[chosen[3:]].any()


def test_empty_pool_samples_only_revisits():
    config = CurriculumConfig(estimator="last", revisits=2)
    state = init_pass_rates(6, config)
    state = update_pass_rates(state, np.arange(6), [0, 1, 1, 0, 1, 1], GROUP, config)
    assert not inside_filter(state, config).any()
    chosen = select_tasks(state, 8, config, 3)
    assert chosen.size == 2 and np.unique(chosen).size == 2


def test_revisits_are_uniform_over_excluded_tasks():
    config = CurriculumConfig(estimator="last", revisits=1)
    state = init_pass_rates(10, config)
    state = update_pass_rates(state, np.arange(5), np.ones(5), GROUP, config)
    rng = np.random.default_rng(1)
    revisited = np.concatenate([select_tasks(state, 5, config, rng)[5:] for _ in range(2_000)])
    counts = np.bincount(revisited, minlength=10)
    assert counts[5:].sum() == 0
    chi2 = ((counts[:5] - 400) ** 2 / 400).sum()
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001


def test_soft_sampling_frequencies_are_proportional_to_p_times_one_minus_p():
    config = CurriculumConfig(estimator="last", sampling="soft", soft_floor=0.01)
    state = init_pass_rates(6, config)
    means = np.array([0.0, 0.125, 0.25, 0.5, 0.875, 1.0])
    state = update_pass_rates(state, np.arange(6), means, GROUP, config)
    rng = np.random.default_rng(2)
    draws = 20_000
    counts = np.bincount(
        np.concatenate([select_tasks(state, 1, config, rng) for _ in range(draws)]), minlength=6
    )
    weight = means * (1 - means) + 0.01
    expected = draws * weight / weight.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert counts[0] > 0 and counts[5] > 0  # the floor: a saturated task stays possible


def test_soft_sampling_without_replacement_is_successive_weighted_draws():
    # Ordered pairs (i, j) must have probability w_i / W * w_j / (W - w_i).
    config = CurriculumConfig(estimator="last", sampling="soft", soft_floor=0.05)
    state = init_pass_rates(3, config)
    means = np.array([0.0, 0.25, 0.5])
    state = update_pass_rates(state, np.arange(3), means, GROUP, config)
    weight = means * (1 - means) + 0.05
    total = weight.sum()
    pairs = [(i, j) for i in range(3) for j in range(3) if i != j]
    expected = np.array([weight[i] / total * weight[j] / (total - weight[i]) for i, j in pairs])
    rng = np.random.default_rng(4)
    draws = 12_000
    seen = [tuple(select_tasks(state, 2, config, rng).tolist()) for _ in range(draws)]
    counts = np.array([seen.count(pair) for pair in pairs])
    chi2 = ((counts - draws * expected) ** 2 / (draws * expected)).sum()
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001


def test_soft_sampling_returns_n_distinct_tasks():
    config = CurriculumConfig(sampling="soft")
    state = init_pass_rates(30, config)
    chosen = select_tasks(state, 12, config, 5)
    assert chosen.size == 12 and np.unique(chosen).size == 12
    assert select_tasks(state, 100, config, 5).size == 30


def test_selection_is_deterministic_given_a_seed():
    rng = np.random.default_rng(11)
    for sampling in ("filter", "soft"):
        config = CurriculumConfig(estimator="ema", sampling=sampling, low=0.05, high=0.95)
        state = run_calls(500, random_calls(rng, 500, 3, 400), config)
        first = select_tasks(state, 64, config, 123)
        np.testing.assert_array_equal(first, select_tasks(state, 64, config, 123))
        np.testing.assert_array_equal(
            first, select_tasks(state, 64, config, np.random.default_rng(123))
        )
        assert not np.array_equal(first, select_tasks(state, 64, config, 124))


def test_update_is_pure():
    config = CurriculumConfig(estimator="beta")
    state = init_pass_rates(4, config)
    before = state.estimate.copy()
    update_pass_rates(state, [1], [1.0], GROUP, config)
    np.testing.assert_array_equal(state.estimate, before)
    assert state.num_updates == 0


def test_grow_registers_unvisited_tasks_and_keeps_old_state():
    config = CurriculumConfig(estimator="last")
    state = update_pass_rates(init_pass_rates(2, config), [0], [1.0], GROUP, config)
    grown = grow(state, 5)
    np.testing.assert_array_equal(grown.estimate, [1.0, 0.5, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(grown.visits, [1, 0, 0, 0, 0])
    assert grown.alpha.size == grown.beta.size == grown.last_visit.size == 5
    grown = update_pass_rates(grown, [4], [0.0], GROUP, config)
    assert grown.estimate[4] == 0.0
    with pytest.raises(ValueError, match="num_tasks"):
        grow(state, 1)


def test_million_tasks_update_and_select_smoke():
    num_tasks = 1_000_000
    rng = np.random.default_rng(0)
    tasks = rng.integers(0, num_tasks, size=num_tasks)
    means = rng.integers(0, 9, size=num_tasks) / 8
    config = CurriculumConfig(estimator="ema", low=0.05, high=0.95, revisits=16)
    state = init_pass_rates(num_tasks, config)
    start = time.perf_counter()
    state = update_pass_rates(state, tasks, means, GROUP, config)
    chosen = select_tasks(state, 4_096, config, rng)
    elapsed = time.perf_counter() - start
    assert chosen.size == 4_096 + 16
    assert elapsed < 5.0  # generous smoke bound; the bench reports the real figure


def test_bad_input_names_the_field_and_index():
    config = CurriculumConfig(estimator="last")
    state = init_pass_rates(3, config)
    with pytest.raises(ValueError, match=r"group_mean_reward\[1\]"):
        update_pass_rates(state, [0, 1], [0.5, float("nan")], GROUP, config)
    with pytest.raises(ValueError, match=r"group_mean_reward\[0\]"):
        update_pass_rates(state, [0], [1.5], GROUP, config)
    with pytest.raises(ValueError, match=r"task_index\[1\]=3 is out of range"):
        update_pass_rates(state, [0, 3], [0.5, 0.5], GROUP, config)
    with pytest.raises(ValueError, match=r"task_index\[0\]=-1"):
        update_pass_rates(state, [-1], [0.5], GROUP, config)
    with pytest.raises(ValueError, match=r"group_size\[1\]"):
        update_pass_rates(state, [0, 1], [0.5, 0.5], [8, 0], config)
    with pytest.raises(ValueError, match="group_size must be a scalar or have one entry"):
        update_pass_rates(state, [0, 1], [0.5, 0.5], [8, 8, 8], config)
    with pytest.raises(ValueError, match="task_index has 2 entries"):
        update_pass_rates(state, [0, 1], [0.5], GROUP, config)
    with pytest.raises(ValueError, match="prior"):
        update_pass_rates(state, [0], [0.5], GROUP, CurriculumConfig(prior_alpha=2.0))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("estimator", "median"),
        ("sampling", "greedy"),
        ("ema_decay", 0.0),
        ("prior_alpha", 0.0),
        ("beta_forgetting", 1.5),
        ("revisits", -1),
        ("soft_floor", 0.0),
        ("low", 2.0),
    ],
)
def test_bad_config_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CurriculumConfig(**{field: value})
