"""Turn a step plan into the serialized response of every rank, once per step.

The step's rollouts live in the flat TokenColumns of the batches they arrived in. Each
rank's response is written by ONE `b"".join` of pieces that view those columns directly
(`sched.gather.microbatch_pieces`, wrapped in Arrow and protobuf framing by
`service.response_pieces`): the token data is copied once, into the response, and what
must be computed (loss masks, advantages; short sequences gathered by index) goes into a
per-thread scratch reused from step to step, so the join is the only write to fresh
memory. The result is one `GetBatchResponse` bytes object per rank; these bytes are what
is stored and served, so a re-fetch of (step, rank) is byte-identical by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from rlfeed.sched.assembly import StepPlan, TokenColumns
from rlfeed.sched.gather import TokenScratch
from rlfeed.service.codec.messages import join_rank_response
from rlfeed.service.codec.response_pieces import (
    encode_spans,
    rank_header,
    step_spans,
    thread_scratch,
)
from rlfeed.service.scheduler.records import StepWork


def materialize_work(work: StepWork, resolve: Callable[[Any], TokenColumns]) -> list[bytes]:
    """Serialized GetBatchResponse of every rank; `resolve(handle)` gives a batch's columns."""
    return materialize_step(
        step=work.step,
        plan=work.plan,
        rows=work.rows,
        rollout_ids=work.rollout_ids,
        policy_versions=work.policy_versions,
        columns={key: resolve(handle) for key, handle in work.payloads.items()},
    )


def materialize_step(
    *,
    step: int,
    plan: StepPlan,
    rows: Sequence[tuple[int, int]],
    rollout_ids: Sequence[str],
    policy_versions: np.ndarray,
    columns: Mapping[int, TokenColumns],
    scratch: TokenScratch | None = None,
) -> list[bytes]:
    """Serialized GetBatchResponse of every rank for one assembled step.

    rows / rollout_ids / policy_versions: per step rollout, in the order `plan` indexes.
    scratch: per-token buffers to reuse (default: this thread's); the responses never
    reference it. Byte-identical to encoding `materialize_sequences` of every microbatch
    with `encode_microbatch_parts` and joining each rank with `join_rank_response`.
    """
    keys = sorted(columns)
    sources = [columns[key] for key in keys]
    source_of = np.searchsorted(keys, [key for key, _ in rows]).astype(np.int64)
    row_of = np.array([row for _, row in rows], dtype=np.int64)
    spans = step_spans(sources, plan, source_of, row_of)
    scratch = thread_scratch() if scratch is None else scratch
    responses = []
    for rank, microbatch_indices in enumerate(plan.ranks):
        # A rank's pieces view the scratch until its join: the next rank may reuse it.
        scratch.reset()
        wire = [
            encode_spans(sources, spans[i], [rollout_ids[j] for j in plan.microbatches[i]], scratch)
            for i in microbatch_indices
        ]
        header = rank_header(step=step, plan=plan, rank=rank, policy_versions=policy_versions)
        responses.append(
            join_rank_response(header, [parts for parts, _ in wire], [size for _, size in wire])
        )
    return responses
