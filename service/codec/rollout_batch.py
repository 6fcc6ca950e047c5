"""One rollout batch from bytes to what the scheduler takes and back to its ack: decode,
validate, the per-rollout metadata, the ack. Shared by the gRPC ingest handler and the
in-process transport, so neither path can check a batch differently."""

from __future__ import annotations

import numpy as np
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.messages import RolloutBatchArrays, decode_rollout_batch
from rlfeed.service.codec.validation import validate_rollout_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import InvalidBatchError, RejectReason
from rlfeed.service.scheduler.records import BatchMeta, IngestResult


def decode_batch(arrow_ipc: bytes | memoryview) -> RolloutBatchArrays:
    """The batch's arrays; InvalidBatchError (MALFORMED) if they cannot be read."""
    try:
        return decode_rollout_batch(arrow_ipc)
    except ValueError as exc:  # the codec's errors: the stream itself is malformed
        raise InvalidBatchError(str(exc), reason=RejectReason.MALFORMED) from None


def validate_batch(arrays: RolloutBatchArrays, config: SidecarConfig) -> None:
    """InvalidBatchError (with its reason) for what the contract refuses before the
    scheduler sees the batch."""
    validate_rollout_batch(
        arrays,
        token_budget=config.batching.token_budget,
        vocab_size=config.rollouts.vocab_size,
        max_rollouts=config.server.max_ids_per_call,
        max_id_bytes=config.server.max_id_bytes,
    )


def batch_meta(arrays: RolloutBatchArrays) -> BatchMeta:
    """The per-rollout metadata the scheduler needs (the small part of a batch)."""
    return BatchMeta(
        rollout_ids=arrays.rollout_ids,
        task_ids=arrays.task_ids,
        group_ids=arrays.group_ids,
        policy_versions=np.asarray(arrays.policy_versions, dtype=np.int64),
        rewards=np.asarray(arrays.rewards, dtype=np.float64),
        lengths=arrays.lengths.astype(np.int64),
        policy_tokens=arrays.policy_tokens,
    )


def ack_of(sequence: int, result: IngestResult) -> pb.SubmitAck:
    return pb.SubmitAck(
        sequence=sequence,
        accepted=result.accepted,
        duplicate=result.duplicate,
        stale=result.stale,
        newest_policy_version=result.newest_policy_version,
        buffered_rollouts=result.buffered_rollouts,
    )
