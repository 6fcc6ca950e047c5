"""The sections whose owner is `rlfeed.sched` (which imports nothing from the service):
`[ray]`, `[batching]`, `[rollouts]`, `[advantages]`, `[curriculum]`, `[accounting]`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from rlfeed.sched.models import GPUS, MODELS
from rlfeed.sched.rounds import StepGroups
from rlfeed.sched.throughput import EpisodeShape
from rlfeed.service.config.fields import documented, require

FROM_MODEL = -1.0  # [batching] attention_weight: derive it from [accounting] model

# The enum-like fields' values: sched/'s own Literals (budgets.CostModel, packing.PackingMethod,
# advantages.AdvantageMode, curriculum.Estimator and Sampling), spelled again here because
# those modules import numpy.
CostModel = Literal["packed", "padded"]
PackingMethod = Literal["ffd", "bfd"]
AdvantageMode = Literal["mean", "mean_std", "constant"]
Estimator = Literal["last", "ema", "beta"]
Sampling = Literal["filter", "soft"]

_require = require


@dataclass(kw_only=True, frozen=True)
class RayConfig:
    """Where the scheduler actor lives."""

    namespace: str = documented(
        "rlfeed", "Ray namespace of the sidecar's named actors (scheduler, front-ends, lease)"
    )
    actor_name: str = documented(
        "rlfeed-scheduler",
        "name of the scheduler actor in that namespace; the front-end actors and the driver "
        "lease are named after it (NAME-frontend-i, NAME-driver)",
    )
    num_cpus: int = documented(2, "CPUs of an embedded local Ray (ignored when joining a cluster)")

    def __post_init__(self) -> None:
        _require(self.num_cpus >= 1, "ray", "num_cpus", f"must be >= 1, got {self.num_cpus}")
        _require(bool(self.actor_name), "ray", "actor_name", "must not be empty")


@dataclass(kw_only=True, frozen=True)
class BatchingConfig:
    """How a step is cut into microbatches and ranks (maps onto sched.assembly.StepConfig)."""

    token_budget: int = documented(
        65536, "tokens per microbatch (packed: sum of lengths; padded: count x longest)"
    )
    world_size: int = documented(
        1, "data-parallel trainer ranks; each gets the same microbatch count"
    )
    cost_model: CostModel = documented(
        "packed", "'packed' (varlen rows) or 'padded' (rows padded to longest)"
    )
    packing_method: PackingMethod = documented(
        "ffd", "bin packing: 'ffd' (first-fit) or 'bfd' (best-fit decreasing)"
    )
    attention_weight: float = documented(
        FROM_MODEL,
        "rank-balancing cost = tokens + attention_weight * sum(L^2), the predicted compute that "
        "ranks and lockstep slots are evened out on (microbatches still obey token_budget); "
        f"{FROM_MODEL} = from [accounting] model's FLOPs (2N per token plus causal attention), "
        "printed next to it at start-up; 0 = balance tokens only",
    )
    retained_steps: int = documented(
        4,
        "steps kept for re-fetch after every rank acknowledged them (AckSteps; BatchLoader "
        "acknowledges a step when asked for the next one): a trainer resuming from a "
        "checkpoint up to this many steps back is served its steps; set it to at least the "
        "checkpoint interval, count",
    )

    def __post_init__(self) -> None:
        _require(self.token_budget >= 1, "batching", "token_budget", "must be >= 1")
        _require(self.world_size >= 1, "batching", "world_size", "must be >= 1")
        _require(self.cost_model in get_args(CostModel), "batching", "cost_model", "packed|padded")
        _require(
            self.packing_method in get_args(PackingMethod), "batching", "packing_method", "ffd|bfd"
        )
        _require(
            self.attention_weight >= 0 or self.attention_weight == FROM_MODEL,
            "batching",
            "attention_weight",
            f"must be >= 0, or {FROM_MODEL} for the model's own",
        )
        _require(self.retained_steps >= 1, "batching", "retained_steps", "must be >= 1")


@dataclass(kw_only=True, frozen=True)
class RolloutsConfig:
    """What makes a step and which rollouts are accepted."""

    prompts_per_step: int = documented(8, "complete groups (tasks) per training step")
    step_groups: StepGroups = documented(
        "fixed",
        "how many complete groups a step takes: 'fixed' = prompts_per_step; 'sampled' = as "
        "many as the curriculum handed out (filtered runs train on fewer groups, as in the "
        "chapter's 14.5): each SampleTasks call that returns k > 0 tasks opens a round of k "
        "groups, and step i takes round i's k complete groups in completion order, from "
        "any producer (not necessarily round i's tasks); groups completing with no round "
        "waiting for them go prompts_per_step to a step. A group dropped before a step "
        "(stale, expired, zero-advantage) is deducted from the oldest round still waiting, "
        "so no step waits for it. A round whose producer dies unfinished keeps waiting and "
        "is filled by later rounds' groups (the README's 'Step size')",
    )
    group_size: int = documented(8, "rollouts per group; a group is complete when all have arrived")
    max_policy_lag: int = documented(
        4,
        "rollouts more than this many policy versions behind the newest known are dropped as "
        "stale; the newest known is the higher of the newest version in a rollout and the "
        "version the trainer published (BatchLoader.report(policy_version=...))",
    )
    max_version_jump: int = documented(
        16,
        "a rollout whose policy_version is more than this many versions ahead of the newest "
        "known so far (in a rollout, or published by the trainer) is rejected "
        "(INVALID_ARGUMENT), so one bogus version cannot make every honest rollout stale; "
        "before any, the baseline is initial_policy_version, or, if that is -1, the first "
        "accepted rollout's version",
    )
    initial_policy_version: int = documented(
        -1,
        "the policy version the run starts from (e.g. the checkpoint's, when resuming): the "
        "newest version seen starts here, so even the first rollouts are held to "
        "max_version_jump and max_policy_lag; -1 = take the first accepted rollout's version "
        "(then a bogus version on the very first rollout becomes the baseline)",
    )
    vocab_size: int = documented(
        0,
        "token ids must lie in [0, vocab_size): set it to the tokenizer's vocabulary size. "
        "0 = unchecked (ids only >= 0; an id past the vocabulary reaches the trainer's "
        "embedding lookup): rlfeed then warns at start-up and exports "
        "rlfeed_rollouts_vocab_size 0",
    )
    dedup_window_groups: int = documented(
        100_000,
        "closed groups (trained, stale or dropped) whose rollout ids are remembered so a "
        "resent rollout is answered as a duplicate, oldest forgotten first; a resend of a "
        "forgotten group is taken as new data (opens the group again). Buffered groups are "
        "always remembered. Memory: about 130 bytes per remembered 20-character rollout id "
        "(the default with group_size 8: about 100 MB)",
    )
    max_buffered_rollouts: int = documented(
        200_000,
        "bound on accepted rollouts not yet fetched by every rank: while an assembled step "
        "waits for ranks, a batch opening a new group beyond it is refused "
        "(RESOURCE_EXHAUSTED) until they fetch; rollouts joining a group already buffered are "
        "always taken, and with no step waiting so are new groups (partial groups may then "
        "exceed it), so a refusal never deadlocks. Memory is bounded by max_buffered_bytes",
    )
    max_buffered_bytes: int = documented(
        4 * 2**30,
        "bound on the memory held for rollouts, bytes: the token columns (9 bytes a token) of "
        "every ingest batch that a buffered rollout, partial groups included, still reads, "
        "plus the responses of the steps not yet fetched by every rank (in a front-end or "
        "the object store). A batch that would pass it is refused (RESOURCE_EXHAUSTED, with "
        "a retry hint) while ranks fetching can make room; batches opening new groups stop "
        "at 3/4 of it then, leaving the rest to rollouts completing buffered groups. When "
        "nothing can come out of the buffer without more rollouts (no step waits for a rank, "
        "too few complete groups for one), the oldest buffered groups, open ones first, are "
        "expired (dropped, counted rollouts_expired; their late rollouts answered as stale) "
        "to make room, so it cannot deadlock. Taking a batch never passes it; storing the "
        "steps the batch completes may, by their responses, until ranks fetch. Must be >= "
        "[server] max_message_bytes. The default suits a 16 GiB machine: on top come the "
        "idle processes (about 0.9 GiB), [server] retained_free_mib, the batches in flight "
        "and retained_steps fetched steps; and 4 GiB holds about 390 steps of 64 8k-token "
        "rollouts (48 of 64k tokens; responses take 21 bytes a token), far more than "
        "max_policy_lag lets trainers use",
    )

    def __post_init__(self) -> None:
        _require(self.prompts_per_step >= 1, "rollouts", "prompts_per_step", "must be >= 1")
        _require(
            self.step_groups in get_args(StepGroups),
            "rollouts",
            "step_groups",
            f"one of {get_args(StepGroups)}, got {self.step_groups!r}",
        )
        _require(self.group_size >= 1, "rollouts", "group_size", "must be >= 1")
        _require(self.max_policy_lag >= 0, "rollouts", "max_policy_lag", "must be >= 0")
        _require(self.max_version_jump >= 1, "rollouts", "max_version_jump", "must be >= 1")
        _require(
            self.initial_policy_version >= -1,
            "rollouts",
            "initial_policy_version",
            "must be >= 0, or -1 for the first rollout's version",
        )
        _require(self.vocab_size >= 0, "rollouts", "vocab_size", "must be >= 0")
        _require(self.dedup_window_groups >= 1, "rollouts", "dedup_window_groups", "must be >= 1")
        _require(self.max_buffered_bytes >= 1 << 20, "rollouts", "max_buffered_bytes", ">= 1 MiB")
        _require(
            self.max_buffered_rollouts >= self.prompts_per_step * self.group_size,
            "rollouts",
            "max_buffered_rollouts",
            "must hold at least one step (prompts_per_step * group_size)",
        )


@dataclass(kw_only=True, frozen=True)
class AdvantagesConfig:
    """Group-relative advantages."""

    mode: AdvantageMode = documented(
        "mean_std", "'mean', 'mean_std' (GRPO) or 'constant' (Dr. GRPO)"
    )
    scale: float = documented(1.0, "divisor of reward - group mean in 'constant' mode")
    drop_zero_advantage: bool = documented(
        False,
        "discard all-equal-reward groups as they complete, so steps fill with informative "
        "groups (dynamic sampling); counted either way",
    )

    def __post_init__(self) -> None:
        modes = get_args(AdvantageMode)
        _require(self.mode in modes, "advantages", "mode", f"one of {modes}, got {self.mode!r}")
        _require(self.scale > 0, "advantages", "scale", "must be > 0")


@dataclass(kw_only=True, frozen=True)
class CurriculumSection:
    """Which tasks to sample (maps onto sched.curriculum.CurriculumConfig)."""

    # sched.curriculum.CurriculumConfig checks estimator and sampling: its message
    # ("estimator must be one of ...") is the one users see.
    estimator: Estimator = documented(
        "ema",
        "pass-rate estimate: 'last' group mean, 'ema' or 'beta' posterior",
        checked_by="sched.curriculum.CurriculumConfig",
    )
    low: float = documented(0.0, "sample a task while low < estimate (0 drops all-fail tasks)")
    high: float = documented(1.0, "sample a task while estimate < high (1 drops all-pass tasks)")
    ema_decay: float = documented(0.5, "weight of the newest visit with estimator 'ema', in (0, 1]")
    prior_alpha: float = documented(1.0, "Beta prior successes (estimator 'beta'), > 0")
    prior_beta: float = documented(1.0, "Beta prior failures (estimator 'beta'), > 0")
    beta_forgetting: float = documented(1.0, "per-visit discount of old Beta evidence, in (0, 1]")
    revisits: int = documented(
        1, "tasks from outside the filter added to each sample ('filter'), count"
    )
    sampling: Sampling = documented(
        "filter",
        "'filter' (hard pass-rate filter) or 'soft' (p(1-p) + floor)",
        checked_by="sched.curriculum.CurriculumConfig",
    )
    soft_floor: float = documented(
        0.01, "added to p(1-p) in 'soft' sampling so no task is impossible"
    )
    seed: int = documented(0, "seed of the task sampler (sampling is deterministic given it)")

    def __post_init__(self) -> None:
        try:
            self.curriculum_config()
        except ValueError as exc:
            raise ValueError(f"[curriculum] {exc}") from exc

    def curriculum_config(self):
        """The sched.curriculum.CurriculumConfig of this section (all fields but seed)."""
        from rlfeed.sched.curriculum import CurriculumConfig

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.pop("seed")
        return CurriculumConfig(**values)


@dataclass(kw_only=True, frozen=True)
class AccountingConfig:
    """Presets used to price steps in GPU-hours (rlfeed.sched.models).

    The defaults of the pricing assumptions are `sched.throughput.EpisodeShape`'s, the
    chapter's Section 14.6 example; the metrics and the demo's summary price with this."""

    model: str = documented("qwen3-8b", "model preset name (sched.models.MODELS)")
    gpu: str = documented("h200", "GPU preset name (sched.models.GPUS)")
    mfu: float = documented(
        EpisodeShape.mfu, "training model-FLOPs utilization assumed for pricing, 0-1"
    )
    decode_batch: int = documented(
        EpisodeShape.decode_batch, "sequences one inference GPU decodes at once, for decode pricing"
    )
    decode_context: int = documented(
        EpisodeShape.decode_context,
        "context while decoding, tokens (KV-cache reads per decoded token)",
    )
    busy_fraction: float = documented(
        EpisodeShape.busy_fraction,
        "share of wall time the inference GPUs generate, in (0, 1]; divides decode GPU-hours",
    )
    logprob_forward_passes: int = documented(
        EpisodeShape.logprob_forward_passes,
        "extra forward passes per trained position (reference and old-policy log-probs)",
    )

    def __post_init__(self) -> None:
        _require(0 < self.mfu <= 1, "accounting", "mfu", f"must be in (0, 1], got {self.mfu}")
        _require(self.decode_batch >= 1, "accounting", "decode_batch", "must be >= 1")
        _require(self.decode_context >= 0, "accounting", "decode_context", "must be >= 0")
        _require(
            0 < self.busy_fraction <= 1,
            "accounting",
            "busy_fraction",
            f"must be in (0, 1], got {self.busy_fraction}",
        )
        _require(
            self.logprob_forward_passes >= 0, "accounting", "logprob_forward_passes", "must be >= 0"
        )
        _require(self.model in MODELS, "accounting", "model", f"one of {sorted(MODELS)}")
        _require(self.gpu in GPUS, "accounting", "gpu", f"one of {sorted(GPUS)}")
