"""Turn a step plan into the serialized response of every rank, once per step.

The step's rollouts live in the flat TokenColumns of the batches they arrived in. They are
gathered once into step-level columns (one vectorized gather per batch involved), then each
microbatch is materialized with `sched.assembly.materialize_microbatch` and encoded by the
codec. The result is one `GetBatchResponse` bytes object per rank; these bytes are what is
stored and served, so a re-fetch of (step, rank) is byte-identical by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.sched.assembly import (
    StepPlan,
    TokenColumns,
    gather_token_ranges,
    materialize_microbatch,
)
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


def gather_step_columns(
    rows: Sequence[tuple[int, int]], columns: Mapping[int, TokenColumns]
) -> tuple[TokenColumns, np.ndarray]:
    """Step-level columns of rollouts rows[i] = (batch key, row in that batch).

    Returns (step_columns, column_of): step rollout i is rollout column_of[i] of
    step_columns. Rollouts are grouped by batch inside step_columns (one gather per batch).
    """
    batch_keys = np.array([key for key, _ in rows], dtype=np.int64)
    batch_rows = np.array([row for _, row in rows], dtype=np.int64)
    order = np.argsort(batch_keys, kind="stable")
    column_of = np.empty(len(rows), dtype=np.int64)
    column_of[order] = np.arange(len(rows))
    pieces: dict[str, list[np.ndarray]] = {"token_ids": [], "action_mask": [], "logprobs": []}
    lengths = []
    for key in np.unique(batch_keys).tolist():
        selected = batch_rows[order][batch_keys[order] == key]
        source = columns[key]
        offsets = np.asarray(source.offsets, dtype=np.int64)
        positions = gather_token_ranges(offsets, selected)
        pieces["token_ids"].append(source.token_ids[positions])
        pieces["action_mask"].append(source.action_mask[positions])
        pieces["logprobs"].append(source.sampler_logprobs[positions])
        lengths.append(offsets[selected + 1] - offsets[selected])
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    step_offsets = np.concatenate(([0], np.cumsum(all_lengths))).astype(np.int64)

    def joined(name: str, dtype: type) -> np.ndarray:
        return np.concatenate(pieces[name]) if pieces[name] else np.zeros(0, dtype)

    step_columns = TokenColumns(
        offsets=step_offsets,
        token_ids=joined("token_ids", np.int32),
        action_mask=joined("action_mask", np.uint8),
        sampler_logprobs=joined("logprobs", np.float32),
    )
    return step_columns, column_of


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
    step_columns, column_of = gather_step_columns(rows, columns)
    advantages_by_column = np.zeros(len(rows), dtype=np.float32)
    advantages_by_column[column_of] = plan.advantages
    kept_versions = policy_versions[plan.kept] if plan.kept.size else policy_versions
    wire_microbatches = [
        encode_microbatch_parts(
            materialize_microbatch(step_columns, column_of[members], advantages_by_column),
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
