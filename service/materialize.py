"""Turn a step plan into the serialized response of every rank, once per step.

The step's rollouts live in the flat TokenColumns of the batches they arrived in. Each
microbatch is gathered straight from those columns (`sched.gather.materialize_sequences`:
every token copied once, no step-level intermediate) and encoded by the codec, whose Arrow
streams reference the gathered arrays until one join writes the rank's response. The
result is one `GetBatchResponse` bytes object per rank; these bytes are what is stored and
served, so a re-fetch of (step, rank) is byte-identical by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.sched.assembly import StepPlan, TokenColumns
from rlfeed.sched.gather import materialize_sequences
from rlfeed.service.codec import encode_microbatch_parts, join_rank_response


@dataclass(frozen=True)
class StepWork:
    """Everything needed to materialize one planned step, away from the scheduler."""

    step: int
    plan: StepPlan
    rows: list[tuple[int, int]]  # per step rollout: (batch key, row in that batch)
    rollout_ids: list[str]  # per step rollout
    policy_versions: np.ndarray  # int64, per step rollout
    payloads: dict[int, Any]  # batch key -> payload handle of its TokenColumns
    record: Any = None  # the step's StepRecord, response_bytes still 0 (set by store_step)


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
) -> list[bytes]:
    """Serialized GetBatchResponse of every rank for one assembled step.

    rows / rollout_ids / policy_versions: per step rollout, in the order `plan` indexes.
    """
    keys = sorted(columns)
    sources = [columns[key] for key in keys]
    source_of = np.searchsorted(keys, [key for key, _ in rows]).astype(np.int64)
    row_of = np.array([row for _, row in rows], dtype=np.int64)
    advantages = np.asarray(plan.advantages, dtype=np.float32)
    kept_versions = policy_versions[plan.kept] if plan.kept.size else policy_versions
    wire_microbatches = [
        encode_microbatch_parts(
            materialize_sequences(
                sources, source_of[members], row_of[members], advantages[members], members
            ),
            [rollout_ids[i] for i in members],
        )
        for members in plan.microbatches
    ]
    world_size = len(plan.ranks)
    responses = []
    for rank, microbatch_indices in enumerate(plan.ranks):
        header = pb.GetBatchResponse(
            ready=True,
            step=step,
            rank=rank,
            world_size=world_size,
            policy_token_count=plan.policy_token_count,
            microbatches_per_rank=plan.microbatches_per_rank,
            policy_version=int(kept_versions.max()) if kept_versions.size else 0,
            min_policy_version=int(kept_versions.min()) if kept_versions.size else 0,
            num_rollouts=int(plan.kept.size),
        )
        responses.append(
            join_rank_response(header, [wire_microbatches[i] for i in microbatch_indices])
        )
    return responses
