"""Step assembly: the plan and the materialized microbatches against the plain computation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.assembly import (
    StepConfig,
    StepRollouts,
    TokenColumns,
    assemble_step,
    gather_token_ranges,
    materialize_microbatch,
)


def make_step(rng: np.random.Generator, groups: int, group_size: int, max_len: int = 300):
    """Random rollouts: prompt tokens (mask 0) followed by policy tokens (mask 1)."""
    n = groups * group_size
    lengths = rng.integers(2, max_len, size=n)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    token_ids = rng.integers(0, 1000, size=offsets[-1]).astype(np.int32)
    action_mask = np.zeros(offsets[-1], dtype=np.uint8)
    for start, length in zip(offsets[:-1], lengths, strict=True):
        prompt = rng.integers(1, length)
        action_mask[start + prompt : start + length] = 1
    logprobs = np.where(action_mask > 0, -rng.random(offsets[-1]), 0.0).astype(np.float32)
    rewards = rng.integers(0, 2, size=n).astype(np.float64)
    rewards[:group_size] = 1.0  # the first group is always a zero-advantage group
    group_ids = np.repeat(np.arange(groups) * 7 + 3, group_size)
    columns = TokenColumns(offsets, token_ids, action_mask, logprobs)
    policy_tokens = np.add.reduceat(action_mask.astype(np.int64), offsets[:-1])
    rollouts = StepRollouts(
        lengths=lengths, policy_tokens=policy_tokens, rewards=rewards, group_ids=group_ids
    )
    return rollouts, columns


def test_global_policy_token_count_is_sum_of_action_masks_over_the_step():
    rollouts, columns = make_step(np.random.default_rng(0), groups=16, group_size=8)
    plan = assemble_step(rollouts, StepConfig(token_budget=2048, world_size=4))
    assert plan.policy_token_count == int(columns.action_mask.sum())
    served = [
        materialize_microbatch(columns, plan.microbatches[m], plan.advantages)
        for rank in plan.ranks
        for m in rank
    ]
    assert sum(int(mb.loss_mask.sum()) for mb in served) == plan.policy_token_count


def test_every_kept_rollout_is_in_exactly_one_microbatch_and_every_rank_has_the_same_count():
    rollouts, _ = make_step(np.random.default_rng(1), groups=10, group_size=4)
    plan = assemble_step(rollouts, StepConfig(token_budget=1500, world_size=3))
    placed = np.sort(np.concatenate(plan.microbatches))
    np.testing.assert_array_equal(placed, plan.kept)
    assert len({len(r) for r in plan.ranks}) == 1
    assert sorted(m for r in plan.ranks for m in r) == list(range(len(plan.microbatches)))
    for mb in plan.microbatches:
        assert rollouts.lengths[mb].sum() <= 1500


def test_zero_advantage_groups_are_counted_and_dropped_only_when_configured():
    rollouts, _ = make_step(np.random.default_rng(2), groups=6, group_size=4)
    keep_all = assemble_step(rollouts, StepConfig(token_budget=4096))
    drop = assemble_step(rollouts, StepConfig(token_budget=4096, drop_zero_advantage=True))
    assert keep_all.zero_advantage_groups == drop.zero_advantage_groups >= 1
    assert keep_all.kept.size == rollouts.lengths.size
    np.testing.assert_array_equal(drop.kept, np.flatnonzero(~drop.zero_advantage))
    assert drop.policy_token_count == int(rollouts.policy_tokens[drop.kept].sum())
    assert np.all(drop.advantages[drop.zero_advantage] == 0)


def test_materialized_microbatch_reproduces_each_rollout_alone():
    rollouts, columns = make_step(np.random.default_rng(3), groups=4, group_size=4)
    plan = assemble_step(rollouts, StepConfig(token_budget=1024, world_size=2))
    for indices in plan.microbatches:
        mb = materialize_microbatch(columns, indices, plan.advantages)
        np.testing.assert_array_equal(mb.rollout_index, indices)
        for k, rollout in enumerate(indices):
            start, stop = columns.offsets[rollout], columns.offsets[rollout + 1]
            a, b = mb.cu_seqlens[k], mb.cu_seqlens[k + 1]
            alone_tokens = columns.token_ids[start:stop]
            np.testing.assert_array_equal(mb.input_ids[a:b], alone_tokens)
            np.testing.assert_array_equal(mb.position_ids[a:b], np.arange(stop - start))
            # Position t predicts token t+1 of the same rollout; the last predicts nothing.
            np.testing.assert_array_equal(mb.target_ids[a : b - 1], alone_tokens[1:])
            np.testing.assert_array_equal(
                mb.loss_mask[a : b - 1], columns.action_mask[start + 1 : stop]
            )
            assert mb.loss_mask[b - 1] == 0 and mb.target_ids[b - 1] == 0
            np.testing.assert_array_equal(
                mb.sampler_logprobs[a : b - 1], columns.sampler_logprobs[start + 1 : stop]
            )
            expected_adv = np.where(
                columns.action_mask[start + 1 : stop] > 0, plan.advantages[rollout], 0
            )
            np.testing.assert_array_equal(mb.advantages[a : b - 1], expected_adv)
        assert mb.max_seqlen == int(rollouts.lengths[indices].max())


def test_assembly_is_a_deterministic_function_of_its_inputs():
    rollouts, _ = make_step(np.random.default_rng(4), groups=8, group_size=8)
    config = StepConfig(token_budget=3000, world_size=4)
    first, second = assemble_step(rollouts, config), assemble_step(rollouts, config)
    assert first.ranks == second.ranks
    for a, b in zip(first.microbatches, second.microbatches, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(first.advantages, second.advantages)


def test_padded_alternative_and_plan_padding_share():
    rollouts, _ = make_step(np.random.default_rng(5), groups=4, group_size=8)
    packed = assemble_step(rollouts, StepConfig(token_budget=4096))
    assert packed.padding_share == 0.0  # varlen rows compute only real tokens
    assert packed.padded_positions == rollouts.lengths.size * rollouts.lengths.max()
    padded = assemble_step(rollouts, StepConfig(token_budget=4096, cost_model="padded"))
    assert 0.0 < padded.padding_share < packed.padded_alternative_padding_share


def test_step_reports_balance_in_tokens_and_in_compute():
    rollouts, _ = make_step(np.random.default_rng(4), groups=12, group_size=4, max_len=900)
    weight = 0.002
    plan = assemble_step(
        rollouts, StepConfig(token_budget=3000, world_size=4, attention_weight=weight)
    )
    lengths = np.asarray(rollouts.lengths)
    per_unit = {}
    for unit, w in (("tokens", 0.0), ("compute", weight)):
        costs = [sum(int(x) + w * int(x) ** 2 for x in lengths[m]) for m in plan.microbatches]
        ranks = [sum(costs[m] for m in rank) for rank in plan.ranks]
        slowest = [max(costs[r[s]] for r in plan.ranks) for s in range(len(plan.ranks[0]))]
        per_unit[unit] = (max(ranks) / np.mean(ranks), sum(costs) / (4 * sum(slowest)))
    assert plan.rank_imbalance == pytest.approx(per_unit["tokens"][0])
    assert plan.lockstep_efficiency == pytest.approx(per_unit["tokens"][1])
    assert plan.compute_rank_imbalance == pytest.approx(per_unit["compute"][0])
    assert plan.compute_lockstep_efficiency == pytest.approx(per_unit["compute"][1])
    # Balanced on tokens, counted in compute: the same plan as attention_weight 0 gives.
    token_plan = assemble_step(
        rollouts, StepConfig(token_budget=3000, world_size=4, compute_weight=weight)
    )
    tokens_only = assemble_step(rollouts, StepConfig(token_budget=3000, world_size=4))
    assert token_plan.ranks == tokens_only.ranks
    assert token_plan.lockstep_efficiency == tokens_only.compute_lockstep_efficiency


def test_gather_token_ranges_matches_concatenated_slices():
    offsets = np.array([0, 3, 3, 8, 10])
    got = gather_token_ranges(offsets, np.array([2, 0, 3]))
    np.testing.assert_array_equal(got, [3, 4, 5, 6, 7, 0, 1, 2, 8, 9])


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 6),
    group_size=st.integers(1, 5),
    world_size=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_every_policy_token_is_served_exactly_once(groups, group_size, world_size, seed):
    rollouts, columns = make_step(np.random.default_rng(seed), groups, group_size, max_len=60)
    plan = assemble_step(rollouts, StepConfig(token_budget=128, world_size=world_size))
    served_positions = []
    for rank in plan.ranks:
        for m in rank:
            mb = materialize_microbatch(columns, plan.microbatches[m], plan.advantages)
            # Map every served loss position back to the flat index of the token it predicts.
            flat = gather_token_ranges(columns.offsets, mb.rollout_index)
            served_positions.append(flat[1:][mb.loss_mask[:-1] > 0])
    served = np.sort(np.concatenate(served_positions)) if served_positions else np.array([])
    np.testing.assert_array_equal(served, np.flatnonzero(columns.action_mask))


def test_config_rejects_a_non_positive_budget():
    with pytest.raises(ValueError, match="token_budget"):
        StepConfig(token_budget=0)


def test_a_policy_token_in_first_position_is_refused_naming_the_rollout():
    columns = TokenColumns(
        offsets=np.array([0, 3, 6]),
        token_ids=np.arange(6, dtype=np.int32),
        action_mask=np.array([0, 1, 1, 1, 1, 0], dtype=np.uint8),
        sampler_logprobs=np.zeros(6, dtype=np.float32),
    )
    with pytest.raises(ValueError, match="rollout 1: action_mask"):
        materialize_microbatch(columns, np.array([0, 1]), np.zeros(2, np.float32))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cost_model", "pad"),
        ("packing_method", "xfd"),
        ("attention_weight", -1.0),
        ("advantage_scale", 0.0),
        ("token_budget", 1.5),
        ("world_size", 0),
    ],
)
def test_step_config_names_the_invalid_field(field, value):
    with pytest.raises(ValueError, match=f"StepConfig.{field}"):
        StepConfig(**{field: value})
