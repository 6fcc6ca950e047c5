"""Microbatches gathered straight from ingest batches equal the reference gather."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.assembly import Microbatch, TokenColumns, materialize_microbatch
from rlfeed.sched.gather import (
    COLUMN_DTYPES,
    TokenScratch,
    locate_sequences,
    materialize_sequences,
    microbatch_pieces,
)

FIELDS = (
    "input_ids",
    "position_ids",
    "cu_seqlens",
    "target_ids",
    "loss_mask",
    "sampler_logprobs",
    "advantages",
    "rollout_index",
)


def make_batch(rng: np.random.Generator, lengths: list[int]) -> TokenColumns:
    """Rollouts of `lengths`: a prompt (mask 0, at least the first token), then policy tokens."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(offsets[-1])
    action_mask = np.zeros(total, np.uint8)
    for start, length in zip(offsets[:-1].tolist(), lengths, strict=True):
        action_mask[start + int(rng.integers(1, length + 1)) : start + length] = 1
    logprobs = np.where(action_mask > 0, -rng.random(total), 0.0).astype(np.float32)
    token_ids = rng.integers(0, 50_000, total).astype(np.int32)
    return TokenColumns(offsets, token_ids, action_mask, logprobs)


def concatenated(batches: list[TokenColumns]) -> tuple[TokenColumns, np.ndarray]:
    """The straightforward layout: every batch's columns back to back; row base per batch."""
    bases = np.cumsum([0] + [b.offsets.size - 1 for b in batches])
    token_bases = np.cumsum([0] + [int(b.offsets[-1]) for b in batches])
    offsets = np.concatenate(
        [[0]] + [b.offsets[1:] + base for b, base in zip(batches, token_bases, strict=False)]
    )
    columns = TokenColumns(
        offsets=offsets.astype(np.int64),
        token_ids=np.concatenate([b.token_ids for b in batches]),
        action_mask=np.concatenate([b.action_mask for b in batches]),
        sampler_logprobs=np.concatenate([b.sampler_logprobs for b in batches]),
    )
    return columns, bases


def assert_same(got: Microbatch, want: Microbatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, name
        # Byte equality, so +0.0 / -0.0 and every padding value must match as served.
        assert a.tobytes() == b.tobytes(), name
    assert got.max_seqlen == want.max_seqlen


@settings(max_examples=60, deadline=None)
@given(
    batch_lengths=st.lists(
        st.lists(st.integers(1, 40), min_size=1, max_size=8), min_size=1, max_size=4
    ),
    picks=st.integers(0, 30),
    seed=st.integers(0, 10_000),
)
def test_both_strategies_equal_the_reference_on_concatenated_columns(batch_lengths, picks, seed):
    rng = np.random.default_rng(seed)
    batches = [make_batch(rng, lengths) for lengths in batch_lengths]
    columns, bases = concatenated(batches)
    pairs = [(b, r) for b, lengths in enumerate(batch_lengths) for r in range(len(lengths))]
    chosen = rng.permutation(len(pairs))[: min(picks, len(pairs))]
    source_of = np.array([pairs[i][0] for i in chosen], dtype=np.int64)
    row_of = np.array([pairs[i][1] for i in chosen], dtype=np.int64)
    global_rows = bases[source_of] + row_of
    per_rollout = rng.standard_normal(columns.offsets.size - 1).astype(np.float32)
    want = materialize_microbatch(columns, global_rows, per_rollout)
    for strategy in ("slices", "indexed", "auto"):
        got = materialize_sequences(
            batches, source_of, row_of, per_rollout[global_rows], global_rows, strategy=strategy
        )
        assert_same(got, want)


def test_long_sequences_from_several_batches_equal_the_reference():
    rng = np.random.default_rng(1)
    batches = [make_batch(rng, [2000, 513, 4096]), make_batch(rng, [1500, 3000])]
    columns, bases = concatenated(batches)
    source_of, row_of = np.array([1, 0, 0, 1, 0]), np.array([1, 2, 0, 0, 1])
    global_rows = bases[source_of] + row_of
    advantages = np.array([0.5, -1.0, 2.0, -0.25, 1.5], np.float32)
    per_rollout = np.zeros(columns.offsets.size - 1, np.float32)
    per_rollout[global_rows] = advantages
    reference = materialize_microbatch(columns, global_rows, per_rollout)
    for strategy in ("auto", "indexed"):  # "auto" copies slices at these lengths
        got = materialize_sequences(
            batches, source_of, row_of, advantages, global_rows, strategy=strategy
        )
        assert_same(got, reference)


def test_a_policy_token_in_first_position_is_refused_naming_the_rollout():
    batch = TokenColumns(
        offsets=np.array([0, 3, 6]),
        token_ids=np.arange(6, dtype=np.int32),
        action_mask=np.array([0, 1, 1, 1, 1, 0], dtype=np.uint8),
        sampler_logprobs=np.zeros(6, dtype=np.float32),
    )
    with pytest.raises(ValueError, match="rollout 17: action_mask"):
        materialize_sequences([batch], [0, 0], [0, 1], np.zeros(2, np.float32), [16, 17])


def test_an_unknown_strategy_is_refused():
    batch = make_batch(np.random.default_rng(0), [4])
    with pytest.raises(ValueError, match="strategy"):
        materialize_sequences([batch], [0], [0], np.zeros(1, np.float32), [0], strategy="fast")


def joined(pieces: dict[str, list[np.ndarray]]) -> dict[str, bytes]:
    """What a serializer joining the pieces writes, per column."""
    for name, parts in pieces.items():
        for part in parts:
            assert part.dtype == COLUMN_DTYPES[name] and part.ndim == 1, name
            assert part.flags.c_contiguous, name
    return {name: b"".join(parts) for name, parts in pieces.items()}


def reference_bytes(microbatch: Microbatch) -> dict[str, bytes]:
    return {name: getattr(microbatch, name).tobytes() for name in COLUMN_DTYPES}


@settings(max_examples=60, deadline=None)
@given(
    batch_lengths=st.lists(
        st.lists(st.one_of(st.integers(1, 6), st.integers(300, 900)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
)
def test_joined_pieces_equal_the_reference_columns_for_every_strategy(batch_lengths, cuts, seed):
    rng = np.random.default_rng(seed)
    batches = [make_batch(rng, lengths) for lengths in batch_lengths]
    columns, bases = concatenated(batches)
    pairs = [(b, r) for b, lengths in enumerate(batch_lengths) for r in range(len(lengths))]
    per_rollout = rng.standard_normal(columns.offsets.size - 1).astype(np.float32)
    per_rollout[rng.random(per_rollout.size) < 0.2] = 0.0  # dropped / zero-advantage rollouts
    scratch = TokenScratch()  # shared by every microbatch below: their pieces must not overlap
    for strategy in ("slices", "indexed", "auto"):
        scratch.reset()
        taken = []
        for picks in cuts:  # several microbatches (some empty) between two resets
            chosen = rng.permutation(len(pairs))[: min(picks, len(pairs))]
            source_of = np.array([pairs[i][0] for i in chosen], dtype=np.int64)
            row_of = np.array([pairs[i][1] for i in chosen], dtype=np.int64)
            global_rows = bases[source_of] + row_of
            spans = locate_sequences(
                batches, source_of, row_of, per_rollout[global_rows], global_rows
            )
            pieces = microbatch_pieces(batches, spans, scratch, strategy=strategy)
            want = materialize_microbatch(columns, global_rows, per_rollout)
            taken.append((pieces, want))
        for pieces, want in taken:
            assert joined(pieces) == reference_bytes(want), strategy


def test_pieces_taken_before_the_scratch_grows_stay_valid():
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [5, 3, 2000, 4000, 7])
    scratch = TokenScratch()
    advantages = rng.standard_normal(5).astype(np.float32)
    taken = []
    for rows in ([0, 1, 4], [2, 3], [3, 0, 1, 2, 4]):  # each larger than the scratch so far
        rows = np.array(rows)
        spans = locate_sequences([batch], np.zeros(rows.size), rows, advantages[rows], rows)
        pieces = microbatch_pieces([batch], spans, scratch, strategy="indexed")
        taken.append((pieces, materialize_microbatch(batch, rows, advantages)))
    for pieces, want in taken:
        assert joined(pieces) == reference_bytes(want)


def test_sources_in_other_dtypes_or_strided_are_served_as_the_reference_serves_them():
    rng = np.random.default_rng(4)
    batch = make_batch(rng, [700, 900, 3])
    wide = TokenColumns(
        offsets=batch.offsets,
        token_ids=batch.token_ids.astype(np.int64),
        action_mask=batch.action_mask.astype(np.int16),
        sampler_logprobs=batch.sampler_logprobs.astype(np.float64),
    )
    strided = TokenColumns(  # every other entry of a twice-as-long column
        offsets=batch.offsets,
        token_ids=np.repeat(batch.token_ids, 2)[::2],
        action_mask=np.repeat(batch.action_mask, 2)[::2],
        sampler_logprobs=np.repeat(batch.sampler_logprobs, 2)[::2],
    )
    narrow_mask = TokenColumns(  # token ids and log-probs still served as views
        offsets=batch.offsets,
        token_ids=batch.token_ids,
        action_mask=batch.action_mask.astype(np.int16),
        sampler_logprobs=batch.sampler_logprobs,
    )
    rows, advantages = np.array([1, 2, 0]), np.array([0.5, -2.0, 1.0], np.float32)
    want = materialize_microbatch(batch, rows, advantages)
    for source in (wide, strided, narrow_mask):
        for strategy in ("slices", "indexed"):
            spans = locate_sequences([source], np.zeros(3), rows, advantages[rows], rows)
            pieces = microbatch_pieces([source], spans, TokenScratch(), strategy=strategy)
            assert joined(pieces) == reference_bytes(want), strategy


def test_a_step_located_once_checks_each_microbatch_it_takes():
    batch = TokenColumns(
        offsets=np.array([0, 3, 6, 8]),
        token_ids=np.arange(8, dtype=np.int32),
        action_mask=np.array([0, 1, 1, 1, 1, 0, 0, 1], dtype=np.uint8),
        sampler_logprobs=np.zeros(8, dtype=np.float32),
    )
    step = locate_sequences(
        [batch], [0, 0, 0], [0, 1, 2], np.zeros(3, np.float32), [0, 1, 2], check=False
    )
    assert step.take(np.array([2, 0])).num_tokens == 5
    with pytest.raises(ValueError, match="rollout 1: action_mask"):
        step.take(np.array([0, 1]))


def test_a_scratch_hands_out_the_same_memory_once_it_holds_a_round():
    scratch, dtype = TokenScratch(), np.dtype(np.float32)

    def one_round() -> list[np.ndarray]:
        scratch.reset()
        return [scratch.take("advantages", 100, dtype), scratch.take("advantages", 50, dtype)]

    one_round()  # grows to hold a round
    first, second = one_round(), one_round()
    assert not np.shares_memory(*first)
    assert all(np.shares_memory(a, b) for a, b in zip(first, second, strict=True))
