"""The sidecar's scheduling state and logic, as a plain Python class (no Ray, gRPC or Arrow).

`Scheduler` is the one object a journal replays: every state change is one of its few
public methods, each deterministic given its arguments and the state, so replaying them
rebuilds the same state. It composes one part per job, each in its own module:

- `tasks.TaskPool`          task ids, pass-rate estimates, the sampling draws
- `admission.AdmissionControl`  may a batch come in, what goes stale or expires
- `groups.GroupBook`        buffered groups, closed groups, dedup memory, sampling rounds
- `batches.BatchTable`      the ingest batches still read, and where their columns are
- `steps.StepBook`          planned -> stored -> fetched -> acknowledged -> released
- `snapshot`                the snapshot format

and does here what spans parts: taking a batch in, planning steps, the trainer's reports.
Bulk token data never passes through here: `ingest_batch` takes per-rollout metadata and
an opaque handle of the batch's columns (`BatchHandle` in the sidecar). `actor.py` hosts
one instance in a named Ray actor. The state machines: README.md.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from rlfeed.sched.assembly import TOKEN_BYTES
from rlfeed.service.config import SidecarConfig
from rlfeed.service.scheduler import snapshot
from rlfeed.service.scheduler.admission import Admission, AdmissionControl, PolicyVersions
from rlfeed.service.scheduler.batches import BatchTable
from rlfeed.service.scheduler.groups import CloseReason, Group, GroupBook, in_arrival_order
from rlfeed.service.scheduler.records import (
    BatchMeta,
    Counters,
    FetchResult,
    IngestResult,
    SampleResult,
    StatusSnapshot,
    StepRecord,
    StepWork,
    checked_report,
    typed_report,
)
from rlfeed.service.scheduler.steps import StepBook
from rlfeed.service.scheduler.tasks import TaskPool

__all__ = ["Scheduler", "typed_report"]


class Scheduler:
    """All scheduling state of one sidecar. Not thread-safe: the actor serializes calls.
    It never materializes a step: `plan_ready_steps` hands the work to a front-end."""

    def __init__(self, config: SidecarConfig, *, track_releases: bool = False) -> None:
        """`track_releases`: keep what the scheduler stops needing (payload handles,
        released steps) for the front-end holding the bytes to free at once
        (`take_releases`)."""
        self.config = config
        self._step_config = config.step_config()
        self._tasks = TaskPool(config)
        self._versions = PolicyVersions(newest=config.rollouts.initial_policy_version)
        self._batches = BatchTable(track_releases=track_releases)
        self._groups = GroupBook(config.rollouts, self._batches)
        self._steps = StepBook(config.batching, self._batches, track_releases=track_releases)
        self._admission = AdmissionControl(
            config.rollouts, self._versions, self._tasks, self._groups, self._batches, self._steps
        )
        self.counters = Counters()
        self.step_records: deque[StepRecord] = deque(maxlen=4096)
        self.last_reports: dict[int, dict[str, float]] = {}

    # ---- tasks ----------------------------------------------------------------------

    def register_tasks(self, task_ids: list[str]) -> tuple[int, int]:
        """Add unknown task ids to the pool; returns (added, total). All or nothing:
        ValueError for an empty id or a pool that would outgrow `[server] max_tasks`."""
        return self._tasks.register(task_ids)

    def sample_tasks(self, n: int) -> SampleResult:
        """Tasks to roll out next (curriculum.select_tasks); n = 0 means prompts_per_step.
        n is counted as requested only up to the pool's size: tasks that do not exist are
        not rollouts the filter saved (one call asking for 2**32 - 1 would otherwise
        poison the cumulative counters for the rest of the run)."""
        n = min(n or self.config.rollouts.prompts_per_step, len(self._tasks.ids))
        result = self._tasks.sample(n)
        self._groups.rounds.open_round(len(result.task_ids))
        self.counters.tasks_requested += n
        self.counters.tasks_sampled += len(result.task_ids)
        self.counters.revisits_sampled += sum(result.revisit)
        return result

    # ---- ingest (admission.py checks, groups.py buffers) ------------------------------

    def ingest_batch(self, meta: BatchMeta, payload: Any) -> IngestResult:
        """Buffer a validated batch. All-or-nothing: InvalidBatchError (unknown task, group
        over group_size or spanning two tasks, policy_version too far ahead) or
        BackpressureError (a full buffer, in rollouts or bytes: `admission.py`) leave no
        trace. The work is per group of the batch, not per rollout, wherever it can be:
        this is the actor's hot path (one call per batch, all producers)."""
        by_group = self._groups.fresh_rows(meta)  # fresh rows of each group, in row order
        versions = meta.policy_versions.tolist()
        newest = max([self._versions.newest] + [versions[r] for g in by_group.values() for r in g])
        admitted = self._admission.admit(meta, versions, by_group, newest)
        return self._take(meta, versions, payload, by_group, newest, admitted)

    def _take(
        self,
        meta: BatchMeta,
        versions: list[int],
        payload: Any,
        by_group: dict[str, list[int]],
        newest: int,
        admitted: Admission,
    ) -> IngestResult:
        """Buffer the admitted batch: drop the stale and expired groups, add the fresh rows,
        complete the groups that reached group_size."""
        self._versions.newest = newest
        groups = self._groups
        stale_tokens = sum(
            row.length for g in admitted.stale if (group := groups.get(g)) for row in group.rows
        )
        for group_id in sorted(admitted.stale):  # a set: sorted, so replay drops alike
            self._drop_group(group_id, "stale")
        expired_rollouts = sum(len(groups.get(group_id).rows) for group_id in admitted.expired)
        for group_id in admitted.expired:
            self._drop_group(group_id, "expired")
        batch_key = self._batches.new_key()
        dropped = admitted.stale.union(admitted.expired)  # the batch's rows of these are late
        added = groups.add(meta, versions, by_group, batch_key, dropped)
        if added.accepted:
            batch_bytes = TOKEN_BYTES * int(meta.lengths.sum())
            self._batches.add(batch_key, payload, added.accepted, batch_bytes)
        n, fresh = len(meta.rollout_ids), sum(map(len, by_group.values()))
        self.counters.rollouts_received += n
        self.counters.rollouts_accepted += added.accepted
        self.counters.rollouts_duplicate += n - fresh
        self.counters.rollouts_stale += added.late
        self._complete_groups(added.completed)
        groups.forget_old()
        trainer_stale = self._versions.take_unreported()
        return IngestResult(
            accepted=added.accepted,
            duplicate=n - fresh,
            stale=added.late,
            newest_policy_version=max(self._versions.newest, 0),
            buffered_rollouts=groups.buffered_rollouts,
            steps_ready=groups.rounds.steps_ready(),
            accepted_tokens=added.accepted_tokens,
            stale_buffered=admitted.freed + trainer_stale.rollouts,
            stale_tokens=stale_tokens + added.late_tokens + trainer_stale.tokens,
            expired=expired_rollouts,
        )

    def _drop_group(self, group_id: str, reason: CloseReason) -> None:
        dropped = self._groups.drop(group_id, reason)
        if reason == "stale":
            self.counters.rollouts_stale += dropped
        elif reason == "expired":
            self.counters.rollouts_expired += dropped

    def _complete_groups(self, group_ids: list[str]) -> None:
        drop_zero = self.config.advantages.drop_zero_advantage
        completed = self._groups.complete_groups(group_ids, self._tasks, drop_zero)
        self.counters.zero_advantage_groups += completed.zero_advantage_groups
        self.counters.zero_advantage_rollouts_dropped += completed.rollouts_dropped

    def record_rejection(self) -> None:
        """Count a batch rejected as invalid (INVALID_ARGUMENT). A full buffer's refusal
        (RESOURCE_EXHAUSTED) is healthy backpressure, counted by the metrics apart, so an
        alert on rejections does not fire on it."""
        self.counters.batches_rejected += 1

    @property
    def held_bytes(self) -> int:
        """Bytes counted against `max_buffered_bytes` (see `AdmissionControl._admit_bytes`)."""
        return self._batches.nbytes + self._steps.step_bytes

    def take_releases(self) -> tuple[list[Any], list[int]]:
        """What the scheduler stopped needing since the last call (empty unless tracking):
        the payload handles nothing refers to any more (no buffered rollout, no planned step
        whose responses are not stored yet), whose columns their holder frees at once, and
        the steps released (no longer servable), whose responses their holder drops. An
        output, not a state change: replay recomputes it."""
        return self._batches.take_released(), self._steps.take_released()

    # ---- steps (steps.py) -------------------------------------------------------------

    def plan_ready_steps(self) -> list[StepWork]:
        """Plan every step the complete groups make (in completion order), each of
        prompts_per_step groups or, with step_groups "sampled", of its round's count.

        Returns the work to materialize each new step; a step answers "not ready" until its
        responses come back through `store_step`, and holds the batches it reads until
        then (they are released, see `take_releases`, only after that).
        """
        work = []
        while groups := self._groups.take_step():
            work.append(self._plan(groups))
        self._groups.forget_old()
        return work

    def _plan(self, groups: list[tuple[str, Group]]) -> StepWork:
        rows, group_of = in_arrival_order(groups)
        zero_dropped = self._groups.zero_dropped_since_step
        work = self._steps.plan(rows, group_of, self._step_config, zero_dropped)
        for group_id, group in groups:
            self._groups.release(group.rows)
            self._groups.close(group_id, "assembled", group.rows)
        self._groups.zero_dropped_since_step = 0
        self.counters.steps_assembled += 1
        self.counters.rollouts_trained += work.record.num_rollouts
        self.counters.policy_tokens_assembled += work.record.policy_token_count
        return work

    def store_step(
        self, step: int, responses: list[Any], response_bytes: int | None = None
    ) -> StepRecord:
        """Keep every rank's response of a planned step (bytes, or handles with their total
        `response_bytes`); returns the step's record. See `StepBook.store`."""
        record = self._steps.store(step, responses, response_bytes)
        self.step_records.append(record)
        return record

    def fetch_batch(self, step: int, rank: int) -> FetchResult:
        """Rank `rank`'s stored response of `step`; notes the fetch (`StepBook.fetch`)."""
        return self._steps.fetch(step, rank)

    def first_fetch(self, step: int, rank: int) -> bool:
        """Whether `fetch_batch(step, rank)` would change the state (a query): the step is
        stored and `rank` has not fetched it yet."""
        return self._steps.first_fetch(step, rank)

    def ack_steps(self, rank: int, through_step: int | None) -> int:
        """Rank `rank` is done with every step <= `through_step` (AckSteps; None: none
        yet); returns its acknowledged step. See `StepBook.ack`."""
        return self._steps.ack(rank, through_step)

    @property
    def next_step(self) -> int:
        return self._steps.next_step

    def step_rounds(self) -> list[list[int]]:
        """[groups, 1 if a sampling round else 0] of each step still to plan, oldest first;
        empty with step_groups "fixed" (a query, `sched.rounds.RoundQueue.entries`)."""
        return self._groups.rounds.entries()

    # ---- where the bytes are (batches.py, steps.py; queries but for the handles) -------

    def held_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` whose responses are stored and not yet released (a query)."""
        return self._steps.held(steps)

    def unstored_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` planned and still waiting for their responses (a query)."""
        return self._steps.unstored(steps)

    def move_step(self, step: int, responses: list[Any]) -> bool:
        """Replace a stored step's handles (False if released); `StepBook.move`."""
        return self._steps.move(step, responses)

    def rehome_payloads(self, handles: dict[Any, Any]) -> list[int]:
        """Batches take new handles to the same columns (`BatchTable.rehome`); returns
        the unstored steps reading a moved one (served by the old holder until stored)."""
        return self._steps.reading(self._batches.rehome(handles))

    def claim_journaled(
        self, slot: str, frontend_id: str
    ) -> tuple[list[int], dict[int, list[Any]]]:
        """`slot`'s journal references become handles to `frontend_id`'s memory; returns
        the batch positions it must load and the references of the stored steps' responses
        it must load or build (`BatchTable.claim`, `StepBook.claim`)."""
        return self._batches.claim(slot, frontend_id), self._steps.claim(slot, frontend_id)

    def orphan_frontend(self, frontend_id: str, slot: str, step_refs: dict[int, list[Any]]) -> None:
        """Front-end `frontend_id` (journaling into `slot`) died: handles to its memory
        become journal references again (`BatchTable.orphan`, `StepBook.orphan`)."""
        self._batches.orphan(frontend_id, slot)
        self._steps.orphan(slot, step_refs)

    def step_payloads(self, step: int) -> dict[int, Any]:
        """Batch key -> current handle of every ingest batch a planned, unstored `step`
        reads (empty otherwise): the handles its work went out with may name a front-end
        that died since (a query)."""
        return {key: self._batches.handle(key) for key in self._steps.reads(step)}

    def payload_handles(self) -> list[Any]:
        """The handle of every ingest batch still held (a query)."""
        return self._batches.handles()

    # ---- trainer reports and status -------------------------------------------------

    def record_report(self, rank: int, report: dict[str, float]) -> None:
        """Keep the latest report of each rank (the metrics exporter reads them) and the
        policy version it publishes, if any (`_publish_version`). ValueError, keeping
        nothing, for a rank outside [0, world_size) or a negative report["step"] or
        report["policy_version"]: a stray rank must not grow the state or the metrics."""
        self.last_reports[int(rank)] = checked_report(rank, report, self.config.batching.world_size)
        self.counters.trainer_reports += 1
        if "policy_version" in report:
            self._publish_version(int(report["policy_version"]))

    def _publish_version(self, version: int) -> None:
        """The trainer's weights are at `version` (it only counts if higher than any published
        before: a late retry of an older report must not move it back). Staleness is then
        measured against max(it, newest version in a rollout): buffered groups now more than
        max_policy_lag behind are dropped at once, before any step takes them, so a fleet
        that lags as a whole is caught even when no rollout carries a newer version."""
        versions = self._versions
        if version <= versions.trainer:
            return
        versions.trainer = version
        oldest_allowed = max(version, versions.newest) - self.config.rollouts.max_policy_lag
        dropped = self._groups.drop_older_than(oldest_allowed)
        self.counters.rollouts_stale += dropped.rollouts
        versions.note_stale(dropped)
        self._groups.forget_old()

    def status(self) -> StatusSnapshot:
        """What the state looks like now (a copy; `snapshot.status`)."""
        return snapshot.status(self._parts(), self._statistics())

    def pass_rate_estimates(self) -> np.ndarray:
        """float64 [tasks]: the current pass-rate estimate of every registered task, in
        registration order (a copy; the metrics' pass-rate histogram reads it)."""
        return self._tasks.estimates()

    # ---- snapshots (snapshot.py: a journal's shortcut past its older records) ---------

    def snapshot_state(self, batch_ref: Any, step_refs: Any) -> dict | None:
        """The whole state as plain msgpack values (`snapshot.snapshot_state`); None while
        a planned step is not stored yet or a handle has no journal reference."""
        return snapshot.snapshot_state(self._parts(), self._statistics(), batch_ref, step_refs)

    def restore_state(self, state: dict, unref: Any) -> None:
        """Become the scheduler `snapshot_state` described (on a fresh instance): handles
        come back as `unref([slot, position])`, i.e. journal references."""
        # Through `register_tasks`, as any call: a subclass sees the tasks registered.
        self.register_tasks(state["tasks"])
        statistics = snapshot.restore_state(self._parts(), state, unref)
        self.counters = statistics.counters
        self.step_records.extend(statistics.step_records)
        self.last_reports = statistics.last_reports

    def _statistics(self) -> snapshot.Statistics:
        return snapshot.Statistics(self.counters, self.step_records, self.last_reports)

    def _parts(self) -> snapshot.Parts:
        return snapshot.Parts(self._tasks, self._groups, self._batches, self._steps, self._versions)
