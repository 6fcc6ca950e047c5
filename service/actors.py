"""The named Ray actor that hosts the sidecar's `Scheduler` (a thin shell, no logic).

One actor per sidecar, named `config.ray.actor_name` in `config.ray.namespace`, so any
process of the Ray cluster (a second gRPC front-end, `rlfeed status` tooling, the metrics
exporter) can find it with `ray.get_actor`. Calls run one at a time, in order, which is
what makes the scheduler's state changes a journal-able sequence.

Bulk data stays out of the actor's method queue: `ingest_batch` gets one call per batch
with small metadata arrays and `[ObjectRef]` of the batch's TokenColumns (wrapped in a list
so Ray passes the reference instead of resolving it); the token data is read from the
object store when a step is materialized, and that happens in the gRPC front-end that
asked for the plan (`plan_ready_steps` -> materialize -> `store_step`), so the actor's
queue only carries metadata, plans and handles. The actor keeps each rank's response
handle until the step is released (`retained_steps`): the marker of the front-end that
holds the bytes in memory, or, once that front-end moved them out (`move_step`), an
object reference.

Expected failures come back as values, `("ok", result)` / `("invalid", message)` /
`("backpressure", message)`, rather than as Ray-wrapped exceptions.
"""

from __future__ import annotations

from typing import Any

import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.scheduler import BackpressureError, BatchMeta, Scheduler
from rlfeed.service.validation import InvalidBatchError


class SchedulerActor:
    """Ray actor body: forwards each call to a Scheduler (created with ray.remote)."""

    def __init__(self, config: SidecarConfig) -> None:
        self._scheduler = Scheduler(config)  # never materializes: front-ends do

    def ping(self) -> bool:
        return True

    def register_tasks(self, task_ids: list[str]) -> tuple[str, Any]:
        try:
            return "ok", self._scheduler.register_tasks(task_ids)
        except ValueError as exc:
            return "invalid", str(exc)

    def sample_tasks(self, n: int) -> tuple[str, Any]:
        return "ok", self._scheduler.sample_tasks(n)

    def ingest_batch(self, meta: BatchMeta, payload: list | None) -> tuple[str, Any]:
        try:
            return "ok", self._scheduler.ingest_batch(meta, payload)
        except InvalidBatchError as exc:
            self._scheduler.record_rejection()
            return "invalid", str(exc)
        except BackpressureError as exc:
            self._scheduler.record_rejection()
            return "backpressure", str(exc)

    def record_rejection(self) -> None:
        self._scheduler.record_rejection()

    def plan_ready_steps(self) -> list:
        """StepWork of every newly planned step; the caller materializes and stores it."""
        return self._scheduler.plan_ready_steps()

    def store_step(self, step: int, responses: list, response_bytes: int) -> Any:
        """responses[rank] = that rank's handle: [ObjectRef of its GetBatchResponse bytes],
        or the marker of the front-end holding the bytes; returns the step's StepRecord."""
        return self._scheduler.store_step(step, responses, response_bytes)

    def held_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` still stored (not released)."""
        return self._scheduler.held_steps(steps)

    def move_step(self, step: int, responses: list[list]) -> bool:
        """A front-end moved a held step's bytes into the object store: responses[rank] =
        [ObjectRef]; False if the step was released meanwhile."""
        return self._scheduler.move_step(step, responses)

    def fetch_batch(self, step: int, rank: int) -> tuple[str, Any]:
        """("ready", that rank's handle, see store_step) | ("waiting", next_step) |
        ("released", next_step) | ("invalid", message)."""
        try:
            result = self._scheduler.fetch_batch(step, rank)
        except ValueError as exc:
            return "invalid", str(exc)
        if result.ready:
            return "ready", result.payload
        return ("released" if result.released else "waiting"), self._scheduler.next_step

    def record_report(self, rank: int, report: dict[str, float]) -> tuple[str, Any]:
        """("ok", None) | ("invalid", message): a rank outside the world or a negative step."""
        try:
            self._scheduler.record_report(rank, report)
        except ValueError as exc:
            return "invalid", str(exc)
        return "ok", None

    def status(self) -> Any:
        return self._scheduler.status()

    def step_records(self, since_step: int = 0) -> list:
        """Step statistics with step >= since_step (for the metrics exporter)."""
        return [r for r in self._scheduler.step_records if r.step >= since_step]

    def pass_rate_estimates(self) -> Any:
        """float64 [tasks]: every task's pass-rate estimate (the metrics' histogram)."""
        return self._scheduler.pass_rate_estimates()


def create_scheduler_actor(config: SidecarConfig) -> ray.actor.ActorHandle:
    """Start the named scheduler actor; RuntimeError if one with that name already runs."""
    name, namespace = config.ray.actor_name, config.ray.namespace
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise RuntimeError(
            f"a scheduler actor named {name!r} already runs in Ray namespace {namespace!r} "
            "(another rlfeed serve?); set [ray] actor_name to run a second sidecar"
        )
    actor_class = ray.remote(SchedulerActor)
    handle = actor_class.options(name=name, namespace=namespace, max_restarts=0).remote(config)
    ray.get(handle.ping.remote())  # surface construction errors here, not on first use
    return handle
