"""How `RolloutWriter`'s sender threads put one sealed batch on the wire: encode it, submit
it, and ask again as long as the answer says to (a full sidecar at its hinted pace, an
unreachable one under `client/retry.py`'s policy, a restarted one that lost its tasks once
they are registered again). Kept apart from the writer's buffering (`client/producer.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlfeed.client.arrow_codec import RolloutColumns, encode_rollout_batch, encode_rollouts
from rlfeed.client.retry import FullSidecar, RetryPolicy
from rlfeed.client.transport import (
    BufferFullError,
    InvalidRolloutsError,
    SidecarError,
    Transport,
    fast_variant,
)
from rlfeed.proto import rlfeed_pb2 as pb

# The sidecar's reason for a rollout of a task it does not know (service/scheduler/state.py).
_UNKNOWN_TASK = "field task_id: unknown task"


class BatchSender:
    """Submits batches to one transport, retrying as the writer's docstring tells.

    restore_tasks: registers the writer's tasks again; returns how many the sidecar had lost.
    """

    def __init__(
        self,
        transport: Transport,
        retry: RetryPolicy,
        retry_backoff_s: float,
        restore_tasks: Callable[[], int],
    ) -> None:
        self._transport = transport
        self._retry = retry
        self._retry_backoff_s = retry_backoff_s
        self._restore_tasks = restore_tasks
        # Request bytes written in one copy where the transport takes them (one copy of the
        # token data, not three), as the loader resolves its fast path once.
        self._submit_serialized = fast_variant(transport, "submit", "submit_serialized")

    def request(self, rows: RolloutColumns, sequence: int) -> bytes | pb.RolloutBatch:
        """The batch as the transport sends it: serialized where it takes bytes."""
        if self._submit_serialized is not None:
            return encode_rollout_batch(rows, sequence)
        return pb.RolloutBatch(arrow_ipc=encode_rollouts(rows), sequence=sequence)

    def submit(
        self, request: bytes | pb.RolloutBatch, rows: RolloutColumns
    ) -> tuple[pb.SubmitAck | None, Exception | None]:
        """(ack, None) once the sidecar took `request`, or (None, the error to surface)."""
        if self._submit_serialized is not None:  # `request` serialized it
            send = lambda: self._submit_serialized(request)  # noqa: E731
        else:
            send = lambda: self._transport.submit(request)  # noqa: E731
        backoff = self._retry_backoff_s
        outage = self._retry.outage()
        full = FullSidecar(self._retry.address, self._retry_backoff_s)
        restored = False
        while True:
            try:
                ack = send()
            except InvalidRolloutsError as exc:
                outage.succeeded()
                if not restored and _UNKNOWN_TASK in exc.message and self._restore_tasks():
                    restored = True  # a restarted sidecar lost the pool: it has it again
                    continue
                return None, InvalidRolloutsError(exc.message, tuple(rows.rollout_id))
            except BufferFullError as exc:
                # A full sidecar is waited out for as long as it takes, at its hinted pace,
                # with a warning at once and every 10 s.
                outage.succeeded()
                time.sleep(full.pause_s(exc))
                continue
            except SidecarError as exc:
                exc.rollout_ids = tuple(rows.rollout_id)  # the caller may re-send them
                try:
                    outage.failed(exc)  # an unreachable one under the retry policy
                except SidecarError as final:
                    return None, final
            else:
                outage.succeeded()
                return ack, None
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
