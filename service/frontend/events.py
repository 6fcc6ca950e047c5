"""Hooks the gRPC front-end calls as it works: where metrics (or logging) plug in.

`ServerEvents` is the no-op default; an exporter passes its own subclass to
`start_server(..., events=...)`. The front-end calls them on its threads, after the work
they describe, through `GuardedEvents`: a hook that raises is logged, never fatal.
"""

from __future__ import annotations

import logging

from rlfeed.service.scheduler.records import IngestResult, SampleResult, StepRecord

_log = logging.getLogger("rlfeed.service.frontend.events")


class ServerEvents:
    """Every method is a no-op; override the ones you need."""

    def on_ingest(self, result: IngestResult, *, tokens: int, seconds: float) -> None:
        """A batch was taken: `tokens` in it, `seconds` from receipt to the ack."""

    def on_reject(self, error: BaseException, *, rollouts: int, tokens: int) -> None:
        """A batch was refused (InvalidBatchError / BackpressureError, with a `reason`); rollouts
        and tokens are 0 when the payload could not be decoded."""

    def on_step(self, record: StepRecord, *, responses: list[bytes], ready_time: float) -> None:
        """A step was planned, materialized and stored; `ready_time` is time.time() when its
        planning started; `responses[rank]` are the serialized GetBatchResponse bytes."""

    def on_served(self, step: int, rank: int, response: bytes) -> None:
        """(step, rank) was answered with a ready response held by this front-end (its
        GetBatch, or a peer it handed the bytes to), or fetched here from the object
        store: each fetch is reported once, by the front-end holding the step."""

    def on_task_sample(self, *, requested: int, result: SampleResult) -> None:
        """SampleTasks answered; `requested` is n after the prompts_per_step default."""

    def on_trainer_report(self, rank: int, report: dict[str, float]) -> None:
        """A trainer rank reported (step, loss, ratio_outlier_share, tokens_per_second,
        step_seconds)."""


class GuardedEvents(ServerEvents):
    """The front-end's view of the hooks: each call is logged and swallowed if it raises,
    so a metrics bug never fails the call it observes. `inner` is the hooks object given."""

    def __init__(self, inner: ServerEvents) -> None:
        self.inner = inner

    @staticmethod
    def _call(hook, *args, **kwargs) -> None:
        try:
            hook(*args, **kwargs)
        except Exception:
            _log.exception("rlfeed event hook %s failed", hook.__name__)

    def on_ingest(self, result: IngestResult, *, tokens: int, seconds: float) -> None:
        self._call(self.inner.on_ingest, result, tokens=tokens, seconds=seconds)

    def on_reject(self, error: BaseException, *, rollouts: int, tokens: int) -> None:
        self._call(self.inner.on_reject, error, rollouts=rollouts, tokens=tokens)

    def on_step(self, record: StepRecord, *, responses: list[bytes], ready_time: float) -> None:
        self._call(self.inner.on_step, record, responses=responses, ready_time=ready_time)

    def on_served(self, step: int, rank: int, response: bytes) -> None:
        self._call(self.inner.on_served, step, rank, response)

    def on_task_sample(self, *, requested: int, result: SampleResult) -> None:
        self._call(self.inner.on_task_sample, requested=requested, result=result)

    def on_trainer_report(self, rank: int, report: dict[str, float]) -> None:
        self._call(self.inner.on_trainer_report, rank, report)
