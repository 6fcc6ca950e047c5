"""The README's producer and trainer examples, run verbatim against a real sidecar.

The code blocks are read from README.md between `<!-- producer-example -->` /
`<!-- trainer-example -->` markers and their closing `<!-- /... -->` markers, so the
examples users copy cannot rot. The trainer runs twice: in this process (one rank), and
under `torchrun --standalone --nproc_per_node 2`, where it wraps its module in DDP.
"""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_readme_runs_the_torchrun_trainer_beside_a_sidecar_cut_for_its_ranks():
    """The commands above the examples: `rlfeed serve --world-size N` (a real flag) beside
    `torchrun --nproc_per_node N`, the same N."""
    from rlfeed.service.cli import build_parser

    section = README.read_text().split("\n## Using it\n", 1)[1].split("<!-- producer-example", 1)[0]
    (commands,) = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    (serve,) = (
        line.split("#")[0].split() for line in commands.splitlines() if "rlfeed serve" in line
    )
    args = build_parser().parse_args([word for word in serve[1:] if word != "&"])
    nproc = re.search(r"torchrun .*--nproc_per_node (\d+) trainer\.py", commands)
    assert nproc is not None and "python producer.py" in commands, commands
    assert args.world_size == int(nproc.group(1))


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
    assert status.trainer_policy_version == 2  # the weights after the second update
    after = list(trainer["model"].parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after, strict=True))


def test_readme_trainer_under_torchrun_keeps_the_ranks_weights_equal(
    make_sidecar, monkeypatch, tmp_path
):
    """Two ranks (DDP over gloo), each training on its own microbatches: equal weights after
    two optimizer steps mean the gradients were all-reduced. (The example's former
    `ddp.module.model(...)` pattern ran as well, and left every rank's weights its own.)"""
    sidecar = make_sidecar(
        batching={"token_budget": 1024, "world_size": 2},
        rollouts={"prompts_per_step": 8, "group_size": 8, "vocab_size": 1000},
    )
    monkeypatch.setenv("RLFEED_ADDRESS", sidecar.address)
    np.random.seed(1)
    exec(compile(example("producer-example"), "producer-example", "exec"), {})
    script = tmp_path / "trainer.py"
    save = "torch.save(model.state_dict(), f\"{os.environ['OUT']}/rank{os.environ['RANK']}.pt\")\n"
    script.write_text(example("trainer-example") + save)
    monkeypatch.setenv("OUT", str(tmp_path))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = subprocess.run(
        [*torchrun, "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):  # each rank says how its steps went (the two ranks' lines may interleave)
        assert re.search(rf"step 1 rank {rank}: loss -?\d+\.\d{{4}}", run.stdout), run.stdout
    from rlfeed.client.transport import GrpcTransport

    transport = GrpcTransport(sidecar.address)
    try:
        status = transport.status()
    finally:
        transport.close()
    assert status.counters.trainer_reports == 4  # 2 steps x 2 ranks
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


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
