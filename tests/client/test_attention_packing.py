"""Attention inputs for packed rows: masks, position ids and varlen boundaries (14.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.client.attention import (
    block_causal_mask,
    concat_rows_cu_seqlens,
    hf_packed_kwargs,
    position_ids_from_cu_seqlens,
    segment_ids_from_cu_seqlens,
    varlen_inputs,
)
from rlfeed.sched.layout import row_layout

lengths_lists = st.lists(st.integers(1, 12), min_size=1, max_size=6)


def allowed_by_definition(segment_ids: np.ndarray) -> np.ndarray:
    """The mask spelled out one pair at a time: [L, L] bool, query by key."""
    length = segment_ids.size
    allowed = np.zeros((length, length), dtype=bool)
    for query in range(length):
        for key in range(length):
            same_sequence = segment_ids[query] == segment_ids[key] >= 0
            allowed[query, key] = (same_sequence and key <= query) or key == query
    return allowed


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_lists, padding=st.integers(0, 5))
def test_block_mask_matches_pairwise_definition(lengths, padding):
    layout = row_layout(lengths, sum(lengths) + padding)
    mask = block_causal_mask(torch.from_numpy(layout.segment_ids))
    expected = allowed_by_definition(layout.segment_ids)
    assert mask.shape == (1, 1, expected.shape[0], expected.shape[0])
    assert mask.dtype == torch.float32
    np.testing.assert_array_equal(mask[0, 0].numpy() == 0, expected)
    assert torch.isneginf(mask[0, 0][torch.from_numpy(~expected)]).all()


def test_padding_attends_to_itself_only_and_no_softmax_row_is_empty():
    segment_ids = torch.tensor([0, 0, 1, -1, -1])
    allowed = block_causal_mask(segment_ids, dtype=torch.bool)[0, 0]
    assert allowed.any(dim=-1).all()
    assert allowed[3].tolist() == [False, False, False, True, False]
    assert allowed[4].tolist() == [False, False, False, False, True]
    assert allowed[2].tolist() == [False, False, True, False, False]


def test_per_head_layout_repeats_each_row_n_heads_times():
    segment_ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, -1]])
    broadcast = block_causal_mask(segment_ids)
    per_head = block_causal_mask(segment_ids, n_heads=3)
    assert per_head.shape == (6, 4, 4)
    for row in range(2):
        for head in range(3):
            torch.testing.assert_close(per_head[row * 3 + head], broadcast[row, 0], rtol=0, atol=0)


def test_masked_sdpa_on_packed_rows_equals_each_sequence_alone():
    torch.manual_seed(0)
    lengths, row_length, heads, width = [5, 9, 3], 20, 2, 8
    layout = row_layout(lengths, row_length)
    q, k, v = (torch.randn(1, heads, row_length, width) for _ in range(3))
    mask = block_causal_mask(torch.from_numpy(layout.segment_ids))
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(packed).all()
    for start, stop in zip(layout.cu_seqlens[:-1], layout.cu_seqlens[1:], strict=True):
        alone = F.scaled_dot_product_attention(
            q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :], is_causal=True
        )
        torch.testing.assert_close(packed[..., start:stop, :], alone, rtol=1e-5, atol=1e-6)


def test_multihead_attention_accepts_the_per_head_layout():
    torch.manual_seed(0)
    heads, width = 2, 8
    layout = row_layout([3, 4], 8)
    attention = torch.nn.MultiheadAttention(width, heads, batch_first=True).eval()
    x = torch.randn(1, 8, width)
    mask = block_causal_mask(torch.from_numpy(layout.segment_ids), n_heads=heads)
    packed, _ = attention(x, x, x, attn_mask=mask, need_weights=False)
    alone, _ = attention(
        x[:, 3:7],
        x[:, 3:7],
        x[:, 3:7],
        attn_mask=block_causal_mask(torch.zeros(4, dtype=int))[0, 0],
    )
    torch.testing.assert_close(packed[:, 3:7], alone, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_lists, padding=st.integers(0, 5))
def test_ids_from_cu_seqlens_match_the_sched_layout(lengths, padding):
    layout = row_layout(lengths, sum(lengths) + padding)
    total = layout.segment_ids.size
    np.testing.assert_array_equal(
        position_ids_from_cu_seqlens(layout.cu_seqlens, total).numpy(), layout.position_ids
    )
    np.testing.assert_array_equal(
        segment_ids_from_cu_seqlens(layout.cu_seqlens, total).numpy(), layout.segment_ids
    )


def test_varlen_inputs_are_int32_boundaries_and_int_max_seqlen():
    inputs = varlen_inputs(np.array([0, 3, 10, 12], dtype=np.int32))
    assert inputs["cu_seqlens_q"].dtype == torch.int32
    assert inputs["cu_seqlens_q"].tolist() == [0, 3, 10, 12]
    assert inputs["cu_seqlens_k"] is inputs["cu_seqlens_q"]
    assert inputs["max_seqlen_q"] == inputs["max_seqlen_k"] == 7
    assert isinstance(inputs["max_seqlen_q"], int)


def test_varlen_padding_becomes_its_own_sequence():
    inputs = varlen_inputs([0, 3, 5], total_tokens=16)
    assert inputs["cu_seqlens_q"].tolist() == [0, 3, 5, 16]
    assert inputs["max_seqlen_q"] == 11


def test_rows_flatten_into_one_varlen_stream():
    rows = [np.array([0, 4, 6]), np.array([0, 8]), np.array([0, 2, 5])]
    cu = concat_rows_cu_seqlens(rows, row_length=8)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 4, 6, 8, 16, 18, 21, 24]


def test_hf_packed_kwargs_use_transformers_flash_attention_names():
    transformers_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    kwargs = hf_packed_kwargs([0, 3, 7], total_tokens=9)
    flash_names = set(transformers_utils.FlashAttentionKwargs.__annotations__)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= flash_names
    assert set(kwargs) - flash_names == {"position_ids", "use_cache"}
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 7, 9]
    assert kwargs["max_length_q"] == 4
    assert kwargs["use_cache"] is False


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [([1, 3], "cu_seqlens\\[0\\] must be 0"), ([0, 4, 2], "non-decreasing; cu_seqlens\\[2\\]")],
)
def test_bad_cu_seqlens_are_rejected_with_the_index(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        varlen_inputs(cu_seqlens)


def test_row_longer_than_row_length_is_rejected():
    with pytest.raises(ValueError, match="row 1 holds 9 tokens"):
        concat_rows_cu_seqlens([[0, 4], [0, 9]], row_length=8)
    with pytest.raises(ValueError, match="total_tokens=3"):
        position_ids_from_cu_seqlens([0, 4], total_tokens=3)


def test_float_segment_ids_are_rejected():
    with pytest.raises(ValueError, match="integer"):
        block_causal_mask(torch.zeros(4))
