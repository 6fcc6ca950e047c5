"""Token layout of one packed row: what a trainer needs to run it correctly.

A packed row concatenates sequences; the trainer must (chapter 14.1) restart position ids
at every sequence and keep attention inside each sequence (a block-diagonal causal mask, or
`cu_seqlens` for variable-length kernels). The targets use a *next-token* layout aligned
with the inputs: entry t holds what position t predicts, which is token t+1 of the same
sequence. A sequence's last position predicts nothing of its own, so its target is 0 and
its loss mask is 0: the entry that would predict the next sequence's first token never
counts. The chapter's [R, L-1] layout is this one with the last column dropped.

Everything here is vectorized over tokens; nothing loops per token in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from rlfeed.sched.packing import as_lengths


@dataclass(frozen=True)
class RowLayout:
    """Index arrays of one packed row of `row_length` positions.

    cu_seqlens:   [n + 1] int32, cumulative sequence lengths starting at 0.
    position_ids: [row_length] int64, restarting at 0 per sequence; 0 on padding.
    segment_ids:  [row_length] int32, index of the sequence within the row, -1 on padding.
    last_position:[row_length] bool, True where a sequence ends (it predicts nothing).
    """

    cu_seqlens: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    last_position: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the row."""
        return int(self.cu_seqlens[-1])

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if self.cu_seqlens.size > 1 else 0


def cu_seqlens_from_lengths(lengths: ArrayLike) -> np.ndarray:
    """[n + 1] int32 cumulative lengths starting at 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if cu[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"row of {int(cu[-1])} tokens does not fit int32 cu_seqlens")
    return cu.astype(np.int32)


def row_layout(lengths: ArrayLike, row_length: int | None = None) -> RowLayout:
    """Layout of sequences of `lengths` placed back to back, padded to `row_length`."""
    lengths = as_lengths(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    total = int(cu[-1])
    row_length = total if row_length is None else int(row_length)
    if row_length < total:
        raise ValueError(f"sequences hold {total} tokens, more than the row length {row_length}")
    segment_ids = np.full(row_length, -1, dtype=np.int32)
    segment_ids[:total] = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
    position_ids = np.zeros(row_length, dtype=np.int64)
    position_ids[:total] = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    last_position = np.zeros(row_length, dtype=bool)
    last_position[cu[1:] - 1] = lengths.size > 0
    return RowLayout(cu, position_ids, segment_ids, last_position)


def next_token_targets(
    token_ids: np.ndarray, layout: RowLayout, fill: int | float = 0
) -> np.ndarray:
    """Per-position target: the next token of the same sequence, `fill` where none.

    `token_ids` holds the row's real tokens ([num_tokens]) or the whole padded row; the
    result has the row's length. Works for any per-token array (action mask, sampler
    log-probs, advantages): the value of the *predicted* token lands on the predicting
    position.
    """
    row_length = layout.segment_ids.size
    total = layout.num_tokens
    targets = np.full(row_length, fill, dtype=np.asarray(token_ids).dtype)
    if total > 1:
        targets[: total - 1] = token_ids[1:total]
    targets[layout.last_position] = fill
    return targets
