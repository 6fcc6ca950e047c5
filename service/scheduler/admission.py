"""Admission: may an ingest batch's fresh rows come in, and what do they push out?

`AdmissionControl.admit` checks a batch against the state and changes nothing: it raises
what `Scheduler.ingest_batch` refuses with (InvalidBatchError: unknown task, a group over
group_size or spanning two tasks, a policy version too far ahead; BackpressureError: a
full buffer), or returns an `Admission`: the groups that go stale, the buffered rollouts
they free and the open groups to expire so the batch fits `max_buffered_bytes`.

Backpressure, two bounds (see `RolloutsConfig`): in rollouts, a batch is refused only if
it opens a new group, the rollouts buffered or in unfetched steps plus the batch's would
exceed `max_buffered_rollouts`, and ranks fetching can make room. In bytes
(`max_buffered_bytes`, `_admit_bytes`): refused while ranks can make room, else taken by
expiring the oldest open groups; never exceeded by taking a batch.

Staleness is measured against `PolicyVersions`: the newest version in any rollout and the
one the trainer published, whichever is higher, minus `max_policy_lag`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from rlfeed.sched.assembly import TOKEN_BYTES
from rlfeed.service.config import RolloutsConfig
from rlfeed.service.errors import BackpressureError, RejectReason, rollout_error
from rlfeed.service.scheduler.batches import BatchTable
from rlfeed.service.scheduler.groups import Group, GroupBook, StaleCount
from rlfeed.service.scheduler.records import BatchMeta
from rlfeed.service.scheduler.steps import StepBook
from rlfeed.service.scheduler.tasks import TaskPool


@dataclass
class PolicyVersions:
    """The policy versions staleness is measured against."""

    newest: int  # the newest in an accepted batch's fresh rollout; -1: none seen yet
    trainer: int = -1  # the highest a trainer published; -1: none
    # Buffered rollouts (and their tokens) a trainer's version made stale, not yet in an
    # IngestResult: the metrics count stale rollouts from those.
    unreported: StaleCount = field(default_factory=lambda: StaleCount(0, 0))

    def note_stale(self, dropped: StaleCount) -> None:
        """Buffered rollouts a trainer's version made stale, to report with the next batch."""
        rollouts, tokens = self.unreported
        self.unreported = StaleCount(rollouts + dropped.rollouts, tokens + dropped.tokens)

    def take_unreported(self) -> StaleCount:
        taken, self.unreported = self.unreported, StaleCount(0, 0)
        return taken


class Admission(NamedTuple):
    """What taking an admitted batch does to the groups buffered before it."""

    stale: set[str]  # groups going stale: the batch's own and buffered ones left behind
    freed: int  # buffered rollouts of those
    expired: list[str]  # buffered groups to expire, oldest first, for the batch to fit


class AdmissionControl:
    """The checks of `Scheduler.ingest_batch`, over the scheduler's parts (read only)."""

    def __init__(
        self,
        rollouts: RolloutsConfig,
        versions: PolicyVersions,
        tasks: TaskPool,
        groups: GroupBook,
        batches: BatchTable,
        steps: StepBook,
    ) -> None:
        self._config = rollouts
        self._versions = versions
        self._tasks = tasks
        self._groups = groups
        self._batches = batches
        self._steps = steps

    def admit(
        self, meta: BatchMeta, versions: list[int], by_group: dict[str, list[int]], newest: int
    ) -> Admission:
        """Check the batch's fresh rows (`by_group`) against the state, changing nothing:
        raises what `ingest_batch` refuses with. `versions` is `meta.policy_versions` as
        a list, converted once per batch; `newest` the newest version with the batch's."""
        rollouts, known = self._config, self._versions
        ids, tasks = meta.rollout_ids, meta.task_ids
        oldest_allowed = max(newest, known.trainer) - rollouts.max_policy_lag
        # One lookup per task of the batch: a set difference with the pool walks the pool.
        batch_tasks = {tasks[row] for rows in by_group.values() for row in rows}
        unknown = {task for task in batch_tasks if task not in self._tasks.index}
        if unknown:
            row = min(row for rows in by_group.values() for row in rows if tasks[row] in unknown)
            problem = f"unknown task {tasks[row]!r}"
            raise rollout_error(ids[row], "task_id", problem, reason=RejectReason.UNKNOWN_TASK)
        self._check_version_jump(meta, by_group)
        stale: set[str] = set()
        incoming = opening = 0  # fresh rollouts taken; those of them that open a new group
        for group_id, rows in by_group.items():
            group = self._groups.get(group_id)
            if self._goes_stale(meta, versions, group_id, rows, group, oldest_allowed):
                stale.add(group_id)
                continue
            incoming += len(rows)
            opening += len(rows) if group is None else 0
        if newest > max(known.newest, known.trainer):
            stale.update(self._groups.older_than(oldest_allowed))
        freed = sum(len(group.rows) for g in stale if (group := self._groups.get(g)))
        live = self._groups.buffered_rollouts + self._steps.rollouts_in_steps - freed
        if (
            opening
            and live + incoming > rollouts.max_buffered_rollouts
            and self.ranks_can_make_room(stale)
        ):
            raise BackpressureError(
                f"buffer full: {live} rollouts buffered or in unfetched steps, batch adds "
                f"{incoming} ({opening} opening new groups), max_buffered_rollouts = "
                f"{rollouts.max_buffered_rollouts}; retry once trainer ranks fetch a step"
            )
        expired = self._admit_bytes(meta, stale, opening) if incoming else []
        return Admission(stale, freed, expired)

    def _admit_bytes(self, meta: BatchMeta, dropping: set[str], opening: int) -> list[str]:
        """The byte bound, changing nothing: BackpressureError, or the buffered groups to
        expire for the batch to fit. `dropping`: the groups going stale.

        Counted (`Scheduler.held_bytes`): the token bytes of every batch a buffered rollout
        or an unstored step reads (the front-end keeps a batch's columns whole), plus the
        steps not yet fetched by every rank. While fetching can make room
        (`ranks_can_make_room`) a batch passing the bound is refused, and one opening a new
        group already past 3/4 of it, so the last quarter goes to rollouts completing
        buffered groups. Otherwise no refusal could ever end (the rollouts completing the
        buffered groups may sit behind the refused batch), so the oldest buffered groups
        are expired instead: groups that never complete cannot grow memory, and the bound
        holds."""
        bound = self._config.max_buffered_bytes
        batch_bytes = TOKEN_BYTES * int(meta.lengths.sum())
        if batch_bytes > bound:  # only in process: gRPC caps a batch at max_message_bytes
            raise BackpressureError(
                f"a batch of {_mib(batch_bytes)} of tokens can never fit [rollouts] "
                f"max_buffered_bytes = {_mib(bound)}: send smaller batches"
            )
        let_go: Counter[int] = Counter()  # batch key -> its rows dropped so far
        step_bytes = self._steps.step_bytes
        held = self._batches.nbytes + step_bytes - self._bytes_freed(dropping, let_go)
        can_make_room = self.ranks_can_make_room(dropping)
        limit = bound * 3 // 4 if opening and can_make_room else bound
        if held + batch_bytes <= limit:
            return []
        if can_make_room:
            raise BackpressureError(
                f"buffer full: {_mib(held)} held for rollouts ({_mib(step_bytes)} of it "
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
        for group_id in (*self._groups.open, *self._groups.complete):
            if held + batch_bytes <= bound:
                break
            if group_id not in dropping:
                held -= self._bytes_freed([group_id], let_go)
                expired.append(group_id)
        return expired

    def _bytes_freed(self, group_ids, let_go: Counter[int]) -> int:
        """Token bytes of the batches that dropping the buffered groups among `group_ids`
        would release (a query; `let_go` adds up across calls, see `BatchTable.bytes_freed`)."""
        keys = (
            row.batch_key
            for group_id in group_ids
            if (group := self._groups.get(group_id))
            for row in group.rows
        )
        return self._batches.bytes_freed(keys, let_go)

    def _goes_stale(
        self,
        meta: BatchMeta,
        versions: list[int],
        group_id: str,
        rows: list[int],
        group: Group | None,
        oldest_allowed: int,
    ) -> bool:
        """Whether the batch's fresh `rows` of `group_id` go stale (the group closed as
        stale, or a row older than `oldest_allowed`); InvalidBatchError if they name another
        task than the group's or do not fit in it (a closed group takes none)."""
        ids, tasks, group_size = meta.rollout_ids, meta.task_ids, self._config.group_size
        group_task = group.task_id if group else tasks[rows[0]]
        for row in rows:
            if tasks[row] != group_task:
                raise rollout_error(
                    ids[row],
                    "group_id",
                    f"group {group_id!r} belongs to task {group_task!r}",
                    reason=RejectReason.GROUP_OVERFLOW,
                )
        closed = self._groups.closed.get(group_id)
        if closed is not None and closed.reason in ("stale", "expired"):  # late rollouts
            return True
        if closed is not None or group_id in self._groups.complete:
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

    def _check_version_jump(self, meta: BatchMeta, by_group: dict[str, list[int]]) -> None:
        """InvalidBatchError for the first fresh rollout more than `max_version_jump` versions
        ahead of the newest version known (in a rollout or published by the trainer; before
        any, the batch's first fresh rollout's): the newest version only grows, so one bogus
        version would make every honest rollout stale for the rest of the run."""
        if not by_group:
            return
        baseline = max(self._versions.newest, self._versions.trainer)
        if baseline < 0:
            baseline = int(meta.policy_versions[min(rows[0] for rows in by_group.values())])
        limit = baseline + self._config.max_version_jump
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
                f"{self._config.max_version_jump} ahead of the newest policy version "
                f"seen, {baseline} (in a rollout or published by the trainer)",
                reason=RejectReason.BAD_POLICY_VERSION,
            )

    def ranks_can_make_room(self, dropping: set[str]) -> bool:
        """Whether trainer ranks fetching can free buffer room without further rollouts: an
        assembled step still waits for a rank, or enough complete groups (after dropping the
        groups in `dropping`) to assemble one. The backpressure rule refuses a batch only
        then, so a refusal is always resolved by fetching: refused otherwise, a producer
        retrying its batches in order would wait forever for the rollouts that complete the
        buffered groups, which may sit behind the refused batch."""
        if self._steps.rollouts_in_steps:
            return True
        # Per dropped group, not per complete one: this runs for every batch. A group closed
        # before (late rollouts of a stale one) was deducted from the rounds then.
        complete = sum(group_id in self._groups.complete for group_id in dropping)
        new = sum(group_id not in self._groups.closed for group_id in dropping)
        return self._groups.rounds.ready_despite(dropped=new, dropped_complete=complete)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
