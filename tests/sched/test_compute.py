"""The compute cost model: balancing cost x unit FLOPs is the model's forward FLOP count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.balance import microbatch_cost
from rlfeed.sched.compute import model_attention_weight, sequence_cost, sequence_flops
from rlfeed.sched.models import MODELS, param_count
from rlfeed.sched.planning import plan_microbatches

FAST = settings(max_examples=60, deadline=None)
PRESETS = st.sampled_from(sorted(MODELS))


def direct_forward_flops(model: str, length: int) -> int:
    """Forward FLOPs of one sequence, counted term by term in exact integers.

    Every token multiplies every weight once (2 FLOPs per parameter). In every layer and
    query head, query i attends to keys 0..i: a q·k dot product and a p·v accumulation of
    head_dim multiply-adds each.
    """
    arch = MODELS[model]
    linear = 2 * param_count(arch) * length
    causal_pairs = sum(query + 1 for query in range(length))
    per_pair = 2 * arch.head_dim + 2 * arch.head_dim  # q·k, then p·v
    attention = arch.num_layers * arch.num_attention_heads * per_pair * causal_pairs
    return linear + attention


@FAST
@given(PRESETS, st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=8))
def test_sequence_flops_match_the_direct_count(model, lengths):
    expected = [direct_forward_flops(model, length) for length in lengths]
    np.testing.assert_allclose(sequence_flops(MODELS[model], lengths), expected, rtol=1e-12)


@FAST
@given(PRESETS, st.lists(st.integers(min_value=1, max_value=3000), min_size=0, max_size=8))
def test_balancing_cost_times_unit_flops_is_the_flop_count(model, lengths):
    weight = model_attention_weight(model)
    cost = microbatch_cost(lengths, [np.arange(len(lengths))], attention_weight=weight)
    unit = sequence_cost(MODELS[model]).unit_flops
    expected = sum(direct_forward_flops(model, length) for length in lengths)
    assert cost[0] * unit == pytest.approx(expected, rel=1e-12, abs=0)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["qwen3-0.6b", "qwen3-8b", "llama3-70b"]),
    st.lists(st.integers(min_value=1, max_value=4000), min_size=1, max_size=120),
    st.integers(min_value=1, max_value=8),
)
def test_plan_rank_compute_matches_a_direct_flop_count(model, lengths, world_size):
    plan = plan_microbatches(
        lengths, 4000, world_size, attention_weight=model_attention_weight(model)
    )
    unit = sequence_cost(MODELS[model]).unit_flops
    assignment = plan.assignment
    for rank, slots in enumerate(assignment.ranks):
        members = [i for slot in slots for i in assignment.microbatches[slot].tolist()]
        direct = sum(direct_forward_flops(model, lengths[i]) for i in members)
        assert assignment.rank_cost[rank] * unit == pytest.approx(direct, rel=1e-9, abs=0)


def test_attention_matters_more_for_smaller_models_and_grows_with_length():
    # Attention per token grows with L at a rate set by layers x heads x head_dim / N.
    weights = {name: model_attention_weight(name) for name in MODELS}
    assert weights["qwen3-0.6b"] > weights["qwen3-8b"] > weights["llama3-70b"] > 0
    arch = MODELS["qwen3-8b"]
    per_token = sequence_flops(arch, [1024, 8192, 65536]) / np.array([1024, 8192, 65536])
    assert np.all(np.diff(per_token) > 0)


def test_model_attention_weight_accepts_an_architecture_and_rejects_unknown_names():
    arch = MODELS["llama3-8b"]
    assert model_attention_weight(arch) == model_attention_weight("llama3-8b")
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        model_attention_weight("gpt-9")
