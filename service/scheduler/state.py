"""The sidecar's scheduling state and logic, as a plain Python class (no Ray, gRPC or Arrow).

`Scheduler` owns the task pool and its pass-rate estimates, the buffered groups, the
planned steps and the counters. Every state change is one of a few explicit methods, each
deterministic given its arguments and the state, so a journal can replay them to the same
state. Bulk token data never passes through here: `ingest_batch` takes per-rollout
metadata and an opaque handle of the batch's columns (`BatchHandle` in the sidecar).
`actor.py` hosts one instance in a named Ray actor.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
from rlfeed.sched.advantages import zero_advantage_groups
from rlfeed.sched.assembly import TOKEN_BYTES, StepRollouts, assemble_step
from rlfeed.sched.curriculum import (
    PassRates,
    grow,
    init_pass_rates,
    inside_filter,
    select_tasks,
    update_pass_rates,
)
from rlfeed.sched.rounds import RoundQueue
from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import BackpressureError, RejectReason, rollout_error
from rlfeed.service.scheduler.records import (
    BatchHandle,
    BatchMeta,
    Counters,
    FetchResult,
    HeldBy,
    IngestResult,
    JournalRef,
    SampleResult,
    StatusSnapshot,
    StepRecord,
    StepWork,
)
from rlfeed.service.scheduler.retention import StepRetention


class _Row(NamedTuple):
    """One buffered rollout (the per-rollout hot path: a tuple, not an object)."""

    arrival: int
    batch_key: int
    row: int  # in its ingest batch
    rollout_id: str
    policy_version: int
    reward: float
    length: int  # tokens
    policy_tokens: int


@dataclass
class _Group:
    task_id: str
    rows: list[_Row] = field(default_factory=list)
    min_version: int = 2**62


@dataclass
class _Step:
    record: StepRecord
    num_rollouts: int
    # Counted against max_buffered_bytes until every rank fetched it: its token bytes while
    # it is planned (its batches are held too), its response bytes once stored.
    nbytes: int
    payloads: list[Any] | None = None  # per rank, once materialized: bytes or a handle
    fetched: set[int] = field(default_factory=set)
    done: bool = False  # every rank is done with it (`StepRetention`): released in turn
    # The ingest batches the step reads, held until its responses are stored (whichever
    # front-end materializes it, the columns must outlive that).
    reads: list[int] = field(default_factory=list)


class Scheduler:
    """All scheduling state of one sidecar. Not thread-safe: the actor serializes calls.
    It never materializes a step: `plan_ready_steps` hands the work to a front-end."""

    def __init__(self, config: SidecarConfig, *, track_releases: bool = False) -> None:
        self.config = config
        # When set, what the scheduler stops needing is kept for the front-end that holds
        # the bytes, to free at once (`take_releases`): payload handles and released steps.
        self._released: list[Any] | None = [] if track_releases else None
        self._released_steps: list[int] | None = [] if track_releases else None
        self._step_config = config.step_config()
        self._curriculum = config.curriculum.curriculum_config()
        self._rng = np.random.default_rng(config.curriculum.seed)
        self._task_index: dict[str, int] = {}
        self._task_ids: list[str] = []
        self._pass_rates = init_pass_rates(0, self._curriculum)
        # Idempotency memory. `_seen` holds the rollout ids of every buffered group (exactly)
        # and of the closed groups in `_closed`: group id -> (reason, its rollout ids), reason
        # "stale" | "expired" | "assembled" | "zero_advantage", in closing order and at most
        # `dedup_window_groups` of them (oldest forgotten first), so memory stays bounded.
        self._seen: set[str] = set()
        self._open: dict[str, _Group] = {}
        self._complete: OrderedDict[str, _Group] = OrderedDict()
        self._closed: OrderedDict[str, tuple[str, list[str]]] = OrderedDict()
        # How many of the complete groups each next step takes ([rollouts] step_groups);
        # its count of complete groups is len(self._complete).
        rollouts = config.rollouts
        self._rounds = RoundQueue(rollouts.prompts_per_step, rollouts.step_groups)
        # batch key -> [handle, holders (buffered rollouts + unstored steps), token bytes]
        self._payloads: dict[int, list] = {}
        self._payload_bytes = 0  # token bytes of the batches in `_payloads`
        self._step_bytes = 0  # `_Step.nbytes` of the steps not yet fetched by every rank
        self._next_batch_key = 0
        self._next_arrival = 0
        self._newest_version = config.rollouts.initial_policy_version  # -1: none seen yet
        self._trainer_version = -1  # the highest a trainer published; -1: none
        # Buffered rollouts (and their tokens) a trainer's version made stale, not yet in an
        # IngestResult: the metrics count stale rollouts from those.
        self._stale_unreported = [0, 0]
        self._buffered_rollouts = 0
        self._buffered_bytes = 0
        self._steps: dict[int, _Step] = {}
        self._retention = StepRetention(config.batching.world_size, config.batching.retained_steps)
        # Backpressure counts a step until every rank fetched it, not until it is released:
        # fetching is what frees room, and a trainer acknowledging only at checkpoints must
        # still be able to fetch the steps up to its next checkpoint.
        self._rollouts_in_steps = 0  # assembled, not yet fetched by every rank
        self._next_step = 0
        self._zero_dropped_since_step = 0
        self.counters = Counters()
        self.step_records: deque[StepRecord] = deque(maxlen=4096)
        self.last_reports: dict[int, dict[str, float]] = {}

    # ---- tasks ----------------------------------------------------------------------

    def register_tasks(self, task_ids: list[str]) -> tuple[int, int]:
        """Add unknown task ids to the pool; returns (added, total). All or nothing:
        ValueError for an empty id or a pool that would outgrow `[server] max_tasks`."""
        if not all(task_ids):
            raise ValueError("task_ids: empty task id")
        new = [task_id for task_id in dict.fromkeys(task_ids) if task_id not in self._task_index]
        max_tasks = self.config.server.max_tasks
        if len(self._task_ids) + len(new) > max_tasks:
            raise ValueError(
                f"task_ids: {len(new)} new tasks would grow the pool of {len(self._task_ids)} "
                f"beyond [server] max_tasks = {max_tasks}"
            )
        for task_id in new:
            self._task_index[task_id] = len(self._task_ids)
            self._task_ids.append(task_id)
        if new:
            self._pass_rates = grow(self._pass_rates, len(self._task_ids))
        return len(new), len(self._task_ids)

    def sample_tasks(self, n: int) -> SampleResult:
        """Tasks to roll out next (curriculum.select_tasks); n = 0 means prompts_per_step.
        n is counted as requested only up to the pool's size: tasks that do not exist are
        not rollouts the filter saved (one call asking for 2**32 - 1 would otherwise
        poison the cumulative counters for the rest of the run)."""
        n = min(n or self.config.rollouts.prompts_per_step, len(self._task_ids))
        chosen = select_tasks(self._pass_rates, n, self._curriculum, self._rng)
        inside = inside_filter(self._pass_rates, self._curriculum)[chosen]
        self._rounds.open_round(int(chosen.size))
        self.counters.tasks_requested += n
        self.counters.tasks_sampled += int(chosen.size)
        self.counters.revisits_sampled += int((~inside).sum())
        return SampleResult(
            task_ids=[self._task_ids[i] for i in chosen.tolist()],
            revisit=(~inside).tolist(),
            pass_rate=self._pass_rates.estimate[chosen].tolist(),
            requested=n,
        )

    # ---- ingest ---------------------------------------------------------------------

    def ingest_batch(self, meta: BatchMeta, payload: Any) -> IngestResult:
        """Buffer a validated batch. All-or-nothing: InvalidBatchError (unknown task, group
        over group_size or spanning two tasks, policy_version too far ahead) or
        BackpressureError leave no trace.

        Backpressure, two bounds (see `RolloutsConfig`): in rollouts, the batch is refused
        only if it opens a new group, the rollouts buffered or in unfetched steps plus the
        batch's would exceed `max_buffered_rollouts`, and ranks fetching can make room. In
        bytes (`max_buffered_bytes`, `_admit_bytes`): refused while ranks can make room,
        else taken by expiring the oldest open groups; never exceeded by taking a batch.

        The work is per group of the batch, not per rollout, wherever it can be: this is
        the actor's hot path (one call per batch, all producers).
        """
        by_group: dict[str, list[int]] = {}  # fresh rows of each group, in row order
        for row, (rollout_id, group_id) in enumerate(
            zip(meta.rollout_ids, meta.group_ids, strict=True)
        ):
            if rollout_id not in self._seen:
                by_group.setdefault(group_id, []).append(row)
        versions = meta.policy_versions.tolist()
        newest = max([self._newest_version] + [versions[r] for g in by_group.values() for r in g])
        stale_groups, freed, expired = self._admit(meta, versions, by_group, newest)
        return self._apply(meta, versions, payload, by_group, newest, stale_groups, freed, expired)

    def _admit(
        self, meta: BatchMeta, versions: list[int], by_group: dict[str, list[int]], newest: int
    ) -> tuple[set[str], int, list[str]]:
        """Check the batch's fresh rows against the state, changing nothing: raises what
        `ingest_batch` refuses with; returns the groups that go stale (the batch's own and
        buffered ones the newest version leaves behind), the buffered rollouts they free and
        the open groups to expire for the batch to fit in `max_buffered_bytes`.
        `versions` is `meta.policy_versions` as a list, converted once per batch."""
        rollouts = self.config.rollouts
        ids, tasks = meta.rollout_ids, meta.task_ids
        oldest_allowed = max(newest, self._trainer_version) - rollouts.max_policy_lag
        # One lookup per task of the batch: a set difference with the pool walks the pool.
        batch_tasks = {tasks[row] for rows in by_group.values() for row in rows}
        unknown = {task for task in batch_tasks if task not in self._task_index}
        if unknown:
            row = min(row for rows in by_group.values() for row in rows if tasks[row] in unknown)
            problem = f"unknown task {tasks[row]!r}"
            raise rollout_error(ids[row], "task_id", problem, reason=RejectReason.UNKNOWN_TASK)
        self._check_version_jump(meta, by_group)
        stale_groups: set[str] = set()
        incoming = opening = 0  # fresh rollouts taken; those of them that open a new group
        for group_id, rows in by_group.items():
            group = self._group(group_id)
            if self._goes_stale(meta, versions, group_id, rows, group, oldest_allowed):
                stale_groups.add(group_id)
                continue
            incoming += len(rows)
            opening += len(rows) if group is None else 0
        if newest > max(self._newest_version, self._trainer_version):
            stale_groups.update(
                g
                for g, group in (*self._open.items(), *self._complete.items())
                if group.min_version < oldest_allowed
            )
        freed = sum(len(self._group(g).rows) for g in stale_groups if self._group(g))
        live = self._buffered_rollouts + self._rollouts_in_steps - freed
        if (
            opening
            and live + incoming > rollouts.max_buffered_rollouts
            and self._ranks_can_make_room(stale_groups)
        ):
            raise BackpressureError(
                f"buffer full: {live} rollouts buffered or in unfetched steps, batch adds "
                f"{incoming} ({opening} opening new groups), max_buffered_rollouts = "
                f"{rollouts.max_buffered_rollouts}; retry once trainer ranks fetch a step"
            )
        expired = self._admit_bytes(meta, stale_groups, opening) if incoming else []
        return stale_groups, freed, expired

    def _admit_bytes(self, meta: BatchMeta, dropping: set[str], opening: int) -> list[str]:
        """The byte bound, changing nothing: BackpressureError, or the buffered groups to
        expire for the batch to fit. `dropping`: the groups going stale.

        Counted (`held_bytes`): the token bytes of every batch a buffered rollout or an
        unstored step reads (the front-end keeps a batch's columns whole), plus the steps
        not yet fetched by every rank. While fetching can make room (`_ranks_can_make_room`)
        a batch passing the bound is refused, and one opening a new group already past 3/4
        of it, so the last quarter goes to rollouts completing buffered groups. Otherwise
        no refusal could ever end (the rollouts completing the buffered groups may sit
        behind the refused batch), so the oldest buffered groups are expired instead:
        groups that never complete cannot grow memory, and the bound holds."""
        bound = self.config.rollouts.max_buffered_bytes
        batch_bytes = TOKEN_BYTES * int(meta.lengths.sum())
        if batch_bytes > bound:  # only in process: gRPC caps a batch at max_message_bytes
            raise BackpressureError(
                f"a batch of {_mib(batch_bytes)} of tokens can never fit [rollouts] "
                f"max_buffered_bytes = {_mib(bound)}: send smaller batches"
            )
        let_go: Counter[int] = Counter()  # batch key -> its rows dropped so far
        held = self.held_bytes - self._bytes_freed(dropping, let_go)
        can_make_room = self._ranks_can_make_room(dropping)
        limit = bound * 3 // 4 if opening and can_make_room else bound
        if held + batch_bytes <= limit:
            return []
        if can_make_room:
            raise BackpressureError(
                f"buffer full: {_mib(held)} held for rollouts ({_mib(self._step_bytes)} of it "
                f"in steps not yet fetched by every rank), the batch adds {_mib(batch_bytes)}"
                f"{f' ({opening} rollouts opening new groups)' if opening else ''}; "
                f"[rollouts] max_buffered_bytes = {_mib(bound)}"
                f"{', new groups stop at 3/4 of it' if opening else ''}; retry once trainer "
                "ranks fetch a step"
            )
        # Open groups first, then complete ones (too few for a step), each oldest first; a
        # batch's own rows of an expired group are dropped as late. Expiring them all leaves
        # nothing held (no step waits), and a batch fits (max_message_bytes <= the bound).
        expired = []
        for group_id in (*self._open, *self._complete):
            if held + batch_bytes <= bound:
                break
            if group_id not in dropping:
                held -= self._bytes_freed([group_id], let_go)
                expired.append(group_id)
        return expired

    def _bytes_freed(self, group_ids, let_go: Counter[int]) -> int:
        """Token bytes of the batches that dropping the buffered groups among `group_ids`
        would release (a query). `let_go` counts each batch's rows dropped so far and is
        updated, so that successive calls add up."""
        freed = 0
        for group_id in group_ids:
            group = self._group(group_id)
            for row in group.rows if group else ():
                let_go[row.batch_key] += 1
                entry = self._payloads[row.batch_key]
                if let_go[row.batch_key] == entry[1]:
                    freed += entry[2]
        return freed

    @property
    def held_bytes(self) -> int:
        """Bytes counted against `max_buffered_bytes` (see `_admit_bytes`)."""
        return self._payload_bytes + self._step_bytes

    def _goes_stale(
        self,
        meta: BatchMeta,
        versions: list[int],
        group_id: str,
        rows: list[int],
        group: _Group | None,
        oldest_allowed: int,
    ) -> bool:
        """Whether the batch's fresh `rows` of `group_id` go stale (the group closed as
        stale, or a row older than `oldest_allowed`); InvalidBatchError if they name another
        task than the group's or do not fit in it (a closed group takes none)."""
        ids, tasks, group_size = meta.rollout_ids, meta.task_ids, self.config.rollouts.group_size
        group_task = group.task_id if group else tasks[rows[0]]
        for row in rows:
            if tasks[row] != group_task:
                raise rollout_error(
                    ids[row],
                    "group_id",
                    f"group {group_id!r} belongs to task {group_task!r}",
                    reason=RejectReason.GROUP_OVERFLOW,
                )
        closed = self._closed.get(group_id, (None,))[0]
        if closed in ("stale", "expired"):  # late rollouts of a dropped group
            return True
        if closed is not None or group_id in self._complete:
            raise rollout_error(
                ids[rows[0]],
                "group_id",
                f"group {group_id!r} already has its {group_size} rollouts",
                reason=RejectReason.GROUP_OVERFLOW,
            )
        if min(versions[row] for row in rows) < oldest_allowed:
            return True
        room = group_size - (len(group.rows) if group else 0)
        if len(rows) > room:
            raise rollout_error(
                ids[rows[room]],
                "group_id",
                f"group {group_id!r} would exceed group_size {group_size}",
                reason=RejectReason.GROUP_OVERFLOW,
            )
        return False

    def _apply(
        self,
        meta: BatchMeta,
        versions: list[int],
        payload: Any,
        by_group: dict[str, list[int]],
        newest: int,
        stale_groups: set[str],
        freed: int,
        expired: list[str],
    ) -> IngestResult:
        """Buffer the admitted batch: drop the stale and expired groups, add the fresh rows,
        complete the groups that reached group_size."""
        ids, tasks, n = meta.rollout_ids, meta.task_ids, len(meta.rollout_ids)
        self._newest_version = newest
        stale_tokens = sum(
            row.length for g in stale_groups if self._group(g) for row in self._group(g).rows
        )
        for group_id in sorted(stale_groups):  # a set: sorted, so replay drops alike
            self._drop_group(group_id, "stale")
        expired_rollouts = sum(len(self._group(group_id).rows) for group_id in expired)
        for group_id in expired:
            self._drop_group(group_id, "expired")
        dropped = stale_groups.union(expired)  # the batch's rows of these are late
        batch_key = self._next_batch_key
        self._next_batch_key += 1
        first_arrival = self._next_arrival  # arrival order = row order inside a batch
        self._next_arrival += n
        rewards, lengths = meta.rewards.tolist(), meta.lengths.tolist()
        policy_tokens = meta.policy_tokens.tolist()
        stale = accepted = accepted_tokens = 0
        completed: list[tuple[int, str]] = []  # (completing row, group id)
        for group_id, rows in by_group.items():
            fresh_ids = [ids[row] for row in rows]
            self._seen.update(fresh_ids)
            tokens = sum(lengths[row] for row in rows)
            if group_id in dropped:  # closed above or before: its entry keeps the ids
                self._closed[group_id][1].extend(fresh_ids)
                stale += len(rows)
                stale_tokens += tokens
                continue
            group = self._open.setdefault(group_id, _Group(task_id=tasks[rows[0]]))
            group.rows.extend(
                _Row(
                    first_arrival + row,
                    batch_key,
                    row,
                    ids[row],
                    versions[row],
                    rewards[row],
                    lengths[row],
                    policy_tokens[row],
                )
                for row in rows
            )
            group.min_version = min(group.min_version, *(versions[row] for row in rows))
            self._buffered_bytes += TOKEN_BYTES * tokens
            accepted += len(rows)
            accepted_tokens += tokens
            if len(group.rows) == self.config.rollouts.group_size:
                completed.append((rows[-1], group_id))
        self._buffered_rollouts += accepted
        if accepted:
            self._payloads[batch_key] = [payload, accepted, TOKEN_BYTES * sum(lengths)]
            self._payload_bytes += self._payloads[batch_key][2]
        fresh = sum(map(len, by_group.values()))
        self.counters.rollouts_received += n
        self.counters.rollouts_accepted += accepted
        self.counters.rollouts_duplicate += n - fresh
        self.counters.rollouts_stale += stale
        self._complete_groups([group_id for _, group_id in sorted(completed)])
        self._forget_old_groups()
        (trainer_stale, trainer_stale_tokens), self._stale_unreported = (
            self._stale_unreported,
            [0, 0],
        )
        return IngestResult(
            accepted=accepted,
            duplicate=n - fresh,
            stale=stale,
            newest_policy_version=max(self._newest_version, 0),
            buffered_rollouts=self._buffered_rollouts,
            steps_ready=self._rounds.steps_ready(),
            accepted_tokens=accepted_tokens,
            stale_buffered=freed + trainer_stale,
            stale_tokens=stale_tokens + trainer_stale_tokens,
            expired=expired_rollouts,
        )

    def _check_version_jump(self, meta: BatchMeta, by_group: dict[str, list[int]]) -> None:
        """InvalidBatchError for the first fresh rollout more than `max_version_jump` versions
        ahead of the newest version known (in a rollout or published by the trainer; before
        any, the batch's first fresh rollout's): the newest version only grows, so one bogus
        version would make every honest rollout stale for the rest of the run."""
        if not by_group:
            return
        baseline = max(self._newest_version, self._trainer_version)
        if baseline < 0:
            baseline = int(meta.policy_versions[min(rows[0] for rows in by_group.values())])
        limit = baseline + self.config.rollouts.max_version_jump
        ahead = np.flatnonzero(meta.policy_versions > limit).tolist()
        if not ahead:
            return
        fresh = {row for rows in by_group.values() for row in rows}
        row = next((row for row in ahead if row in fresh), None)
        if row is not None:
            raise rollout_error(
                meta.rollout_ids[row],
                "policy_version",
                f"{int(meta.policy_versions[row])} is more than max_version_jump "
                f"{self.config.rollouts.max_version_jump} ahead of the newest policy version "
                f"seen, {baseline} (in a rollout or published by the trainer)",
                reason=RejectReason.BAD_POLICY_VERSION,
            )

    def _ranks_can_make_room(self, dropping: set[str]) -> bool:
        """Whether trainer ranks fetching can free buffer room without further rollouts: an
        assembled step still waits for a rank, or enough complete groups (after dropping the
        groups in `dropping`) to assemble one. The backpressure rule refuses a batch only
        then, so a refusal is always resolved by fetching: refused otherwise, a producer
        retrying its batches in order would wait forever for the rollouts that complete the
        buffered groups, which may sit behind the refused batch."""
        if self._rollouts_in_steps:
            return True
        # Per dropped group, not per complete one: this runs for every batch. A group closed
        # before (late rollouts of a stale one) was deducted from the rounds then.
        complete = sum(group_id in self._complete for group_id in dropping)
        new = sum(group_id not in self._closed for group_id in dropping)
        return self._rounds.ready_despite(dropped=new, dropped_complete=complete)

    def record_rejection(self) -> None:
        """Count a batch rejected as invalid (INVALID_ARGUMENT). A full buffer's refusal
        (RESOURCE_EXHAUSTED) is healthy backpressure, counted by the metrics apart, so an
        alert on rejections does not fire on it."""
        self.counters.batches_rejected += 1

    def _group(self, group_id: str) -> _Group | None:
        return self._open.get(group_id) or self._complete.get(group_id)

    def _release_rows(self, rows: list[_Row]) -> None:
        for row in rows:
            self._unref_payload(row.batch_key)
            self._buffered_bytes -= row.length * TOKEN_BYTES
        self._buffered_rollouts -= len(rows)

    def _unref_payload(self, batch_key: int) -> None:
        """One holder (a buffered rollout, or a planned step not yet stored) lets go of a
        batch; the last one releases it."""
        entry = self._payloads[batch_key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._payloads[batch_key]
            self._payload_bytes -= entry[2]
            if self._released is not None:
                self._released.append(entry[0])

    def take_releases(self) -> tuple[list[Any], list[int]]:
        """What the scheduler stopped needing since the last call (empty unless tracking):
        the payload handles nothing refers to any more (no buffered rollout, no planned step
        whose responses are not stored yet), whose columns their holder frees at once, and
        the steps released (no longer servable), whose responses their holder drops. An
        output, not a state change: replay recomputes it."""
        if self._released is None or self._released_steps is None:
            return [], []
        released = (self._released, self._released_steps)
        self._released, self._released_steps = [], []
        return released

    def _drop_group(self, group_id: str, reason: str) -> None:
        complete = self._complete.pop(group_id, None)
        group = self._open.pop(group_id, None) or complete
        if group_id not in self._closed:  # a group leaving for good: no step waits for it
            self._rounds.drop(was_complete=complete is not None)
        if group is not None:
            self._release_rows(group.rows)
            if reason == "stale":
                self.counters.rollouts_stale += len(group.rows)
            elif reason == "expired":
                self.counters.rollouts_expired += len(group.rows)
        self._close(group_id, reason, group.rows if group else [])

    def _close(self, group_id: str, reason: str, rows: list[_Row]) -> None:
        """Remember a closed group and its rollout ids (a group closed before keeps its place
        in the window and its reason: only a stale or expired group closes again, for late
        rollouts)."""
        if group_id not in self._closed:
            self._closed[group_id] = (reason, [])
        self._closed[group_id][1].extend(row.rollout_id for row in rows)

    def _forget_old_groups(self) -> None:
        """Forget the oldest closed groups beyond `dedup_window_groups`, with their rollout
        ids: a resend of one of them is then taken as new data (the price of bounded memory).
        Runs at the end of the calls that close groups, never between their checks."""
        for _ in range(len(self._closed) - self.config.rollouts.dedup_window_groups):
            _, (_, rollout_ids) = self._closed.popitem(last=False)
            self._seen.difference_update(rollout_ids)

    def _complete_groups(self, group_ids: list[str]) -> None:
        """Move complete groups on: update pass rates (one vectorized call), count and
        maybe discard zero-advantage ones, queue the rest for the next step."""
        if not group_ids:
            return
        groups = [self._open.pop(g) for g in group_ids]
        rewards = np.array([row.reward for group in groups for row in group.rows], dtype=np.float64)
        group_of = np.repeat(np.arange(len(groups)), [len(group.rows) for group in groups])
        # Rewards are treated as pass fractions for the estimate (clipped into [0, 1]).
        means = np.clip(np.bincount(group_of, weights=rewards) / np.bincount(group_of), 0, 1)
        tasks = np.array([self._task_index[group.task_id] for group in groups], dtype=np.int64)
        # In place: this runs per ingest batch, and a copy would cost O(task pool) each time.
        self._pass_rates = update_pass_rates(
            self._pass_rates,
            tasks,
            means,
            self.config.rollouts.group_size,
            self._curriculum,
            in_place=True,
        )
        zero_rows = zero_advantage_groups(rewards, group_of)
        zero_groups = np.zeros(len(groups), dtype=bool)
        zero_groups[group_of] = zero_rows
        for group_id, group, zero in zip(group_ids, groups, zero_groups.tolist(), strict=True):
            self.counters.zero_advantage_groups += zero
            if zero and self.config.advantages.drop_zero_advantage:
                self._release_rows(group.rows)
                self._close(group_id, "zero_advantage", group.rows)
                self.counters.zero_advantage_rollouts_dropped += len(group.rows)
                self._zero_dropped_since_step += 1
                self._rounds.drop(was_complete=False)
            else:
                self._complete[group_id] = group
                self._rounds.add_complete()

    # ---- steps ----------------------------------------------------------------------

    def plan_ready_steps(self) -> list[StepWork]:
        """Plan every step the complete groups make (in completion order), each of
        prompts_per_step groups or, with step_groups "sampled", of its round's count.

        Returns the work to materialize each new step; a step answers "not ready" until its
        responses come back through `store_step`, and holds the batches it reads until
        then (they are released, see `take_releases`, only after that).
        """
        work = []
        while groups_in_step := self._rounds.take_step():
            groups = [self._complete.popitem(last=False) for _ in range(groups_in_step)]
            work.append(self._plan(groups))
        self._forget_old_groups()
        return work

    def store_step(
        self, step: int, responses: list[Any], response_bytes: int | None = None
    ) -> StepRecord:
        """Keep every rank's response of a planned step: the serialized bytes (served as-is),
        or a handle to them (the actor keeps object references; `response_bytes` then gives
        their total size for the step's record), and let go of the ingest batches the step
        read. Returns the step's record."""
        held = self._steps.get(step)
        if held is None or held.payloads is not None:
            raise ValueError(f"step {step} is not waiting for its responses")
        if len(responses) != self.config.batching.world_size:
            raise ValueError(f"step {step}: {len(responses)} responses for world_size ranks")
        held.payloads = list(responses)
        for key in held.reads:
            self._unref_payload(key)
        held.reads = []
        if response_bytes is None:
            response_bytes = sum(len(r) for r in responses)
        self._step_bytes += int(response_bytes) - held.nbytes  # no rank can have fetched it
        held.nbytes = int(response_bytes)
        record = replace(held.record, response_bytes=int(response_bytes))
        self.step_records.append(record)
        self._settle(step)  # every rank may have acknowledged it while it was materialized
        return record

    def held_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` whose responses are stored and not yet released (a query)."""
        return [
            step
            for step in steps
            if (held := self._steps.get(step)) is not None and held.payloads is not None
        ]

    def move_step(self, step: int, responses: list[Any]) -> bool:
        """Replace a stored step's per-rank handles with others to the same bytes (a
        front-end moving them out of its memory into the object store). Returns False and
        changes nothing if the step is no longer held (released in the meantime)."""
        held = self._steps.get(step)
        if held is None or held.payloads is None:
            return False
        if len(responses) != self.config.batching.world_size:
            raise ValueError(f"step {step}: {len(responses)} responses for world_size ranks")
        held.payloads = list(responses)
        return True

    def rehome_payloads(self, handles: dict[Any, Any]) -> list[int]:
        """Give held ingest batches new handles to the same columns (a front-end leaving
        moves its batches into the object store): each batch whose handle is a key of
        `handles` takes its value. Returns the planned steps not yet stored that read a
        moved batch: their work went out with the old handles, so the old holder keeps
        serving those until `unstored_steps` says they are stored."""
        moved = set()
        for key, entry in self._payloads.items():
            new_handle = handles.get(entry[0]) if isinstance(entry[0], BatchHandle) else None
            if new_handle is not None:
                entry[0] = new_handle
                moved.add(key)
        return sorted(
            step
            for step, held in self._steps.items()
            if held.payloads is None and moved.intersection(held.reads)
        )

    def claim_journaled(
        self, slot: str, frontend_id: str
    ) -> tuple[list[int], dict[int, list[int]]]:
        """Hand what recovery left in `slot`'s journal to the front-end now serving that
        slot: every `JournalRef` of the slot becomes a handle to `frontend_id`'s memory (the
        journal position is the batch's key there). Returns the positions it must load: the
        ingest batches, and each stored step's responses (per rank)."""
        batches = []
        for entry in self._payloads.values():
            handle = entry[0]
            if isinstance(handle, JournalRef) and handle.slot == slot:
                entry[0] = BatchHandle(frontend_id, handle.position)
                batches.append(handle.position)
        steps = {}
        for step, held in self._steps.items():
            refs = held.payloads or []
            if refs and isinstance(refs[0], JournalRef) and refs[0].slot == slot:
                steps[step] = [ref.position for ref in refs]
                held.payloads = [HeldBy(frontend_id)] * len(refs)
        return sorted(batches), steps

    def orphan_frontend(
        self, frontend_id: str, slot: str, step_refs: dict[int, list[JournalRef]]
    ) -> None:
        """Front-end `frontend_id`, which journaled into `slot`, died: the handles naming its
        memory become references to its journal again (the inverse of `claim_journaled`),
        so the next front-end of `slot` claims them. Every ingest batch it held (the key is
        the journal position), and every held step whose responses `step_refs` places in
        `slot` (step -> one reference per rank; also steps moved into the object store by
        the dead process, which owned those objects). Not a logical change: what is
        buffered, planned, stored and fetched stays the same; only where the bytes are."""
        for entry in self._payloads.values():
            handle = entry[0]
            if isinstance(handle, BatchHandle) and handle.frontend_id == frontend_id:
                entry[0] = JournalRef(slot, handle.key)
        for step, refs in step_refs.items():
            held = self._steps.get(step)
            if held is not None and held.payloads is not None and refs[0].slot == slot:
                held.payloads = list(refs)

    def step_payloads(self, step: int) -> dict[int, Any]:
        """Batch key -> current handle of every ingest batch a planned, unstored `step`
        reads (empty otherwise): the handles its work went out with may name a front-end
        that died since (a query)."""
        held = self._steps.get(step)
        if held is None or held.payloads is not None:
            return {}
        return {key: self._payloads[key][0] for key in held.reads}

    def payload_handles(self) -> list[Any]:
        """The handle of every ingest batch still held (a query)."""
        return [entry[0] for entry in self._payloads.values()]

    def unstored_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` planned and still waiting for their responses (a query)."""
        return [
            step
            for step in steps
            if (held := self._steps.get(step)) is not None and held.payloads is None
        ]

    def _plan(self, groups: list[tuple[str, _Group]]) -> StepWork:
        rows = sorted(
            ((row, index) for index, (_, group) in enumerate(groups) for row in group.rows),
            key=lambda item: item[0][0],  # arrival order
        )
        group_of = np.array([index for _, index in rows], dtype=np.int64)
        rows = [row for row, _ in rows]
        versions = np.array([row.policy_version for row in rows], dtype=np.int64)
        step_rollouts = StepRollouts(
            lengths=np.array([row.length for row in rows], dtype=np.int64),
            policy_tokens=np.array([row.policy_tokens for row in rows], dtype=np.int64),
            rewards=np.array([row.reward for row in rows], dtype=np.float64),
            group_ids=group_of,
        )
        plan = assemble_step(step_rollouts, self._step_config)
        step = self._next_step
        reads = sorted({row.batch_key for row in rows})  # the ingest batches the step reads
        work = StepWork(
            step=step,
            plan=plan,
            rows=[(row.batch_key, row.row) for row in rows],
            rollout_ids=[row.rollout_id for row in rows],
            policy_versions=versions,
            payloads={key: self._payloads[key][0] for key in reads},
        )
        for key in reads:  # the step holds its batches until store_step
            self._payloads[key][1] += 1
        for group_id, group in groups:
            self._release_rows(group.rows)
            self._close(group_id, "assembled", group.rows)
        record = StepRecord.from_plan(
            plan,
            step=step,
            zero_advantage_groups_dropped=self._zero_dropped_since_step,
            policy_versions=plan.policy_version_range(versions),
        )
        nbytes = TOKEN_BYTES * int(step_rollouts.lengths.sum())
        self._steps[step] = _Step(record=record, num_rollouts=len(rows), nbytes=nbytes, reads=reads)
        self._rollouts_in_steps += len(rows)
        self._step_bytes += nbytes
        self._next_step += 1
        self._zero_dropped_since_step = 0
        self.counters.steps_assembled += 1
        self.counters.rollouts_trained += record.num_rollouts
        self.counters.policy_tokens_assembled += record.policy_token_count
        return replace(work, record=record)  # the front-end reports the step with it

    def fetch_batch(self, step: int, rank: int) -> FetchResult:
        """Rank `rank`'s stored response of `step`, and note the fetch (a state change: it
        counts towards backpressure, and for a rank that never acknowledged a step, towards
        release; see `ack_steps`)."""
        self._check_rank(rank)
        held = self._steps.get(step)
        if held is None or held.payloads is None:  # not planned, released, or materializing
            return FetchResult(ready=False, released=held is None and step < self._next_step)
        if rank not in held.fetched:
            self._served(held, rank)
            self._settle(step)
        return FetchResult(ready=True, payload=held.payloads[rank])

    def first_fetch(self, step: int, rank: int) -> bool:
        """Whether `fetch_batch(step, rank)` would change the state (a query): the step is
        stored and `rank` has not fetched it yet."""
        held = self._steps.get(step)
        return held is not None and held.payloads is not None and rank not in held.fetched

    def _served(self, held: _Step, rank: int) -> None:
        """`rank` fetched the step or acknowledged it: it waits for that rank no more (the
        backpressure rule counts a step until no rank waits)."""
        if rank not in held.fetched:
            held.fetched.add(rank)
            if len(held.fetched) == self.config.batching.world_size:
                self._rollouts_in_steps -= held.num_rollouts
                self._step_bytes -= held.nbytes

    def ack_steps(self, rank: int, through_step: int | None) -> int:
        """Rank `rank` is done with every step <= `through_step` (AckSteps; None: with none
        yet, but from now on only its acknowledgements count, not its fetches); returns its
        acknowledged step afterwards (-1: none). A step every rank is done with is released
        once `retained_steps` newer ones are done too (`retention.StepRetention`).
        Idempotent; ValueError, changing nothing, for a rank outside the world or a step
        not assembled yet (a trainer cannot have trained it)."""
        self._check_rank(rank)
        if through_step is None:
            return self._retention.ack(rank, -1)
        if not 0 <= through_step < self._next_step:
            raise ValueError(
                f"acknowledgement of rank {rank}: field through_step: step {through_step} "
                f"has not been assembled (the next step is {self._next_step}; did the sidecar "
                "restart without a journal?)"
            )
        acked = self._retention.ack(rank, through_step)
        for step in sorted(self._steps):
            if step > acked:
                break
            self._served(self._steps[step], rank)  # e.g. resumed past it: never fetched
            self._settle(step)
        return acked

    def _check_rank(self, rank: int) -> None:
        world_size = self.config.batching.world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")

    def _settle(self, step: int) -> None:
        """Mark a stored step done once every rank is done with it, and release the done
        steps beyond the newest `retained_steps`."""
        held = self._steps.get(step)
        if held is None or held.payloads is None or held.done:
            return
        if not self._retention.done_by_every_rank(step, held.fetched):
            return
        held.done = True
        for released in self._retention.done(step):
            del self._steps[released]
            if self._released_steps is not None:
                self._released_steps.append(released)

    @property
    def next_step(self) -> int:
        return self._next_step

    def step_rounds(self) -> list[list[int]]:
        """[groups, 1 if a sampling round else 0] of each step still to plan, oldest first;
        empty with step_groups "fixed" (a query, `sched.rounds.RoundQueue.entries`)."""
        return self._rounds.entries()

    # ---- trainer reports and status -------------------------------------------------

    def record_report(self, rank: int, report: dict[str, float]) -> None:
        """Keep the latest report of each rank (the metrics exporter reads them) and the
        policy version it publishes, if any (`_publish_version`). ValueError, keeping
        nothing, for a rank outside [0, world_size) or a negative report["step"] or
        report["policy_version"]: a stray rank must not grow the state or the metrics."""
        world_size = self.config.batching.world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"trainer report: field rank: {rank} is outside [0, {world_size})")
        for name in ("step", "policy_version"):
            if report.get(name, 0) < 0:
                raise ValueError(f"trainer report of rank {rank}: field {name}: {report[name]} < 0")
        self.last_reports[int(rank)] = typed_report(report)
        self.counters.trainer_reports += 1
        if "policy_version" in report:
            self._publish_version(int(report["policy_version"]))

    def _publish_version(self, version: int) -> None:
        """The trainer's weights are at `version` (it only counts if higher than any published
        before: a late retry of an older report must not move it back). Staleness is then
        measured against max(it, newest version in a rollout): buffered groups now more than
        max_policy_lag behind are dropped at once, before any step takes them, so a fleet
        that lags as a whole is caught even when no rollout carries a newer version."""
        if version <= self._trainer_version:
            return
        self._trainer_version = version
        oldest_allowed = max(version, self._newest_version) - self.config.rollouts.max_policy_lag
        stale = [
            (group_id, group)
            for group_id, group in (*self._open.items(), *self._complete.items())
            if group.min_version < oldest_allowed
        ]
        for group_id, group in stale:
            self._stale_unreported[0] += len(group.rows)
            self._stale_unreported[1] += sum(row.length for row in group.rows)
            self._drop_group(group_id, "stale")
        self._forget_old_groups()

    def status(self) -> StatusSnapshot:
        world_size = self.config.batching.world_size
        inside = int(inside_filter(self._pass_rates, self._curriculum).sum())
        return StatusSnapshot(
            next_step=self._next_step,
            buffered_rollouts=self._buffered_rollouts,
            buffered_bytes=self._buffered_bytes,
            held_bytes=self.held_bytes,
            open_groups=len(self._open),
            complete_groups=len(self._complete),
            tasks_total=len(self._task_ids),
            tasks_inside_filter=inside,
            newest_policy_version=max(self._newest_version, 0),
            trainer_policy_version=self._trainer_version,
            steps_waiting={
                step: sorted(set(range(world_size)) - held.fetched)
                for step, held in sorted(self._steps.items())
                if len(held.fetched) < world_size
            },
            counters=Counters(**vars(self.counters)),
            last_step=self.step_records[-1] if self.step_records else None,
            last_reports={rank: dict(r) for rank, r in self.last_reports.items()},
            remembered_rollout_ids=len(self._seen),
            remembered_closed_groups=len(self._closed),
        )

    def pass_rate_estimates(self) -> np.ndarray:
        """float64 [tasks]: the current pass-rate estimate of every registered task, in
        registration order (a copy; the metrics' pass-rate histogram reads it)."""
        return np.array(self._pass_rates.estimate, dtype=np.float64)

    # ---- snapshots (a journal's shortcut past its older records) ---------------------

    def snapshot_state(self, batch_ref: Any, step_refs: Any) -> dict | None:
        """The whole state as plain msgpack values, every bytes handle as a journal
        reference: `batch_ref(handle)` -> [slot, position] of an ingest batch,
        `step_refs(step)` -> one per rank. None while that is not possible: a planned step
        is not stored yet (its work exists only in memory) or a handle has no reference."""
        if any(held.payloads is None for held in self._steps.values()):
            return None
        payloads = {key: [batch_ref(entry[0]), *entry[1:]] for key, entry in self._payloads.items()}
        steps = {
            step: [
                dataclasses.asdict(held.record),
                held.num_rollouts,
                held.nbytes,
                step_refs(step),
                sorted(held.fetched),
                held.reads,
                held.done,
            ]
            for step, held in self._steps.items()
        }
        refs = [v[0] for v in payloads.values()] + [v[3] for v in steps.values()]
        if any(ref is None for ref in refs):
            return None
        rates = self._pass_rates
        return {
            "tasks": self._task_ids,
            "pass_rates": [
                *(a.tolist() for a in (rates.estimate, rates.visits, rates.alpha, rates.beta)),
                rates.last_visit.tolist(),
                rates.num_updates,
            ],
            "rng": _rng_state(self._rng),
            "open": _groups_state(self._open),
            "complete": _groups_state(self._complete),
            "closed": [[g, reason, ids] for g, (reason, ids) in self._closed.items()],
            "rounds": self._rounds.entries(),
            "payloads": payloads,
            "steps": steps,
            "counts": {name: getattr(self, name) for name in _COUNTS},
            "acked_through": self._retention.acked_through,
            "done": self._retention.done_steps(),
            "counters": dataclasses.asdict(self.counters),
            "step_records": [dataclasses.asdict(r) for r in self.step_records],
            "last_reports": self.last_reports,
            "trainer_policy_version": self._trainer_version,
        }

    def restore_state(self, state: dict, unref: Any) -> None:
        """Become the scheduler `snapshot_state` described (on a fresh instance): handles
        come back as `unref([slot, position])`, i.e. journal references."""
        self.register_tasks(state["tasks"])
        *arrays, last_visit, updates = state["pass_rates"]
        self._pass_rates = PassRates(
            *(np.asarray(a, dtype=np.float64) for a in arrays[:1]),
            np.asarray(arrays[1], dtype=np.int64),
            *(np.asarray(a, dtype=np.float64) for a in arrays[2:]),
            np.asarray(last_visit, dtype=np.int64),
            num_updates=updates,
            prior_alpha=self._pass_rates.prior_alpha,
            prior_beta=self._pass_rates.prior_beta,
            initial_estimate=self._pass_rates.initial_estimate,
        )
        _set_rng_state(self._rng, state["rng"])
        for name, target in (("open", self._open), ("complete", self._complete)):
            for group_id, task_id, rows, min_version in state[name]:
                target[group_id] = _Group(task_id, [_Row(*row) for row in rows], min_version)
                self._seen.update(row[3] for row in rows)
        for group_id, reason, ids in state["closed"]:
            self._closed[group_id] = (reason, ids)
            self._seen.update(ids)
        self._rounds.restore(state.get("rounds", []), len(self._complete))  # none: version 1
        self._payloads = {
            int(k): [unref(ref), *rest] for k, (ref, *rest) in state["payloads"].items()
        }
        for step, values in state["steps"].items():
            record, num_rollouts, nbytes, refs, fetched, reads, done = values
            handles = [unref(r) for r in refs]
            self._steps[int(step)] = _Step(
                StepRecord(**record), num_rollouts, nbytes, handles, set(fetched), done, reads
            )
        for name in _COUNTS:
            setattr(self, name, state["counts"][name])
        self._retention.restore(
            {int(rank): acked for rank, acked in state["acked_through"].items()}, state["done"]
        )
        self.counters = Counters(**state["counters"])
        self.step_records.extend(StepRecord(**r) for r in state["step_records"])
        self.last_reports = {
            int(rank): typed_report(report) for rank, report in state["last_reports"].items()
        }
        self._trainer_version = state.get("trainer_policy_version", -1)  # older: none


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


# The scheduler's scalar state, as a snapshot names it.
_COUNTS = (
    "_next_batch_key",
    "_next_arrival",
    "_newest_version",
    "_buffered_rollouts",
    "_buffered_bytes",
    "_payload_bytes",
    "_step_bytes",
    "_rollouts_in_steps",
    "_next_step",
    "_zero_dropped_since_step",
)


def _groups_state(groups: dict[str, _Group]) -> list:
    return [[g, x.task_id, [list(r) for r in x.rows], x.min_version] for g, x in groups.items()]


def _rng_state(generator: np.random.Generator) -> list[str]:
    """The PCG64 generator's state as strings (its integers have 128 bits; msgpack, 64)."""
    state = generator.bit_generator.state
    inner = state["state"]
    values = (inner["state"], inner["inc"], state["has_uint32"], state["uinteger"])
    return [state["bit_generator"], *map(str, values)]


def _set_rng_state(generator: np.random.Generator, saved: list[str]) -> None:
    name, state, inc, has_uint32, uinteger = saved
    if name != generator.bit_generator.state["bit_generator"]:
        raise ValueError(f"snapshot: random generator {name!r} is not this numpy's default")
    generator.bit_generator.state = {
        "bit_generator": name,
        "state": {"state": int(state), "inc": int(inc)},
        "has_uint32": int(has_uint32),
        "uinteger": int(uinteger),
    }


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
