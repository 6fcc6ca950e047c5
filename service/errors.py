"""Why the sidecar refuses a rollout batch: one reason per broken rule, carried unchanged
from where the check fails (front-end validation, the scheduler) to the client's status
and the metrics' `reason` label."""

from __future__ import annotations

from enum import Enum


class RejectReason(str, Enum):
    """The metrics' `reason` label of a refused batch (a closed set: no label explosion)."""

    MALFORMED = "malformed"  # not an Arrow IPC stream, missing/ill-typed column, null, empty id
    LENGTH_MISMATCH = "length_mismatch"  # per-rollout arrays of different lengths, empty sequence
    TOO_LONG = "too_long"  # sequence longer than the token budget
    NON_FINITE = "non_finite"  # NaN/inf reward or log-prob
    POSITIVE_LOGPROB = "positive_logprob"  # a sampler log-prob > 0: not a log-probability
    TOKEN_OUT_OF_RANGE = "token_out_of_range"  # token id outside [0, vocab_size)
    UNKNOWN_TASK = "unknown_task"  # task id not registered
    BAD_ACTION_MASK = "bad_action_mask"  # action_mask[0] == 1, or a value other than 0/1
    BAD_POLICY_VERSION = "bad_policy_version"  # negative, or too far ahead of the newest seen
    DUPLICATE_IN_BATCH = "duplicate_in_batch"  # one rollout id twice in a batch
    GROUP_OVERFLOW = "group_overflow"  # over group_size rollouts, or a group on two tasks
    BUFFER_FULL = "buffer_full"  # RESOURCE_EXHAUSTED: the buffer bound is reached
    JOURNAL_UNWRITABLE = "journal_unwritable"  # RESOURCE_EXHAUSTED: the journal's disk fails
    OTHER = "other"


class InvalidBatchError(ValueError):
    """A rollout batch that breaks the wire contract; the message names rollout and field."""

    def __init__(self, message: str, *, reason: RejectReason) -> None:
        super().__init__(message)
        self.reason = reason


class BackpressureError(RuntimeError):
    """The buffer is full; the batch was not taken. Retry later."""

    reason = RejectReason.BUFFER_FULL
    # The wait suggested to the producer (`rlfeed-retry-after-ms`). Room comes back when a
    # trainer rank fetches a step (seconds apart); each retry costs the front-end a decode
    # and validation of the batch, so retrying faster only burns its CPU, and a writer
    # that follows the hint resumes at most this late.
    retry_after_s = 0.5


class JournalUnwritableError(RuntimeError):
    """The front-end's journal cannot write (disk full, I/O error): the batch was not
    taken, nothing was acknowledged. Retry later: the journal heals on its own once the
    disk takes writes again (`service/journal`)."""

    reason = RejectReason.JOURNAL_UNWRITABLE

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def rollout_error(
    rollout_id: str, field: str, problem: str, *, reason: RejectReason
) -> InvalidBatchError:
    return InvalidBatchError(f"rollout {rollout_id!r}: field {field}: {problem}", reason=reason)


def reject_reason(error: BaseException) -> RejectReason:
    """The reason a refused batch carries; OTHER for an error raised by no check of ours."""
    reason = getattr(error, "reason", None)
    return reason if isinstance(reason, RejectReason) else RejectReason.OTHER
