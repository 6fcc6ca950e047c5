"""The README's producer and trainer examples, run verbatim against a real sidecar.

The code blocks are read from README.md between `<!-- producer-example -->` /
`<!-- trainer-example -->` markers and their closing `<!-- /... -->` markers, so the
examples users copy cannot rot.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def example(name: str) -> str:
    """The python code block between the README's `name` markers."""
    pattern = re.compile(
        rf"<!-- {name} -->\s*```python\n(.*?)```\s*<!-- /{name} -->", flags=re.DOTALL
    )
    match = pattern.search(README.read_text())
    if not match:
        raise AssertionError(f"README.md has no `{name}` python block between its markers")
    return match.group(1)


def test_readme_examples_are_complete_code_blocks():
    for name in ("producer-example", "trainer-example"):
        code = example(name)
        compile(code, name, "exec")
        assert "rlfeed.client" in code


def test_readme_producer_and_trainer_run_against_a_real_sidecar(make_sidecar, monkeypatch):
    import rlfeed.client

    for name in ("RolloutWriter", "BatchLoader"):
        if not hasattr(rlfeed.client, name):
            pytest.fail(f"rlfeed.client does not export {name} (the README imports it from there)")
    sidecar = make_sidecar(
        batching={"token_budget": 1024, "world_size": 1},
        rollouts={"prompts_per_step": 8, "group_size": 8, "vocab_size": 1000},
    )
    monkeypatch.setenv("RLFEED_ADDRESS", sidecar.address)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    np.random.seed(0)
    torch.manual_seed(0)

    producer: dict = {}
    exec(compile(example("producer-example"), "producer-example", "exec"), producer)
    from rlfeed.client.transport import GrpcTransport

    transport = GrpcTransport(sidecar.address)
    try:
        status = transport.status()
        assert status.counters.rollouts_accepted >= 2 * 8 * 8
        assert status.next_step >= 2  # two steps assembled from the producer's groups

        trainer: dict = {}
        before = [p.detach().clone() for p in _parameters_after_init()]
        exec(compile(example("trainer-example"), "trainer-example", "exec"), trainer)
        status = transport.status()
    finally:
        transport.close()
    assert trainer["step"].step == 1
    assert status.counters.trainer_reports == 2
    assert {r.step for r in status.last_reports} == {1}
    after = list(trainer["model"].parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True))


def _parameters_after_init():
    """The trainer example's initial weights (same seed, same config), for a before/after."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    code = example("trainer-example")
    config_source = code[code.index("config = Qwen3Config(") : code.index("model = ")]
    scope = {"Qwen3Config": Qwen3Config}
    exec(config_source, scope)
    state = torch.random.get_rng_state()
    model = Qwen3ForCausalLM(scope["config"])
    torch.random.set_rng_state(state)  # the example then draws the same initial weights
    return list(model.parameters())
