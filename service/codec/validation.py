"""Vectorized contract checks of one decoded rollout batch, before anything is accepted.

Every check runs over whole columns (no per-token Python loop); the per-token ones first
compare the column's min and max with the bounds (two reductions, no temporary arrays: NaN
and inf show in them) and only search for the position when that fails. Each reports the
FIRST offending rollout by id and field, e.g. `rollout 'r-17': field token_ids: token id 70001 at
token 12 is outside [0, 65536)`. The gRPC servicer turns an `InvalidBatchError` into
INVALID_ARGUMENT and rejects the batch as a whole. Checks that need the scheduler's state
(unknown tasks, groups that overflow `group_size` or span two tasks, a policy_version more than
`max_version_jump` ahead of the newest seen) live in `scheduler/state.py` and raise the same error.
"""

from __future__ import annotations

import numpy as np
from rlfeed.service.codec.messages import RolloutBatchArrays
from rlfeed.service.codec.request_checks import first_long_id
from rlfeed.service.config.server import DEFAULT_MAX_ID_BYTES, DEFAULT_MAX_IDS_PER_CALL
from rlfeed.service.errors import InvalidBatchError, RejectReason, rollout_error

# A log-probability is <= 0. Samplers compute it in float32 (and sometimes bf16 before the
# log-softmax), so a certain token can come out a few ulps above 0: tolerated up to here.
# Anything larger is a probability, a logit or a sign error, and would corrupt every
# importance ratio of the rollout.
LOGPROB_TOLERANCE = 1e-6


def _rollout_of_token(offsets: np.ndarray, position: int) -> int:
    return int(np.searchsorted(offsets, position, side="right") - 1)


def _check_id_caps(batch: RolloutBatchArrays, max_rollouts: int, max_id_bytes: int) -> None:
    if len(batch) > max_rollouts:
        raise InvalidBatchError(
            f"arrow_ipc: {len(batch)} rollouts in one batch; at most {max_rollouts} "
            "([server] max_ids_per_call)",
            reason=RejectReason.MALFORMED,
        )
    for field in ("rollout_ids", "task_ids", "group_ids"):
        row = first_long_id(getattr(batch, field), max_id_bytes)
        if row is not None:
            raise InvalidBatchError(
                f"row {row}: field {field[:-1]}: longer than {max_id_bytes} bytes "
                "([server] max_id_bytes)",
                reason=RejectReason.MALFORMED,
            )


def _check_ids(batch: RolloutBatchArrays) -> None:
    seen: dict[str, int] = {}
    for row, rollout_id in enumerate(batch.rollout_ids):
        if not rollout_id:
            raise InvalidBatchError(
                f"row {row}: field rollout_id: empty rollout id", reason=RejectReason.MALFORMED
            )
        if rollout_id in seen:
            raise rollout_error(
                rollout_id,
                "rollout_id",
                f"duplicate in this batch (rows {seen[rollout_id]}, {row})",
                reason=RejectReason.DUPLICATE_IN_BATCH,
            )
        seen[rollout_id] = row
    for field in ("task_ids", "group_ids"):
        values = getattr(batch, field)
        empty = [row for row, value in enumerate(values) if not value]
        if empty:
            raise rollout_error(
                batch.rollout_ids[empty[0]], field[:-1], "empty", reason=RejectReason.MALFORMED
            )


def _check_lengths(batch: RolloutBatchArrays, token_budget: int) -> None:
    lengths = batch.lengths
    for field, offsets in (
        ("action_mask", batch.mask_offsets),
        ("sampler_logprobs", batch.logprob_offsets),
    ):
        other = np.diff(offsets)
        mismatch = np.flatnonzero(other != lengths)
        if mismatch.size:
            row = int(mismatch[0])
            raise rollout_error(
                batch.rollout_ids[row],
                field,
                f"{int(other[row])} entries but token_ids has {int(lengths[row])}",
                reason=RejectReason.LENGTH_MISMATCH,
            )
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        raise rollout_error(
            batch.rollout_ids[int(empty[0])],
            "token_ids",
            "empty sequence",
            reason=RejectReason.LENGTH_MISMATCH,
        )
    too_long = np.flatnonzero(lengths > token_budget)
    if too_long.size:
        row = int(too_long[0])
        raise rollout_error(
            batch.rollout_ids[row],
            "token_ids",
            f"{int(lengths[row])} tokens, longer than the token budget {token_budget}; "
            "refusing to truncate",
            reason=RejectReason.TOO_LONG,
        )


def _check_versions(batch: RolloutBatchArrays) -> None:
    negative = np.flatnonzero(batch.policy_versions < 0)
    if negative.size:
        row = int(negative[0])
        raise rollout_error(
            batch.rollout_ids[row],
            "policy_version",
            f"{int(batch.policy_versions[row])} is negative; versions count up from 0",
            reason=RejectReason.BAD_POLICY_VERSION,
        )


def _check_finite(batch: RolloutBatchArrays) -> None:
    bad_reward = np.flatnonzero(~np.isfinite(batch.rewards))
    if bad_reward.size:
        row = int(bad_reward[0])
        raise rollout_error(
            batch.rollout_ids[row],
            "reward",
            f"{batch.rewards[row]} is not finite",
            reason=RejectReason.NON_FINITE,
        )
    if not _all_finite(batch.sampler_logprobs):
        position = int(np.flatnonzero(~np.isfinite(batch.sampler_logprobs))[0])
        row = _rollout_of_token(batch.offsets, position)
        raise rollout_error(
            batch.rollout_ids[row],
            "sampler_logprobs",
            f"{batch.sampler_logprobs[position]} at token {position - int(batch.offsets[row])} "
            "is not finite",
            reason=RejectReason.NON_FINITE,
        )
    logprobs = batch.sampler_logprobs
    if logprobs.size and logprobs.max() > LOGPROB_TOLERANCE:
        position = int(np.flatnonzero(logprobs > LOGPROB_TOLERANCE)[0])
        row = _rollout_of_token(batch.offsets, position)
        raise rollout_error(
            batch.rollout_ids[row],
            "sampler_logprobs",
            f"{float(logprobs[position])} at token {position - int(batch.offsets[row])} is "
            f"above 0; a log-probability is <= 0 (tolerance {LOGPROB_TOLERANCE:g})",
            reason=RejectReason.POSITIVE_LOGPROB,
        )


def _all_finite(values: np.ndarray) -> bool:
    """Two reductions, no temporaries: min and max are finite only if every value is (a NaN
    makes them NaN, an inf shows in one of them)."""
    return values.size == 0 or bool(np.isfinite(values.min()) and np.isfinite(values.max()))


def _check_tokens(batch: RolloutBatchArrays, vocab_size: int) -> None:
    int32_end = np.iinfo(np.int32).max + 1
    upper = min(vocab_size, int32_end) if vocab_size > 0 else int32_end
    ids = batch.token_ids  # int32 from the decoder
    # One reduction for both bounds: read as uint32, a negative id is >= 2**31 >= upper.
    if ids.dtype == np.int32:
        out_of_range = ids.size and ids.view(np.uint32).max() >= upper
    else:
        out_of_range = ids.size and (ids.min() < 0 or ids.max() >= upper)
    if out_of_range:
        position = int(np.flatnonzero((ids < 0) | (ids >= upper))[0])
        row = _rollout_of_token(batch.offsets, position)
        bound = f"[0, {vocab_size})" if vocab_size > 0 else "[0, inf)"
        raise rollout_error(
            batch.rollout_ids[row],
            "token_ids",
            f"token id {int(ids[position])} at token "
            f"{position - int(batch.offsets[row])} is outside {bound}",
            reason=RejectReason.TOKEN_OUT_OF_RANGE,
        )
    mask = batch.action_mask  # uint8: the decoder casts it
    if mask.size and mask.max() > 1:
        position = int(np.flatnonzero(mask > 1)[0])
        row = _rollout_of_token(batch.offsets, position)
        raise rollout_error(
            batch.rollout_ids[row],
            "action_mask",
            f"value {int(mask[position])} at token "
            f"{position - int(batch.offsets[row])}; must be 0 or 1",
            reason=RejectReason.BAD_ACTION_MASK,
        )
    first_is_policy = np.flatnonzero(batch.action_mask[batch.offsets[:-1]] != 0)
    if first_is_policy.size:
        raise rollout_error(
            batch.rollout_ids[int(first_is_policy[0])],
            "action_mask",
            "action_mask[0] is 1, but nothing predicts a sequence's first token",
            reason=RejectReason.BAD_ACTION_MASK,
        )


def unchecked_vocabulary_warning(vocab_size: int) -> str | None:
    """The start-up warning when token ids are not checked against a vocabulary (the
    default, since rlfeed cannot know the tokenizer); None when they are."""
    if vocab_size > 0:
        return None
    return (
        "rlfeed: [rollouts] vocab_size = 0: token ids are only checked to be >= 0, so an id "
        "past the model's vocabulary reaches the trainer; set it to the tokenizer's "
        "vocabulary size"
    )


def validate_rollout_batch(
    batch: RolloutBatchArrays,
    *,
    token_budget: int,
    vocab_size: int = 0,
    max_rollouts: int = DEFAULT_MAX_IDS_PER_CALL,
    max_id_bytes: int = DEFAULT_MAX_ID_BYTES,
) -> None:
    """Raise InvalidBatchError for the first broken rule, else return None.

    Rules: non-empty unique rollout ids; non-empty task/group ids; per rollout, token_ids,
    action_mask and sampler_logprobs of equal length 1..token_budget; policy_version >= 0;
    finite rewards and log-probs; log-probs <= LOGPROB_TOLERANCE; 0 <= token id <
    vocab_size (vocab_size 0: only >= 0); action mask values 0/1 with action_mask[0] == 0;
    at most `max_rollouts` rollouts and ids of at most `max_id_bytes` UTF-8 bytes
    (`[server]` max_ids_per_call, max_id_bytes). Whether each task is registered is the
    scheduler's check.
    """
    _check_id_caps(batch, max_rollouts, max_id_bytes)
    _check_ids(batch)
    _check_lengths(batch, token_budget)
    _check_versions(batch)
    _check_finite(batch)
    _check_tokens(batch, vocab_size)
