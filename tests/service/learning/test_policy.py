"""The demo's policy: a seeded Hugging Face Qwen3 whose warm start lands in the mixed regime
(groups neither all-fail nor all-pass) and is cached per (config, gym seed)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers")

from rlfeed.client.packed_logprobs import PackedLogProbs
from rlfeed.service.gym.splits import make_split
from rlfeed.service.learning.evaluation import pass_rates
from rlfeed.service.learning.policy import PolicyConfig, build_model, warm_started


def same_weights(a, b) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def test_initial_weights_are_a_function_of_the_seed():
    assert same_weights(build_model(PolicyConfig(seed=3)), build_model(PolicyConfig(seed=3)))
    assert not same_weights(build_model(PolicyConfig(seed=3)), build_model(PolicyConfig(seed=4)))
    model = build_model(PolicyConfig())
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert next(model.parameters()).dtype == torch.float32


def test_the_warm_start_is_cached_and_lands_in_the_mixed_regime(tmp_path):
    split = make_split(200, seed=0)
    began = time.monotonic()
    model, path = warm_started(PolicyConfig(), split, tmp_path)
    trained_s = time.monotonic() - began
    began = time.monotonic()
    cached, cached_path = warm_started(PolicyConfig(), split, tmp_path)
    print(f"warm start {trained_s:.1f} s, from the cache {time.monotonic() - began:.2f} s")
    assert cached_path == path and path.parent == tmp_path
    assert same_weights(model, cached)
    other, other_path = warm_started(PolicyConfig(seed=1, warm_start_steps=2), split, tmp_path)
    assert other_path != path and not same_weights(model, other)

    rates = pass_rates(PackedLogProbs(model), split.held_out)
    print({family: round(rate, 3) for family, rate in rates.items()})
    # Above chance, well below solved, and a spread of difficulty across families.
    assert 0.2 < rates["all"] < 0.7
    assert rates["add"] < 0.2 < rates["lookup"] < rates["pick"] < rates["reverse"] < 0.95
