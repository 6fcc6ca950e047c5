"""`PackedLogProbs` under real torch.distributed: 2 gloo processes, a tiny float64 Qwen3.

Each rank trains its own microbatches of one step (rank 1's second one a zero-token no-op,
as the sidecar serves) with the constant normalizer N / world_size. Wrapped in DDP (synced
at every backward, or once under `no_sync()`) or in FSDP2, the gradients must be equal on
both ranks and equal to the single-process gradient of sum(all policy tokens' loss) / N
over the unpacked rollouts (each run alone through the model's ordinary forward). The old
README pattern, `ddp.module.model(...)` with `ddp.module.lm_head.weight`, must show the trap
it set: no error, gradients never synchronized. One launch of `packed_training.py` per
module (~10 s, mostly imports).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

HELPERS = Path(__file__).with_name("packed_training.py")
_spec = importlib.util.spec_from_file_location("packed_training", HELPERS)
training = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(training)

EXACT = 1e-9  # float64: relative difference of every parameter's gradient


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two ranks saved (`packed_training.run_rank`)."""
    out = tmp_path_factory.mktemp("ranks")
    command = [sys.executable, str(HELPERS)]
    processes = [
        subprocess.Popen(
            [*command, str(rank), "2", str(out / "store"), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [process.communicate(timeout=300)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, (process, log) in enumerate(zip(processes, logs, strict=True)):
        assert process.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]


@pytest.fixture(scope="module")
def reference():
    return training.reference_gradients(training.tiny_qwen3(), training.make_rollouts())


@pytest.mark.parametrize("wrapper", ["ddp", "ddp_no_sync", "fsdp2"])
def test_wrapped_gradients_are_equal_across_ranks_and_match_the_unpacked_reference(
    ranks, reference, wrapper
):
    first, second = (saved[wrapper] for saved in ranks)
    assert training.max_relative_difference(first, second) == 0.0
    assert training.max_relative_difference(first, reference) <= EXACT


def test_old_readme_pattern_leaves_gradients_unsynchronized(ranks, reference):
    """`ddp.module.model(...)` bypasses DDP's forward: no all-reduce, no error. Each rank
    keeps its own gradient; their mean (what DDP would have made) is the right one."""
    first, second = (saved["old_readme"] for saved in ranks)
    assert training.max_relative_difference(first, second) > 0.1
    assert training.max_relative_difference(first, reference) > 0.1
    mean = {name: (first[name] + second[name]) / 2 for name in first}
    assert training.max_relative_difference(mean, reference) <= EXACT


def test_a_ddp_wrapped_model_is_refused(ranks):
    for saved in ranks:
        assert saved["refused_ddp_model"].startswith("TypeError")
        assert "DistributedDataParallel(PackedLogProbs(model))" in saved["refused_ddp_model"]


def test_a_sharded_model_inside_an_unsharded_module_is_refused(ranks):
    """fully_shard(model) alone: the output weight is still a DTensor in our forward."""
    for saved in ranks:
        assert saved["refused_sharded_model"].startswith("RuntimeError")
        assert "fully_shard to the PackedLogProbs module" in saved["refused_sharded_model"]
