"""Group and dedup bookkeeping: the buffered groups, the closed ones, the rollout ids seen.

A rollout joins its group's open entry; a group of `group_size` rollouts completes (its
rewards update the pass rates) and waits, in completion order, for a step, unless it is
all-equal rewards and `drop_zero_advantage` drops it. A group leaves for good when a step
takes it ("assembled"), when it goes stale or expires, or when dropped as zero-advantage;
it is then *closed*: remembered with its rollout ids, so a resend is a duplicate, for the
newest `dedup_window_groups` closed groups (bounded memory). `sched.rounds.RoundQueue`
counts how many complete groups each next step takes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from rlfeed.sched.advantages import zero_advantage_groups
from rlfeed.sched.assembly import TOKEN_BYTES
from rlfeed.sched.rounds import RoundQueue
from rlfeed.service.config import RolloutsConfig
from rlfeed.service.scheduler.batches import BatchTable
from rlfeed.service.scheduler.records import BatchMeta
from rlfeed.service.scheduler.tasks import TaskPool

# Why a group closed; a closed group keeps its first reason.
CloseReason = Literal["stale", "expired", "assembled", "zero_advantage"]


class BufferedRollout(NamedTuple):
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
class Group:
    task_id: str
    rows: list[BufferedRollout] = field(default_factory=list)
    min_version: int = 2**62


class ClosedGroup(NamedTuple):
    reason: CloseReason
    rollout_ids: list[str]  # grows while late rollouts of a stale or expired group arrive


class StaleCount(NamedTuple):
    rollouts: int
    tokens: int


class Added(NamedTuple):
    """What `GroupBook.add` did with an ingest batch's fresh rows."""

    accepted: int
    accepted_tokens: int
    late: int  # rows of groups closed as stale or expired (counted stale)
    late_tokens: int
    completed: list[str]  # groups the batch completed, in the order their last row came


class Completed(NamedTuple):
    """What `GroupBook.complete` did: zero-advantage groups found, rollouts dropped."""

    zero_advantage_groups: int
    rollouts_dropped: int


class GroupBook:
    """The buffered groups (open, then complete in completion order), the closed ones and
    the ids of every rollout they hold. Buffered rollouts hold their ingest batch in
    `batches` until their group leaves."""

    def __init__(self, rollouts: RolloutsConfig, batches: BatchTable) -> None:
        self._group_size = rollouts.group_size
        self._dedup_window = rollouts.dedup_window_groups
        self._batches = batches
        # Idempotency memory: the rollout ids of every buffered group (exactly) and of the
        # closed groups in `closed`, in closing order, at most `dedup_window_groups`.
        self.seen: set[str] = set()
        self.open: dict[str, Group] = {}
        self.complete: OrderedDict[str, Group] = OrderedDict()
        self.closed: OrderedDict[str, ClosedGroup] = OrderedDict()
        # How many of the complete groups each next step takes ([rollouts] step_groups);
        # its count of complete groups is len(self.complete).
        self.rounds = RoundQueue(rollouts.prompts_per_step, rollouts.step_groups)
        self.next_arrival = 0
        self.buffered_rollouts = 0
        self.buffered_bytes = 0  # token bytes of the buffered rollouts
        self.zero_dropped_since_step = 0  # zero-advantage groups dropped since the last step

    def get(self, group_id: str) -> Group | None:
        return self.open.get(group_id) or self.complete.get(group_id)

    def fresh_rows(self, meta: BatchMeta) -> dict[str, list[int]]:
        """Group id -> the batch's rows not seen before, in row order (a query)."""
        by_group: dict[str, list[int]] = {}
        for row, (rollout_id, group_id) in enumerate(
            zip(meta.rollout_ids, meta.group_ids, strict=True)
        ):
            if rollout_id not in self.seen:
                by_group.setdefault(group_id, []).append(row)
        return by_group

    def older_than(self, oldest_allowed: int) -> list[str]:
        """The buffered groups holding a rollout older than `oldest_allowed` (a query)."""
        return [
            group_id
            for group_id, group in (*self.open.items(), *self.complete.items())
            if group.min_version < oldest_allowed
        ]

    def add(
        self,
        meta: BatchMeta,
        versions: list[int],
        by_group: dict[str, list[int]],
        batch_key: int,
        dropped: set[str],
    ) -> Added:
        """Buffer the batch's fresh rows (`by_group`, admitted): into their open groups,
        or, for the groups in `dropped` (closed as stale or expired), into the closed
        group's ids only. The caller completes the groups that reached group_size."""
        ids, tasks = meta.rollout_ids, meta.task_ids
        first_arrival = self.next_arrival  # arrival order = row order inside a batch
        self.next_arrival += len(ids)
        rewards, lengths = meta.rewards.tolist(), meta.lengths.tolist()
        policy_tokens = meta.policy_tokens.tolist()
        late = late_tokens = accepted = accepted_tokens = 0
        completed: list[tuple[int, str]] = []  # (completing row, group id)
        for group_id, rows in by_group.items():
            fresh_ids = [ids[row] for row in rows]
            self.seen.update(fresh_ids)
            tokens = sum(lengths[row] for row in rows)
            if group_id in dropped:  # closed above or before: its entry keeps the ids
                self.closed[group_id].rollout_ids.extend(fresh_ids)
                late += len(rows)
                late_tokens += tokens
                continue
            group = self.open.setdefault(group_id, Group(task_id=tasks[rows[0]]))
            group.rows.extend(
                BufferedRollout(
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
            self.buffered_bytes += TOKEN_BYTES * tokens
            accepted += len(rows)
            accepted_tokens += tokens
            if len(group.rows) == self._group_size:
                completed.append((rows[-1], group_id))
        self.buffered_rollouts += accepted
        return Added(
            accepted, accepted_tokens, late, late_tokens, [g for _, g in sorted(completed)]
        )

    def complete_groups(self, group_ids: list[str], tasks: TaskPool, drop_zero: bool) -> Completed:
        """Move complete groups on: update their tasks' pass rates (one vectorized call),
        find the zero-advantage ones and drop them if `drop_zero`, queue the rest for the
        next step."""
        if not group_ids:
            return Completed(0, 0)
        groups = [self.open.pop(g) for g in group_ids]
        rewards = np.array([row.reward for group in groups for row in group.rows], dtype=np.float64)
        group_of = np.repeat(np.arange(len(groups)), [len(group.rows) for group in groups])
        # Rewards are treated as pass fractions for the estimate (clipped into [0, 1]).
        means = np.clip(np.bincount(group_of, weights=rewards) / np.bincount(group_of), 0, 1)
        tasks.update([group.task_id for group in groups], means, self._group_size)
        zero_rows = zero_advantage_groups(rewards, group_of)
        zero_groups = np.zeros(len(groups), dtype=bool)
        zero_groups[group_of] = zero_rows
        found = dropped = 0
        for group_id, group, zero in zip(group_ids, groups, zero_groups.tolist(), strict=True):
            found += zero
            if zero and drop_zero:
                self.release(group.rows)
                self.close(group_id, "zero_advantage", group.rows)
                dropped += len(group.rows)
                self.zero_dropped_since_step += 1
                self.rounds.drop(was_complete=False)
            else:
                self.complete[group_id] = group
                self.rounds.add_complete()
        return Completed(found, dropped)

    def drop_older_than(self, oldest_allowed: int) -> StaleCount:
        """Drop as stale the buffered groups holding a rollout older than `oldest_allowed`;
        returns their rollouts and tokens."""
        rollouts = tokens = 0
        for group_id in self.older_than(oldest_allowed):
            rows = self.get(group_id).rows
            rollouts += len(rows)
            tokens += sum(row.length for row in rows)
            self.drop(group_id, "stale")
        return StaleCount(rollouts, tokens)

    def take_step(self) -> list[tuple[str, Group]]:
        """The complete groups of the next step, oldest first (empty: no step is ready)."""
        return [self.complete.popitem(last=False) for _ in range(self.rounds.take_step())]

    def release(self, rows: list[BufferedRollout]) -> None:
        """The rows leave the buffer (a step took them or their group was dropped)."""
        for row in rows:
            self._batches.let_go(row.batch_key)
            self.buffered_bytes -= row.length * TOKEN_BYTES
        self.buffered_rollouts -= len(rows)

    def drop(self, group_id: str, reason: CloseReason) -> int:
        """Drop a buffered group (or take note of late rollouts of a closed one) and close
        it; returns the rollouts dropped."""
        complete = self.complete.pop(group_id, None)
        group = self.open.pop(group_id, None) or complete
        if group_id not in self.closed:  # a group leaving for good: no step waits for it
            self.rounds.drop(was_complete=complete is not None)
        rows = group.rows if group is not None else []
        self.release(rows)
        self.close(group_id, reason, rows)
        return len(rows)

    def close(self, group_id: str, reason: CloseReason, rows: list[BufferedRollout]) -> None:
        """Remember a closed group and its rollout ids (a group closed before keeps its place
        in the window and its reason: only a stale or expired group closes again, for late
        rollouts)."""
        if group_id not in self.closed:
            self.closed[group_id] = ClosedGroup(reason, [])
        self.closed[group_id].rollout_ids.extend(row.rollout_id for row in rows)

    def forget_old(self) -> None:
        """Forget the oldest closed groups beyond `dedup_window_groups`, with their rollout
        ids: a resend of one of them is then taken as new data (the price of bounded memory).
        Runs at the end of the calls that close groups, never between their checks."""
        for _ in range(len(self.closed) - self._dedup_window):
            _, closed = self.closed.popitem(last=False)
            self.seen.difference_update(closed.rollout_ids)

    # ---- snapshot ("open", "complete", "closed", "rounds") -----------------------------

    def state(self) -> dict[str, list]:
        return {
            "open": _groups_state(self.open),
            "complete": _groups_state(self.complete),
            "closed": [[g, reason, ids] for g, (reason, ids) in self.closed.items()],
            "rounds": self.rounds.entries(),
        }

    def restore(self, state: dict) -> None:
        for name, target in (("open", self.open), ("complete", self.complete)):
            for group_id, task_id, rows, min_version in state[name]:
                buffered = [BufferedRollout(*row) for row in rows]
                target[group_id] = Group(task_id, buffered, min_version)
                self.seen.update(row.rollout_id for row in buffered)
        for group_id, reason, ids in state["closed"]:
            self.closed[group_id] = ClosedGroup(reason, ids)
            self.seen.update(ids)
        self.rounds.restore(state.get("rounds", []), len(self.complete))  # none: version 1


def _groups_state(groups: dict[str, Group]) -> list:
    return [[g, x.task_id, [list(r) for r in x.rows], x.min_version] for g, x in groups.items()]


def in_arrival_order(groups: list[tuple[str, Group]]) -> tuple[list[BufferedRollout], np.ndarray]:
    """The rows of `groups` in arrival order, and each row's index in `groups` (int64)."""
    rows = sorted(
        ((row, index) for index, (_, group) in enumerate(groups) for row in group.rows),
        key=lambda item: item[0].arrival,
    )
    return [row for row, _ in rows], np.array([index for _, index in rows], dtype=np.int64)
