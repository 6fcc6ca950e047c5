"""A rank's microbatches on the wire as buffers to join, straight from the ingest columns.

`sched.gather.microbatch_pieces` describes each served column as pieces (views of the
source columns, of constants, of a reused scratch); this module wraps them in the exact
bytes `codec.encode_microbatch_parts` writes for the materialized microbatch, so that the
one `b"".join` per rank (`codec.join_rank_response`) is the only copy of the token data
and the only write to fresh memory.

The Arrow IPC framing (schema message, record-batch metadata, padding, end-of-stream) of a
record batch of T rows without nulls depends on T and the schema only, never on the values:
`proto.ipc_framing` writes it around the column pieces. Where it cannot (a pyarrow whose
writer lays the messages out differently), the microbatch is encoded the straightforward
way instead (same bytes, slower).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import MICROBATCH_SCHEMA
from rlfeed.proto.ipc_framing import microbatch_framing
from rlfeed.sched.assembly import Microbatch, StepPlan, TokenColumns
from rlfeed.sched.gather import (
    COLUMN_DTYPES,
    SequenceSpans,
    TokenScratch,
    locate_sequences,
    microbatch_pieces,
)
from rlfeed.service.codec.messages import encode_microbatch_parts, microbatch_parts

_per_thread = threading.local()


def thread_scratch() -> TokenScratch:
    """This thread's TokenScratch (created on first use, kept for the thread's life)."""
    scratch = getattr(_per_thread, "scratch", None)
    if scratch is None:
        scratch = _per_thread.scratch = TokenScratch()
    return scratch


def arrow_stream_pieces(columns: dict[str, list], num_tokens: int) -> tuple[list, int] | None:
    """(the Arrow IPC stream of one MICROBATCH_SCHEMA record batch whose columns are the
    concatenated `columns` pieces, as buffers to join; its size), or None where pyarrow's
    writer lays its messages out in a way `proto.ipc_framing` does not know (then encode
    another way).

    `columns`: name -> pieces of num_tokens values each in total (MICROBATCH_SCHEMA order);
    num_tokens >= 1.
    """
    framing = microbatch_framing()
    if framing is None:
        return None
    return framing.pieces(num_tokens, [columns[name] for name in MICROBATCH_SCHEMA.names])


def encode_spans(
    sources: Sequence[TokenColumns],
    spans: SequenceSpans,
    rollout_ids: Sequence[str],
    scratch: TokenScratch,
) -> tuple[list, int]:
    """(the serialized microbatch of `spans` as buffers to join, its size in bytes): the
    bytes of `encode_microbatch_parts(materialize_sequences(...), rollout_ids)`. The buffers
    view the sources and `scratch`: join them before either changes."""
    columns = microbatch_pieces(sources, spans, scratch)
    num_tokens = spans.num_tokens
    stream = arrow_stream_pieces(columns, num_tokens) if num_tokens else None
    if stream is None:  # empty (no-op) microbatch, or a writer ipc_framing does not know
        parts = encode_microbatch_parts(_joined(columns, spans), rollout_ids)
        return parts, sum(memoryview(part).nbytes for part in parts)
    policy_tokens = sum(_mask_sum(piece) for piece in columns["loss_mask"])
    fields = {
        "cu_seqlens": spans.cu_seqlens.tolist(),
        "max_seqlen": spans.max_seqlen,
        "rollout_ids": list(rollout_ids),
        "num_tokens": num_tokens,
        "policy_tokens": policy_tokens,
    }
    return microbatch_parts(*stream, fields)


def _mask_sum(loss_mask: np.ndarray) -> int:
    """Sum of a uint8 mask: a count of nonzeros (4x faster than a widening sum) when every
    entry is 0 or 1, which validation guarantees."""
    if loss_mask.size and loss_mask.max() > 1:
        return int(loss_mask.sum(dtype=np.int64))
    return int(np.count_nonzero(loss_mask))


def _joined(columns: dict[str, list], spans: SequenceSpans) -> Microbatch:
    arrays = {
        name: np.concatenate(pieces) if pieces else np.zeros(0, COLUMN_DTYPES[name])
        for name, pieces in columns.items()
    }
    return Microbatch(
        **arrays,
        cu_seqlens=spans.cu_seqlens,
        max_seqlen=spans.max_seqlen,
        rollout_index=spans.rollout_index,
    )


def rank_header(
    *, step: int, plan: StepPlan, rank: int, policy_versions: np.ndarray
) -> pb.GetBatchResponse:
    """Every GetBatchResponse field of `rank` but the microbatches; `policy_versions` is
    int64 per step rollout, in the order `plan` indexes."""
    newest, oldest = plan.policy_version_range(policy_versions)
    return pb.GetBatchResponse(
        ready=True,
        step=step,
        rank=rank,
        world_size=len(plan.ranks),
        policy_token_count=plan.policy_token_count,
        microbatches_per_rank=plan.microbatches_per_rank,
        policy_version=newest,
        min_policy_version=oldest,
        num_rollouts=int(plan.kept.size),
    )


def step_spans(
    sources: Sequence[TokenColumns],
    plan: StepPlan,
    source_of: np.ndarray,
    row_of: np.ndarray,
) -> list[SequenceSpans]:
    """The spans of every microbatch of `plan` (validated: errors name the rollout)."""
    rollouts = np.arange(row_of.size)
    step = locate_sequences(sources, source_of, row_of, plan.advantages, rollouts, check=False)
    return [step.take(members) for members in plan.microbatches]
