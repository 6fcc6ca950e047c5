"""Hooks the gRPC front-end calls as it works: where metrics (or logging) plug in.

`ServerEvents` is the no-op default. An exporter passes its own object with the same
methods to `start_server(..., events=...)`; the front-end calls them on its handler threads,
after the work they describe, and a hook that raises is logged, never allowed to fail the
call it observes.
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
        """A batch was refused (InvalidBatchError / ValueError / BackpressureError); rollouts
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


def notify(events: ServerEvents, name: str, *args, **kwargs) -> None:
    """Call events.<name>(...); log and swallow what it raises."""
    try:
        getattr(events, name)(*args, **kwargs)
    except Exception:
        _log.exception("rlfeed event hook %s failed", name)
