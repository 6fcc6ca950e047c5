"""The demo's policy: a Hugging Face `Qwen3ForCausalLM` from a tiny config, warm-started.

    model = warm_started(PolicyConfig(seed=0), split, cache_dir)   # seconds once, then cached

Why a warm start: from random weights almost every early group fails in all 8 attempts
(no gradient); a real run starts from an SFT checkpoint. A few seeded supervised steps on
warm-start examples (disjoint by content from the train and held-out tasks) put the policy
where groups are mixed: held-out pass rates well above chance and well below 1. The
checkpoint is cached per (config, gym seed) so a demo does not redo it each run.

Everything is float32 on CPU, one thread per process (the caller sets it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from rlfeed.service.gym.splits import GymSplit
from rlfeed.service.gym.tasks import VOCAB_SIZE, Task, solved_episode
from rlfeed.service.learning.weights import read_weights, write_atomically

CACHE_ENV = "RLFEED_CACHE_DIR"


@dataclass(kw_only=True, frozen=True)
class PolicyConfig:
    """The model and its warm start."""

    vocab_size: int = VOCAB_SIZE  # the gym's vocabulary; default 20
    hidden_size: int = 64  # residual width; default 64
    intermediate_size: int = 128  # MLP width; default 128
    num_layers: int = 2  # decoder layers; default 2
    num_heads: int = 4  # attention heads; default 4
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); default 2
    head_dim: int = 16  # per-head width; default 16
    max_positions: int = 32  # longest episode, tokens (the gym's is 14); default 32
    seed: int = 0  # initial weights and warm-start batches; default 0
    # 150 x 64 solved episodes at 3e-3 (about 5 s on one core, then cached): held-out pass
    # rates pick ~0.5, lookup ~0.25, reverse ~0.8, add ~0.07 (chance 0.1 before EOS); fewer
    # steps leave most groups all-fail, more leave little to learn (see the module docstring).
    warm_start_steps: int = 150  # supervised steps before RL; default 150
    warm_start_batch: int = 64  # solved episodes per supervised step; default 64
    warm_start_lr: float = 3e-3  # Adam learning rate of the warm start; default 3e-3

    def key(self, gym_seed: int) -> str:
        """A short digest naming the cached warm-start checkpoint of this config."""
        text = json.dumps({**dataclasses.asdict(self), "gym_seed": gym_seed}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_model(config: PolicyConfig):
    """A freshly initialised `Qwen3ForCausalLM`, the same in every process for one seed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_config = Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
    )
    # sdpa: the attention `PackedLogProbs` is checked with (block mask from position ids).
    hf_config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen3ForCausalLM(hf_config)
    return model.float()


def packed_stream(episodes) -> dict[str, torch.Tensor]:
    """Episodes back to back as one [T] stream in the served layout: input ids, position
    ids restarting at 0, next-token targets and the target-aligned policy-token mask."""
    ids, positions, targets, mask = [], [], [], []
    for episode in episodes:
        tokens = torch.from_numpy(episode.token_ids).long()
        action = torch.from_numpy(episode.action_mask).bool()
        n = tokens.numel()
        ids.append(tokens)
        positions.append(torch.arange(n))
        targets.append(torch.cat([tokens[1:], tokens.new_zeros(1)]))
        mask.append(torch.cat([action[1:], action.new_zeros(1)]))
    return {
        "input_ids": torch.cat(ids),
        "position_ids": torch.cat(positions),
        "target_ids": torch.cat(targets),
        "loss_mask": torch.cat(mask),
    }


def warm_start(model, tasks: list[Task], config: PolicyConfig) -> list[float]:
    """Supervised steps on solved episodes of `tasks` (policy tokens only); returns the
    loss of each step. `PackedLogProbs` computes the log-probs, as in training."""
    from rlfeed.client.packed_logprobs import PackedLogProbs

    policy = PackedLogProbs(model)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.warm_start_lr)
    batch = config.warm_start_batch
    losses = []
    model.train()
    # One thread: this model is too small to gain from more, and on a busy machine the
    # intra-op threads' spinning made the same steps 10x slower (5 s -> 76 s measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(config.warm_start_steps):
            chunk = tasks[step * batch : (step + 1) * batch]
            stream = packed_stream(solved_episode(t) for t in chunk)
            logprobs = policy(stream["input_ids"], stream["position_ids"], stream["target_ids"])
            loss = -logprobs[stream["loss_mask"]].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    return losses


def default_cache_dir() -> Path:
    """$RLFEED_CACHE_DIR, else ~/.cache/rlfeed."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlfeed")


def warm_started(config: PolicyConfig, split: GymSplit, cache_dir: Path | None = None):
    """The warm-started model of (config, split.seed): loaded from `cache_dir` when cached,
    else trained (a few seconds) and cached. Returns (model, path of the checkpoint)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"warmstart-{config.key(split.seed)}.pt"
    model = build_model(config)
    if path.exists():
        _, state = read_weights(path)
        model.load_state_dict(state)
        return model, path
    tasks = split.sft_tasks(config.warm_start_steps * config.warm_start_batch, config.seed)
    warm_start(model, tasks, config)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, 0, model.state_dict())
    return model, path
