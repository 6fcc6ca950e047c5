"""Prometheus metrics of the sidecar: what the chapter measures by hand, live.

`RlfeedMetrics` owns a private `prometheus_client.CollectorRegistry` (never the global one,
so two sidecars or a test can coexist in one process) and exposes update methods that take
plain values and records; it never imports gRPC or Ray and starts nothing. The HTTP endpoint
is `rlfeed.service.metrics_http.MetricsServer`. Names follow Prometheus conventions: the
`rlfeed_` prefix, base units (`_seconds`, `_bytes`, GPU time in `_gpu_seconds`), `_total`
counters, `_ratio` gauges in [0, 1]. No label ever carries a task, group or rollout id; the
only labels are small fixed sets (`reason`, `phase`, `filter`) and `rank` (< world_size).

Wiring (what the service calls; every call is cheap and thread-safe):

    metrics = RlfeedMetrics(MetricsConfig.from_sidecar_config(config))
    server = MetricsServer(metrics, host=..., port=config.server.metrics_port).start()
    # ingest, after each acknowledged batch / each rejected batch / each drop:
    metrics.on_ingest(accepted=a, accepted_tokens=t, duplicate=d, stale=s,
                      ack_seconds=dt, buffered_rollouts=b, buffered_bytes=bb)
    metrics.on_reject("too_long", rollouts=n, tokens=t)   # reason from REJECT_REASONS
    metrics.on_stale(rollouts=n, tokens=t)                 # groups dropped after acceptance
    # each assembled step (StepRecord is picklable: build it inside the Ray actor):
    metrics.on_step(StepRecord.from_plan(plan, step=s, token_budget=B, ready_time=t0),
                    layout=lambda: layout_from_plan(plan, lengths, token_budget=B, ...))
    metrics.on_served(step, rank)                          # every GetBatch that returns data
    metrics.on_task_sample(requested=n, returned=m, revisits=v, group_size=G)
    metrics.on_curriculum(tasks_inside=i, tasks_outside=o, pass_rates=state.estimate)
    metrics.on_trainer_report(step=s, rank=r, loss=l, ratio_outlier_share=x,
                              tokens_per_second=tps, step_seconds=w)
    server.stop()

Definitions where a number could mean several things:
- fill: real tokens / (world_size x microbatches_per_rank x token_budget): the share of the
  step's microbatch slots (no-op microbatches included) that holds real tokens.
- zero-advantage group share: zero-advantage groups / groups considered for the step,
  counting groups discarded by drop_zero_advantage while the step was filling.
- rollouts saved by the filter: (tasks requested - tasks returned) x group_size, summed over
  SampleTasks calls: what sampling every requested task would have spent, minus what the
  curriculum asked for. Revisits are among the tasks returned, so it can go negative; it is
  a gauge for that reason (Counters.rollouts_saved_by_filter in the proto is the same sum).
- predicted GPU-hours: `rlfeed.sched.throughput.step_cost_from_tokens` on the step's actual
  token counts with the configured model and GPU: phase "decode" prices the policy tokens
  generated for the step (including dropped zero-advantage groups when the record says so),
  "train" and "logprob" the positions the ranks compute. Padding avoided: the padding
  GPU-hours of the padded alternative minus those of the plan (training and log-prob passes
  over padded_positions - computed_positions positions). Stale rollouts are not priced.
- step latency: from the step's `ready_time` (its last group complete) to the first fetch
  by its last rank; trainer lag: newest assembled step - the slowest rank's newest fetched
  step (-1 before its first fetch).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeHistogramMetricFamily

if TYPE_CHECKING:
    from rlfeed.sched.assembly import StepPlan
    from rlfeed.service.layout_plot import StepLayout

# Why a batch was rejected; anything else is counted as "other" (bounded label values).
REJECT_REASONS: tuple[str, ...] = (
    "malformed",  # not an Arrow IPC stream, missing/ill-typed column, nulls
    "length_mismatch",  # per-rollout arrays of different lengths, empty sequence
    "too_long",  # sequence longer than the token budget
    "non_finite",  # NaN/inf reward or log-prob
    "token_out_of_range",  # token id outside [0, vocab_size)
    "unknown_task",  # task id not registered
    "bad_action_mask",  # action_mask[0] == 1 or a value other than 0/1
    "duplicate_in_batch",  # one rollout id twice in a batch
    "group_overflow",  # more than group_size rollouts in a group, or a group on two tasks
    "buffer_full",  # RESOURCE_EXHAUSTED: max_buffered_rollouts reached
    "other",
)
# Upper bounds (le) of the pass-rate histogram buckets; 0 and 1 separate the tasks a (0, 1)
# filter excludes.
PASS_RATE_BUCKETS: tuple[float, ...] = (
    0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.9999, 1.0,
)  # fmt: skip
ACK_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
PHASES = ("decode", "train", "logprob")
SECONDS_PER_HOUR = 3600.0


@dataclass(kw_only=True, frozen=True)
class CostAssumptions:
    """How steps are priced (arguments of `sched.throughput.step_cost_from_tokens`)."""

    model: str = "qwen3-8b"  # preset of sched.models.MODELS; default "qwen3-8b"
    gpu: str = "h200"  # preset of sched.models.GPUS; default "h200"
    mfu: float = 0.4  # model-FLOPs utilisation of training and log-prob passes; 0.4
    decode_batch: int = 64  # sequences one inference GPU decodes at once; default 64
    decode_context: int = 16_384  # context (tokens) while decoding, for KV reads; 16,384
    busy_fraction: float = 0.5  # share of wall time decode GPUs generate; default 0.5
    logprob_forward_passes: int = 2  # extra forward passes per trained position; default 2

    def __post_init__(self) -> None:
        from rlfeed.sched.models import GPUS, MODELS

        if self.model not in MODELS:
            raise ValueError(f"CostAssumptions.model: {self.model!r} not in {sorted(MODELS)}")
        if self.gpu not in GPUS:
            raise ValueError(f"CostAssumptions.gpu: {self.gpu!r} not in {sorted(GPUS)}")


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """What the exporter needs to know about the run."""

    cost: CostAssumptions = field(default_factory=CostAssumptions)  # step pricing
    world_size: int = 1  # trainer ranks; bounds the `rank` label; default 1
    zero_advantage_window_steps: int = 20  # trailing window of the zero-advantage share; 20
    max_tracked_steps: int = 4096  # steps remembered for served/lag bookkeeping; 4096

    def __post_init__(self) -> None:
        for name in ("world_size", "zero_advantage_window_steps", "max_tracked_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"MetricsConfig.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_sidecar_config(cls, config: Any) -> MetricsConfig:
        """From a `service.config.SidecarConfig`: [accounting] fields that CostAssumptions
        has (model, gpu, mfu, and the decode fields if that section grows them) and
        [batching] world_size."""
        names = {f for f in CostAssumptions.__dataclass_fields__}
        accounting = {
            name: value for name, value in vars(config.accounting).items() if name in names
        }
        return cls(cost=CostAssumptions(**accounting), world_size=config.batching.world_size)


@dataclass(kw_only=True, frozen=True)
class StepRecord:
    """Plain figures of one assembled step (picklable: it may cross a Ray boundary)."""

    step: int
    num_rollouts: int  # rollouts in the step, all ranks
    num_groups: int  # groups in the step
    zero_advantage_groups: int  # of those, groups whose rewards are all equal
    zero_advantage_groups_dropped: int = 0  # discarded by drop_zero_advantage while filling
    policy_tokens: int  # global policy-token count N
    real_tokens: int  # tokens of the step's sequences
    computed_positions: int  # positions the ranks compute
    padded_positions: int  # positions of the padded alternative (count x longest)
    microbatches_per_rank: int
    world_size: int
    token_budget: int
    largest_microbatch_positions: int
    rank_imbalance: float  # max rank cost / mean rank cost - 1
    lockstep_efficiency: float  # mean rank cost / max rank cost
    policy_version: int = 0  # newest policy version among the step's rollouts
    generated_policy_tokens: int | None = None  # decode-priced tokens; None = policy_tokens
    generated_tokens: int | None = None  # their rollouts' total tokens; None = real_tokens
    ready_time: float | None = None  # time.time() when the step's last group completed

    @classmethod
    def from_plan(cls, plan: StepPlan, *, step: int, token_budget: int, **extra: Any) -> StepRecord:
        """The record of a `sched.assembly.StepPlan`; `extra` sets the optional fields."""
        return cls(
            step=step,
            num_rollouts=int(plan.kept.size),
            num_groups=plan.num_groups,
            zero_advantage_groups=plan.zero_advantage_groups,
            policy_tokens=plan.policy_token_count,
            real_tokens=plan.real_tokens,
            computed_positions=plan.computed_positions,
            padded_positions=plan.padded_positions,
            microbatches_per_rank=plan.microbatches_per_rank,
            world_size=len(plan.ranks),
            token_budget=token_budget,
            largest_microbatch_positions=plan.largest_microbatch_positions,
            rank_imbalance=plan.rank_imbalance,
            lockstep_efficiency=plan.lockstep_efficiency,
            **extra,
        )

    @property
    def microbatches(self) -> int:
        return self.microbatches_per_rank * self.world_size

    @property
    def padding_ratio(self) -> float:
        return _share(self.computed_positions - self.real_tokens, self.computed_positions)

    @property
    def padded_alternative_padding_ratio(self) -> float:
        return _share(self.padded_positions - self.real_tokens, self.padded_positions)

    @property
    def fill_ratio(self) -> float:
        return _share(self.real_tokens, self.microbatches * self.token_budget)

    @property
    def groups_considered(self) -> int:
        return self.num_groups + self.zero_advantage_groups_dropped

    @property
    def zero_advantage_groups_considered(self) -> int:
        return self.zero_advantage_groups + self.zero_advantage_groups_dropped


def _share(part: float, whole: float) -> float:
    return float(part) / float(whole) if whole else 0.0


@dataclass(frozen=True)
class StepPrice:
    """Predicted GPU-seconds of one step by phase, and those of padding."""

    gpu_seconds: dict[str, float]  # phase -> GPU-seconds (decode, train, logprob)
    padding_gpu_seconds: float  # training + log-prob passes over the plan's padding
    padding_avoided_gpu_seconds: float  # same over padded_alternative - computed positions


def price_step(record: StepRecord, cost: CostAssumptions) -> StepPrice:
    """Price a step with the scheduling core's accounting (see the module docstring)."""
    from rlfeed.sched.models import GPUS, MODELS
    from rlfeed.sched.throughput import step_cost_from_tokens

    common = dict(
        decode_batch=cost.decode_batch,
        decode_context=cost.decode_context,
        busy_fraction=cost.busy_fraction,
        mfu=cost.mfu,
        logprob_forward_passes=cost.logprob_forward_passes,
    )
    arch, gpu = MODELS[cost.model], GPUS[cost.gpu]
    trained = step_cost_from_tokens(
        arch,
        gpu,
        policy_tokens=record.policy_tokens,
        total_tokens=record.real_tokens,
        computed_positions=record.computed_positions,
        **common,
    )
    generated_policy = record.generated_policy_tokens
    decode_hours = trained.decode_gpu_hours
    if generated_policy is not None and generated_policy != record.policy_tokens:
        generated_total = record.generated_tokens or max(record.real_tokens, generated_policy)
        decode_hours = step_cost_from_tokens(
            arch, gpu, policy_tokens=generated_policy, total_tokens=generated_total, **common
        ).decode_gpu_hours
    padded = step_cost_from_tokens(
        arch,
        gpu,
        policy_tokens=record.policy_tokens,
        total_tokens=record.real_tokens,
        computed_positions=max(record.padded_positions, record.computed_positions),
        **common,
    )
    hours = {
        "decode": decode_hours,
        "train": trained.train_gpu_hours,
        "logprob": trained.logprob_gpu_hours,
    }
    return StepPrice(
        gpu_seconds={phase: h * SECONDS_PER_HOUR for phase, h in hours.items()},
        padding_gpu_seconds=trained.padding_gpu_hours * SECONDS_PER_HOUR,
        padding_avoided_gpu_seconds=(padded.padding_gpu_hours - trained.padding_gpu_hours)
        * SECONDS_PER_HOUR,
    )


def pass_rate_bucket_counts(pass_rates: ArrayLike) -> np.ndarray:
    """int64 [len(PASS_RATE_BUCKETS)]: tasks whose estimate is <= each bucket bound."""
    rates = np.sort(np.asarray(pass_rates, dtype=np.float64).ravel())
    return np.searchsorted(rates, PASS_RATE_BUCKETS, side="right").astype(np.int64)


class _PassRateCollector:
    """The current distribution of pass-rate estimates over tasks, as a gauge histogram
    (it is a snapshot, not an accumulation of observations)."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(PASS_RATE_BUCKETS), dtype=np.int64)
        self.total = 0
        self.sum = 0.0

    def collect(self):
        family = GaugeHistogramMetricFamily(
            "rlfeed_curriculum_pass_rate",
            "Tasks by current pass-rate estimate (cumulative buckets over [0, 1]).",
            buckets=[(repr(b), int(c)) for b, c in zip(PASS_RATE_BUCKETS, self.counts, strict=True)]
            + [("+Inf", self.total)],
            gsum_value=self.sum,
        )
        yield family


class RlfeedMetrics:
    """All sidecar metrics on a private registry, plus the latest step's layout picture."""

    def __init__(self, config: MetricsConfig | None = None) -> None:
        self.config = config or MetricsConfig()
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._define_metrics()
        self._zero_window: deque[tuple[int, int]] = deque(
            maxlen=self.config.zero_advantage_window_steps
        )
        self._newest_step = -1
        self._last_fetched = [-1] * self.config.world_size
        self._ready_time: dict[int, float] = {}  # assembled step -> ready_time
        self._fetched: dict[int, set[int]] = {}  # step -> ranks that fetched it
        self._served: deque[int] = deque(maxlen=self.config.max_tracked_steps)
        self._tasks_requested = 0
        self._tasks_returned = 0
        self._saved_rollouts = 0
        self._rollouts_requested = 0
        self._layout_step: int | None = None
        self._layout_source: Any = None
        self._layout_png: tuple[int, bytes] | None = None
        self._render_lock = threading.Lock()

    # ---------------------------------------------------------------- definitions
    def _define_metrics(self) -> None:
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        cost = self.config.cost
        Info("rlfeed_accounting", "Model and GPU presets that price steps.", registry=r).info(
            {"model": cost.model, "gpu": cost.gpu, "mfu": repr(cost.mfu)}
        )
        # Ingest.
        self.ingest_batches = counter("rlfeed_ingest_batches", "Rollout batches acknowledged.")
        self.rollouts_accepted = counter("rlfeed_ingest_rollouts_accepted", "Rollouts buffered.")
        self.tokens_accepted = counter("rlfeed_ingest_tokens_accepted", "Tokens of those.")
        self.rollouts_duplicate = counter(
            "rlfeed_ingest_rollouts_duplicate", "Rollout ids resubmitted (idempotent, ignored)."
        )
        self.rollouts_rejected = counter(
            "rlfeed_ingest_rollouts_rejected", "Rollouts in rejected batches.", ("reason",)
        )
        self.tokens_rejected = counter(
            "rlfeed_ingest_tokens_rejected", "Tokens in rejected batches.", ("reason",)
        )
        self.batches_rejected = counter(
            "rlfeed_ingest_batches_rejected", "Rejected rollout batches.", ("reason",)
        )
        for reason in REJECT_REASONS:  # every series exists from the start, at 0
            for family in (self.rollouts_rejected, self.tokens_rejected, self.batches_rejected):
                family.labels(reason=reason)
        self.rollouts_stale = counter(
            "rlfeed_ingest_rollouts_stale", "Rollouts dropped as older than max_policy_lag."
        )
        self.tokens_stale = counter("rlfeed_ingest_tokens_stale", "Tokens of those.")
        self.ack_latency = Histogram(
            "rlfeed_ingest_ack_latency_seconds",
            "Time from receiving a rollout batch to its ack.",
            buckets=ACK_LATENCY_BUCKETS,
            registry=r,
        )
        self.buffered_rollouts = gauge("rlfeed_buffered_rollouts", "Accepted, not yet in a step.")
        self.buffered_bytes = gauge("rlfeed_buffered_bytes", "Token payload bytes buffered.")
        self.newest_policy_version = gauge(
            "rlfeed_newest_policy_version", "Newest policy version seen in a rollout."
        )
        # Batching: gauges of the newest step, counters over all steps.
        self.step = gauge("rlfeed_step", "Number of the newest assembled step.")
        self.step_rollouts = gauge("rlfeed_step_rollouts", "Rollouts in the newest step.")
        self.step_policy_tokens = gauge("rlfeed_step_policy_tokens", "Global policy tokens N.")
        self.step_real_tokens = gauge("rlfeed_step_real_tokens", "Real tokens of the step.")
        self.step_computed = gauge("rlfeed_step_computed_positions", "Positions computed.")
        self.step_padded = gauge(
            "rlfeed_step_padded_positions", "Positions of the padded alternative (count x max)."
        )
        self.step_padding = gauge("rlfeed_step_padding_ratio", "Padding share of the plan.")
        self.step_padded_padding = gauge(
            "rlfeed_step_padded_alternative_padding_ratio",
            "Padding share if every rollout were padded to the step's longest.",
        )
        self.step_fill = gauge(
            "rlfeed_step_fill_ratio", "Real tokens / (microbatches x token budget)."
        )
        self.step_microbatches = gauge("rlfeed_step_microbatches", "Microbatches, all ranks.")
        self.step_microbatches_per_rank = gauge(
            "rlfeed_step_microbatches_per_rank", "Microbatches each rank runs."
        )
        self.step_largest = gauge(
            "rlfeed_step_largest_microbatch_positions", "Positions of the largest microbatch."
        )
        self.step_imbalance = gauge(
            "rlfeed_step_rank_imbalance", "Max rank cost / mean rank cost - 1 (0 = balanced)."
        )
        self.step_lockstep = gauge(
            "rlfeed_step_lockstep_efficiency_ratio", "Mean rank cost / max rank cost."
        )
        self.step_token_budget = gauge("rlfeed_step_token_budget", "Token budget per microbatch.")
        self.steps_assembled = counter("rlfeed_steps_assembled", "Steps assembled.")
        self.rollouts_trained = counter("rlfeed_rollouts_trained", "Rollouts in steps.")
        self.policy_tokens = counter("rlfeed_policy_tokens", "Policy tokens in steps.")
        self.real_tokens = counter("rlfeed_real_tokens", "Real tokens in steps.")
        self.computed_positions = counter("rlfeed_computed_positions", "Positions computed.")
        self.padded_positions = counter(
            "rlfeed_padded_alternative_positions", "Positions the padded alternative computes."
        )
        self.microbatches = counter("rlfeed_microbatches", "Microbatches served, all ranks.")
        self.microbatch_slots = counter(
            "rlfeed_microbatch_budget_tokens", "Microbatches x token budget (fill denominator)."
        )
        # Curriculum.
        self.groups = counter("rlfeed_groups", "Groups considered for steps.")
        self.zero_groups = counter(
            "rlfeed_zero_advantage_groups", "Groups with all-equal rewards (no gradient)."
        )
        self.step_zero_share = gauge(
            "rlfeed_step_zero_advantage_groups_ratio", "Zero-advantage group share, newest step."
        )
        self.window_zero_share = gauge(
            "rlfeed_zero_advantage_groups_window_ratio",
            "Zero-advantage group share over the trailing window of steps.",
        )
        gauge("rlfeed_zero_advantage_window_steps", "Steps in that window.").set(
            self.config.zero_advantage_window_steps
        )
        self.tasks = gauge("rlfeed_curriculum_tasks", "Tasks by pass-rate filter.", ("filter",))
        for side in ("inside", "outside"):
            self.tasks.labels(filter=side)
        self.sample_requests = counter("rlfeed_curriculum_sample_requests", "SampleTasks calls.")
        self.tasks_requested = counter("rlfeed_curriculum_tasks_requested", "Sum of n asked.")
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
        self.rollouts_saved = gauge(
            "rlfeed_curriculum_rollouts_saved",
            "Requested minus sampled rollouts since start (negative when revisits cost more).",
        )
        self.rollouts_saved_share = gauge(
            "rlfeed_curriculum_rollouts_saved_ratio",
            "Rollouts saved / rollouts requested since start (clipped to [0, 1]).",
        )
        self._pass_rates = _PassRateCollector()
        r.register(self._pass_rates)
        # Cost.
        self.step_gpu_seconds = gauge(
            "rlfeed_step_predicted_gpu_seconds", "Predicted GPU-seconds, newest step.", ("phase",)
        )
        self.gpu_seconds = counter(
            "rlfeed_predicted_gpu_seconds", "Predicted GPU-seconds of all steps.", ("phase",)
        )
        for phase in PHASES:
            self.step_gpu_seconds.labels(phase=phase)
            self.gpu_seconds.labels(phase=phase)
        self.padding_gpu_seconds = counter(
            "rlfeed_padding_gpu_seconds", "Predicted GPU-seconds spent on padding."
        )
        self.avoided_gpu_seconds = counter(
            "rlfeed_padding_avoided_gpu_seconds",
            "Predicted GPU-seconds the padded alternative would spend on padding beyond the plan.",
        )
        self.step_avoided_gpu_seconds = gauge(
            "rlfeed_step_padding_avoided_gpu_seconds", "The same, newest step."
        )
        # Trainers (rank is bounded by world_size).
        self.trainer_reports = counter("rlfeed_trainer_reports", "Trainer reports received.")
        self.trainer_loss = gauge("rlfeed_trainer_loss", "Latest reported loss.", ("rank",))
        self.trainer_outliers = gauge(
            "rlfeed_trainer_ratio_outlier_ratio",
            "Share of policy tokens whose step-0 trainer/sampler ratio left the trust band.",
            ("rank",),
        )
        self.trainer_tps = gauge(
            "rlfeed_trainer_tokens_per_second", "Reported positions per second.", ("rank",)
        )
        self.trainer_step_seconds = gauge(
            "rlfeed_trainer_step_seconds", "Reported wall time of the rank's step.", ("rank",)
        )
        self.trainer_step = gauge("rlfeed_trainer_step", "Step of the latest report.", ("rank",))
        # Health.
        self.step_latency = Histogram(
            "rlfeed_step_latency_seconds",
            "From a step's last group completing to its last rank fetching it.",
            buckets=STEP_LATENCY_BUCKETS,
            registry=r,
        )
        self.steps_served = counter("rlfeed_steps_served", "Steps fetched by every rank.")
        self.batch_fetches = counter("rlfeed_batch_fetches", "First fetches of (step, rank).")
        self.batch_refetches = counter(
            "rlfeed_batch_refetches", "Repeated fetches of a (step, rank) (trainer restarts)."
        )
        self.trainer_lag = gauge(
            "rlfeed_trainer_lag_steps", "Newest assembled step - slowest rank's fetched step."
        )
        self.steps_waiting = gauge(
            "rlfeed_steps_waiting", "Assembled steps not yet fetched by every rank."
        )

    # ---------------------------------------------------------------- ingest
    def on_ingest(
        self,
        *,
        accepted: int,
        accepted_tokens: int,
        duplicate: int = 0,
        stale: int = 0,
        stale_tokens: int = 0,
        ack_seconds: float | None = None,
        buffered_rollouts: int | None = None,
        buffered_bytes: int | None = None,
        newest_policy_version: int | None = None,
    ) -> None:
        """One acknowledged batch (the numbers of its SubmitAck)."""
        self.ingest_batches.inc()
        self.rollouts_accepted.inc(accepted)
        self.tokens_accepted.inc(accepted_tokens)
        self.rollouts_duplicate.inc(duplicate)
        self.on_stale(rollouts=stale, tokens=stale_tokens)
        if ack_seconds is not None:
            self.ack_latency.observe(ack_seconds)
        self.on_buffer(rollouts=buffered_rollouts, bytes_=buffered_bytes)
        if newest_policy_version is not None:
            self.newest_policy_version.set(newest_policy_version)

    def on_reject(self, reason: str, rollouts: int, tokens: int = 0) -> None:
        """One rejected batch; `reason` outside REJECT_REASONS counts as "other"."""
        reason = reason if reason in REJECT_REASONS else "other"
        self.batches_rejected.labels(reason=reason).inc()
        self.rollouts_rejected.labels(reason=reason).inc(rollouts)
        self.tokens_rejected.labels(reason=reason).inc(tokens)

    def on_stale(self, *, rollouts: int, tokens: int = 0) -> None:
        """Rollouts dropped for max_policy_lag (at ingest or when their group went stale)."""
        self.rollouts_stale.inc(rollouts)
        self.tokens_stale.inc(tokens)

    def on_buffer(self, *, rollouts: int | None = None, bytes_: int | None = None) -> None:
        """The buffer's size now (after ingest, after a step took rollouts out)."""
        if rollouts is not None:
            self.buffered_rollouts.set(rollouts)
        if bytes_ is not None:
            self.buffered_bytes.set(bytes_)

    # ---------------------------------------------------------------- steps
    def on_step(
        self,
        record: StepRecord,
        layout: StepLayout | Callable[[], StepLayout | None] | None = None,
    ) -> None:
        """One assembled step. `layout` (a StepLayout or a zero-argument callable returning
        one) is what /layout.png draws; a callable is only called when the picture is asked
        for, so a step nobody looks at costs nothing."""
        price = price_step(record, self.config.cost)
        self.step.set(record.step)
        self.step_rollouts.set(record.num_rollouts)
        self.step_policy_tokens.set(record.policy_tokens)
        self.step_real_tokens.set(record.real_tokens)
        self.step_computed.set(record.computed_positions)
        self.step_padded.set(record.padded_positions)
        self.step_padding.set(record.padding_ratio)
        self.step_padded_padding.set(record.padded_alternative_padding_ratio)
        self.step_fill.set(record.fill_ratio)
        self.step_microbatches.set(record.microbatches)
        self.step_microbatches_per_rank.set(record.microbatches_per_rank)
        self.step_largest.set(record.largest_microbatch_positions)
        self.step_imbalance.set(record.rank_imbalance)
        self.step_lockstep.set(record.lockstep_efficiency)
        self.step_token_budget.set(record.token_budget)
        self.steps_assembled.inc()
        self.rollouts_trained.inc(record.num_rollouts)
        self.policy_tokens.inc(record.policy_tokens)
        self.real_tokens.inc(record.real_tokens)
        self.computed_positions.inc(record.computed_positions)
        self.padded_positions.inc(record.padded_positions)
        self.microbatches.inc(record.microbatches)
        self.microbatch_slots.inc(record.microbatches * record.token_budget)
        groups, zero = record.groups_considered, record.zero_advantage_groups_considered
        self.groups.inc(groups)
        self.zero_groups.inc(zero)
        self.step_zero_share.set(_share(zero, groups))
        for phase, seconds in price.gpu_seconds.items():
            self.step_gpu_seconds.labels(phase=phase).set(seconds)
            self.gpu_seconds.labels(phase=phase).inc(seconds)
        self.padding_gpu_seconds.inc(price.padding_gpu_seconds)
        self.avoided_gpu_seconds.inc(price.padding_avoided_gpu_seconds)
        self.step_avoided_gpu_seconds.set(price.padding_avoided_gpu_seconds)
        with self._lock:
            self._zero_window.append((groups, zero))
            window_groups = sum(g for g, _ in self._zero_window)
            self.window_zero_share.set(_share(sum(z for _, z in self._zero_window), window_groups))
            self._newest_step = max(self._newest_step, record.step)
            if record.step not in self._served:
                self._fetched.setdefault(record.step, set())
                if record.ready_time is not None:
                    self._ready_time[record.step] = record.ready_time
            self._forget_old_steps()
            self._update_progress()
            if layout is not None:
                self._layout_step, self._layout_source = record.step, layout
                self._layout_png = None

    def on_served(
        self, step: int, rank: int, latency_seconds: float | None = None, now: float | None = None
    ) -> None:
        """Rank `rank` fetched step `step`. The step counts as served when its last rank
        fetches it the first time; its latency is `latency_seconds`, or else measured from
        the record's ready_time to `now` (time.time())."""
        self._check_rank(rank)
        with self._lock:
            if step in self._served or rank in self._fetched.get(step, ()):
                self.batch_refetches.inc()
                return
            self.batch_fetches.inc()
            ranks = self._fetched.setdefault(step, set())
            ranks.add(rank)
            self._last_fetched[rank] = max(self._last_fetched[rank], step)
            if len(ranks) == self.config.world_size:
                del self._fetched[step]
                self._served.append(step)
                self.steps_served.inc()
                ready = self._ready_time.pop(step, None)
                if latency_seconds is None and ready is not None:
                    latency_seconds = (time.time() if now is None else now) - ready
                if latency_seconds is not None:
                    self.step_latency.observe(max(latency_seconds, 0.0))
            self._forget_old_steps()
            self._update_progress()

    def _forget_old_steps(self) -> None:
        limit = self.config.max_tracked_steps
        for table in (self._fetched, self._ready_time):
            while len(table) > limit:
                del table[min(table)]

    def _update_progress(self) -> None:
        if self._newest_step >= 0:
            self.trainer_lag.set(self._newest_step - min(self._last_fetched))
        self.steps_waiting.set(sum(1 for s in self._fetched if s <= self._newest_step))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.config.world_size})")

    # ---------------------------------------------------------------- curriculum
    def on_task_sample(
        self, *, requested: int, returned: int, revisits: int, group_size: int
    ) -> None:
        """One SampleTasks call: `requested` tasks asked (n resolved), `returned` given back,
        `revisits` of them from outside the filter."""
        if not 0 <= revisits <= returned:
            raise ValueError(f"revisits ({revisits}) must be in [0, returned={returned}]")
        self.sample_requests.inc()
        self.tasks_requested.inc(requested)
        self.tasks_sampled.inc(returned)
        self.revisits.inc(revisits)
        self.rollouts_requested.inc(requested * group_size)
        self.rollouts_sampled.inc(returned * group_size)
        with self._lock:
            self._saved_rollouts += (requested - returned) * group_size
            self._rollouts_requested += requested * group_size
            self.rollouts_saved.set(self._saved_rollouts)
            share = _share(max(self._saved_rollouts, 0), self._rollouts_requested)
            self.rollouts_saved_share.set(min(share, 1.0))

    def on_curriculum(
        self, *, tasks_inside: int, tasks_outside: int, pass_rates: ArrayLike | None = None
    ) -> None:
        """The curriculum's state now: filter sizes and (optionally) every task's estimate
        [T], of which only bucket counts are kept."""
        self.tasks.labels(filter="inside").set(tasks_inside)
        self.tasks.labels(filter="outside").set(tasks_outside)
        if pass_rates is not None:
            rates = np.asarray(pass_rates, dtype=np.float64).ravel()
            counts = pass_rate_bucket_counts(rates)
            with self._lock:
                self._pass_rates.counts = counts
                self._pass_rates.total = int(rates.size)
                self._pass_rates.sum = float(rates.sum())

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
        """What rank `rank` measured for step `step` (a TrainerReport)."""
        self._check_rank(rank)
        label = str(rank)
        self.trainer_reports.inc()
        self.trainer_loss.labels(rank=label).set(loss)
        self.trainer_outliers.labels(rank=label).set(ratio_outlier_share)
        self.trainer_tps.labels(rank=label).set(tokens_per_second)
        self.trainer_step.labels(rank=label).set(step)
        if step_seconds is not None:
            self.trainer_step_seconds.labels(rank=label).set(step_seconds)

    # ---------------------------------------------------------------- output
    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def latest_layout_png(self) -> tuple[int, bytes] | None:
        """(step, PNG) of the newest step that came with a layout, rendered on first request
        and cached; None when there is none. Raises ImportError without matplotlib."""
        with self._lock:
            step, source, cached = self._layout_step, self._layout_source, self._layout_png
        if source is None:
            return None
        if cached is not None and cached[0] == step:
            return cached
        from rlfeed.service.layout_plot import StepLayout, render_layout_png

        with self._render_lock:  # one render at a time; matplotlib is not free
            layout = source if isinstance(source, StepLayout) else source()
            if layout is None:
                return None
            png = (step, render_layout_png(layout))
        with self._lock:
            if self._layout_step == step:
                self._layout_png = png
        return png
