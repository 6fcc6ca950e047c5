"""`PackedLogProbs` in one process: packed log-probs, entropies and gradients equal the
straightforward computation; Hugging Face models and explicit body + output both work.

The model is a tiny float64 Qwen3 from its config; the reference runs every rollout alone
through the model's ordinary forward (full logits). The distributed checks (DDP, FSDP2, the
old README's trap) are in `test_packed_logprobs_distributed.py`.
"""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from rlfeed.client import PackedLogProbs, full_log_probs
from torch import nn

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "packed_training", Path(__file__).with_name("packed_training.py")
)
training = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(training)

EXACT = 1e-9  # float64, relative


@pytest.fixture(scope="module")
def rollouts():
    return training.make_rollouts()


@pytest.fixture(scope="module")
def stream(rollouts):
    """All rollouts as one served [T] microbatch."""
    return training.served_microbatch(rollouts)


def unpacked(model, rollouts):
    """Per-rollout log-probs and entropies of the next tokens, from full logits."""
    out = []
    with torch.no_grad():
        for rollout in rollouts:
            ids = torch.from_numpy(rollout["token_ids"])[None]
            log_softmax = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            picked = log_softmax.gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append((picked, -(log_softmax.exp() * log_softmax).sum(-1)))
    return out


def test_packed_logprobs_and_entropy_match_unpacked_forwards(rollouts, stream):
    model = training.tiny_qwen3()
    with torch.no_grad():
        logprobs, entropy = PackedLogProbs(model)(
            stream["input_ids"], stream["position_ids"], stream["target_ids"], return_entropy=True
        )
    assert logprobs.shape == entropy.shape == stream["input_ids"].shape
    spans = pairwise(stream["cu_seqlens"].tolist())
    for (start, stop), (picked, entropies) in zip(spans, unpacked(model, rollouts), strict=True):
        torch.testing.assert_close(logprobs[start : stop - 1], picked, rtol=0, atol=1e-12)
        torch.testing.assert_close(entropy[start : stop - 1], entropies, rtol=0, atol=1e-12)


def test_accumulated_gradients_match_the_unpacked_reference(rollouts):
    """Both ranks' microbatches (a no-op one included) in one process, normalized by N."""
    model = training.tiny_qwen3()
    microbatches = [
        training.served_microbatch([rollouts[i] for i in members])
        for rank in (0, 1)
        for members in training.RANK_MICROBATCHES[rank]
    ]
    training.train_microbatches(
        PackedLogProbs(model), microbatches, training.policy_token_count(rollouts)
    )
    packed = training.gradients(model)
    reference = training.reference_gradients(training.tiny_qwen3(), rollouts)
    assert training.max_relative_difference(packed, reference) <= EXACT


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_finds_a_hf_models_body_and_output_layer_and_registers_every_parameter_once(tied):
    model = training.tiny_qwen3(tie_word_embeddings=tied)
    policy = PackedLogProbs(model)
    assert policy.body is model.get_decoder() and policy.output is model.get_output_embeddings()
    assert [id(p) for p in policy.parameters()] == [id(p) for p in model.parameters()]


def test_rows_give_the_log_probs_of_the_stream(rollouts):
    """[R, L] rows padded at the end (position 0, target 0) equal the [T] stream per row."""
    model = training.tiny_qwen3()
    policy = PackedLogProbs(model)
    streams = [training.served_microbatch(rollouts[:3]), training.served_microbatch(rollouts[3:])]
    length = max(s["input_ids"].numel() for s in streams) + 3
    rows = {
        key: torch.stack(
            [nn.functional.pad(s[key].long(), (0, length - s[key].numel())) for s in streams]
        )
        for key in ("input_ids", "position_ids", "target_ids")
    }
    with torch.no_grad():
        as_rows = policy(rows["input_ids"], rows["position_ids"], rows["target_ids"])
        assert as_rows.shape == (2, length)
        for row, s in zip(as_rows, streams, strict=True):
            alone = policy(s["input_ids"], s["position_ids"], s["target_ids"])
            torch.testing.assert_close(row[: alone.numel()], alone, rtol=0, atol=1e-12)


def test_cu_seqlens_go_to_hf_as_flash_attention_keywords(stream):
    """sdpa ignores them (the block mask comes from the positions): same log-probs."""
    policy = PackedLogProbs(training.tiny_qwen3())
    args = stream["input_ids"], stream["position_ids"], stream["target_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            policy(*args, cu_seqlens=stream["cu_seqlens"]), policy(*args), rtol=0, atol=0
        )


def test_a_zero_token_microbatch_gives_every_parameter_a_zero_gradient():
    model = training.tiny_qwen3()
    empty = torch.zeros(0, dtype=torch.int32)
    logprobs = PackedLogProbs(model)(empty, empty, empty)
    assert logprobs.shape == (0,) and logprobs.dtype == torch.float64
    logprobs.sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert not parameter.grad.any(), name


class TinyBody(nn.Module):
    """Not a Hugging Face model: embeddings of tokens and positions, one MLP."""

    def __init__(self, vocab=23, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, dtype=torch.float64)
        self.positions = nn.Embedding(32, width, dtype=torch.float64)
        self.mlp = nn.Linear(width, width, dtype=torch.float64)
        self.seen_kwargs = {}

    def forward(self, input_ids, position_ids, **kwargs):
        self.seen_kwargs = kwargs
        return torch.tanh(self.mlp(self.embed(input_ids) + self.positions(position_ids)))


@pytest.mark.parametrize("head", ["linear_with_bias", "tied_embedding"])
def test_explicit_body_and_output_match_the_full_computation(head):
    torch.manual_seed(0)
    body = TinyBody()
    output = nn.Linear(8, 23, dtype=torch.float64) if head == "linear_with_bias" else body.embed
    policy = PackedLogProbs(body=body, output=output, chunk_size=4, temperature=0.7)
    ids, positions = torch.randint(0, 23, (2, 9)), torch.arange(9).repeat(2, 1)
    targets = torch.randint(0, 23, (2, 9))
    logprobs, entropy = policy(ids, positions, targets, return_entropy=True)
    expected = full_log_probs(
        body(ids, positions),
        output.weight,
        targets,
        bias=getattr(output, "bias", None),
        temperature=0.7,
        return_entropy=True,
    )
    torch.testing.assert_close(logprobs, expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, expected[1], rtol=0, atol=1e-12)
    assert len(list(policy.parameters())) == len({id(p) for p in policy.parameters()})
    policy(ids[0], positions[0], targets[0], cu_seqlens=torch.tensor([0, 4, 9]))
    assert body.seen_kwargs.keys() == {"cu_seqlens"}  # no HF keywords for other bodies


def test_misuse_is_refused_with_the_reason():
    model = training.tiny_qwen3()
    policy = PackedLogProbs(model)
    ids = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="2-D attention_mask"):
        policy(ids, ids, ids, attention_mask=torch.ones(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="use_cache=True"):
        policy(ids, ids, ids, use_cache=True)
    with pytest.raises(ValueError, match="share one"):
        policy(ids, ids[:4], ids)
    with pytest.raises(TypeError, match="body= and output="):
        PackedLogProbs(body=model.model)
    with pytest.raises(TypeError, match=r"cannot find the output .*PackedLogProbs\(output=...\)"):
        PackedLogProbs(nn.Sequential(nn.Linear(2, 2)), body=model.model)
