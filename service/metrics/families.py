"""The sidecar's Prometheus metric families, on a private registry.

Names follow Prometheus conventions: the `rlfeed_` prefix, base units (`_seconds`, `_bytes`,
GPU time in `_gpu_seconds`), `_total` on counters (prometheus_client appends it), `_ratio`
on gauges in [0, 1]. Labels come from small fixed sets (`reason`, `phase`, `filter`) or are
`rank` (< world_size); every labelled series that can be known up front exists from the
start at 0, so dashboards and alerts see zeros rather than missing series (`declare`).
`SidecarMetrics` (rlfeed.service.metrics.recorder) decides what to record; this module and
`step_families` only declare and set. Here: a class for each group of families the recorder
sets by name (ingest, curriculum, trainers, serving); in `step_families`, the batching and
GPU-time ones, set wholly from each assembled step's figures and price.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeHistogramMetricFamily
from rlfeed import __version__
from rlfeed.service.errors import RejectReason
from rlfeed.service.metrics.declare import Declare
from rlfeed.service.metrics.step_families import PHASES, CostFamilies, StepFamilies

if TYPE_CHECKING:
    from rlfeed.service.config import AccountingConfig
    from rlfeed.service.metrics.figures import StepFigures, StepPrice

# Why a batch was rejected (the `reason` label): RejectReason's values, except a full buffer.
# That refusal is backpressure, the normal way a fast fleet waits for the trainer: it has its
# own counter, so an alert on rejected batches fires on bad input only.
REJECT_REASONS: tuple[str, ...] = tuple(
    reason.value for reason in RejectReason if reason is not RejectReason.BUFFER_FULL
)
# Upper bounds (le) of the pass-rate buckets; 0 and 0.9999 isolate the tasks a (0, 1)
# filter excludes as all-fail and all-pass.
PASS_RATE_BUCKETS: tuple[float, ...] = (
    0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.9999, 1.0,
)  # fmt: skip
ACK_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class MetricFamilies:
    """Every rlfeed metric, by what it describes; `observe_step` sets the per-step ones."""

    def __init__(self, accounting: AccountingConfig, zero_advantage_window_steps: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        Info(
            "rlfeed_accounting",
            "The [accounting] model and GPU presets and the MFU that price each step.",
            registry=r,
        ).info({"model": accounting.model, "gpu": accounting.gpu, "mfu": repr(accounting.mfu)})
        # Process health (process_*: CPU, memory, file descriptors, start time; python_*:
        # interpreter and garbage collection) of the front-end process, as the default
        # registry of prometheus_client would have it, and the running version.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Info("rlfeed_build", "The version of the running rlfeed.", registry=r).info(
            {"version": __version__}
        )
        # Declared in this order, which is the order /metrics lists them in.
        declare = Declare(r)
        self.ingest = IngestFamilies(declare)
        self.steps = StepFamilies(declare)
        self.curriculum = CurriculumFamilies(declare, zero_advantage_window_steps)
        self.cost = CostFamilies(declare)
        self.trainers = TrainerFamilies(declare)
        self.serving = ServingFamilies(declare)

    def observe_step(self, f: StepFigures, price: StepPrice) -> None:
        """Set the newest-step gauges and add the step to the counters."""
        self.steps.observe(f)
        self.curriculum.observe(f)
        self.cost.observe(price)


class IngestFamilies:
    """What producers sent and what became of it; the buffer's levels."""

    def __init__(self, declare: Declare) -> None:
        counter, gauge = declare.counter, declare.gauge
        self.batches = counter(
            "rlfeed_ingest_batches", "Rollout batches acknowledged (taken, in whole or part)."
        )
        self.rollouts_accepted = counter(
            "rlfeed_ingest_rollouts_accepted", "Rollouts accepted into the buffer."
        )
        self.tokens_accepted = counter(
            "rlfeed_ingest_tokens_accepted", "Tokens of the rollouts accepted into the buffer."
        )
        self.rollouts_duplicate = counter(
            "rlfeed_ingest_rollouts_duplicate", "Rollout ids resubmitted (idempotent, ignored)."
        )
        self.batches_rejected = counter(
            "rlfeed_ingest_batches_rejected",
            "Rollout batches refused as invalid (INVALID_ARGUMENT), by reason; a full buffer "
            "is counted apart, in rlfeed_ingest_batches_backpressured_total.",
            "reason",
            REJECT_REASONS,
        )
        self.rollouts_rejected = counter(
            "rlfeed_ingest_rollouts_rejected",
            "Rollouts in batches refused as invalid.",
            "reason",
            REJECT_REASONS,
        )
        self.tokens_rejected = counter(
            "rlfeed_ingest_tokens_rejected",
            "Tokens in batches refused as invalid.",
            "reason",
            REJECT_REASONS,
        )
        self.batches_backpressured = counter(
            "rlfeed_ingest_batches_backpressured",
            "Rollout batches refused because the buffer was full (RESOURCE_EXHAUSTED): "
            "backpressure, retried by the producer once a trainer fetches a step.",
        )
        self.rollouts_stale = counter(
            "rlfeed_ingest_rollouts_stale", "Rollouts dropped as older than max_policy_lag."
        )
        self.tokens_stale = counter(
            "rlfeed_ingest_tokens_stale", "Tokens of the rollouts dropped as stale."
        )
        self.rollouts_expired = counter(
            "rlfeed_ingest_rollouts_expired",
            "Buffered rollouts dropped with their group, oldest first, to stay under "
            "max_buffered_bytes when no step could come out of the buffer.",
        )
        self.ack_latency = declare.histogram(
            "rlfeed_ingest_ack_latency_seconds",
            "Seconds from receiving a rollout batch to sending its ack.",
            ACK_LATENCY_BUCKETS,
        )
        # The buffer and the policy versions, as of the newest batch or status pull.
        self.buffered_rollouts = gauge(
            "rlfeed_buffered_rollouts", "Rollouts accepted and not yet in a step."
        )
        self.buffered_bytes = gauge(
            "rlfeed_buffered_bytes", "Bytes of token payload held by buffered rollouts."
        )
        self.held_bytes = gauge(
            "rlfeed_held_bytes",
            "Bytes counted against max_buffered_bytes: ingest batches that buffered rollouts "
            "read, and the responses of steps not yet fetched by every rank.",
        )
        self.newest_policy_version = gauge(
            "rlfeed_newest_policy_version", "Newest policy version seen in a rollout."
        )
        self.vocab_size = gauge(
            "rlfeed_rollouts_vocab_size",
            "Token ids must lie in [0, this) ([rollouts] vocab_size); 0 means they are not "
            "checked against a vocabulary.",
        )
        self.trainer_policy_version = gauge(
            "rlfeed_trainer_policy_version",
            "Highest policy version a trainer published (0 until one does); "
            "max_policy_lag counts from the higher of this and the newest in a rollout.",
        )


class PassRateHistogram:
    """Tasks by current pass-rate estimate: a gauge histogram (a snapshot of the pool, not
    an accumulation of observations), so `_bucket{le}` counts tasks with estimate <= le."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = np.zeros(len(PASS_RATE_BUCKETS), dtype=np.int64)
        self._total, self._sum = 0, 0.0

    def update(self, cumulative_counts: np.ndarray, total: int, total_sum: float) -> None:
        with self._lock:
            self._counts, self._total, self._sum = cumulative_counts, total, total_sum

    def collect(self):
        with self._lock:
            counts, total, total_sum = self._counts, self._total, self._sum
        buckets = [(repr(b), int(c)) for b, c in zip(PASS_RATE_BUCKETS, counts, strict=True)]
        yield GaugeHistogramMetricFamily(
            "rlfeed_curriculum_pass_rate",
            "Tasks by current pass-rate estimate (cumulative buckets over [0, 1]).",
            buckets=[*buckets, ("+Inf", total)],
            gsum_value=total_sum,
        )


class CurriculumFamilies:
    """Zero-advantage groups (per step and over a trailing window), tasks inside and outside
    the filter, SampleTasks calls and the rollouts they saved, the pass-rate histogram."""

    def __init__(self, declare: Declare, zero_advantage_window_steps: int) -> None:
        counter, gauge = declare.counter, declare.gauge
        self.groups = counter("rlfeed_groups", "Rollout groups considered for steps.")
        self.zero_groups = counter(
            "rlfeed_zero_advantage_groups", "Groups with all-equal rewards (no gradient)."
        )
        self.step_zero_share = gauge(
            "rlfeed_step_zero_advantage_groups_ratio",
            "Share of the newest step's groups with zero advantage.",
        )
        self.window_zero_share = gauge(
            "rlfeed_zero_advantage_groups_window_ratio",
            "Zero-advantage group share over the trailing window of steps.",
        )
        gauge(
            "rlfeed_zero_advantage_window_steps",
            "Steps in the trailing window of rlfeed_zero_advantage_groups_window_ratio.",
        ).set(zero_advantage_window_steps)
        self.tasks = gauge(
            "rlfeed_curriculum_tasks",
            "Registered tasks, inside and outside the pass-rate filter.",
            "filter",
            ("inside", "outside"),
        )
        self.sample_requests = counter(
            "rlfeed_curriculum_sample_requests", "SampleTasks calls the curriculum answered."
        )
        self.tasks_requested = counter(
            "rlfeed_curriculum_tasks_requested", "Tasks asked for by SampleTasks calls (sum of n)."
        )
        self.tasks_sampled = counter(
            "rlfeed_curriculum_tasks_sampled", "Tasks returned, revisits included."
        )
        self.revisits = counter(
            "rlfeed_curriculum_revisits", "Tasks returned from outside the filter."
        )
        self.rollouts_requested = counter(
            "rlfeed_curriculum_rollouts_requested",
            "Rollouts sampling every requested task would cost (n x group_size).",
        )
        self.rollouts_sampled = counter(
            "rlfeed_curriculum_rollouts_sampled", "Rollouts the returned tasks cost."
        )
        self.rollouts_saved = counter(
            "rlfeed_curriculum_rollouts_saved",
            "Rollouts not spent because fewer tasks than requested passed the pass-rate "
            "filter: (tasks requested - tasks drawn inside the filter) x group size.",
        )
        self.rollouts_saved_share = gauge(
            "rlfeed_curriculum_rollouts_saved_ratio",
            "Rollouts saved / rollouts requested since start (clipped to [0, 1]).",
        )
        self.pass_rates = PassRateHistogram()
        declare.registry.register(self.pass_rates)

    def observe(self, figures: StepFigures) -> None:
        """The newest step's groups: counted, and its zero-advantage share."""
        groups, zero = figures.groups_considered, figures.zero_advantage_groups_considered
        self.groups.inc(groups)
        self.zero_groups.inc(zero)
        self.step_zero_share.set(zero / groups if groups else 0.0)


class TrainerFamilies:
    """Each rank's latest TrainerReport (`rank` is bounded by world_size)."""

    def __init__(self, declare: Declare) -> None:
        gauge = declare.gauge
        self.reports = declare.counter(
            "rlfeed_trainer_reports", "Trainer reports received, all ranks."
        )
        self.loss = gauge(
            "rlfeed_trainer_loss", "Loss of the rank's latest report (unitless).", "rank"
        )
        self.outliers = gauge(
            "rlfeed_trainer_ratio_outlier_ratio",
            "Share of policy tokens whose step-0 trainer/sampler ratio left the trust band.",
            "rank",
        )
        self.tokens_per_second = gauge(
            "rlfeed_trainer_tokens_per_second",
            "Token positions per second the rank reported for its latest step.",
            "rank",
        )
        self.step_seconds = gauge(
            "rlfeed_trainer_step_seconds",
            "Wall-clock seconds of the rank's latest step, as it reported.",
            "rank",
        )
        self.step = gauge("rlfeed_trainer_step", "Step number of the rank's latest report.", "rank")


class ServingFamilies:
    """Steps fetched by the ranks: latency, first and repeated fetches, and how far the
    slowest rank lags."""

    def __init__(self, declare: Declare) -> None:
        counter, gauge = declare.counter, declare.gauge
        self.step_latency = declare.histogram(
            "rlfeed_step_latency_seconds",
            "Seconds from a step's last group completing to its last rank fetching it.",
            STEP_LATENCY_BUCKETS,
        )
        self.steps_served = counter("rlfeed_steps_served", "Steps fetched by every rank.")
        self.batch_fetches = counter(
            "rlfeed_batch_fetches", "First fetches of a (step, rank) microbatch list."
        )
        self.batch_refetches = counter(
            "rlfeed_batch_refetches",
            "Repeated fetches of a (step, rank) microbatch list (trainer restarts).",
        )
        self.trainer_lag = gauge(
            "rlfeed_trainer_lag_steps",
            "Steps between the newest assembled step and the slowest rank's newest fetch.",
        )
        self.steps_waiting = gauge(
            "rlfeed_steps_waiting", "Assembled steps not yet fetched by every rank."
        )


__all__ = (
    "ACK_LATENCY_BUCKETS",
    "PASS_RATE_BUCKETS",
    "PHASES",
    "REJECT_REASONS",
    "STEP_LATENCY_BUCKETS",
    "CostFamilies",
    "CurriculumFamilies",
    "IngestFamilies",
    "MetricFamilies",
    "PassRateHistogram",
    "ServingFamilies",
    "StepFamilies",
    "TrainerFamilies",
)
