"""Packed forward passes match unpacked ones; each of the two packing bugs is caught (14.1).

A real Hugging Face causal LM (Qwen3 architecture from a tiny config, random init, CPU,
fp32, eval mode) and a minimal reference transformer (RoPE, SDPA with our explicit mask)
score the same episodes twice: packed into rows by `rlfeed.sched` and each episode alone.
The policy-token log-probs must agree to float32 rounding; with running position ids, or
with a plain causal mask, they must differ by far more. What transformers 5 does with packed
inputs (see `rlfeed.client.attention`): sdpa and eager derive the block mask from restarted
position ids, but only with no attention mask and no cache; the trap tests below pin that.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rlfeed.client.attention import (
    block_causal_mask,
    concat_rows_cu_seqlens,
    hf_packed_kwargs,
)
from rlfeed.client.consistency import ratio_outlier_share
from rlfeed.client.logprobs import checkpointed_log_probs
from rlfeed.sched.layout import next_token_targets, row_layout
from rlfeed.sched.packing import pack_sequences

transformers = pytest.importorskip("transformers")

VOCAB, ROW_LENGTH = 97, 64
MATCH = 1e-5  # float32 rounding
LEAK = 1e-2  # what a packing bug must exceed to count as detected
# Weight scale of the random models: above HF's default 0.02 so that the random model's
# predictions depend on context as much as a trained model's (a near-uniform model
# would hide leaks behind tiny log-prob changes).
SHARPNESS = 0.05


# ---------------------------------------------------------------------------------------
# Episodes, packed by rlfeed.sched


def make_episodes(seed=0, count=12):
    rng = np.random.default_rng(seed)
    episodes = []
    for length in rng.integers(6, 40, count):
        tokens = rng.integers(1, VOCAB, length)
        action = np.zeros(length, dtype=bool)
        action[int(rng.integers(2, 5)) :] = True  # a short prompt, then policy tokens
        episodes.append((tokens, action))
    return episodes


def pack(episodes):
    """Packed rows in the served layout: [R, L] arrays of the row fields."""
    lengths = [tokens.size for tokens, _ in episodes]
    rows = {
        key: []
        for key in ("input_ids", "position_ids", "segment_ids", "targets", "loss_mask", "members")
    }
    rows["cu_seqlens"] = []
    for members in pack_sequences(lengths, ROW_LENGTH):
        layout = row_layout([lengths[i] for i in members], ROW_LENGTH)
        input_ids = np.zeros(ROW_LENGTH, dtype=np.int64)
        action = np.zeros(ROW_LENGTH, dtype=bool)
        input_ids[: layout.num_tokens] = np.concatenate([episodes[i][0] for i in members])
        action[: layout.num_tokens] = np.concatenate([episodes[i][1] for i in members])
        rows["input_ids"].append(input_ids)
        rows["position_ids"].append(layout.position_ids)
        rows["segment_ids"].append(layout.segment_ids)
        rows["targets"].append(next_token_targets(input_ids, layout, fill=0))
        rows["loss_mask"].append(next_token_targets(action, layout, fill=False))
        rows["cu_seqlens"].append(layout.cu_seqlens)
        rows["members"].append(members)
    packed = {
        key: torch.from_numpy(np.stack(value))
        for key, value in rows.items()
        if key not in ("cu_seqlens", "members")
    }
    packed["cu_seqlens"], packed["members"] = rows["cu_seqlens"], rows["members"]
    assert len(packed["members"]) > 1 and packed["loss_mask"].any()
    return packed


def sampler_layout(packed, alone_logprobs):
    """Each episode's unpacked log-probs placed in the packed, target-aligned layout."""
    sampler = torch.zeros(packed["targets"].shape)
    for row, (members, cu) in enumerate(zip(packed["members"], packed["cu_seqlens"], strict=True)):
        for member, start in zip(members, cu[:-1], strict=False):
            values = alone_logprobs[member]
            sampler[row, start : start + values.numel()] = values
    return sampler


def running_position_ids(packed):
    return torch.arange(ROW_LENGTH).expand_as(packed["position_ids"]).contiguous()


def plain_causal_mask(packed):
    rows = packed["segment_ids"].shape[0]
    return block_causal_mask(torch.zeros(rows, ROW_LENGTH, dtype=torch.int64))


def policy_token_gap(packed, trainer, sampler):
    mask = packed["loss_mask"]
    return float((trainer[mask] - sampler[mask]).abs().max())


# ---------------------------------------------------------------------------------------
# The Hugging Face model


def hf_model(architecture, attn_implementation):
    """Tiny random-init model: Qwen3 (rotary positions) or GPT-2 (learned absolute ones)."""
    torch.manual_seed(0)
    if architecture == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            initializer_range=SHARPNESS,
            attn_implementation=attn_implementation,
        )
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            initializer_range=SHARPNESS,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn_implementation,
        )
        model = transformers.GPT2LMHeadModel(config)
    model.eval()
    assert model.config._attn_implementation == attn_implementation
    return model


def hf_logprobs(model, input_ids, targets, **forward_kwargs):
    """Target log-probs from the base model's hidden states and the LM head weight."""
    with torch.no_grad():
        hidden = model.base_model(input_ids=input_ids, **forward_kwargs).last_hidden_state
        weight = model.get_output_embeddings().weight
        return checkpointed_log_probs(hidden, weight, targets, chunk_size=50)


def hf_alone(model, episodes):
    """Each episode run by itself, with the model's own defaults: the sampler's view."""
    alone = []
    for tokens, _ in episodes:
        ids = torch.from_numpy(tokens)[None]
        alone.append(hf_logprobs(model, ids[:, :-1], ids[:, 1:], use_cache=False)[0])
    return alone


@pytest.fixture(
    scope="module",
    params=[("qwen3", "sdpa"), ("qwen3", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager")],
    ids=lambda param: "-".join(param),
)
def hf_setting(request):
    model = hf_model(*request.param)
    episodes = make_episodes()
    packed = pack(episodes)
    sampler = sampler_layout(packed, hf_alone(model, episodes))
    return model, packed, sampler


def test_hf_packed_logprobs_match_unpacked_with_position_ids_only(hf_setting):
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=packed["position_ids"],
        use_cache=False,
    )
    assert policy_token_gap(packed, trainer, sampler) < MATCH
    assert ratio_outlier_share(trainer, sampler, packed["loss_mask"]) == 0.0


def test_hf_takes_the_int32_ids_and_positions_the_loader_serves(hf_setting):
    """BatchLoader hands over input_ids and position_ids as int32 (zero-copy from the
    served bytes): exactly the log-probs of the int64 tensors."""
    model, packed, _ = hf_setting
    as_served, widened = (
        hf_logprobs(
            model,
            packed["input_ids"].to(dtype),
            packed["targets"],
            position_ids=packed["position_ids"].to(dtype),
            use_cache=False,
        )
        for dtype in (torch.int32, torch.int64)
    )
    torch.testing.assert_close(as_served, widened, rtol=0, atol=0)


def test_hf_packed_logprobs_match_unpacked_with_our_block_mask(hf_setting):
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=packed["position_ids"],
        attention_mask=block_causal_mask(packed["segment_ids"]),
        use_cache=False,
    )
    assert policy_token_gap(packed, trainer, sampler) < MATCH


def test_hf_packed_kwargs_on_one_flattened_stream_match_unpacked(hf_setting):
    model, packed, sampler = hf_setting
    cu = concat_rows_cu_seqlens(packed["cu_seqlens"], ROW_LENGTH)
    total = packed["input_ids"].numel()
    trainer = hf_logprobs(
        model,
        packed["input_ids"].reshape(1, -1),
        packed["targets"].reshape(1, -1),
        **hf_packed_kwargs(cu, total_tokens=total),
    ).reshape(packed["targets"].shape)
    assert policy_token_gap(packed, trainer, sampler) < MATCH


def test_hf_running_position_ids_are_detected_with_absolute_positions(hf_setting):
    """The position bug alone (correct block mask): visible with learned absolute positions;
    with rotary positions attention depends only on position differences inside a block, so
    there it is exact (the bug then bites through the mask, see the next test)."""
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=running_position_ids(packed),
        attention_mask=block_causal_mask(packed["segment_ids"]),
        use_cache=False,
    )
    gap = policy_token_gap(packed, trainer, sampler)
    if model.config.model_type == "gpt2":
        assert gap > LEAK
    else:
        assert gap < MATCH


def test_hf_running_position_ids_without_mask_also_lose_the_block_mask(hf_setting):
    # transformers derives the packed mask from the position ids: running ones give a
    # plain causal mask, so with rotary positions too the bug is a leak.
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=running_position_ids(packed),
        use_cache=False,
    )
    assert policy_token_gap(packed, trainer, sampler) > LEAK


def test_hf_plain_causal_mask_is_detected(hf_setting):
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=packed["position_ids"],
        attention_mask=plain_causal_mask(packed),
        use_cache=False,
    )
    assert policy_token_gap(packed, trainer, sampler) > LEAK


def assert_leak_seen_by_ratio_check(packed, trainer, sampler, name):
    gap = policy_token_gap(packed, trainer, sampler)
    share = ratio_outlier_share(trainer, sampler, packed["loss_mask"])
    print(f"{name}: max policy log-prob gap {gap:.3f} nats, step-0 ratio outlier share {share:.3f}")
    assert gap > LEAK
    assert share > 0


def test_hf_2d_attention_mask_switches_packed_detection_off(hf_setting):
    model, packed, sampler = hf_setting
    trainer = hf_logprobs(
        model,
        packed["input_ids"],
        packed["targets"],
        position_ids=packed["position_ids"],
        attention_mask=torch.ones_like(packed["input_ids"]),  # all ones, as tokenizers give
        use_cache=False,
    )
    assert_leak_seen_by_ratio_check(packed, trainer, sampler, "all-ones 2-D attention_mask")


def test_hf_default_use_cache_switches_packed_detection_off(hf_setting):
    model, packed, sampler = hf_setting
    assert model.config.use_cache  # the default that the forward falls back to
    trainer = hf_logprobs(
        model, packed["input_ids"], packed["targets"], position_ids=packed["position_ids"]
    )
    assert_leak_seen_by_ratio_check(packed, trainer, sampler, "use_cache left at its default")


# ---------------------------------------------------------------------------------------
# A minimal reference transformer through the explicit SDPA mask path


def rotate(x, position_ids):
    """Rotary position embedding of x: [R, H, L, d] at position_ids [R, L]."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = position_ids[:, None, :, None].float() * frequencies
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class ReferenceTransformer(torch.nn.Module):
    """Pre-norm decoder over an explicit additive SDPA mask, GELU MLP.

    positions: "learned" absolute position embeddings (as in the chapter's TinyAgent) or
    "rotary" (RoPE on queries and keys, as in Qwen3/Llama).
    """

    def __init__(self, positions="learned", width=48, heads=4, layers=2):
        super().__init__()
        torch.manual_seed(1)
        self.heads, self.positions = heads, positions
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position_embed = torch.nn.Embedding(256, width)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.LayerNorm(width),
                    "qkv": torch.nn.Linear(width, 3 * width),
                    "out": torch.nn.Linear(width, width),
                    "norm2": torch.nn.LayerNorm(width),
                    "mlp": torch.nn.Sequential(
                        torch.nn.Linear(width, 4 * width),
                        torch.nn.GELU(),
                        torch.nn.Linear(4 * width, width),
                    ),
                }
            )
            self.blocks.append(block)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB, bias=True)

    def hidden(self, input_ids, position_ids, mask):
        x = self.embed(input_ids)
        if self.positions == "learned":
            x = x + self.position_embed(position_ids)
        rows, length, width = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).chunk(3, dim=-1)
            q, k, v = (t.reshape(rows, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            if self.positions == "rotary":
                q, k = rotate(q, position_ids), rotate(k, position_ids)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + block["out"](attended.transpose(1, 2).reshape(rows, length, width))
            x = x + block["mlp"](block["norm2"](x))
        return self.norm(x)

    def logprobs(self, input_ids, targets, position_ids, mask):
        with torch.no_grad():
            hidden = self.hidden(input_ids, position_ids, mask)
            return checkpointed_log_probs(
                hidden, self.head.weight, targets, bias=self.head.bias, chunk_size=50
            )


@pytest.fixture(scope="module", params=["learned", "rotary"])
def reference_setting(request):
    model = ReferenceTransformer(positions=request.param).eval()
    episodes = make_episodes(seed=1)
    packed = pack(episodes)
    alone = []
    for tokens, _ in episodes:
        ids = torch.from_numpy(tokens)[None]
        length = ids.shape[1] - 1
        causal = block_causal_mask(torch.zeros(1, length, dtype=torch.int64))
        alone.append(model.logprobs(ids[:, :-1], ids[:, 1:], torch.arange(length)[None], causal)[0])
    return model, packed, sampler_layout(packed, alone)


def test_reference_packed_logprobs_match_unpacked(reference_setting):
    model, packed, sampler = reference_setting
    mask = block_causal_mask(packed["segment_ids"])
    trainer = model.logprobs(packed["input_ids"], packed["targets"], packed["position_ids"], mask)
    assert policy_token_gap(packed, trainer, sampler) < MATCH
    assert ratio_outlier_share(trainer, sampler, packed["loss_mask"]) == 0.0


def test_reference_running_position_ids_are_detected(reference_setting):
    """With learned absolute positions the position bug shows on its own; with rotary ones
    and a correct block mask it is exact, since RoPE attention sees position differences."""
    model, packed, sampler = reference_setting
    mask = block_causal_mask(packed["segment_ids"])
    trainer = model.logprobs(
        packed["input_ids"], packed["targets"], running_position_ids(packed), mask
    )
    gap = policy_token_gap(packed, trainer, sampler)
    if model.positions == "learned":
        assert gap > LEAK
    else:
        assert gap < MATCH


def test_reference_plain_causal_mask_is_detected(reference_setting):
    model, packed, sampler = reference_setting
    trainer = model.logprobs(
        packed["input_ids"], packed["targets"], packed["position_ids"], plain_causal_mask(packed)
    )
    assert policy_token_gap(packed, trainer, sampler) > LEAK


def test_reference_both_bugs_move_the_step0_ratios(reference_setting):
    model, packed, sampler = reference_setting
    trainer = model.logprobs(
        packed["input_ids"],
        packed["targets"],
        running_position_ids(packed),
        plain_causal_mask(packed),
    )
    share = ratio_outlier_share(trainer, sampler, packed["loss_mask"])
    print(f"step-0 ratio outlier share, reference transformer, leaky packing: {share:.3f}")
    assert share > 0
