"""Materialize a microbatch straight from the columns of the batches its rollouts came in.

`assembly.materialize_microbatch` is the reference: it reads ONE set of flat columns
through per-token index arrays. A step's rollouts live in the columns of the ingest batches
they arrived in; `materialize_sequences` writes the same `Microbatch` from those columns
directly, so the tokens are copied once (not into step-level columns first and then again
per microbatch), by one of two strategies that give identical arrays:

- "slices": one slice copy per sequence and column, no index arrays: memcpy speed, plus
  a fixed ~10 us of Python per sequence. Right for long sequences.
- "indexed": per-token index arrays and one gather per source batch: ~25 ns per token and
  nothing per sequence. Right for short sequences.

"auto" picks by the mean sequence length (`SLICE_MIN_MEAN_LENGTH`, the measured
crossover). `tests/test_gather.py` checks both against the reference on the concatenated
columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from rlfeed.sched.assembly import Microbatch, TokenColumns, gather_token_ranges
from rlfeed.sched.layout import cu_seqlens_from_lengths

SLICE_MIN_MEAN_LENGTH = 384
"""Tokens per sequence from which "auto" copies slices instead of gathering by index."""

Strategy = Literal["auto", "slices", "indexed"]


def materialize_sequences(
    sources: Sequence[TokenColumns],
    source_of: np.ndarray,
    row_of: np.ndarray,
    advantages: np.ndarray,
    rollout_index: np.ndarray,
    *,
    strategy: Strategy = "auto",
) -> Microbatch:
    """The packed, shifted microbatch of n sequences; sequence i is row `row_of[i]` of
    `sources[source_of[i]]`, with advantage `advantages[i]` (float32 [n], per sequence).

    Equal, array for array, to `materialize_microbatch` over the sources' concatenation;
    `rollout_index` (int64 [n]) is what the result records as `rollout_index` and names
    in errors. Every sequence must hold at least one token (validation guarantees it).
    """
    source_of = np.asarray(source_of, dtype=np.int64)
    row_of = np.asarray(row_of, dtype=np.int64)
    rollout_index = np.asarray(rollout_index, dtype=np.int64)
    n = row_of.size
    starts, lengths, first_mask = (np.zeros(n, np.int64) for _ in range(3))
    used = np.unique(source_of).tolist()
    for key in used:
        mine = source_of == key
        offsets = np.asarray(sources[key].offsets, dtype=np.int64)
        starts[mine] = offsets[row_of[mine]]
        lengths[mine] = offsets[row_of[mine] + 1] - starts[mine]
    if np.any(lengths < 1):
        raise ValueError(f"rollout {int(rollout_index[np.argmax(lengths < 1)])}: empty sequence")
    for key in used:
        mine = source_of == key
        first_mask[mine] = sources[key].action_mask[starts[mine]]
    # Served loss masks drop each rollout's first token; a policy token there would make the
    # step's global count N disagree with what the trainer sums.
    if np.any(first_mask > 0):
        bad = int(rollout_index[np.argmax(first_mask > 0)])
        raise ValueError(
            f"rollout {bad}: action_mask[0] is 1, but nothing predicts a rollout's first token"
        )
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    total = int(cu_seqlens[-1])
    out = {
        "input_ids": np.empty(total, np.int32),
        "position_ids": np.empty(total, np.int32),
        "target_ids": np.empty(total, np.int32),
        "loss_mask": np.empty(total, np.uint8),
        "sampler_logprobs": np.empty(total, np.float32),
    }
    if strategy == "auto":
        strategy = "slices" if n and total >= SLICE_MIN_MEAN_LENGTH * n else "indexed"
    if strategy == "slices":
        _copy_slices(sources, source_of, starts, lengths, cu_seqlens, out)
    elif strategy == "indexed":
        _gather_indexed(sources, source_of, row_of, used, lengths, cu_seqlens, out)
    else:
        raise ValueError(f"strategy must be 'auto', 'slices' or 'indexed', got {strategy!r}")
    per_token_advantage = np.repeat(np.asarray(advantages, np.float32), lengths)
    return Microbatch(
        input_ids=out["input_ids"],
        position_ids=out["position_ids"],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if n else 0,
        target_ids=out["target_ids"],
        loss_mask=out["loss_mask"],
        sampler_logprobs=out["sampler_logprobs"],
        advantages=np.where(out["loss_mask"] > 0, per_token_advantage, np.float32(0.0)),
        rollout_index=rollout_index,
    )


def _copy_slices(sources, source_of, starts, lengths, cu_seqlens, out) -> None:
    """Per sequence: its tokens, and the same shifted by one (the next-token targets)."""
    ids, targets = out["input_ids"], out["target_ids"]
    mask, logprobs, positions = out["loss_mask"], out["sampler_logprobs"], out["position_ids"]
    counting = np.arange(int(lengths.max()) if lengths.size else 0, dtype=np.int32)
    for key, start, length, begin in zip(
        source_of.tolist(), starts.tolist(), lengths.tolist(), cu_seqlens[:-1].tolist(), strict=True
    ):
        source, end, last = sources[key], begin + length, begin + length - 1
        ids[begin:end] = source.token_ids[start : start + length]
        targets[begin:last] = source.token_ids[start + 1 : start + length]
        mask[begin:last] = source.action_mask[start + 1 : start + length]
        logprobs[begin:last] = source.sampler_logprobs[start + 1 : start + length]
        positions[begin:end] = counting[:length]
        targets[last] = mask[last] = logprobs[last] = 0


def _gather_indexed(sources, source_of, row_of, used, lengths, cu_seqlens, out) -> None:
    """One gather per source batch (scattered into place when the microbatch has several)."""
    cu = cu_seqlens.astype(np.int64)
    total = int(cu[-1])
    out["position_ids"][:] = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    for key in used:
        source = sources[key]
        mine = np.flatnonzero(source_of == key)
        offsets = np.asarray(source.offsets, dtype=np.int64)
        here = gather_token_ranges(offsets, row_of[mine])
        # The token after each one; a sequence's last position is overwritten below, and
        # clipping keeps the batch's very last token in range.
        following = np.minimum(here + 1, max(int(offsets[-1]) - 1, 0))
        into = slice(None) if len(used) == 1 else gather_token_ranges(cu, mine)
        out["input_ids"][into] = source.token_ids[here]
        out["target_ids"][into] = source.token_ids[following]
        out["loss_mask"][into] = source.action_mask[following]
        out["sampler_logprobs"][into] = source.sampler_logprobs[following]
    last = cu[1:] - 1
    out["target_ids"][last] = 0
    out["loss_mask"][last] = 0
    out["sampler_logprobs"][last] = 0
