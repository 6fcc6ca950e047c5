"""Packed-row layout: a packed row must look, sequence by sequence, like each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.layout import cu_seqlens_from_lengths, next_token_targets, row_layout
from rlfeed.sched.packing import pack_sequences

FAST = settings(max_examples=150, deadline=None)


@st.composite
def row_of_sequences(draw):
    """Lengths of sequences in one row, their token ids, and a row length >= their total."""
    lengths = draw(st.lists(st.integers(1, 12), min_size=0, max_size=8))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, 1000, size=length) for length in lengths]
    row_length = sum(lengths) + draw(st.integers(0, 6))
    return lengths, tokens, row_length


def alone(tokens: np.ndarray, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Position ids and next-token targets of one sequence run by itself."""
    targets = np.append(tokens[1:], fill)
    return np.arange(tokens.size), targets


@FAST
@given(row_of_sequences(), st.integers(-1, 0))
def test_packed_positions_and_targets_match_each_sequence_alone(case, fill):
    lengths, tokens, row_length = case
    layout = row_layout(lengths, row_length)
    row = np.concatenate([*tokens, np.zeros(row_length - sum(lengths), dtype=np.int64)])
    targets = next_token_targets(row, layout, fill=fill)
    start = 0
    for segment, sequence in enumerate(tokens):
        span = slice(start, start + sequence.size)
        expected_positions, expected_targets = alone(sequence, fill)
        np.testing.assert_array_equal(layout.position_ids[span], expected_positions)
        np.testing.assert_array_equal(targets[span], expected_targets)
        assert (layout.segment_ids[span] == segment).all()
        start += sequence.size
    padding = slice(start, row_length)
    assert (layout.segment_ids[padding] == -1).all()
    assert (layout.position_ids[padding] == 0).all()
    assert (targets[padding] == fill).all()


@FAST
@given(row_of_sequences())
def test_targets_accept_the_real_tokens_only(case):
    lengths, tokens, row_length = case
    layout = row_layout(lengths, row_length)
    real = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    padded = np.concatenate([real, np.full(row_length - real.size, 7, dtype=np.int64)])
    np.testing.assert_array_equal(
        next_token_targets(real, layout), next_token_targets(padded, layout)
    )


@FAST
@given(row_of_sequences())
def test_cu_seqlens_and_last_positions_mark_sequence_boundaries(case):
    lengths, _, row_length = case
    layout = row_layout(lengths, row_length)
    assert layout.cu_seqlens.dtype == np.int32
    assert layout.cu_seqlens.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert np.flatnonzero(layout.last_position).tolist() == [
        int(end) - 1 for end in np.cumsum(lengths)
    ]
    assert layout.num_tokens == sum(lengths)
    assert layout.max_seqlen == max(lengths, default=0)


@FAST
@given(row_of_sequences())
def test_segment_mask_is_block_diagonal_of_per_sequence_causal_masks(case):
    lengths, _, row_length = case
    layout = row_layout(lengths, row_length)
    segments = layout.segment_ids
    index = np.arange(row_length)
    packed = (
        (segments[:, None] == segments[None, :])
        & (segments[:, None] >= 0)
        & (index[None, :] <= index[:, None])
    )
    expected = np.zeros((row_length, row_length), dtype=bool)
    start = 0
    for length in lengths:
        expected[start : start + length, start : start + length] = np.tril(
            np.ones((length, length), dtype=bool)
        )
        start += length
    np.testing.assert_array_equal(packed, expected)


def test_packing_then_layout_places_every_sequence_once_with_its_tokens():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, size=120)
    tokens = [rng.integers(1, 50_000, size=length) for length in lengths.tolist()]
    row_length = 64
    seen = []
    for members in pack_sequences(lengths, row_length):
        layout = row_layout(lengths[members], row_length)
        row = np.zeros(row_length, dtype=np.int64)
        row[: layout.num_tokens] = np.concatenate([tokens[i] for i in members.tolist()])
        targets = next_token_targets(row, layout)
        for segment, sequence in enumerate(members.tolist()):
            span = layout.segment_ids == segment
            np.testing.assert_array_equal(row[span], tokens[sequence])
            np.testing.assert_array_equal(layout.position_ids[span], np.arange(lengths[sequence]))
            np.testing.assert_array_equal(targets[span], alone(tokens[sequence], 0)[1])
            seen.append(sequence)
    assert sorted(seen) == list(range(lengths.size))


def test_row_shorter_than_its_sequences_is_rejected():
    with pytest.raises(ValueError, match="more than the row length 4"):
        row_layout([3, 2], 4)


def test_empty_row_is_all_padding():
    layout = row_layout([], 3)
    assert layout.cu_seqlens.tolist() == [0]
    assert layout.segment_ids.tolist() == [-1, -1, -1]
    assert not layout.last_position.any()
    assert layout.max_seqlen == 0


def test_cu_seqlens_refuses_rows_beyond_int32():
    with pytest.raises(ValueError, match="does not fit int32"):
        cu_seqlens_from_lengths([2**31 - 1, 1])


def test_row_layout_rejects_empty_and_negative_lengths_naming_the_sequence():
    with pytest.raises(ValueError, match="sequence 0 has length 0"):
        row_layout([0, 3], 5)
    with pytest.raises(ValueError, match="sequence 1 has length -1"):
        row_layout([3, -1], 5)
