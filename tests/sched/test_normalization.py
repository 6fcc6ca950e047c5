"""Loss normalization: accumulated microbatch gradients against the single-pass gradient."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.normalization import per_token_weights, policy_token_count, weight_distortion

NUM_MICROBATCHES = 4


def chapter_style_episode_lengths() -> np.ndarray:
    """Policy-token counts of 64 episodes whose length-sorted quarters hold 96/130/160/355.

    Those are the chapter's smallest and largest length-sorted microbatches (96 and 355);
    N = 741, so the closed form gives 741 / (4 * 96) = 1.93 and 741 / (4 * 355) = 0.52.
    """
    lengths = np.concatenate(
        [
            np.full(16, 6),  # 96: immediate submits
            np.r_[np.full(14, 8), np.full(2, 9)],  # 130
            np.full(16, 10),  # 160
            np.r_[np.full(15, 22), 25],  # 355
        ]
    )
    return np.random.default_rng(14).permutation(lengths)


def split_tokens(lengths: np.ndarray, order: np.ndarray, parts: int) -> np.ndarray:
    """Microbatch id of every policy token when episodes in `order` are cut into `parts`."""
    microbatch_of_episode = np.empty(lengths.size, dtype=np.int64)
    for part, episodes in enumerate(np.array_split(order, parts)):
        microbatch_of_episode[episodes] = part
    return np.repeat(microbatch_of_episode, lengths)


def accumulated_gradient(token_grads, microbatch_of_token, normalizer):
    """The straightforward microbatch loop: sum each microbatch's token gradients, normalize.

    normalizer = "microbatch": token_mean per microbatch, averaged over the K microbatches;
    normalizer = "global": each microbatch's token sum divided by the global N.
    """
    total = np.zeros(token_grads.shape[1])
    microbatches = np.unique(microbatch_of_token)
    for microbatch in microbatches:
        grads = token_grads[microbatch_of_token == microbatch]
        if normalizer == "microbatch":
            total += grads.sum(axis=0) / grads.shape[0] / microbatches.size
        else:
            total += grads.sum(axis=0) / token_grads.shape[0]
    return total


def test_length_sorted_token_mean_distorts_weights_by_closed_form():
    lengths = chapter_style_episode_lengths()
    microbatch = split_tokens(lengths, np.argsort(lengths, kind="stable"), NUM_MICROBATCHES)
    counts = np.bincount(microbatch)
    assert counts.tolist() == [96, 130, 160, 355]
    n = policy_token_count(np.ones(int(lengths.sum()), dtype=bool))
    assert n == 741

    weights = per_token_weights(microbatch, mode="microbatch_token_mean")
    distortion = weights * n
    closed_form = n / (NUM_MICROBATCHES * counts)
    np.testing.assert_allclose(distortion, closed_form[microbatch], rtol=1e-12)
    np.testing.assert_allclose(weight_distortion(counts), closed_form, rtol=1e-12)
    # The chapter's effect: the short-episode microbatch ~1.93x, the long one ~0.52x.
    assert distortion[microbatch == 0][0] == pytest.approx(1.93, abs=0.01)
    assert distortion[microbatch == 3][0] == pytest.approx(0.52, abs=0.01)


def test_global_token_mean_gives_every_token_exactly_one_over_n():
    lengths = chapter_style_episode_lengths()
    for order in (np.argsort(lengths, kind="stable"), np.arange(lengths.size)):
        microbatch = split_tokens(lengths, order, NUM_MICROBATCHES)
        weights = per_token_weights(microbatch, mode="global_token_mean")
        assert np.all(weights == 1.0 / 741)
        assert weights.sum() == pytest.approx(1.0, abs=1e-12)


def test_weights_reproduce_the_accumulated_gradient_and_only_global_matches_full_batch():
    lengths = chapter_style_episode_lengths()
    rng = np.random.default_rng(0)
    episode_of_token = np.repeat(np.arange(lengths.size), lengths)
    # Short episodes behave differently (a shared direction), as in the chapter's gym.
    token_grads = rng.normal(size=(int(lengths.sum()), 8))
    token_grads[:, 0] += 3.0 * (lengths[episode_of_token] <= 6)
    full_batch = token_grads.mean(axis=0)
    microbatch = split_tokens(lengths, np.argsort(lengths, kind="stable"), NUM_MICROBATCHES)

    for mode, normalizer in (("microbatch_token_mean", "microbatch"), ("global_token_mean", "g")):
        weights = per_token_weights(microbatch, mode=mode)
        loop = accumulated_gradient(token_grads, microbatch, normalizer)
        np.testing.assert_allclose(weights @ token_grads, loop, rtol=1e-10, atol=1e-13)

    global_grad = accumulated_gradient(token_grads, microbatch, "global")
    np.testing.assert_allclose(global_grad, full_batch, rtol=1e-10, atol=1e-13)
    per_microbatch = accumulated_gradient(token_grads, microbatch, "microbatch")
    relative_error = np.linalg.norm(per_microbatch - full_batch) / np.linalg.norm(full_batch)
    assert relative_error > 0.2


def test_data_parallel_ranks_each_averaging_then_allreduce_mean():
    lengths = chapter_style_episode_lengths()
    order = np.argsort(lengths, kind="stable")
    # 2 ranks x 2 microbatches; length-sorted: rank 0 gets the short half, rank 1 the long.
    global_microbatch = split_tokens(lengths, order, 4)
    rank = global_microbatch // 2
    local_microbatch = global_microbatch % 2
    rng = np.random.default_rng(1)
    token_grads = rng.normal(size=(global_microbatch.size, 3))

    # Straightforward: each rank accumulates its own token_mean microbatches, then the
    # all-reduce averages over ranks.
    per_rank = [
        accumulated_gradient(token_grads[rank == r], local_microbatch[rank == r], "microbatch")
        for r in (0, 1)
    ]
    reduced = np.mean(per_rank, axis=0)
    weights = per_token_weights(local_microbatch, mode="microbatch_token_mean", rank_of_token=rank)
    np.testing.assert_allclose(weights @ token_grads, reduced, rtol=1e-10, atol=1e-13)

    counts = np.bincount(global_microbatch).reshape(2, 2)
    n = counts.sum()
    np.testing.assert_allclose(
        weights * n, weight_distortion(counts).reshape(-1)[global_microbatch]
    )
    np.testing.assert_allclose(weight_distortion(counts), n / (2 * 2 * counts))

    global_weights = per_token_weights(
        local_microbatch, mode="global_token_mean", rank_of_token=rank
    )
    assert np.all(global_weights == 1.0 / n)
    np.testing.assert_allclose(global_weights @ token_grads, token_grads.mean(axis=0), rtol=1e-10)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 5)),
        min_size=1,
        max_size=80,
    )
)
def test_weights_match_loop_and_sum_to_one(pairs):
    rank = np.array([r for r, _ in pairs])
    microbatch = np.array([m for _, m in pairs])
    weights = per_token_weights(microbatch, mode="microbatch_token_mean", rank_of_token=rank)
    ranks = sorted(set(rank.tolist()))
    for t in range(len(pairs)):
        on_rank = microbatch[rank == rank[t]]
        k = len(set(on_rank.tolist()))
        n_k = int(np.sum(on_rank == microbatch[t]))
        assert weights[t] == pytest.approx(1.0 / (len(ranks) * k * n_k), rel=1e-12)
    assert weights.sum() == pytest.approx(1.0, rel=1e-12)


def test_empty_microbatch_still_counts_in_k():
    # Microbatch 1 of K = 3 holds no policy token: the loop still divides by 3.
    weights = per_token_weights([0, 0, 2], mode="microbatch_token_mean", num_microbatches=3)
    np.testing.assert_allclose(weights, [1 / 6, 1 / 6, 1 / 3])
    assert weights.sum() == pytest.approx(2 / 3)
    assert np.isnan(weight_distortion([2, 0, 1])[1])


def test_policy_token_count_sums_masks_over_ranks_and_microbatches():
    masks = [np.array([[1, 1, 0], [0, 1, 0]]), np.array([True, False]), [0, 0, 1, 1]]
    assert policy_token_count(*masks) == 6
    assert policy_token_count() == 0
    with pytest.raises(ValueError, match=r"action_masks\[1\]"):
        policy_token_count([1, 0], [0.5, 1.0])


def test_bad_ids_are_rejected_with_their_index():
    with pytest.raises(ValueError, match=r"microbatch_of_token\[1\]"):
        per_token_weights([0, -1], mode="global_token_mean")
    with pytest.raises(ValueError, match="rank_of_token"):
        per_token_weights([0, 1], mode="global_token_mean", rank_of_token=[0])
    with pytest.raises(ValueError, match=r"microbatch_of_token\[2\].*num_microbatches"):
        per_token_weights([0, 1, 4], mode="microbatch_token_mean", num_microbatches=2)
    with pytest.raises(ValueError, match="mode"):
        per_token_weights([0], mode="token_sum")
    with pytest.raises(ValueError, match="flat position 1"):
        weight_distortion([3.0, float("nan")])
