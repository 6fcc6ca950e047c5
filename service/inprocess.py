"""The sidecar without gRPC or Ray: `InProcessTransport` runs the front-end's decode,
validation and ack code and a `Scheduler` in the calling process, so client and trainer
code is testable without a server. It lives on the service side (not in `rlfeed.client`)
because it runs service code, and trainers never import server internals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rlfeed.client.arrow_codec import ServedResponse, parse_get_batch_response
from rlfeed.client.transport import (
    BufferFullError,
    InvalidRequestError,
    InvalidRolloutsError,
    StepReleasedError,
)
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.sched.assembly import TokenColumns
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.messages import status_to_proto
from rlfeed.service.codec.request_checks import check_task_ids, trainer_report_of
from rlfeed.service.codec.rollout_batch import ack_of, batch_meta, decode_batch, validate_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import BackpressureError, InvalidBatchError
from rlfeed.service.scheduler.state import Scheduler


def assemble_ready_steps(
    scheduler: Scheduler, resolve: Callable[[Any], TokenColumns] = lambda columns: columns
) -> list[int]:
    """Plan, materialize (`resolve` turns a payload handle into columns; identity when the
    handles are the columns) and store every ready step; returns them."""
    steps = []
    for work in scheduler.plan_ready_steps():
        scheduler.store_step(work.step, materialize_work(work, resolve))
        steps.append(work.step)
    return steps


class InProcessTransport:
    """`Transport` backed by a `Scheduler` in this process; it answers with the same
    messages as a real sidecar (served steps are the stored `GetBatchResponse` bytes).
    Thread-safe: one lock serializes calls, as the scheduler actor does."""

    def __init__(self, config: SidecarConfig | None = None) -> None:
        self.config = config if config is not None else SidecarConfig()
        self._scheduler = Scheduler(self.config)
        self._cond = threading.Condition()

    def submit(self, batch: pb.RolloutBatch) -> pb.SubmitAck:
        with self._cond:
            try:
                arrays = decode_batch(batch.arrow_ipc)
                validate_batch(arrays, self.config)
                result = self._scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
            except BackpressureError as exc:
                self._scheduler.record_rejection()
                raise BufferFullError(str(exc), retry_after_s=exc.retry_after_s) from None
            except InvalidBatchError as exc:
                self._scheduler.record_rejection()
                raise InvalidRolloutsError(str(exc)) from None
            if assemble_ready_steps(self._scheduler):
                self._cond.notify_all()
            return ack_of(batch.sequence, result)

    def register_tasks(self, task_ids: list[str]) -> pb.RegisterTasksResponse:
        with self._cond:
            try:
                check_task_ids(task_ids, self.config.server)
                added, total = self._scheduler.register_tasks(list(task_ids))
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        return pb.RegisterTasksResponse(added=added, total_tasks=total)

    def sample_tasks(self, n: int) -> pb.SampleTasksResponse:
        with self._cond:
            result = self._scheduler.sample_tasks(n)
        return pb.SampleTasksResponse(
            task_ids=result.task_ids, revisit=result.revisit, pass_rate=result.pass_rate
        )

    def get_batch(self, step: int, rank: int, wait_s: float) -> pb.GetBatchResponse:
        served = self._fetch(step, rank, wait_s)
        return pb.GetBatchResponse.FromString(served) if served else pb.GetBatchResponse()

    def get_batch_view(self, step: int, rank: int, wait_s: float) -> ServedResponse:
        """`get_batch` as a `ServedResponse` (Arrow payloads viewed in the stored bytes)."""
        return parse_get_batch_response(self._fetch(step, rank, wait_s))

    def _fetch(self, step: int, rank: int, wait_s: float) -> bytes:
        """The stored response bytes, or b"" (a not-ready answer) after `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                try:
                    result = self._scheduler.fetch_batch(step, rank)
                except ValueError as exc:
                    raise InvalidRequestError(str(exc)) from None
                if result.ready:
                    return result.response
                if result.released:
                    raise StepReleasedError(f"step {step} is no longer retained")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return b""
                self._cond.wait(remaining)

    def ack_steps(self, rank: int, through_step: int | None) -> pb.AckStepsResponse:
        with self._cond:
            try:
                acked = self._scheduler.ack_steps(rank, through_step)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
        return pb.AckStepsResponse(acked_through=acked)

    def report(self, report: pb.TrainerReport) -> None:
        with self._cond:
            try:
                self._scheduler.record_report(report.rank, trainer_report_of(report))
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None

    def status(self) -> pb.StatusResponse:
        with self._cond:
            return status_to_proto(self._scheduler.status(), self.config)

    def close(self) -> None:
        pass
