"""Materialize a microbatch straight from the columns of the batches its rollouts came in.

`assembly.materialize_microbatch` is the reference: it reads ONE set of flat columns
through per-token index arrays. A step's rollouts live in the columns of the ingest batches
they arrived in; this module writes the same columns from those batches directly, as
`materialize_sequences` (a `Microbatch` of fresh arrays, the straightforward form) or as
`microbatch_pieces`: per served column, arrays whose concatenation IS the column, so a
serializer that joins them copies every token once, into its output. Long sequences are
not gathered at all: their pieces view the source columns (targets are the tokens shifted
by one plus a constant 0 per sequence end; position ids a shared `arange`); the loss mask
and advantages, and short sequences' gathers, go into a caller-owned `TokenScratch` reused
from step to step, because rewriting warm pages runs ~7x faster than first-touching fresh
ones (measured on the 2-core dev box).

Two strategies, chosen per microbatch, give identical bytes:

- "slices": per sequence a few views (pieces) or slice copies (fresh arrays): ~4 us of
  Python per sequence, nothing per token but the copy. Right for long sequences.
- "indexed": per-token index arrays and one gather per source batch and column: ~10 ns per
  token into warm scratch, nothing per sequence. Right for short sequences.

"auto" picks by the mean sequence length (`SLICE_MIN_MEAN_LENGTH`, the measured crossover
for a 64k-token microbatch gathered and joined: indexed wins below ~400 tokens per
sequence, slices above ~600). `tests/sched/test_gather.py` checks every form against the
reference on the concatenated columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from rlfeed.sched.assembly import Microbatch, TokenColumns
from rlfeed.sched.layout import cu_seqlens_from_lengths

SLICE_MIN_MEAN_LENGTH = 512
"""Tokens per sequence from which "auto" copies slices instead of gathering by index."""

Strategy = Literal["auto", "slices", "indexed"]

COLUMN_DTYPES = {
    "input_ids": np.dtype(np.int32),
    "position_ids": np.dtype(np.int32),
    "target_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "sampler_logprobs": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
}
"""The served per-token columns, in wire order, with their dtypes."""

_GATHERED = ("input_ids", "target_ids", "loss_mask", "sampler_logprobs")


# What a sequence's last position holds in target_ids / sampler_logprobs: shared by every
# caller, so read-only.
_ZERO_INT32, _ZERO_FLOAT32 = np.zeros(1, np.int32), np.zeros(1, np.float32)
_ZERO_INT32.flags.writeable = _ZERO_FLOAT32.flags.writeable = False


@dataclass(frozen=True)
class SequenceSpans:
    """Where the n sequences of one microbatch lie in their source batches' columns."""

    source_of: np.ndarray
    """int64 [n]: index of the sequence's batch in `sources`."""
    starts: np.ndarray
    """int64 [n]: its first token in that batch's flat columns."""
    lengths: np.ndarray
    """int64 [n]: its tokens."""
    first_mask: np.ndarray
    """uint8 [n]: action mask of its first token (must be 0)."""
    advantages: np.ndarray
    """float32 [n]: its advantage."""
    rollout_index: np.ndarray
    """int64 [n]: what the microbatch records as `rollout_index` and errors name."""
    cu_seqlens: np.ndarray
    """int32 [n+1]: its place in the packed row."""

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def max_seqlen(self) -> int:
        return int(self.lengths.max()) if self.lengths.size else 0

    def take(self, index: np.ndarray) -> SequenceSpans:
        """The spans of sequences `index` (int [m]), in that order, checked."""
        index = np.asarray(index, dtype=np.int64)
        lengths = self.lengths[index]
        taken = SequenceSpans(
            source_of=self.source_of[index],
            starts=self.starts[index],
            lengths=lengths,
            first_mask=self.first_mask[index],
            advantages=self.advantages[index],
            rollout_index=self.rollout_index[index],
            cu_seqlens=cu_seqlens_from_lengths(lengths),
        )
        taken.check()
        return taken

    def check(self) -> None:
        """ValueError naming the rollout (by `rollout_index`) for an empty sequence or a policy
        token in first position."""
        if np.any(self.lengths < 1):
            bad = int(self.rollout_index[np.argmax(self.lengths < 1)])
            raise ValueError(f"rollout {bad}: empty sequence")
        # Served loss masks drop each rollout's first token; a policy token there would make
        # the step's global count N disagree with what the trainer sums.
        if np.any(self.first_mask > 0):
            bad = int(self.rollout_index[np.argmax(self.first_mask > 0)])
            raise ValueError(
                f"rollout {bad}: action_mask[0] is 1, but nothing predicts a rollout's first token"
            )


def locate_sequences(
    sources: Sequence[TokenColumns],
    source_of: np.ndarray,
    row_of: np.ndarray,
    advantages: np.ndarray,
    rollout_index: np.ndarray,
    *,
    check: bool = True,
) -> SequenceSpans:
    """Spans of n sequences; sequence i is row `row_of[i]` of `sources[source_of[i]]`.

    check: raise `SequenceSpans.check`'s ValueError now; without it, locate a whole step's
    rows once and `take` (which checks) each microbatch's.
    """
    source_of = np.asarray(source_of, dtype=np.int64)
    row_of = np.asarray(row_of, dtype=np.int64)
    n = row_of.size
    starts, lengths = np.zeros(n, np.int64), np.zeros(n, np.int64)
    first_mask = np.zeros(n, np.uint8)
    used = _used_sources(source_of)
    for key in used:
        mine = source_of == key if len(used) > 1 else slice(None)
        offsets = np.asarray(sources[key].offsets, dtype=np.int64)
        starts[mine] = offsets[row_of[mine]]
        lengths[mine] = offsets[row_of[mine] + 1] - starts[mine]
        # Clipped: an empty last row's start is one past the column's end (check() names it).
        column = sources[key].action_mask
        first_mask[mine] = column[np.minimum(starts[mine], column.size - 1)] if column.size else 0
    spans = SequenceSpans(
        source_of=source_of,
        starts=starts,
        lengths=lengths,
        first_mask=first_mask,
        advantages=np.asarray(advantages, np.float32),
        rollout_index=np.asarray(rollout_index, dtype=np.int64),
        cu_seqlens=cu_seqlens_from_lengths(np.maximum(lengths, 0)),
    )
    if check:
        spans.check()
    return spans


def _used_sources(source_of: np.ndarray) -> list[int]:
    """The distinct source indices, ascending (one source is the common case: no sort)."""
    if source_of.size and source_of.min() == source_of.max():
        return [int(source_of[0])]
    return np.unique(source_of).tolist()


def _pick(strategy: Strategy, spans: SequenceSpans) -> Strategy:
    n, total = spans.lengths.size, spans.num_tokens
    if strategy == "auto":
        return "slices" if n and total >= SLICE_MIN_MEAN_LENGTH * n else "indexed"
    if strategy not in ("slices", "indexed"):
        raise ValueError(f"strategy must be 'auto', 'slices' or 'indexed', got {strategy!r}")
    return strategy


def materialize_sequences(
    sources: Sequence[TokenColumns],
    source_of: np.ndarray,
    row_of: np.ndarray,
    advantages: np.ndarray,
    rollout_index: np.ndarray,
    *,
    strategy: Strategy = "auto",
) -> Microbatch:
    """The packed, shifted microbatch of n sequences, in fresh arrays; sequence i is row
    `row_of[i]` of `sources[source_of[i]]`, with advantage `advantages[i]` (float32 [n]).

    Equal, array for array, to `materialize_microbatch` over the sources' concatenation;
    `rollout_index` (int64 [n]) is what the result records as `rollout_index` and names
    in errors. Every sequence must hold at least one token (validation guarantees it).
    """
    spans = locate_sequences(sources, source_of, row_of, advantages, rollout_index)
    strategy = _pick(strategy, spans)
    total = spans.num_tokens
    out = {name: np.empty(total, COLUMN_DTYPES[name]) for name in (*_GATHERED, "position_ids")}
    if strategy == "slices":
        _copy_slices(sources, spans, out)
    else:
        _gather_indexed(sources, spans, out, TokenScratch())
    per_token_advantage = np.repeat(spans.advantages, spans.lengths)
    return Microbatch(
        input_ids=out["input_ids"],
        position_ids=out["position_ids"],
        cu_seqlens=spans.cu_seqlens,
        max_seqlen=spans.max_seqlen,
        target_ids=out["target_ids"],
        loss_mask=out["loss_mask"],
        sampler_logprobs=out["sampler_logprobs"],
        advantages=np.where(out["loss_mask"] > 0, per_token_advantage, np.float32(0.0)),
        rollout_index=spans.rollout_index,
    )


def _copy_slices(sources, spans: SequenceSpans, out: dict[str, np.ndarray]) -> None:
    """Per sequence: its tokens, and the same shifted by one (the next-token targets)."""
    ids, targets = out["input_ids"], out["target_ids"]
    mask, logprobs, positions = out["loss_mask"], out["sampler_logprobs"], out["position_ids"]
    counting = np.arange(spans.max_seqlen, dtype=np.int32)
    for key, start, length, begin in zip(
        spans.source_of.tolist(),
        spans.starts.tolist(),
        spans.lengths.tolist(),
        spans.cu_seqlens[:-1].tolist(),
        strict=True,
    ):
        source, end, last = sources[key], begin + length, begin + length - 1
        ids[begin:end] = source.token_ids[start : start + length]
        targets[begin:last] = source.token_ids[start + 1 : start + length]
        mask[begin:last] = source.action_mask[start + 1 : start + length]
        logprobs[begin:last] = source.sampler_logprobs[start + 1 : start + length]
        positions[begin:end] = counting[:length]
        targets[last] = mask[last] = logprobs[last] = 0


def _gather_indexed(
    sources, spans: SequenceSpans, out: dict[str, np.ndarray], scratch: TokenScratch
) -> None:
    """One gather per source batch and column (masked into place when there are several,
    straight into `out` when there is one). A target is the next input token, so the shifted
    columns read the input positions shifted by one, and target_ids copies input_ids.

    Per-token temporaries live in `scratch` or die before the next is made: several fresh
    ones alive at once get their pages back from the allocator, and page faults on every
    call (measured: the gather took twice as long)."""
    total, lengths = spans.num_tokens, spans.lengths
    if total == 0:
        return
    last = spans.cu_seqlens[1:] - 1
    positions = out["position_ids"]
    counting = scratch.counting(total)[:total]
    np.subtract(counting, np.repeat(spans.cu_seqlens[:-1], lengths), out=positions)
    here = scratch.take("token_index", total, np.dtype(np.int64))  # index in its source
    np.add(np.repeat(spans.starts, lengths), positions, out=here)
    used = _used_sources(spans.source_of)
    owner = np.repeat(spans.source_of, lengths) if len(used) > 1 else None  # token -> source
    for key in used:
        source = sources[key]
        # (served column, source column, shift): a shifted column's entry t reads token
        # t+1, which is right except at sequence ends (overwritten below).
        for name, column, shift in (
            ("input_ids", source.token_ids, 0),
            ("loss_mask", source.action_mask, 1),
            ("sampler_logprobs", source.sampler_logprobs, 1),
        ):
            target, index = out[name][: total - shift], here[shift:]
            if owner is None and column.dtype == target.dtype:
                # mode="wrap" never applies (indices are in range) and, unlike "raise",
                # does not buffer the output.
                np.take(column, index, out=target, mode="wrap")
            elif owner is None:
                target[:] = column[index]
            else:
                mine = owner[shift:] == key
                target[mine] = column[index[mine]]
    out["target_ids"][:-1] = out["input_ids"][1:]
    out["target_ids"][last] = 0
    out["loss_mask"][last] = 0
    out["sampler_logprobs"][last] = 0


class TokenScratch:
    """Per-token buffers reused from microbatch to microbatch and step to step.

    One per thread (not thread-safe). `take` hands out the next n entries of a named
    buffer; `reset` starts handing out the same memory again, so the views taken before
    must be consumed (joined) first. Growing allocates a larger buffer and leaves the
    views already handed out valid. New buffers are written once at allocation, so later
    writes never take page faults. Memory held: about the largest amount taken between two
    resets, per buffer name.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self._used: dict[str, int] = {}
        self._counting = np.zeros(0, np.int32)

    def reset(self) -> None:
        self._used = dict.fromkeys(self._used, 0)

    def take(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        """A writable [n] view of buffer `name` (of `dtype`), not handed out since reset."""
        buffer, used = self._buffers.get(name), self._used.get(name, 0)
        if buffer is None or buffer.dtype != dtype or used + n > buffer.size:
            size = max(used + n, 2 * buffer.size if buffer is not None else 0)
            buffer, used = np.empty(size, dtype), 0
            buffer.fill(0)  # fault the pages in now, once
            self._buffers[name] = buffer
        self._used[name] = used + n
        return buffer[used : used + n]

    def counting(self, n: int) -> np.ndarray:
        """Read-only int32 [>= n] array 0, 1, 2, ... (position ids of any sequence <= n)."""
        if self._counting.size < n:
            self._counting = np.arange(max(n, 2 * self._counting.size), dtype=np.int32)
            self._counting.flags.writeable = False
        return self._counting


def microbatch_pieces(
    sources: Sequence[TokenColumns],
    spans: SequenceSpans,
    scratch: TokenScratch,
    *,
    strategy: Strategy = "auto",
) -> dict[str, list[np.ndarray]]:
    """Per served column (`COLUMN_DTYPES`, in order): contiguous 1-D arrays whose
    concatenation equals, byte for byte, that column of `materialize_sequences`.

    The pieces are views of the sources' columns, of shared read-only constants and of
    `scratch`: read them (join them) before the sources change or `scratch.reset()`.
    """
    strategy = _pick(strategy, spans)
    if strategy == "slices" and all(
        _viewable(sources[key]) for key in _used_sources(spans.source_of)
    ):
        return _slice_pieces(sources, spans, scratch)
    total = spans.num_tokens
    out = {name: scratch.take(name, total, dtype) for name, dtype in COLUMN_DTYPES.items()}
    if strategy == "slices":
        _copy_slices(sources, spans, out)
    else:
        _gather_indexed(sources, spans, out, scratch)
    advantages = out["advantages"]
    np.copyto(advantages, np.repeat(spans.advantages, spans.lengths))
    _zero_where_no_loss(advantages, out["loss_mask"], scratch)
    return {name: [array] for name, array in out.items()}


def _viewable(source: TokenColumns) -> bool:
    """Whether the source's slices can be served as they are (served dtypes, contiguous)."""
    return all(
        column.dtype == dtype and column.flags.c_contiguous
        for column, dtype in (
            (source.token_ids, COLUMN_DTYPES["input_ids"]),
            (source.sampler_logprobs, COLUMN_DTYPES["sampler_logprobs"]),
        )
    )


def _slice_pieces(sources, spans: SequenceSpans, scratch: TokenScratch) -> dict[str, list]:
    """Views of the sources for the copied columns; loss mask and advantages into scratch."""
    total = spans.num_tokens
    mask = scratch.take("loss_mask", total, COLUMN_DTYPES["loss_mask"])
    advantages = scratch.take("advantages", total, COLUMN_DTYPES["advantages"])
    counting = scratch.counting(spans.max_seqlen)
    ids, positions, targets, logprobs = [], [], [], []
    for key, start, length, begin, advantage in zip(
        spans.source_of.tolist(),
        spans.starts.tolist(),
        spans.lengths.tolist(),
        spans.cu_seqlens[:-1].tolist(),
        spans.advantages.tolist(),
        strict=True,
    ):
        source, after, end = sources[key], start + 1, start + length
        ids.append(source.token_ids[start:end])
        positions.append(counting[:length])
        targets += (source.token_ids[after:end], _ZERO_INT32)
        logprobs += (source.sampler_logprobs[after:end], _ZERO_FLOAT32)
        mask[begin : begin + length - 1] = source.action_mask[after:end]
        advantages[begin : begin + length] = advantage
    mask[spans.cu_seqlens[1:] - 1] = 0
    _zero_where_no_loss(advantages, mask, scratch)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "target_ids": targets,
        "loss_mask": [mask],
        "sampler_logprobs": logprobs,
        "advantages": [advantages],
    }


def _zero_where_no_loss(advantages: np.ndarray, loss_mask: np.ndarray, scratch: TokenScratch):
    """advantages = where(loss_mask > 0, advantages, +0.0), in place."""
    no_loss = scratch.take("no_loss", loss_mask.size, np.dtype(bool))
    np.equal(loss_mask, 0, out=no_loss)
    np.copyto(advantages, np.float32(0.0), where=no_loss)
