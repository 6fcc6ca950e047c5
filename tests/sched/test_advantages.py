"""Group advantages: checked against a per-group Python loop over the same rollouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.advantages import (
    group_advantages,
    zero_advantage_group_share,
    zero_advantage_groups,
)


def loop_advantages(rewards, group_ids, mode, scale=1.0, eps=1e-6):
    """The straightforward computation: one Python pass per group."""
    out = [0.0] * len(rewards)
    for group in set(group_ids):
        members = [i for i, g in enumerate(group_ids) if g == group]
        values = [rewards[i] for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for i in members:
            if len(set(values)) == 1:
                out[i] = 0.0
            elif mode == "mean":
                out[i] = rewards[i] - mean
            elif mode == "mean_std":
                out[i] = (rewards[i] - mean) / (std + eps)
            else:
                out[i] = (rewards[i] - mean) / scale
    return np.array(out)


rollouts = st.lists(
    st.tuples(
        st.integers(min_value=-(2**40), max_value=2**40).map(lambda g: g % 7 * 1_000_003 - 5),
        st.sampled_from([0.0, 1.0, 0.5, -1.0, 0.25, 3.0]),
    ),
    min_size=0,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(rollouts, st.sampled_from(["mean", "mean_std", "constant"]))
def test_group_advantages_match_per_group_loop(pairs, mode):
    group_ids = [g for g, _ in pairs]
    rewards = [r for _, r in pairs]
    got = group_advantages(rewards, np.array(group_ids, dtype=np.int64), mode=mode, scale=4.0)
    assert got.dtype == np.float32
    assert got.shape == (len(pairs),)
    want = loop_advantages(rewards, group_ids, mode, scale=4.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_advantages_sum_to_zero_within_each_group():
    rng = np.random.default_rng(0)
    group_ids = rng.integers(-50, 50, size=2_000)
    rewards = rng.normal(size=2_000)
    advantages = group_advantages(rewards, group_ids, mode="mean_std").astype(np.float64)
    _, inverse = np.unique(group_ids, return_inverse=True)
    np.testing.assert_allclose(np.bincount(inverse, weights=advantages), 0.0, atol=1e-4)


def test_mean_std_uses_population_std_of_each_group():
    # Group 7: rewards 0, 1 -> mean 0.5, population std 0.5 -> advantages -1, +1.
    got = group_advantages([0.0, 1.0, 2.0, 2.0], [7, 7, 3, 3], mode="mean_std", eps=0.0)
    np.testing.assert_array_equal(got, [-1.0, 1.0, 0.0, 0.0])


def test_constant_group_gets_exact_zero_even_with_inexact_mean():
    # Three times 0.1 sums to 0.30000000000000004, so r - mean is not exactly zero.
    rewards = [0.1, 0.1, 0.1, 0.0, 1.0]
    for mode in ("mean", "mean_std", "constant"):
        got = group_advantages(rewards, [1, 1, 1, 2, 2], mode=mode, eps=0.0)
        assert np.all(got[:3] == 0.0)
        assert np.all(got[3:] != 0.0)


def test_constant_mode_divides_by_scale_not_by_std():
    got = group_advantages([0.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], mode="constant", scale=2.0)
    np.testing.assert_allclose(got, np.array([-0.25, -0.25, -0.25, 0.75]) / 2.0)


def test_zero_advantage_groups_flag_all_pass_all_fail_and_ties():
    rewards = [1, 1, 1, 0, 0, 0, 1, 0, 0.5, 0.5]
    groups = [5, 5, 5, 9, 9, 9, 2, 2, 40, 40]
    flags = zero_advantage_groups(rewards, groups)
    np.testing.assert_array_equal(flags, [1, 1, 1, 1, 1, 1, 0, 0, 1, 1])
    assert zero_advantage_group_share(rewards, groups) == pytest.approx(3 / 4)


def test_zero_advantage_share_counts_groups_not_rollouts():
    # One big all-pass group of 10 and one mixed group of 2: share of groups is 1/2.
    rewards = [1.0] * 10 + [0.0, 1.0]
    groups = [0] * 10 + [1, 1]
    assert zero_advantage_group_share(rewards, groups) == 0.5
    assert zero_advantage_group_share([], []) == 0.0


def test_zero_advantage_flags_match_per_group_loop():
    rng = np.random.default_rng(3)
    groups = rng.integers(0, 300, size=3_000) * 17
    rewards = (rng.random(3_000) < 0.8).astype(np.float64)
    values_of_group: dict[int, set[float]] = {}
    for reward, group in zip(rewards.tolist(), groups.tolist(), strict=True):
        values_of_group.setdefault(group, set()).add(reward)
    want = [len(values_of_group[g]) == 1 for g in groups.tolist()]
    np.testing.assert_array_equal(zero_advantage_groups(rewards, groups), want)


def test_nan_reward_is_rejected_with_its_index():
    with pytest.raises(ValueError, match=r"rewards\[2\]"):
        group_advantages([0.0, 1.0, float("nan")], [0, 0, 0])
    with pytest.raises(ValueError, match=r"rewards\[0\]"):
        zero_advantage_groups([float("inf")], [0])


def test_mismatched_lengths_and_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages([0.0, 1.0], [0])
    with pytest.raises(ValueError, match="integers"):
        group_advantages([0.0, 1.0], [0.5, 1.5])
    with pytest.raises(ValueError, match="mode"):
        group_advantages([0.0], [0], mode="median")
    with pytest.raises(ValueError, match="scale"):
        group_advantages([0.0], [0], mode="constant", scale=0.0)


def test_empty_batch_gives_empty_advantages():
    assert group_advantages([], []).shape == (0,)
    assert zero_advantage_groups([], []).shape == (0,)
