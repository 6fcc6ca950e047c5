"""Specification of the roofline throughput and GPU-hour accounting (chapter Section 14.6).

The chapter's figures for Qwen3-8B on an H200 are held within 2%; the example step's
GPU-hours within the rounding the chapter prints them with. The episode shape behind the
step is an assumption (`EpisodeShape`'s defaults), inferred from the chapter's figures.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rlfeed.sched.throughput import (
    GPUS,
    MODELS,
    EpisodeShape,
    GpuSpec,
    ModelArch,
    decode_memory_bytes,
    decode_tokens_per_s,
    kv_bytes_per_token,
    param_count,
    step_cost_from_tokens,
    step_gpu_hours,
    train_tokens_per_s,
)

QWEN3_8B = MODELS["qwen3-8b"]
QWEN3_32B = MODELS["qwen3-32b"]
H200 = GPUS["h200"]
CHAPTER_TOLERANCE = 0.02


def _step_kwargs(shape: EpisodeShape) -> dict:
    return {
        "decode_batch": shape.decode_batch,
        "decode_context": shape.decode_context,
        "busy_fraction": shape.busy_fraction,
        "mfu": shape.mfu,
        "logprob_forward_passes": shape.logprob_forward_passes,
    }


# --- architecture arithmetic ---------------------------------------------------------------


def test_qwen3_8b_kv_cache_is_147_kb_per_token():
    # keys and values x 36 layers x 8 KV heads x 128 dims x 2 bytes (bf16)
    assert kv_bytes_per_token(QWEN3_8B) == 2 * 36 * 8 * 128 * 2 == 147_456
    assert round(kv_bytes_per_token(QWEN3_8B) / 1e3) == 147


@pytest.mark.parametrize(
    ("preset", "published_params"),
    [
        ("qwen3-0.6b", 0.596e9),
        ("qwen3-8b", 8.19e9),
        ("qwen3-32b", 32.8e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
    ],
)
def test_param_count_matches_published_totals(preset, published_params):
    assert param_count(MODELS[preset]) == pytest.approx(published_params, rel=0.01)


def test_preset_keys_are_their_names():
    assert set(MODELS) == {"qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama3-8b", "llama3-70b"}
    assert all(arch.name == key for key, arch in MODELS.items())
    assert set(GPUS) == {"h100", "h200", "a100"}
    assert all(gpu.name == key for key, gpu in GPUS.items())


def test_tied_embeddings_count_the_embedding_once():
    tied = MODELS["qwen3-0.6b"]
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    assert param_count(untied) - param_count(tied) == tied.vocab_size * tied.hidden_size


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_param_count_matches_an_instantiated_transformers_model(family):
    """The formula against the straightforward count: build a tiny model and sum numel."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shape = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,  # != hidden/heads, as in Qwen3-0.6B, to exercise head_dim
        "intermediate_size": 96,
        "vocab_size": 320,
        "tie_word_embeddings": family == "qwen3",
    }
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    arch = ModelArch(
        name=f"tiny-{family}",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=24,
        intermediate_size=96,
        vocab_size=320,
        tie_word_embeddings=family == "qwen3",
        qk_norm=family == "qwen3",
    )
    assert param_count(arch) == sum(p.numel() for p in model.parameters())


def test_model_arch_rejects_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(QWEN3_8B, num_kv_heads=7)


def test_model_arch_rejects_non_positive_fields():
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(QWEN3_8B, num_layers=0)


def test_gpu_spec_rejects_non_positive_bandwidth():
    with pytest.raises(ValueError, match="memory_bandwidth_bytes_per_s"):
        GpuSpec(name="x", memory_bandwidth_bytes_per_s=0, dense_bf16_flops_per_s=1e15)


# --- rates: the chapter's Qwen3-8B on an H200 ----------------------------------------------


@pytest.mark.parametrize(
    ("batch", "context", "chapter_tokens_per_s"),
    [(64, 2048, 8600), (64, 16_384, 1800), (256, 16_384, 1935)],
)
def test_decode_rate_matches_chapter(batch, context, chapter_tokens_per_s):
    rate = decode_tokens_per_s(QWEN3_8B, H200, batch=batch, context=context)
    assert rate == pytest.approx(chapter_tokens_per_s, rel=CHAPTER_TOLERANCE)


def test_training_rate_at_40_percent_mfu_matches_chapter():
    assert train_tokens_per_s(QWEN3_8B, H200, mfu=0.4) == pytest.approx(8000, rel=CHAPTER_TOLERANCE)


def test_training_is_4_5x_faster_than_long_context_decode():
    train = train_tokens_per_s(QWEN3_8B, H200, mfu=0.4)
    decode = decode_tokens_per_s(QWEN3_8B, H200, batch=64, context=16_384)
    assert train / decode == pytest.approx(4.5, rel=CHAPTER_TOLERANCE)


def test_decode_step_time_is_bytes_read_over_bandwidth():
    """The roofline against counting the bytes read one sequence at a time."""
    batch, context = 48, 3000
    weight_bytes = 2 * param_count(QWEN3_8B)
    cache_bytes = sum(context * kv_bytes_per_token(QWEN3_8B) for _ in range(batch))
    seconds = (weight_bytes + cache_bytes) / H200.memory_bandwidth_bytes_per_s
    rate = decode_tokens_per_s(QWEN3_8B, H200, batch=batch, context=context)
    assert rate == pytest.approx(batch / seconds, rel=1e-12)
    assert decode_memory_bytes(QWEN3_8B, batch=batch, context=context) == (
        weight_bytes + cache_bytes
    )


@given(
    batch=st.integers(1, 1024),
    context=st.integers(1, 131_072),
    preset=st.sampled_from(sorted(MODELS)),
)
def test_larger_batches_help_decode_but_never_past_the_kv_bound(batch, context, preset):
    arch = MODELS[preset]
    rate = decode_tokens_per_s(arch, H200, batch=batch, context=context)
    assert decode_tokens_per_s(arch, H200, batch=batch + 1, context=context) > rate
    # with the weight reads amortised away, each token still costs its own cache read
    kv_bound = H200.memory_bandwidth_bytes_per_s / (context * kv_bytes_per_token(arch))
    assert rate < kv_bound
    assert decode_tokens_per_s(arch, H200, batch=batch, context=context + 1) < rate


def test_rates_reject_bad_inputs():
    with pytest.raises(ValueError, match="batch"):
        decode_tokens_per_s(QWEN3_8B, H200, batch=0, context=2048)
    with pytest.raises(ValueError, match="context"):
        decode_tokens_per_s(QWEN3_8B, H200, batch=1, context=-1)
    with pytest.raises(ValueError, match="mfu"):
        train_tokens_per_s(QWEN3_8B, H200, mfu=1.5)


# --- the chapter's example step -------------------------------------------------------------


def test_default_shape_has_policy_tokens_a_quarter_of_all_tokens():
    shape = EpisodeShape()
    assert shape.policy_tokens_per_step / shape.total_tokens_per_step == pytest.approx(0.25)


def test_chapter_step_costs_about_1_6_gpu_hours_and_490_over_300_steps():
    cost = step_gpu_hours(QWEN3_8B, H200, EpisodeShape())
    assert round(cost.total_gpu_hours, 1) == 1.6
    assert 300 * cost.total_gpu_hours == pytest.approx(490, rel=CHAPTER_TOLERANCE)
    assert cost.total == cost.total_gpu_hours
    assert cost.total_gpu_hours == pytest.approx(
        cost.decode_gpu_hours + cost.train_gpu_hours + cost.logprob_gpu_hours
    )


def test_chapter_step_is_mostly_decode_and_about_a_quarter_training():
    cost = step_gpu_hours(QWEN3_8B, H200, EpisodeShape())
    assert cost.decode_gpu_hours / cost.total_gpu_hours == pytest.approx(0.59, abs=0.03)
    assert cost.train_gpu_hours / cost.total_gpu_hours == pytest.approx(0.25, abs=0.02)


def test_halving_busy_fraction_adds_about_one_gpu_hour():
    base = step_gpu_hours(QWEN3_8B, H200, EpisodeShape(busy_fraction=0.5))
    busy_quarter = step_gpu_hours(QWEN3_8B, H200, EpisodeShape(busy_fraction=0.25))
    assert busy_quarter.total_gpu_hours - base.total_gpu_hours == pytest.approx(1.0, abs=0.1)
    # only decode pays for idle time, and it pays 1/busy_fraction
    assert busy_quarter.decode_gpu_hours == pytest.approx(2 * base.decode_gpu_hours)
    assert busy_quarter.train_gpu_hours == base.train_gpu_hours


def test_32b_step_scales_decode_by_its_rate_and_training_by_its_parameters():
    shape = EpisodeShape()
    small, large = step_gpu_hours(QWEN3_8B, H200, shape), step_gpu_hours(QWEN3_32B, H200, shape)
    decode_slowdown = small.decode_tokens_per_s / large.decode_tokens_per_s
    param_ratio = param_count(QWEN3_32B) / param_count(QWEN3_8B)
    assert large.decode_gpu_hours == pytest.approx(small.decode_gpu_hours * decode_slowdown)
    assert large.train_gpu_hours + large.logprob_gpu_hours == pytest.approx(
        (small.train_gpu_hours + small.logprob_gpu_hours) * param_ratio
    )


def test_chapter_32b_figure_is_beyond_the_roofline_bound_for_any_shape():
    """The chapter quotes ~7.7 GPU-hours for 32B against ~1.6 for 8B (x4.8). Under this
    roofline every term grows at most by the parameter ratio (x4.0; KV size only x1.78), so
    no shared shape reproduces both; with the default shape the 32B step costs ~4.6."""
    param_ratio = param_count(QWEN3_32B) / param_count(QWEN3_8B)
    kv_ratio = kv_bytes_per_token(QWEN3_32B) / kv_bytes_per_token(QWEN3_8B)
    assert kv_ratio < param_ratio < 7.7 / 1.6
    small = step_gpu_hours(QWEN3_8B, H200, EpisodeShape())
    large = step_gpu_hours(QWEN3_32B, H200, EpisodeShape())
    assert large.total_gpu_hours <= small.total_gpu_hours * param_ratio
    assert large.total_gpu_hours < 0.9 * 7.7


@given(
    prompt=st.integers(0, 50_000),
    policy=st.integers(0, 50_000),
    tool=st.integers(0, 50_000),
    context=st.integers(0, 65_536),
    batch=st.integers(1, 512),
)
def test_32b_over_8b_step_ratio_never_exceeds_the_parameter_ratio(
    prompt, policy, tool, context, batch
):
    shape = EpisodeShape(
        prompt_tokens=prompt,
        policy_tokens=policy,
        tool_tokens=tool + 1,  # at least one token, so the 8B step costs something
        decode_context=context,
        decode_batch=batch,
    )
    small = step_gpu_hours(QWEN3_8B, H200, shape).total_gpu_hours
    large = step_gpu_hours(QWEN3_32B, H200, shape).total_gpu_hours
    assert large <= small * param_count(QWEN3_32B) / param_count(QWEN3_8B) * (1 + 1e-12)


def test_episode_shape_rejects_bad_fields():
    with pytest.raises(ValueError, match="group_size"):
        EpisodeShape(group_size=0)
    with pytest.raises(ValueError, match="busy_fraction"):
        EpisodeShape(busy_fraction=0.0)
    with pytest.raises(ValueError, match="tool_tokens"):
        EpisodeShape(tool_tokens=-1)


# --- pricing an actual served step ----------------------------------------------------------


@given(
    episodes=st.lists(
        st.tuples(st.integers(0, 4096), st.integers(0, 4096)),  # (policy, non-policy) tokens
        min_size=1,
        max_size=64,
    )
)
def test_pricing_a_step_equals_the_sum_of_pricing_each_episode(episodes):
    kwargs = _step_kwargs(EpisodeShape())
    whole = step_cost_from_tokens(
        QWEN3_8B,
        H200,
        policy_tokens=sum(policy for policy, _ in episodes),
        total_tokens=sum(policy + other for policy, other in episodes),
        **kwargs,
    )
    parts = [
        step_cost_from_tokens(
            QWEN3_8B, H200, policy_tokens=policy, total_tokens=policy + other, **kwargs
        )
        for policy, other in episodes
    ]
    for field in ("decode_gpu_hours", "train_gpu_hours", "logprob_gpu_hours", "total_gpu_hours"):
        assert getattr(whole, field) == pytest.approx(sum(getattr(p, field) for p in parts))


def test_step_from_shape_tokens_equals_step_from_shape():
    shape = EpisodeShape()
    from_tokens = step_cost_from_tokens(
        QWEN3_8B,
        H200,
        policy_tokens=shape.episodes_per_step * shape.policy_tokens,
        total_tokens=shape.episodes_per_step
        * (shape.prompt_tokens + shape.policy_tokens + shape.tool_tokens),
        **_step_kwargs(shape),
    )
    assert from_tokens == step_gpu_hours(QWEN3_8B, H200, shape)


@given(real=st.integers(1, 10**7), padding=st.integers(0, 10**7), passes=st.integers(0, 3))
def test_padding_gpu_hours_is_the_cost_of_computed_minus_real_positions(real, padding, passes):
    kwargs = _step_kwargs(dataclasses.replace(EpisodeShape(), logprob_forward_passes=passes))
    packed = step_cost_from_tokens(QWEN3_8B, H200, policy_tokens=0, total_tokens=real, **kwargs)
    padded = step_cost_from_tokens(
        QWEN3_8B,
        H200,
        policy_tokens=0,
        total_tokens=real,
        computed_positions=real + padding,
        **kwargs,
    )
    # what the padded layout costs, priced as if its padding were real tokens
    as_real = step_cost_from_tokens(
        QWEN3_8B, H200, policy_tokens=0, total_tokens=real + padding, **kwargs
    )
    assert padded.trained_positions == real + padding
    assert padded.total_gpu_hours == pytest.approx(as_real.total_gpu_hours)
    assert padded.padding_gpu_hours == pytest.approx(
        padded.total_gpu_hours - packed.total_gpu_hours, abs=1e-12
    )
    assert packed.padding_gpu_hours == 0.0


def test_logprob_term_is_a_third_of_training_per_forward_pass():
    kwargs = _step_kwargs(dataclasses.replace(EpisodeShape(), logprob_forward_passes=0))
    none = step_cost_from_tokens(QWEN3_8B, H200, policy_tokens=10, total_tokens=40, **kwargs)
    assert none.logprob_gpu_hours == 0.0
    assert none.total_gpu_hours == none.decode_gpu_hours + none.train_gpu_hours
    kwargs["logprob_forward_passes"] = 3
    three = step_cost_from_tokens(QWEN3_8B, H200, policy_tokens=10, total_tokens=40, **kwargs)
    assert three.logprob_gpu_hours == pytest.approx(three.train_gpu_hours)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"policy_tokens": 50, "total_tokens": 40}, "policy_tokens"),
        ({"total_tokens": 40, "computed_positions": 39}, "computed_positions"),
        ({"total_tokens": -1}, "total_tokens"),
        ({"busy_fraction": 0.0}, "busy_fraction"),
        ({"mfu": 0.0}, "mfu"),
        ({"decode_batch": 0}, "batch"),
        ({"logprob_forward_passes": -1}, "logprob_forward_passes"),
    ],
)
def test_step_cost_from_tokens_rejects_bad_inputs_naming_the_field(override, field):
    kwargs = {"policy_tokens": 10, "total_tokens": 40, **_step_kwargs(EpisodeShape())}
    kwargs.update(override)
    with pytest.raises(ValueError, match=field):
        step_cost_from_tokens(QWEN3_8B, H200, **kwargs)
