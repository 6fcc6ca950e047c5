"""Ingest: the RolloutIngest and TaskSampling handlers (the decode → validate → ack path
they share with the in-process transport is `service/codec/rollout_batch.py`).

A batch is decoded and validated on the handler thread (vectorized numpy), its columns
stay in this front-end's memory under a key, and the actor gets one small call with the
metadata and the handle; the ack answers from its result.
"""

from __future__ import annotations

import contextlib
import logging
import time

import grpc
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.metadata import RETRY_AFTER_MS
from rlfeed.service.codec.messages import (
    RolloutBatchArrays,
    RolloutBatchView,
)
from rlfeed.service.codec.request_checks import check_task_ids
from rlfeed.service.codec.rollout_batch import ack_of, batch_meta, decode_batch, validate_batch
from rlfeed.service.codec.validation import (
    unchecked_vocabulary_warning,
)
from rlfeed.service.errors import (
    BackpressureError,
    InvalidBatchError,
    JournalUnwritableError,
)
from rlfeed.service.frontend.assembler import StepAssembler
from rlfeed.service.frontend.journaling import KIND_BATCH
from rlfeed.service.frontend.state import FrontendState, admitted, unavailable_when_ray_fails
from rlfeed.service.journal import JournalWriteError
from rlfeed.service.scheduler.client import IngestGroups
from rlfeed.service.scheduler.records import (
    BatchHandle,
    IngestKind,
    IngestReply,
    Refused,
)

_log = logging.getLogger(__name__)


class RolloutIngest:
    """RolloutIngest and TaskSampling handlers of one front-end."""

    def __init__(self, frontend: FrontendState, assembler: StepAssembler) -> None:
        self.frontend = frontend
        self.assembler = assembler
        self._groups = IngestGroups(frontend.scheduler.ingest)
        warning = unchecked_vocabulary_warning(frontend.config.rollouts.vocab_size)
        if warning is not None:
            _log.warning(warning)

    def SubmitRollouts(self, request_iterator, context):
        for request in request_iterator:
            yield self.SubmitRolloutBatch(request, context)

    @unavailable_when_ray_fails
    @admitted
    def SubmitRolloutBatch(self, request: RolloutBatchView, context) -> pb.SubmitAck:
        received = time.monotonic()
        arrays = None
        try:
            arrays = decode_batch(request.arrow_ipc)
            validate_batch(arrays, self.frontend.config)
        except InvalidBatchError as exc:
            self.frontend.scheduler.record_rejection()
            self._refuse(exc, arrays, grpc.StatusCode.INVALID_ARGUMENT, context)
        try:
            reply = self._ingest(arrays, request.arrow_ipc)
        except JournalWriteError as exc:  # nothing acknowledged; the journal heals itself
            error = JournalUnwritableError(
                f"rlfeed: the batch was not taken: {exc}", max(exc.retry_after_s, 0.5)
            )
            self._refuse(error, arrays, grpc.StatusCode.RESOURCE_EXHAUSTED, context)
        if reply.kind is IngestKind.INVALID:
            error = InvalidBatchError(reply.message, reason=reply.reason)
            self._refuse(error, arrays, grpc.StatusCode.INVALID_ARGUMENT, context)
        if reply.kind is IngestKind.BACKPRESSURE:
            error = BackpressureError(reply.message)
            self._refuse(error, arrays, grpc.StatusCode.RESOURCE_EXHAUSTED, context)
        self.frontend.events.on_ingest(
            reply.result, tokens=int(arrays.token_ids.size), seconds=time.monotonic() - received
        )
        return ack_of(request.sequence, reply.result)

    def _refuse(
        self,
        error: InvalidBatchError | BackpressureError | JournalUnwritableError,
        arrays: RolloutBatchArrays | None,
        code: grpc.StatusCode,
        context: grpc.ServicerContext,
    ) -> None:
        rollouts, tokens = (len(arrays), int(arrays.token_ids.size)) if arrays else (0, 0)
        self.frontend.events.on_reject(error, rollouts=rollouts, tokens=tokens)
        if isinstance(error, BackpressureError | JournalUnwritableError):
            retry_after_ms = str(round(error.retry_after_s * 1000))
            context.set_trailing_metadata(((RETRY_AFTER_MS, retry_after_ms),))
        context.abort(code, str(error))

    def _ingest(self, arrays: RolloutBatchArrays, arrow_ipc: bytes | memoryview) -> IngestReply:
        """Buffer a validated batch in the actor, in a call shared with the batches arriving
        alongside; hand the steps it made ready to the assembler and free what the actor
        released. With a journal the Arrow bytes are journaled first, as received, and its
        position is the batch's key: the actor records the batch by it."""
        payloads, retention = self.frontend.payloads, self.frontend.retention
        with retention.appending() if retention is not None else contextlib.nullcontext():
            key = None
            if len(arrays) and retention is not None:
                key = retention.journal.append(KIND_BATCH, arrow_ipc)
                payloads.put(key, arrays.columns)
            elif len(arrays):
                key = payloads.add(arrays.columns)
            handle = BatchHandle(self.frontend.id, key) if key is not None else None
            # A failed call keeps the columns: the batch may have been buffered before the
            # failure (the actor's journal then has it, and this slot serves it).
            reply = self._groups.ingest(batch_meta(arrays), handle)
        if key is not None and not (reply.kind is IngestKind.OK and reply.result.accepted > 0):
            payloads.discard(key)  # the scheduler did not keep the batch
        if reply.work:
            self.assembler.add_work(reply.work)
        self.assembler.free(reply.releases)
        return reply

    @unavailable_when_ray_fails
    def RegisterTasks(self, request: pb.RegisterTasksRequest, context):
        try:
            check_task_ids(request.task_ids, self.frontend.config.server)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        result = self.frontend.scheduler.register_tasks(list(request.task_ids))
        if isinstance(result, Refused):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, result.message)
        added, total = result
        return pb.RegisterTasksResponse(added=added, total_tasks=total)

    @unavailable_when_ray_fails
    def SampleTasks(self, request: pb.SampleTasksRequest, context):
        result = self.frontend.scheduler.sample_tasks(int(request.n))
        self.frontend.events.on_task_sample(requested=result.requested, result=result)
        return pb.SampleTasksResponse(
            task_ids=result.task_ids, revisit=result.revisit, pass_rate=result.pass_rate
        )
