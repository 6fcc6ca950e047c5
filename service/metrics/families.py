"""The sidecar's Prometheus metric families, on a private registry.

Names follow Prometheus conventions: the `rlfeed_` prefix, base units (`_seconds`, `_bytes`,
GPU time in `_gpu_seconds`), `_total` on counters (prometheus_client appends it), `_ratio`
on gauges in [0, 1]. Labels come from small fixed sets (`reason`, `phase`, `filter`) or are
`rank` (< world_size); every labelled series that can be known up front exists from the
start at 0, so dashboards and alerts see zeros rather than missing series. `SidecarMetrics`
(rlfeed.service.metrics.recorder) decides what to record; this module only declares and sets.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeHistogramMetricFamily
from rlfeed import __version__
from rlfeed.service.errors import RejectReason

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
PHASES: tuple[str, ...] = ("decode", "train", "logprob")
ACK_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


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


class MetricFamilies:
    """Every rlfeed metric, as attributes; `observe_step` sets the per-step ones."""

    def __init__(self, accounting: AccountingConfig, zero_advantage_window_steps: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

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
        # Ingest.
        self.ingest_batches = counter(
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
        reason = ("reason",)
        self.batches_rejected = counter(
            "rlfeed_ingest_batches_rejected",
            "Rollout batches refused as invalid (INVALID_ARGUMENT), by reason; a full buffer "
            "is counted apart, in rlfeed_ingest_batches_backpressured_total.",
            reason,
        )
        self.rollouts_rejected = counter(
            "rlfeed_ingest_rollouts_rejected", "Rollouts in batches refused as invalid.", reason
        )
        self.tokens_rejected = counter(
            "rlfeed_ingest_tokens_rejected", "Tokens in batches refused as invalid.", reason
        )
        self.batches_backpressured = counter(
            "rlfeed_ingest_batches_backpressured",
            "Rollout batches refused because the buffer was full (RESOURCE_EXHAUSTED): "
            "backpressure, retried by the producer once a trainer fetches a step.",
        )
        for family in (self.batches_rejected, self.rollouts_rejected, self.tokens_rejected):
            for value in REJECT_REASONS:
                family.labels(reason=value)
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
        self.ack_latency = Histogram(
            "rlfeed_ingest_ack_latency_seconds",
            "Seconds from receiving a rollout batch to sending its ack.",
            buckets=ACK_LATENCY_BUCKETS,
            registry=r,
        )
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
        # Batching: gauges of the newest step, counters over all steps.
        self.step = gauge("rlfeed_step", "Number of the newest assembled step.")
        self.step_rollouts = gauge("rlfeed_step_rollouts", "Rollouts in the newest step.")
        self.step_policy_tokens = gauge(
            "rlfeed_step_policy_tokens",
            "Policy tokens (action_mask 1) of the newest step, all ranks: the loss's N.",
        )
        self.step_real_tokens = gauge(
            "rlfeed_step_real_tokens", "Tokens of the newest step's rollouts, all ranks."
        )
        self.step_computed = gauge(
            "rlfeed_step_computed_positions",
            "Token positions the newest step's packed microbatches compute, padding included.",
        )
        self.step_padded = gauge(
            "rlfeed_step_padded_positions",
            "Token positions the padded alternative would compute for the newest step "
            "(rollouts x longest rollout).",
        )
        self.step_padding = gauge(
            "rlfeed_step_padding_ratio",
            "Share of the newest step's computed positions that are padding.",
        )
        self.step_padded_padding = gauge(
            "rlfeed_step_padded_alternative_padding_ratio",
            "Padding share if every rollout were padded to the step's longest.",
        )
        self.step_fill = gauge(
            "rlfeed_step_fill_ratio",
            "Newest step's real tokens / (microbatches x token budget).",
        )
        self.step_microbatches = gauge(
            "rlfeed_step_microbatches", "Microbatches of the newest step, all ranks."
        )
        self.step_microbatches_per_rank = gauge(
            "rlfeed_step_microbatches_per_rank", "Microbatches each rank runs in the newest step."
        )
        self.step_largest = gauge(
            "rlfeed_step_largest_microbatch_positions",
            "Token positions of the newest step's largest microbatch.",
        )
        self.step_imbalance = gauge(
            "rlfeed_step_rank_imbalance",
            "Max rank tokens / mean rank tokens (1 = balanced; sched.balance.rank_imbalance, "
            "as rlfeed status and plan print it); positions when padded.",
        )
        self.step_lockstep = gauge(
            "rlfeed_step_lockstep_efficiency_ratio",
            "Share of rank-time spent working, counted in tokens: tokens / (ranks x sum of "
            "each lockstep slot's largest microbatch).",
        )
        self.step_compute_imbalance = gauge(
            "rlfeed_step_compute_rank_imbalance",
            "Max rank compute / mean rank compute (1 = balanced); compute = tokens + "
            "attention_weight x sum(L^2), the trained model's predicted FLOPs by default.",
        )
        self.step_compute_lockstep = gauge(
            "rlfeed_step_compute_lockstep_efficiency_ratio",
            "Share of rank-time spent working, counted in predicted compute: what trainer "
            "time follows, and what predicted GPU-seconds are divided by.",
        )
        self.step_token_budget = gauge(
            "rlfeed_step_token_budget", "Tokens each microbatch may hold ([batching] token_budget)."
        )
        self.steps_assembled = counter(
            "rlfeed_steps_assembled", "Steps assembled from complete groups."
        )
        self.rollouts_trained = counter(
            "rlfeed_rollouts_trained", "Rollouts placed in assembled steps."
        )
        self.policy_tokens = counter(
            "rlfeed_policy_tokens", "Policy tokens (action_mask 1) in assembled steps."
        )
        self.real_tokens = counter(
            "rlfeed_real_tokens", "Tokens of the rollouts in assembled steps."
        )
        self.computed_positions = counter(
            "rlfeed_computed_positions",
            "Token positions the packed microbatches of assembled steps compute.",
        )
        self.padded_positions = counter(
            "rlfeed_padded_alternative_positions",
            "Token positions the padded alternative would compute for assembled steps.",
        )
        self.microbatches = counter(
            "rlfeed_microbatches", "Microbatches in assembled steps, all ranks."
        )
        self.budget_tokens = counter(
            "rlfeed_microbatch_budget_tokens",
            "Microbatches x token budget in assembled steps, in tokens (fill denominator).",
        )
        # Curriculum.
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
            ("filter",),
        )
        for side in ("inside", "outside"):
            self.tasks.labels(filter=side)
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
        r.register(self.pass_rates)
        # Cost.
        phase = ("phase",)
        self.step_gpu_seconds = gauge(
            "rlfeed_step_predicted_gpu_seconds",
            "Predicted GPU-seconds of the newest step, by phase.",
            phase,
        )
        self.gpu_seconds = counter(
            "rlfeed_predicted_gpu_seconds",
            "Predicted GPU-seconds of all assembled steps, by phase.",
            phase,
        )
        for value in PHASES:
            self.step_gpu_seconds.labels(phase=value)
            self.gpu_seconds.labels(phase=value)
        self.padding_gpu_seconds = counter(
            "rlfeed_padding_gpu_seconds",
            "Predicted GPU-seconds the packed plans spend computing padding.",
        )
        self.lockstep_idle_gpu_seconds = counter(
            "rlfeed_lockstep_idle_gpu_seconds",
            "Of the train and logprob phases, predicted GPU-seconds ranks wait for a lockstep "
            "slot's slowest microbatch: (train + logprob) x (1 - compute lockstep efficiency).",
        )
        self.avoided_gpu_seconds = counter(
            "rlfeed_padding_avoided_gpu_seconds",
            "Predicted GPU-seconds the padded alternative would spend on padding beyond the plan.",
        )
        self.step_avoided_gpu_seconds = gauge(
            "rlfeed_step_padding_avoided_gpu_seconds",
            "Predicted GPU-seconds of padding the newest step's plan avoids against the padded "
            "alternative.",
        )
        # Trainers (rank is bounded by world_size).
        rank = ("rank",)
        self.trainer_reports = counter(
            "rlfeed_trainer_reports", "Trainer reports received, all ranks."
        )
        self.trainer_loss = gauge(
            "rlfeed_trainer_loss", "Loss of the rank's latest report (unitless).", rank
        )
        self.trainer_outliers = gauge(
            "rlfeed_trainer_ratio_outlier_ratio",
            "Share of policy tokens whose step-0 trainer/sampler ratio left the trust band.",
            rank,
        )
        self.trainer_tps = gauge(
            "rlfeed_trainer_tokens_per_second",
            "Token positions per second the rank reported for its latest step.",
            rank,
        )
        self.trainer_step_seconds = gauge(
            "rlfeed_trainer_step_seconds",
            "Wall-clock seconds of the rank's latest step, as it reported.",
            rank,
        )
        self.trainer_step = gauge(
            "rlfeed_trainer_step", "Step number of the rank's latest report.", rank
        )
        # Health.
        self.step_latency = Histogram(
            "rlfeed_step_latency_seconds",
            "Seconds from a step's last group completing to its last rank fetching it.",
            buckets=STEP_LATENCY_BUCKETS,
            registry=r,
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

    def observe_step(self, f: StepFigures, price: StepPrice) -> None:
        """Set the newest-step gauges and add the step to the counters."""
        r = f.record
        for gauge, value in (
            (self.step, r.step),
            (self.step_rollouts, r.num_rollouts),
            (self.step_policy_tokens, r.policy_token_count),
            (self.step_real_tokens, r.real_tokens),
            (self.step_computed, r.computed_positions),
            (self.step_padded, r.padded_positions),
            (self.step_padding, f.padding_ratio),
            (self.step_padded_padding, f.padded_alternative_padding_ratio),
            (self.step_fill, f.fill_ratio),
            (self.step_microbatches, f.microbatches),
            (self.step_microbatches_per_rank, r.microbatches_per_rank),
            (self.step_largest, r.largest_microbatch_positions),
            (self.step_imbalance, r.rank_imbalance),
            (self.step_lockstep, r.lockstep_efficiency),
            (self.step_compute_imbalance, r.compute_rank_imbalance),
            (self.step_compute_lockstep, r.compute_lockstep_efficiency),
            (self.step_token_budget, f.token_budget),
            (self.step_avoided_gpu_seconds, price.padding_avoided_gpu_seconds),
        ):
            gauge.set(value)
        groups, zero = f.groups_considered, f.zero_advantage_groups_considered
        self.step_zero_share.set(zero / groups if groups else 0.0)
        for counter, amount in (
            (self.steps_assembled, 1),
            (self.rollouts_trained, r.num_rollouts),
            (self.policy_tokens, r.policy_token_count),
            (self.real_tokens, r.real_tokens),
            (self.computed_positions, r.computed_positions),
            (self.padded_positions, r.padded_positions),
            (self.microbatches, f.microbatches),
            (self.budget_tokens, f.microbatches * f.token_budget),
            (self.groups, groups),
            (self.zero_groups, zero),
            (self.padding_gpu_seconds, price.padding_gpu_seconds),
            (self.lockstep_idle_gpu_seconds, price.lockstep_idle_gpu_seconds),
            (self.avoided_gpu_seconds, price.padding_avoided_gpu_seconds),
        ):
            counter.inc(amount)
        for phase, seconds in price.gpu_seconds.items():
            self.step_gpu_seconds.labels(phase=phase).set(seconds)
            self.gpu_seconds.labels(phase=phase).inc(seconds)
