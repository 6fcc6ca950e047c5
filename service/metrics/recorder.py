"""The sidecar's Prometheus metrics: what the chapter measures by hand, live.

`SidecarMetrics` owns a private registry (never the global one, so two sidecars or a test
share a process) and update methods that take plain values and the scheduler's records; it
imports neither gRPC nor Ray and starts nothing. Declarations are in `families`, per-step
figures and their GPU-time price in `figures`, the /layout.png picture in `newest_layout`,
the front-end hooks and the HTTP endpoint in `exporter` and `http`. No label carries a
task, group or rollout id. What each figure means is in its metric's help text and in
`figures`; step latency runs from `ready_time` (the step's last group complete) to its
last rank's first fetch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from rlfeed.sched.assembly import share
from rlfeed.service.config import AccountingConfig, BatchingConfig, RolloutsConfig
from rlfeed.service.errors import RejectReason
from rlfeed.service.metrics.families import (
    PASS_RATE_BUCKETS,
    PHASES,
    REJECT_REASONS,
    MetricFamilies,
)
from rlfeed.service.metrics.figures import StepFigures, StepPrice, price_step
from rlfeed.service.metrics.newest_layout import NewestLayout

if TYPE_CHECKING:
    from rlfeed.service.config import SidecarConfig
    from rlfeed.service.metrics.layout_plot import StepLayout
    from rlfeed.service.scheduler.records import StepRecord

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """What the recorder needs: the run's pricing and shape (from `SidecarConfig`, see
    `from_sidecar_config`) and its own bookkeeping bounds."""

    accounting: AccountingConfig = field(default_factory=AccountingConfig)  # step pricing
    world_size: int = BatchingConfig.world_size  # trainer ranks; bounds the `rank` label
    token_budget: int = BatchingConfig.token_budget  # tokens per microbatch (fill, layout)
    vocab_size: int = RolloutsConfig.vocab_size  # [rollouts] vocab_size; 0 = ids unchecked
    zero_advantage_window_steps: int = 20  # trailing window of the zero-advantage share; 20
    max_tracked_steps: int = 4096  # steps remembered for served/lag bookkeeping; 4096
    refresh_interval_s: float = 0.5  # least time between two refresh() calls; default 0.5

    def __post_init__(self) -> None:
        for name in ("world_size", "token_budget", "zero_advantage_window_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"MetricsConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tracked_steps < 1 or self.refresh_interval_s < 0:
            raise ValueError("MetricsConfig: max_tracked_steps >= 1, refresh_interval_s >= 0")

    @classmethod
    def from_sidecar_config(cls, config: SidecarConfig) -> MetricsConfig:
        """The run's [accounting] section, [batching] world_size and token_budget, and
        [rollouts] vocab_size."""
        return cls(
            accounting=config.accounting,
            world_size=config.batching.world_size,
            token_budget=config.batching.token_budget,
            vocab_size=config.rollouts.vocab_size,
        )


def pass_rate_bucket_counts(pass_rates: ArrayLike) -> np.ndarray:
    """int64 [len(PASS_RATE_BUCKETS)]: tasks whose estimate is <= each bucket bound."""
    rates = np.sort(np.asarray(pass_rates, dtype=np.float64).ravel())
    return np.searchsorted(rates, PASS_RATE_BUCKETS, side="right").astype(np.int64)


class _WithoutCreated:
    """What /metrics serves of a registry: every family without its `*_created` samples.
    They are a second series per counter and histogram child (with labels, many), that no
    dashboard or alert reads: `process_start_time_seconds` dates the counters' starts. This
    filters one registry instead of calling prometheus_client's `disable_created_metrics()`,
    which switches them off for every registry of the process."""

    def __init__(self, registry) -> None:
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield kept


class SidecarMetrics:
    """All sidecar metrics on a private registry, plus the newest step's layout picture."""

    def __init__(self, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.families = MetricFamilies(
            self.config.accounting, self.config.zero_advantage_window_steps
        )
        self.registry = self.families.registry
        self.families.ingest.vocab_size.set(self.config.vocab_size)
        self._lock = threading.Lock()
        self._zero_window: deque[tuple[int, int]] = deque(
            maxlen=self.config.zero_advantage_window_steps
        )
        self._newest_step = -1
        self._last_fetched = [-1] * self.config.world_size
        self._ready_time: dict[int, float] = {}  # assembled, not fully served -> ready_time
        self._fetched: dict[int, set[int]] = {}  # step -> ranks that fetched it
        self._served: deque[int] = deque(maxlen=self.config.max_tracked_steps)
        self._saved_rollouts = 0
        self._rollouts_requested = 0
        self._layout = NewestLayout(self.config.world_size, self.config.token_budget)
        self._refresh: Callable[[], None] | None = None
        self._refreshed_at = float("-inf")

    # ---------------------------------------------------------------- ingest
    def on_ingest(
        self,
        *,
        accepted: int,
        accepted_tokens: int | None = None,
        duplicate: int = 0,
        stale: int = 0,
        stale_tokens: int = 0,
        expired: int = 0,
        ack_seconds: float | None = None,
        buffered_rollouts: int | None = None,
        buffered_bytes: int | None = None,
        newest_policy_version: int | None = None,
    ) -> None:
        """One acknowledged batch (the numbers of its SubmitAck, plus timing)."""
        m = self.families.ingest
        m.batches.inc()
        m.rollouts_accepted.inc(accepted)
        if accepted_tokens is not None:
            m.tokens_accepted.inc(accepted_tokens)
        m.rollouts_duplicate.inc(duplicate)
        self.on_stale(rollouts=stale, tokens=stale_tokens)
        m.rollouts_expired.inc(expired)
        if ack_seconds is not None:
            m.ack_latency.observe(ack_seconds)
        if buffered_rollouts is not None:
            m.buffered_rollouts.set(buffered_rollouts)
        if buffered_bytes is not None:
            m.buffered_bytes.set(buffered_bytes)
        if newest_policy_version is not None:
            m.newest_policy_version.set(newest_policy_version)

    def on_reject(self, reason: str, rollouts: int, tokens: int = 0) -> None:
        """One refused batch. A full buffer ("buffer_full") is backpressure, counted apart
        from the rejections; another `reason` outside REJECT_REASONS counts as "other"."""
        m = self.families.ingest
        if reason == RejectReason.BUFFER_FULL.value:
            m.batches_backpressured.inc()
            return
        reason = reason if reason in REJECT_REASONS else "other"
        m.batches_rejected.labels(reason=reason).inc()
        m.rollouts_rejected.labels(reason=reason).inc(rollouts)
        m.tokens_rejected.labels(reason=reason).inc(tokens)

    def on_stale(self, *, rollouts: int, tokens: int = 0) -> None:
        """Rollouts dropped for max_policy_lag (at ingest or when their group went stale)."""
        self.families.ingest.rollouts_stale.inc(rollouts)
        self.families.ingest.tokens_stale.inc(tokens)

    def on_status(self, snapshot: Any, pass_rates: ArrayLike | None = None) -> None:
        """Levels from a `service.scheduler.StatusSnapshot` (or a proto StatusResponse):
        buffer, filter sizes, newest and trainer's policy versions; `pass_rates` [T] if
        known."""
        m = self.families.ingest
        m.buffered_rollouts.set(snapshot.buffered_rollouts)
        m.buffered_bytes.set(snapshot.buffered_bytes)
        m.held_bytes.set(snapshot.held_bytes)
        m.newest_policy_version.set(snapshot.newest_policy_version)
        if _trainer_published(snapshot):
            m.trainer_policy_version.set(snapshot.trainer_policy_version)
        self.on_curriculum(
            tasks_inside=snapshot.tasks_inside_filter,
            tasks_outside=snapshot.tasks_total - snapshot.tasks_inside_filter,
            pass_rates=pass_rates,
        )

    # ---------------------------------------------------------------- steps
    def on_step(
        self,
        record: StepRecord,
        *,
        ready_time: float | None = None,
        layout: StepLayout | Callable[[], StepLayout | None] | None = None,
        generated_policy_tokens: int | None = None,
        generated_tokens: int | None = None,
    ) -> None:
        """One assembled step, as the scheduler recorded it.

        ready_time: time.time() when the step's last group completed (for step latency).
        layout: what /layout.png draws for this step, a StepLayout or a zero-argument
        callable called only when the picture is asked for. Without it the picture is
        built from the responses passed to `on_served` once every rank fetched the step.
        """
        figures = StepFigures(
            record=record,
            world_size=self.config.world_size,
            token_budget=self.config.token_budget,
            generated_policy_tokens=generated_policy_tokens,
            generated_tokens=generated_tokens,
        )
        self.families.observe_step(figures, price_step(figures, self.config.accounting))
        groups, zero = figures.groups_considered, figures.zero_advantage_groups_considered
        with self._lock:
            self._zero_window.append((groups, zero))
            self.families.curriculum.window_zero_share.set(
                share(sum(z for _, z in self._zero_window), sum(g for g, _ in self._zero_window))
            )
            self._newest_step = max(self._newest_step, record.step)
            if record.step not in self._served:
                self._fetched.setdefault(record.step, set())
                if ready_time is not None:
                    self._ready_time[record.step] = ready_time
            if layout is not None:
                self._layout.set(record.step, layout)
            self._forget_old_steps()
            self._update_progress()

    def on_served(
        self,
        step: int,
        rank: int,
        latency_seconds: float | None = None,
        *,
        response: Any = None,
        now: float | None = None,
    ) -> None:
        """Rank `rank` fetched step `step` (`response`: its GetBatchResponse or the bytes).

        A step is served when its last rank fetches it the first time; its latency is
        `latency_seconds`, or else `now` (time.time()) minus the step's ready_time."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.config.world_size})")
        m = self.families.serving
        with self._lock:
            if step in self._served or rank in self._fetched.get(step, ()):
                m.batch_refetches.inc()
                return
            m.batch_fetches.inc()
            ranks = self._fetched.setdefault(step, set())
            ranks.add(rank)
            self._last_fetched[rank] = max(self._last_fetched[rank], step)
            if response is not None:
                self._layout.add_response(step, rank, response)
            if len(ranks) == self.config.world_size:
                del self._fetched[step]
                self._served.append(step)
                m.steps_served.inc()
                ready = self._ready_time.pop(step, None)
                if latency_seconds is None and ready is not None:
                    latency_seconds = (time.time() if now is None else now) - ready
                if latency_seconds is not None:
                    m.step_latency.observe(max(latency_seconds, 0.0))
                self._layout.served(step)
            self._forget_old_steps()
            self._update_progress()

    def _forget_old_steps(self) -> None:
        limit = self.config.max_tracked_steps
        for table in (self._fetched, self._ready_time):
            while len(table) > limit:
                del table[min(table)]
        self._layout.forget_old()

    def _update_progress(self) -> None:
        serving = self.families.serving
        if self._newest_step >= 0:
            serving.trainer_lag.set(self._newest_step - min(self._last_fetched))
        serving.steps_waiting.set(sum(1 for s in self._fetched if s <= self._newest_step))

    # ---------------------------------------------------------------- curriculum
    def on_task_sample(
        self, *, requested: int, returned: int, revisits: int, group_size: int
    ) -> None:
        """One SampleTasks call: `requested` tasks asked (n resolved), `returned` given
        back, `revisits` of them from outside the filter."""
        if not 0 <= revisits <= returned:
            raise ValueError(f"revisits ({revisits}) must be in [0, returned={returned}]")
        m = self.families.curriculum
        m.sample_requests.inc()
        m.tasks_requested.inc(requested)
        m.tasks_sampled.inc(returned)
        m.revisits.inc(revisits)
        m.rollouts_requested.inc(requested * group_size)
        m.rollouts_sampled.inc(returned * group_size)
        with self._lock:
            saved_now = (requested - (returned - revisits)) * group_size
            self._saved_rollouts += saved_now
            self._rollouts_requested += requested * group_size
            m.rollouts_saved.inc(saved_now)
            saved = share(self._saved_rollouts, self._rollouts_requested)
            m.rollouts_saved_share.set(min(saved, 1.0))

    def on_curriculum(
        self, *, tasks_inside: int, tasks_outside: int, pass_rates: ArrayLike | None = None
    ) -> None:
        """The curriculum now: filter sizes and (optionally) every task's estimate [T], of
        which only the bucket counts are kept."""
        m = self.families.curriculum
        m.tasks.labels(filter="inside").set(tasks_inside)
        m.tasks.labels(filter="outside").set(tasks_outside)
        if pass_rates is not None:
            rates = np.asarray(pass_rates, dtype=np.float64).ravel()
            m.pass_rates.update(pass_rate_bucket_counts(rates), int(rates.size), float(rates.sum()))

    # ---------------------------------------------------------------- trainers
    def on_trainer_report(
        self,
        *,
        step: int,
        rank: int,
        loss: float,
        ratio_outlier_share: float,
        tokens_per_second: float,
        step_seconds: float | None = None,
    ) -> None:
        """What rank `rank` measured for step `step` (a TrainerReport). A value that is None
        or not finite (NaN: not measured this step, e.g. the ratio outlier share, which
        trainers measure at their first step only) leaves its gauge as it was."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.config.world_size})")
        m, label = self.families.trainers, str(rank)
        m.reports.inc()
        m.step.labels(rank=label).set(step)
        for gauge, value in (
            (m.loss, loss),
            (m.outliers, ratio_outlier_share),
            (m.tokens_per_second, tokens_per_second),
            (m.step_seconds, step_seconds),
        ):
            if value is not None and math.isfinite(value):
                gauge.labels(rank=label).set(value)

    # ---------------------------------------------------------------- output
    def set_refresh(self, refresh: Callable[[], None] | None) -> None:
        """A callable run before an exposition (at most every refresh_interval_s) to pull
        levels from the scheduler, e.g. `on_status(...)`; its errors are logged."""
        self._refresh = refresh

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what /metrics serves)."""
        refresh = self._refresh
        now = time.monotonic()
        if refresh is not None and now - self._refreshed_at >= self.config.refresh_interval_s:
            self._refreshed_at = now
            try:
                refresh()
            except Exception:  # a slow or failed pull must not break the scrape
                log.exception("metrics refresh failed")
        return generate_latest(_WithoutCreated(self.registry))

    def latest_layout_png(self) -> tuple[int, bytes] | None:
        """(step, PNG) of the newest step with a layout, rendered on first request and
        cached; None when there is none. Raises ImportError without matplotlib."""
        return self._layout.png()


__all__: Sequence[str] = (
    "PASS_RATE_BUCKETS",
    "PHASES",
    "REJECT_REASONS",
    "MetricsConfig",
    "SidecarMetrics",
    "StepFigures",
    "StepPrice",
    "pass_rate_bucket_counts",
    "price_step",
)


def _trainer_published(snapshot: Any) -> bool:
    """Whether a trainer published a policy version: a StatusSnapshot says -1 for none, a
    StatusResponse leaves the field unset."""
    if hasattr(snapshot, "HasField"):
        return snapshot.HasField("trainer_policy_version")
    return snapshot.trainer_policy_version >= 0
