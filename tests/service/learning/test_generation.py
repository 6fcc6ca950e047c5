"""Producer-side sampling against the trainer-side computation it must agree with.

- Sampler log-probs (KV-cached decoding, batched group) equal `PackedLogProbs` on the
  packed, served microbatches of the same weights: the step-0 ratio check, through the
  real write -> sidecar -> BatchLoader path (in-process sidecar), tool episodes included.
- The KV cache changes nothing: each token's log-prob equals a full uncached forward's.
- The exact pass probability (`evaluation.py`) equals the sampled pass rate in expectation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlfeed.client.loader import BatchLoader
from rlfeed.client.packed_logprobs import PackedLogProbs
from rlfeed.client.producer import RolloutWriter
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.gym.splits import make_split
from rlfeed.service.gym.tasks import TOOL_CALL, VOCAB_SIZE
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.learning.evaluation import pass_probabilities
from rlfeed.service.learning.generation import sample_group
from rlfeed.service.learning.policy import PolicyConfig, build_model, warm_start

MATCH = 1e-5  # float32 rounding of two different forwards
GROUP = 8


@pytest.fixture(scope="module")
def split():
    return make_split(20, seed=0)


@pytest.fixture(scope="module")
def model(split):
    """A briefly warm-started policy: tool calls and answers are likely, not certain, so
    groups hold both tool episodes and cut ones, passes and failures."""
    config = PolicyConfig(seed=1, warm_start_steps=40)
    model = build_model(config)
    warm_start(model, split.sft_tasks(40 * config.warm_start_batch, seed=1), config)
    return model.eval()


def sample_groups(model, tasks, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [sample_group(model, task, GROUP, generator) for task in tasks]


def test_sampler_logprobs_match_packed_logprobs_on_served_steps(model, split):
    config = with_overrides(
        SidecarConfig(),
        batching={"token_budget": 256, "world_size": 1},
        rollouts={"prompts_per_step": len(split.train), "group_size": GROUP},
    )
    transport = InProcessTransport(config)
    groups = sample_groups(model, split.train)
    with RolloutWriter(transport) as writer:
        writer.register_tasks([t.task_id for t in split.train])
        for task, group in zip(split.train, groups, strict=True):
            for k, sampled in enumerate(group):
                writer.write(
                    rollout_id=f"{task.task_id}/{k}",
                    task_id=task.task_id,
                    group_id=task.task_id,
                    policy_version=0,
                    reward=sampled.episode.reward,
                    token_ids=sampled.episode.token_ids,
                    action_mask=sampled.episode.action_mask,
                    sampler_logprobs=sampled.sampler_logprobs,
                )
    lookups = [g for t, g in zip(split.train, groups, strict=True) if t.family == "lookup"]
    called = sum(int(s.episode.token_ids[4]) == TOOL_CALL for g in lookups for s in g)
    assert 0 < called < GROUP * len(lookups)  # both kinds of tool episode are checked
    policy = PackedLogProbs(model)
    with BatchLoader(transport, start_step=0, stop_step=1, prefetch=0) as loader:
        step = next(iter(loader))
    assert len(step) > 1  # several packed rows: packing is really exercised
    gaps, tokens = [], 0
    with torch.no_grad():
        for mb in step:
            trainer = policy(mb.input_ids, mb.position_ids, mb.target_ids, cu_seqlens=mb.cu_seqlens)
            selected = mb.loss_mask != 0
            gaps.append((trainer - mb.sampler_logprobs)[selected].abs().max())
            tokens += int(selected.sum())
    gap = float(max(gaps))
    print(f"max |trainer - sampler log-prob| over {tokens} policy tokens: {gap:.2e}")
    assert tokens == sum(int(s.episode.action_mask.sum()) for g in groups for s in g)
    assert gap < MATCH


def test_kv_cached_sampling_matches_full_forwards(model, split):
    for group in sample_groups(model, split.train[:8], seed=3):
        for sampled in group:
            ids = torch.from_numpy(sampled.episode.token_ids).long()[None]
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
            full = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            mask = sampled.episode.action_mask[1:].astype(bool)
            assert np.allclose(sampled.sampler_logprobs[1:][mask], full.numpy()[mask], atol=MATCH)
            assert (sampled.sampler_logprobs[~sampled.episode.action_mask.astype(bool)] == 0).all()


def test_groups_are_reproducible_and_in_the_vocabulary(model, split):
    first, second = sample_groups(model, split.train[:4]), sample_groups(model, split.train[:4])
    for a, b in zip(first, second, strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x.episode.token_ids, y.episode.token_ids)
            assert x.episode.token_ids.max() < VOCAB_SIZE


def test_exact_pass_probability_is_the_sampled_pass_rate_in_expectation(model, split):
    tasks = [t for t in split.train if t.family in ("pick", "lookup")][:4]
    exact = pass_probabilities(PackedLogProbs(model), tasks)
    generator = torch.Generator().manual_seed(5)
    episodes = 400
    for task, p in zip(tasks, exact.tolist(), strict=True):
        rewards = [s.episode.reward for s in sample_group(model, task, episodes, generator)]
        sampled = float(np.mean(rewards))
        sigma = max((p * (1 - p) / episodes) ** 0.5, 1e-3)
        print(f"{task.task_id}: exact {p:.3f}, sampled {sampled:.3f} over {episodes}")
        assert abs(sampled - p) < 4 * sigma
