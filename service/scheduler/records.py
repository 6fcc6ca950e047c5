"""The values that cross the scheduler actor's boundary: small, plain, picklable records.

`BatchMeta` is the per-rollout metadata of one ingest call and the handles name where bulk
bytes live; `IngestReply`, `Fetch`, `Refused`, `SampleResult` and `StatusSnapshot` are
answers; `StepWork` is a planned step for a front-end to materialize; `StepRecord` and
`Counters` are the statistics the metrics publish. numpy only: no Ray, gRPC or Arrow.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
from rlfeed.sched.assembly import StepPlan
from rlfeed.service.errors import RejectReason


class BatchHandle(NamedTuple):
    """An ingest batch's columns in the memory of the front-end that decoded it."""

    frontend_id: str
    key: int


class HeldBy(NamedTuple):
    """A step's response bytes in the memory of the front-end that stored them."""

    frontend_id: str


class StoredObject(NamedTuple):
    """Bytes in Ray's object store. The reference stays wrapped: Ray resolves only
    top-level ObjectRef arguments, and the actor must keep the reference, not the bytes."""

    ref: Any  # ray.ObjectRef


class JournalRef(NamedTuple):
    """Bytes in a front-end's journal (`[journal] dir`): record `position` of the journal
    in `slot`'s folder. What the scheduler's journal names instead of a memory handle, and
    what recovery hands the front-end of that slot to load again."""

    slot: str
    position: int


class Rederive(NamedTuple):
    """A stored step's response for one rank that no journal holds: the front-end of
    `slot` builds it again from the step's journaled ingest batches (the scheduler keeps
    how, `recipes.StepRecipe`) and checks it against `crc32c` and `size`, what the bytes
    first served had. What the scheduler's journal names instead of the bytes."""

    slot: str
    crc32c: int
    size: int


class Refused(NamedTuple):
    """An input the scheduler refused (INVALID_ARGUMENT); the message names what."""

    message: str


@dataclass(frozen=True)
class BatchMeta:
    """Per-rollout metadata of one validated batch, n rows (the small part of a batch)."""

    rollout_ids: list[str]
    task_ids: list[str]
    group_ids: list[str]
    policy_versions: np.ndarray  # int64 [n]
    rewards: np.ndarray  # float64 [n]
    lengths: np.ndarray  # int64 [n] tokens
    policy_tokens: np.ndarray  # int64 [n] action-mask tokens


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicate: int
    stale: int
    newest_policy_version: int
    buffered_rollouts: int
    steps_ready: int  # steps `assemble_ready_steps` would assemble now
    accepted_tokens: int = 0  # tokens of the accepted rollouts
    # Rollouts of earlier batches dropped as stale by this call (the newest policy version
    # moved on) or by a trainer's published version since the previous call (then dropped
    # already; counted here for the metrics); `stale` counts this batch's own stale rollouts.
    stale_buffered: int = 0
    stale_tokens: int = 0  # tokens of all rollouts this call dropped as stale (both kinds)
    # Rollouts of earlier batches dropped by this call with their open group, the oldest,
    # to keep memory under max_buffered_bytes (`AdmissionControl._admit_bytes`).
    expired: int = 0


@dataclass(frozen=True)
class StoreStepNote:
    """A front-end stored a planned step's responses (`Scheduler.store_step`), sent to
    the actor with its next call instead of as a call of its own."""

    step: int
    handles: list[HeldBy | StoredObject]  # per rank
    response_bytes: int
    # Per rank: where the front-end journaled the response (empty: not journaled).
    positions: list[int] = field(default_factory=list)
    # Per rank: (CRC32C, size) of a response the journal does not hold (the step's work
    # was `derivable`): a restart builds it again and checks it against these.
    digests: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class FetchNote:
    """A rank's first fetch of a step, answered by the front-end from its memory
    (`Scheduler.fetch_batch`); sent like StoreStepNote, after the step's note."""

    step: int
    rank: int


@dataclass(frozen=True)
class AckNote:
    """A rank's acknowledgement (`Scheduler.ack_steps`) that its front-end, the sidecar's
    only one, answered itself (`frontend/acks.py`); sent like FetchNote, after the fetches
    of the rank that came before it."""

    rank: int
    through_step: int


@dataclass(frozen=True)
class Releases:
    """What one front-end may free now: its ingest batches (by key) that nothing reads any
    more (no buffered rollout, no step still to be stored), and the steps no longer
    servable (whichever front-end holds their responses drops them)."""

    payload_keys: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepWork:
    """Everything needed to materialize one planned step, away from the scheduler."""

    step: int
    plan: StepPlan
    rows: list[tuple[int, int]]  # per step rollout: (batch key, row in that batch)
    rollout_ids: list[str]  # per step rollout
    policy_versions: np.ndarray  # int64, per step rollout
    payloads: dict[int, Any]  # batch key -> payload handle of its TokenColumns
    record: StepRecord | None = None  # response_bytes still 0 (set by store_step)
    # With a journal: the scheduler keeps what builds this step again from its journaled
    # ingest batches, so the front-end journals a digest of each response, not its bytes.
    derivable: bool = False


@dataclass(frozen=True)
class SlotClaim:
    """What a front-end serving a journal slot must load from it after a recovery (see
    `Scheduler.claim_journaled`), and the planned steps it must materialize again."""

    batches: list[int] = field(default_factory=list)  # journal positions
    steps: dict[int, list[int]] = field(default_factory=dict)  # step -> position per rank
    work: list[StepWork] = field(default_factory=list)
    # Stored steps to build again from journaled batches (payload handles: JournalRefs,
    # possibly of other slots), with the (CRC32C, size) each rank's bytes must have.
    derive: list[tuple[StepWork, list[tuple[int, int]]]] = field(default_factory=list)


class IngestKind(str, Enum):
    OK = "ok"
    INVALID = "invalid"  # INVALID_ARGUMENT
    BACKPRESSURE = "backpressure"  # RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class IngestReply:
    """The actor's answer to one batch of an ingest call: the batch's outcome, the work of
    every step it made ready (planned in the same call) and, on the call's last batch, what
    the calling front-end may free."""

    kind: IngestKind
    result: IngestResult | None  # for OK
    message: str = ""  # for INVALID / BACKPRESSURE
    reason: RejectReason | None = None  # for INVALID / BACKPRESSURE
    work: list[StepWork] = field(default_factory=list)  # in step order
    releases: Releases = field(default_factory=Releases)


@dataclass(frozen=True)
class FetchResult:
    ready: bool  # the step is assembled and still held
    released: bool = False  # the step was assembled but is no longer held
    response: Any = None  # what store_step kept for the rank: response bytes or a handle


class FetchKind(str, Enum):
    READY = "ready"  # value: the rank's handle (HeldBy | StoredObject)
    WAITING = "waiting"  # value: the next step to be assembled
    RELEASED = "released"  # value: the next step to be assembled
    INVALID = "invalid"  # value: the message (a rank outside the world, a negative step)


class Fetch(NamedTuple):
    """The actor's answer to a GetBatch it was asked about."""

    kind: FetchKind
    value: Any


@dataclass(frozen=True)
class StepRecord:
    """Statistics of one assembled step (the metrics exporter publishes these)."""

    step: int
    num_rollouts: int
    num_groups: int
    zero_advantage_groups: int
    zero_advantage_groups_dropped: int
    policy_token_count: int
    real_tokens: int
    computed_positions: int
    padded_positions: int
    largest_microbatch_positions: int
    rank_imbalance: float  # in tokens (positions when padded); 1.0 = even
    lockstep_efficiency: float  # in tokens
    microbatches_per_rank: int
    policy_version: int
    min_policy_version: int
    response_bytes: int
    compute_rank_imbalance: float  # in predicted compute (the balancing cost)
    compute_lockstep_efficiency: float  # in predicted compute: what GPU time follows

    @classmethod
    def from_plan(
        cls,
        plan: Any,
        *,
        step: int,
        zero_advantage_groups_dropped: int,
        policy_versions: tuple[int, int],
    ) -> StepRecord:
        """The record of `plan` (a `sched.assembly.StepPlan`) as step `step`, before its
        responses are stored (response_bytes 0); policy_versions = (newest, oldest). Every
        other field is the plan's own of the same name."""
        given = {
            "step": step,
            "num_rollouts": int(plan.kept.size),
            "zero_advantage_groups_dropped": zero_advantage_groups_dropped,
            "policy_version": policy_versions[0],
            "min_policy_version": policy_versions[1],
            "response_bytes": 0,
        }
        copied = {f.name: getattr(plan, f.name) for f in fields(cls) if f.name not in given}
        return cls(**given, **copied)


@dataclass
class Counters:
    """Monotonic counters since start (exported as Prometheus `_total` counters later)."""

    rollouts_received: int = 0
    rollouts_accepted: int = 0
    rollouts_duplicate: int = 0
    rollouts_stale: int = 0
    batches_rejected: int = 0
    zero_advantage_groups: int = 0
    zero_advantage_rollouts_dropped: int = 0
    steps_assembled: int = 0
    rollouts_trained: int = 0
    policy_tokens_assembled: int = 0
    trainer_reports: int = 0
    tasks_requested: int = 0
    tasks_sampled: int = 0
    revisits_sampled: int = 0
    rollouts_expired: int = 0  # dropped with their open group for max_buffered_bytes


@dataclass(frozen=True)
class SampleResult:
    task_ids: list[str]
    revisit: list[bool]
    pass_rate: list[float]
    requested: int = 0  # n as counted: the run's default for 0, at most the pool's size


@dataclass(frozen=True)
class FrontendSeen:
    """A front-end as the scheduler actor sees it, for `rlfeed status`: where clients reach
    it, the Ray node it runs on, its journal slot and its state: "serving" (its watch
    asked within the last few seconds), "unresponsive" (registered, silent since: dead or
    cut off, not yet replaced) or "restarting" (declared dead: its slot waits for the
    front-end Ray starts in its place)."""

    frontend_id: str
    address: str
    node_id: str
    slot: str
    state: str
    last_seen_s: float  # seconds since its watch last asked (inf: never)


@dataclass(frozen=True)
class StatusSnapshot:
    next_step: int
    buffered_rollouts: int
    buffered_bytes: int
    open_groups: int
    complete_groups: int
    tasks_total: int
    tasks_inside_filter: int
    newest_policy_version: int
    steps_waiting: dict[int, list[int]]  # step -> ranks that neither fetched nor acked it
    counters: Counters
    last_step: StepRecord | None
    last_reports: dict[int, dict[str, float]]
    # Idempotency memory: rollout ids remembered (buffered groups' and the remembered closed
    # groups'), and closed groups remembered (at most `dedup_window_groups`).
    remembered_rollout_ids: int = 0
    remembered_closed_groups: int = 0
    held_bytes: int = 0  # counted against max_buffered_bytes (`Scheduler.held_bytes`)
    front_ends: int = 0  # registered with the scheduler actor (set by the actor)
    notes_refused: int = 0  # front-end notes the scheduler refused: bugs (set by the actor)
    front_end_list: tuple[FrontendSeen, ...] = ()  # every front-end known (set by the actor)
    trainer_policy_version: int = -1  # the highest a trainer published; -1: none


def checked_report(rank: int, report: dict[str, float], world_size: int) -> dict[str, float]:
    """`typed_report(report)`, or ValueError for a rank outside [0, world_size) or a negative
    report["step"] or report["policy_version"]: a stray rank must not grow the state or
    the metrics."""
    if not 0 <= rank < world_size:
        raise ValueError(f"trainer report: field rank: {rank} is outside [0, {world_size})")
    for name in ("step", "policy_version"):
        if report.get(name, 0) < 0:
            raise ValueError(f"trainer report of rank {rank}: field {name}: {report[name]} < 0")
    return typed_report(report)


def typed_report(report: dict[str, float]) -> dict[str, float]:
    """A trainer report as the scheduler keeps it: `step` and `policy_version` ints, every
    other field a float.

    One place decides the types, so a report that went through a journal or a snapshot
    (where a version before this one wrote `step` as a float) reads back as the live one:
    status puts `step` in an integer proto field, which refuses 2.0."""
    return {
        name: int(value) if name in _INT_REPORT_FIELDS else float(value)
        for name, value in report.items()
    }


_INT_REPORT_FIELDS = frozenset({"step", "policy_version"})
