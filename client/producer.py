"""Inference side: `RolloutWriter` buffers finished rollouts and ships them as Arrow batches.

    with RolloutWriter("sidecar:50051") as writer:
        for task_id in writer.sample_tasks(8):
            for k, episode in enumerate(run_group(task_id)):
                writer.write(rollout_id=f"{task_id}/{k}", task_id=task_id, ...)

`write()` only appends to column lists; every `max_batch_rollouts` rollouts become one
`RolloutBatch` that a background sender thread encodes (`arrow_codec.encode_rollout_batch`)
and submits, so generation and network overlap; with `max_in_flight` > 1, that many sender
threads keep batches in flight together. The writer holds at most
`max_buffered_rollouts` rollouts, and at most `max_buffered_bytes` of their token payload,
that the sidecar has not acknowledged (pending + queued + in flight). When the sidecar
answers RESOURCE_EXHAUSTED the sender retries the batch at the pace the sidecar hints
(`rlfeed-retry-after-ms`, else with backoff), logging a warning that names the sidecar and
its bound at once and every 10 s; the writer's buffer then fills,
and `write()` blocks (`on_full="block"`) or raises `BufferFullError` (`on_full="raise"`):
backpressure reaches the producer instead of memory growing without bound. A batch over
the sidecar's message size limit is not retried: its `MessageTooLargeError` names the limit
(`[server] max_message_bytes`) and the batch's rollout ids, and is raised the same way as a
rejection.

A batch the sidecar rejects (INVALID_ARGUMENT) is dropped as a whole, as the server drops
it; the `InvalidRolloutsError`, carrying the server's message and the batch's rollout ids,
is raised by the next `write()`, `flush()` or `close()`.

Riding through a restart: a sidecar that does not answer (UNAVAILABLE: nothing listens at
the address, the name does not resolve, it crashed or restarts) or a call whose deadline
passed with its outcome unknown is asked again (`client/retry.py`: for
`connect_timeout_s`, 30 s, until the sidecar first answered, then for
`reconnect_timeout_s`, 120 s) with a warning naming the address logged at once and every
10 s; then `SidecarUnreachableError` (with the batch's `rollout_ids`, to re-send) is raised
the same way. A batch is re-sent as it was, same rollout ids, so what the sidecar already
has is answered `duplicate`, never taken twice. A sidecar restarted without a journal has
lost its task pool: when it answers "unknown task", or a task call went through an outage,
the writer registers the tasks it registered before again (idempotent) and carries on.

`write()` checks that every value fits the wire type it is narrowed to (token ids int32,
action mask 0/1 as uint8, log-probs finite as float32, policy_version int64) and raises a
`ValueError` naming the rollout and the field otherwise: a token id of 2**32 + 7 is never
sent as 7.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from rlfeed.client.arrow_codec import TOKEN_BYTES, RolloutColumns
from rlfeed.client.batch_sender import BatchSender
from rlfeed.client.buffer_bound import BufferBound
from rlfeed.client.narrowing import narrowed_columns
from rlfeed.client.retry import RetryPolicy
from rlfeed.client.transport import (
    BufferFullError,
    SidecarError,
    Transport,
    address_of,
    connect,
)
from rlfeed.client.writer_tasks import WriterTasks
from rlfeed.proto import rlfeed_pb2 as pb

if TYPE_CHECKING:
    from rlfeed.client.auth import ChannelSecurity, Credentials
    from typing_extensions import Unpack


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# RolloutWriter's batch limits (the benchmark sends the same batches through its raw stream).
DEFAULT_MAX_BATCH_ROLLOUTS = 256
DEFAULT_MAX_BATCH_BYTES = 8 << 20
DEFAULT_MAX_BUFFERED_BYTES = 64 << 20  # 8 batches of the default size


class RolloutWriter:
    """Buffered, backpressured rollout submission to one sidecar.

    address_or_transport: "host:port" of a sidecar, several of its front-ends
      ("ip:port,ip:port" or "dns:///name:port": calls spread over them and move off one
      that goes away; `client/addressing.py`), or a `Transport` (e.g. in-process).
    max_batch_rollouts: rollouts per submitted Arrow batch.
    max_batch_bytes: also seal a batch once its token payload reaches this many bytes.
      The default, 8 MiB (114 rollouts of 8k tokens), sits where a sweep of the end-to-end
      benchmark peaked on a 2-core machine: 4.5-9 MiB batches moved 42-43% of the raw
      gRPC byte rate, 1.1 MiB 32%, 18 MiB 37% (medians of 3, `tests/bench/
      bench_e2e_throughput.py --batch-rollouts N`); fewer, larger batches mean fewer
      scheduler-actor calls.
    max_buffered_rollouts: unacknowledged rollouts held at most (>= max_batch_rollouts).
    max_buffered_bytes: their token payload held at most, in bytes (9 a token: id, mask,
      log-prob; >= max_batch_bytes); default 64 MiB (about 900 rollouts of 8k tokens), or
      max_batch_bytes when that is larger, so a writer made for larger batches still
      starts. A rollout larger than the whole bound is taken alone, once nothing else is
      held.
      On top: each sender's serialized batch (see max_in_flight).
    on_full: "block" waits for room (up to `block_timeout_s`, then BufferFullError);
      "raise" raises BufferFullError at once.
    retry_backoff_s: first wait after a RESOURCE_EXHAUSTED answer without the sidecar's
      retry hint (`rlfeed-retry-after-ms`, followed when given); doubles up to 1 s. While
      the sidecar is full a warning naming it and its bound is logged at once and every 10 s.
    connect_timeout_s: how long a batch (or a task call) is re-sent while a sidecar that
      has not answered yet is UNAVAILABLE (or the call times out), with a warning naming
      the address at once and every 10 s, before `SidecarUnreachableError` surfaces with
      the batch's `rollout_ids`; default RLFEED_CONNECT_TIMEOUT_S, else 30 s. Re-sending
      is safe: rollout ids are idempotency keys, so nothing counts twice.
    reconnect_timeout_s: the same once the sidecar has answered (a restart); default
      RLFEED_RECONNECT_TIMEOUT_S, else 120 s.
    max_in_flight: batches submitted at once. 1 keeps this writer's batches in write
      order at the sidecar; more overlaps one batch's round trip with the next ones (the
      sidecar may then see them in another order; acks still come back in batch order).
      Each sender keeps the serialized batch it sent last until its next one (memory:
      up to max_in_flight batches of max_batch_bytes beyond the buffer).
    token, tls_ca, tls_cert, tls_key, tls_server_name: a secured sidecar's credentials
      (see `GrpcTransport`; default: `RLFEED_TOKEN`, `RLFEED_TLS_CA`, ... from the
      environment). A refused credential raises `AuthenticationError`, not retried.
    security: the same already resolved (`client.auth.ChannelSecurity`), instead.
    """

    def __init__(
        self,
        address_or_transport: str | Transport,
        *,
        max_batch_rollouts: int = DEFAULT_MAX_BATCH_ROLLOUTS,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        max_buffered_rollouts: int = 4096,
        max_buffered_bytes: int | None = None,
        on_full: Literal["block", "raise"] = "block",
        block_timeout_s: float | None = None,
        retry_backoff_s: float = 0.01,
        connect_timeout_s: float | None = None,
        reconnect_timeout_s: float | None = None,
        max_in_flight: int = 1,
        security: ChannelSecurity | None = None,
        **credentials: Unpack[Credentials],
    ) -> None:
        if max_batch_rollouts < 1:
            raise ValueError(f"max_batch_rollouts must be >= 1, got {max_batch_rollouts}")
        if max_buffered_rollouts < max_batch_rollouts:
            raise ValueError(
                f"max_buffered_rollouts ({max_buffered_rollouts}) must be >= "
                f"max_batch_rollouts ({max_batch_rollouts})"
            )
        if max_buffered_bytes is None:
            max_buffered_bytes = max(DEFAULT_MAX_BUFFERED_BYTES, max_batch_bytes)
        if max_buffered_bytes < max_batch_bytes:
            raise ValueError(
                f"max_buffered_bytes ({max_buffered_bytes}) must be >= "
                f"max_batch_bytes ({max_batch_bytes})"
            )
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if on_full not in ("block", "raise"):
            raise ValueError(f"on_full must be 'block' or 'raise', got {on_full!r}")
        self._transport, self._owns_transport = connect(
            address_or_transport, security, **credentials
        )
        self.max_batch_rollouts = max_batch_rollouts
        self.max_batch_bytes = max_batch_bytes
        self.max_buffered_rollouts = max_buffered_rollouts
        self.max_buffered_bytes = max_buffered_bytes
        self.on_full = on_full
        self.block_timeout_s = block_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.address = address_of(self._transport)
        self._retry = RetryPolicy(self.address, connect_timeout_s, reconnect_timeout_s)
        self.connect_timeout_s = self._retry.connect_timeout_s
        self.reconnect_timeout_s = self._retry.reconnect_timeout_s
        self._tasks = WriterTasks(self._transport, self._retry)
        self._sender = BatchSender(
            self._transport, self._retry, retry_backoff_s, self._tasks.restore
        )
        self.max_in_flight = max_in_flight

        self._pending = RolloutColumns.empty()
        self._pending_bytes = 0
        self._queue: deque[RolloutColumns] = deque()
        self._bound = BufferBound(max_buffered_rollouts, max_buffered_bytes)
        self._in_flight = 0  # batches being submitted
        self._sequence = 0  # of the next batch sent
        self._acks: list[tuple[int, pb.SubmitAck]] = []  # (sequence, ack)
        self._error: Exception | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._senders: list[threading.Thread] = []

    # -- producer API -------------------------------------------------------------------

    def write(
        self,
        *,
        rollout_id: str,
        task_id: str,
        group_id: str,
        policy_version: int,
        reward: float,
        token_ids: Sequence[int] | np.ndarray,
        action_mask: Sequence[int] | np.ndarray,
        sampler_logprobs: Sequence[float] | np.ndarray,
    ) -> None:
        """Buffer one rollout (token_ids int32 [L], action_mask 0/1 [L] with mask[0] = 0,
        sampler_logprobs float32 [L]); sends a batch once `max_batch_rollouts` are pending.
        A value that does not fit its wire type is a ValueError naming the field."""
        token_ids, action_mask, sampler_logprobs = narrowed_columns(
            rollout_id, token_ids, action_mask, sampler_logprobs
        )
        if not _INT64_MIN <= int(policy_version) <= _INT64_MAX:
            raise ValueError(
                f"rollout {rollout_id!r}: policy_version {policy_version} does not fit int64"
            )
        with self._cond:
            self._raise_pending_error()
            self._check_open()
            self._wait_for_room(token_ids.size * TOKEN_BYTES)
            nbytes = self._pending.append(
                rollout_id=rollout_id,
                task_id=task_id,
                group_id=group_id,
                policy_version=policy_version,
                reward=reward,
                token_ids=token_ids,
                action_mask=action_mask,
                sampler_logprobs=sampler_logprobs,
            )
            self._pending_bytes += nbytes
            self._bound.add(nbytes)
            if (
                len(self._pending) >= self.max_batch_rollouts
                or self._pending_bytes >= self.max_batch_bytes
            ):
                self._seal()

    def flush(self, timeout_s: float | None = None) -> list[pb.SubmitAck]:
        """Send everything buffered and wait for the acks; returns the acks received since
        the previous `flush()` (one per batch, in order). Raises a pending server error."""
        with self._cond:
            self._check_open()
            if len(self._pending):
                self._seal()
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while (self._queue or self._in_flight) and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"flush: {self._bound.rollouts} rollouts still unacknowledged"
                    )
                self._cond.wait(remaining)
            self._raise_pending_error()
            acks, self._acks = self._acks, []
            return [ack for _, ack in sorted(acks, key=lambda pair: pair[0])]

    def close(self) -> None:
        """Flush, stop the sender thread, close an owned channel. Idempotent."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            for sender in self._senders:
                sender.join()
            if self._owns_transport:
                self._transport.close()
        self._raise_pending_error()

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: do not mask the original error with a flush error.
        with contextlib.suppress(SidecarError):
            self.close()

    @property
    def unacknowledged(self) -> int:
        """Rollouts written but not yet acknowledged by the sidecar."""
        return self._bound.rollouts

    @property
    def unacknowledged_bytes(self) -> int:
        """Their token payload in bytes (bounded by `max_buffered_bytes`)."""
        return self._bound.nbytes

    # -- tasks ----------------------------------------------------------------------------

    def register_tasks(self, task_ids: Sequence[str]) -> int:
        """Add tasks to the sidecar's pool (known ids are ignored); returns how many were new.
        An unreachable sidecar is asked again (module docstring)."""
        return self._tasks.register(task_ids)

    def sample_tasks(self, n: int) -> list[str]:
        """The next tasks to run, per the sidecar's curriculum; may be fewer than n. An
        unreachable sidecar is asked again (module docstring)."""
        return self._tasks.sample(n)

    # -- internals (hold self._cond) --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RolloutWriter is closed")

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _wait_for_room(self, nbytes: int) -> None:
        if not self._bound.full(nbytes):
            return
        if self.on_full == "raise":
            raise BufferFullError(
                f"RolloutWriter holds {self._bound.held()}: no room for a rollout of {nbytes} bytes"
            )
        if len(self._pending):
            self._seal()  # a full buffer of pending rollouts can only drain if sent
        deadline = None if self.block_timeout_s is None else time.monotonic() + self.block_timeout_s
        while self._bound.full(nbytes) and self._error is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise BufferFullError(
                    f"RolloutWriter: no room after {self.block_timeout_s} s ({self._bound.held()})"
                )
            self._cond.wait(remaining)
        self._raise_pending_error()

    def _seal(self) -> None:
        self._queue.append(self._pending)
        self._pending = RolloutColumns.empty()
        self._pending_bytes = 0
        if len(self._senders) < self.max_in_flight:
            sender = threading.Thread(
                target=self._send_loop, name="rlfeed-rollout-writer", daemon=True
            )
            self._senders.append(sender)
            sender.start()
        self._cond.notify_all()

    # -- sender thread --------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                rows = self._queue.popleft()
                self._in_flight += 1
                sequence = self._sequence
                self._sequence += 1
            try:
                # `request` holds the batch sent last until the next one is built, so gRPC's
                # copy of the next one reuses its memory. Freed right after its send, with
                # gRPC's copy, it left twice a batch free at the top of this thread's heap,
                # which glibc hands back to the kernel: every batch landed on fresh pages (8k-
                # token benchmark: 32.7k page faults per producer, half its CPU; now 2k).
                request = self._sender.request(rows, sequence)
                ack, error = self._sender.submit(request, rows)
            except Exception as exc:  # surfaced to the producer, never lost in this thread
                ack, error = None, exc
            with self._cond:
                self._in_flight -= 1
                self._bound.acknowledged(len(rows), rows.token_bytes())
                if ack is not None:
                    self._acks.append((sequence, ack))
                if error is not None and self._error is None:
                    self._error = error
                self._cond.notify_all()
