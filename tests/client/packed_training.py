"""One training step's gradients three ways, for the `PackedLogProbs` tests.

Shared by `test_packed_logprobs.py` and `test_packed_logprobs_distributed.py` (which load it
by path): a tiny float64 Qwen3 built from its config, seven rollouts, the served microbatch
layout (`rlfeed.sched.layout`), the README's clipped loss, and the straightforward
reference: every rollout scored alone with the model's own full-logits forward.

Run as a script it is one gloo rank of a 2-process group (file rendezvous, no port):

    python tests/client/packed_training.py RANK WORLD_SIZE STORE_FILE OUT_DIR

and saves `OUT_DIR/rank{RANK}.pt`: the gradients of one step through
`DistributedDataParallel(PackedLogProbs(model))` (syncing at every backward, and under
`no_sync()` but for the last microbatch), through FSDP2 (`fully_shard` on each
decoder layer, then on the `PackedLogProbs` root), and through the old README pattern
(`ddp.module.model(...)`, `ddp.module.lm_head.weight`), plus the errors of the two misuses
`PackedLogProbs` refuses. Cost: ~1 s of compute per rank after the imports.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
from rlfeed.client import PackedLogProbs, aggregate_loss, checkpointed_log_probs
from rlfeed.sched.layout import next_token_targets, row_layout

VOCAB = 61
# Rollout indices of each rank's microbatches; rank 1's second is a no-op (zero tokens), as
# the sidecar serves to keep every rank at the same microbatch count.
RANK_MICROBATCHES = {0: [[0, 1, 2], [3]], 1: [[4, 5, 6], []]}


def tiny_qwen3(*, tie_word_embeddings: bool = False):
    """Qwen3 from a tiny config, random weights (seed 0), float64, sdpa attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.1,  # above HF's 0.02: outputs depend on context
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(torch.float64)


def make_rollouts(seed: int = 0, count: int = 7) -> list[dict[str, np.ndarray]]:
    """Rollouts of 5-23 tokens: a 2-4 token prompt, then policy tokens; per-token sampler
    log-probs near the model's and a per-rollout advantage (so some ratios clip)."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for length in rng.integers(5, 24, count):
        action = np.zeros(length, dtype=np.uint8)
        action[int(rng.integers(2, 5)) :] = 1
        rollouts.append(
            {
                "token_ids": rng.integers(0, VOCAB, length),
                "action_mask": action,
                "sampler_logprobs": -np.log(VOCAB) + rng.normal(0.0, 0.3, length),
                "advantages": np.full(length, rng.normal()),
            }
        )
    return rollouts


def policy_token_count(rollouts) -> int:
    """N: the policy tokens that are predicted (a sequence's first token never is)."""
    return int(sum(r["action_mask"][1:].sum() for r in rollouts))


def served_microbatch(rollouts) -> dict[str, torch.Tensor]:
    """The rollouts packed back to back as `BatchLoader` serves them: [T] columns, each
    entry t holding what position t predicts, plus cu_seqlens int32 [n + 1]."""
    layout = row_layout([r["token_ids"].size for r in rollouts])

    def column(name, dtype):
        values = [r[name] for r in rollouts]
        return np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype)

    token_ids = column("token_ids", np.int32)
    arrays = {
        "input_ids": token_ids,
        "position_ids": layout.position_ids.astype(np.int32),
        "target_ids": next_token_targets(token_ids, layout),
        "loss_mask": next_token_targets(column("action_mask", np.uint8), layout),
        "sampler_logprobs": next_token_targets(column("sampler_logprobs", np.float64), layout),
        "advantages": next_token_targets(column("advantages", np.float64), layout),
        "cu_seqlens": layout.cu_seqlens.astype(np.int32),
    }
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}


def clipped_loss(logprobs, sampler_logprobs, advantages, mask, norm_const):
    """The README's PPO-clipped token loss, summed over `mask` and divided by norm_const."""
    ratio = torch.exp(logprobs - sampler_logprobs)
    per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return aggregate_loss(per_token, mask, mode="constant", norm_const=norm_const)


def train_microbatches(policy, microbatches, norm_const, *, sync_last_only=False) -> None:
    """Backward of every microbatch through `policy` (a PackedLogProbs, wrapped or not);
    sync_last_only: under DDP's `no_sync()` but for the last (one all-reduce per step)."""
    for index, mb in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last or not sync_last_only else policy.no_sync():
            logprobs = policy(mb["input_ids"], mb["position_ids"], mb["target_ids"])
            loss = clipped_loss(
                logprobs, mb["sampler_logprobs"], mb["advantages"], mb["loss_mask"], norm_const
            )
            loss.backward()


def reference_gradients(model, rollouts) -> dict[str, torch.Tensor]:
    """grad(sum over every policy token of the step / N), each rollout run alone through
    the model's ordinary forward (full logits, its own causal mask), in one process."""
    model.zero_grad(set_to_none=True)
    norm_const = policy_token_count(rollouts)
    for rollout in rollouts:
        ids = torch.from_numpy(rollout["token_ids"])[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        loss = clipped_loss(
            logprobs,
            torch.from_numpy(rollout["sampler_logprobs"][1:]),
            torch.from_numpy(rollout["advantages"][1:]),
            torch.from_numpy(rollout["action_mask"][1:]),
            norm_const,
        )
        loss.backward()
    return gradients(model)


def gradients(model) -> dict[str, torch.Tensor]:
    """Parameter name -> full gradient (gathered from the shards under FSDP2)."""
    out = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.detach().clone()
    return out


def max_relative_difference(grads, reference) -> float:
    """max over parameters of max|g - g_ref| / max|g_ref|."""
    assert grads.keys() == reference.keys()
    return max(
        float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in reference.items()
    )


def _old_readme_step(ddp, microbatches, norm_const) -> None:
    """The README trainer before PackedLogProbs, on a DDP-wrapped model: the body and the
    head weight reached through `.module`, so DDP's forward never runs."""
    model = ddp.module
    for mb in microbatches:
        if mb["input_ids"].numel() == 0:
            continue  # this pattern cannot run a zero-token row
        hidden = model.model(
            input_ids=mb["input_ids"][None], position_ids=mb["position_ids"][None], use_cache=False
        ).last_hidden_state[0]
        logprobs = checkpointed_log_probs(hidden, model.lm_head.weight, mb["target_ids"])
        loss = clipped_loss(
            logprobs, mb["sampler_logprobs"], mb["advantages"], mb["loss_mask"], norm_const
        )
        loss.backward()


def _refusal(function) -> str:
    try:
        function()
    except (TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_rank(rank: int, world_size: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        rollouts = make_rollouts()
        norm_const = policy_token_count(rollouts) / world_size
        microbatches = [
            served_microbatch([rollouts[i] for i in members]) for members in RANK_MICROBATCHES[rank]
        ]
        results = {}

        model = tiny_qwen3()
        train_microbatches(DistributedDataParallel(PackedLogProbs(model)), microbatches, norm_const)
        results["ddp"] = gradients(model)

        model = tiny_qwen3()
        policy = DistributedDataParallel(PackedLogProbs(model))
        train_microbatches(policy, microbatches, norm_const, sync_last_only=True)
        results["ddp_no_sync"] = gradients(model)

        model = tiny_qwen3()
        policy = PackedLogProbs(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(policy)
        train_microbatches(policy, microbatches, norm_const)
        results["fsdp2"] = gradients(model)

        model = tiny_qwen3()
        _old_readme_step(DistributedDataParallel(model), microbatches, norm_const)
        results["old_readme"] = gradients(model)

        model = tiny_qwen3()
        results["refused_ddp_model"] = _refusal(
            lambda: PackedLogProbs(DistributedDataParallel(model))
        )
        fully_shard(model)  # the model sharded, the PackedLogProbs around it not
        mb = microbatches[0]
        results["refused_sharded_model"] = _refusal(
            lambda: PackedLogProbs(model)(mb["input_ids"], mb["position_ids"], mb["target_ids"])
        )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
