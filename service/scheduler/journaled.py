"""`JournaledScheduler`: a `Scheduler` whose every state change is recorded in a journal
before the actor answers, and that rebuilds itself from that journal when it starts.

The scheduler is deterministic given its calls (see `state.py`), so the journal records
calls, not state: each state-changing method appends one msgpack record of its arguments
after it succeeds (a refused call changes nothing and records nothing but the rejection
counter), and `commit()` makes the records durable before the actor replies. Recovery
replays them through the plain `Scheduler` methods into the same state, the random
generator of `sample_tasks` included.

Bulk bytes are never in this journal: an ingest batch's columns live in the journal of
the front-end that received them, named here as `JournalRef(slot, position)`. A stored
step's responses are in no journal: this one keeps the step's recipe (`recipes.py`) and
names each rank's response as `Rederive(slot, crc32c, size)`, the front-end of `slot`
building it again after a restart. (Journals of call format 1 name responses that the
front-end journaled, as `JournalRef`s; they are read as before.) After recovery every
handle in the state is such a reference; the front-end of each slot loads or rebuilds what
its slot holds (`claim_slot`) and the references become memory handles again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from rlfeed.service.config import SidecarConfig
from rlfeed.service.journal import (
    Journal,
    JournalConfig,
    JournalError,
    JournalVersionError,
    SnapshotStore,
)
from rlfeed.service.scheduler.recipes import StepRecipes
from rlfeed.service.scheduler.records import (
    BatchMeta,
    FetchResult,
    IngestResult,
    JournalRef,
    Rederive,
    SampleResult,
    SlotClaim,
    StepRecord,
    StepWork,
)
from rlfeed.service.scheduler.snapshot import READS_STATE_VERSIONS, STATE_VERSION
from rlfeed.service.scheduler.state import Scheduler

_log = logging.getLogger("rlfeed.service.scheduler.journaled")

SCHEDULER_SLOT = "scheduler"  # the folder of this journal under [journal] dir
_CALL = 1  # the one record kind: [format version, method, *arguments]
# 2: a stored step's responses may be named as Rederive maps, not only journal positions.
CALL_FORMAT_VERSION = 2
READS_CALL_FORMATS = (1, CALL_FORMAT_VERSION)

RefOf = Callable[[Any], JournalRef | None]  # a payload handle -> where its bytes are journaled
Ref = JournalRef | Rederive


def _ref(value: Ref | None) -> list | dict | None:
    """A reference as a msgpack value: [slot, position], or a Rederive as a map."""
    if isinstance(value, Rederive):
        return {"slot": value.slot, "crc32c": value.crc32c, "size": value.size}
    return None if value is None else [value.slot, value.position]


def _unref(value: list | dict | None) -> Ref | None:
    if isinstance(value, dict):
        return Rederive(value["slot"], int(value["crc32c"]), int(value["size"]))
    return None if value is None else JournalRef(value[0], int(value[1]))


class JournaledScheduler(Scheduler):
    """A Scheduler that journals its calls (see the module docstring). `ref_of` names where
    a payload handle's bytes are journaled; the actor knows each front-end's slot."""

    def __init__(
        self,
        config: SidecarConfig,
        directory: Path,
        ref_of: RefOf,
        on_write_failure: Callable[[JournalError], None] | None = None,
    ) -> None:
        super().__init__(config, track_releases=True)
        storage = _storage_config(config.journal)
        self._journal = Journal.open(directory / SCHEDULER_SLOT, storage)
        # A call whose record failed has changed the state in memory already: this state
        # never goes on from there (the journal would miss the call). The journal is not
        # healed in place; `on_write_failure` (the actor: exit, so that Ray restarts it
        # from the journal) runs, else the error is raised and every later call fails.
        self._journal.retry_after_s = math.inf
        self._on_write_failure = on_write_failure
        self._snapshots = SnapshotStore(directory / SCHEDULER_SLOT, config.journal)
        self._durable = config.journal.sync != "none"
        self._snapshot_every = config.journal.snapshot_every_records
        self._ref_of = ref_of
        self._step_refs: dict[int, list[Ref]] = {}  # where held steps' responses come from
        self._recipes = StepRecipes()  # how to build again those named as Rederive
        self._since_snapshot = 0
        self._replaying = False
        self.recovered_work = self._recover()

    # ---- recording ----------------------------------------------------------------------

    def _record(self, method: str, *args: Any) -> None:
        if not self._replaying:
            body = msgpack.packb([CALL_FORMAT_VERSION, method, *args], use_bin_type=True)
            try:
                self._journal.append(_CALL, body)
            except JournalError as error:
                self._write_failed(error)
            self._since_snapshot += 1

    def _write_failed(self, error: JournalError) -> None:
        if self._on_write_failure is not None:
            self._on_write_failure(error)
        raise error

    def commit(self) -> None:
        """Make every call recorded so far durable (per `[journal] sync`): the actor calls
        it before it answers a call that changed the state. Every `snapshot_every_records`
        calls, also snapshot the state and delete the records the older kept snapshot
        covers (tried again at each commit while a step waits to be stored)."""
        if self._durable:
            try:
                self._journal.sync()
            except JournalError as error:
                self._write_failed(error)
        if self._since_snapshot >= self._snapshot_every:
            self.snapshot()

    def snapshot(self) -> bool:
        """Write a snapshot now if the state allows one (see `Scheduler.snapshot_state`)."""
        state = self.snapshot_state(
            lambda handle: _ref(self._ref_of(handle)),
            lambda step: (
                [_ref(r) for r in self._step_refs[step]] if step in self._step_refs else None
            ),
        )
        if state is None:
            return False
        state["recipes"] = self._recipes.state(self.held_steps(list(self._step_refs)))
        position = self._journal.sync()  # never a snapshot ahead of the journal
        self._snapshots.write(position, STATE_VERSION, state)
        self._since_snapshot = 0
        self._journal.delete_before(self._snapshots.oldest_position() + 1)
        return True

    def journal_floor(self, slot: str) -> int | None:
        """The oldest position of `slot`'s journal the state still refers to (a buffered
        or unstored step's batch, a held step's response or the batches it is built
        from); None if none: the front-end of that slot may delete the segments before it."""
        positions = [
            ref.position
            for handle in self.payload_handles()
            if (ref := self._ref_of(handle)) is not None and ref.slot == slot
        ]
        held = self.held_steps(list(self._step_refs))  # not released yet
        for step in held:
            positions.extend(
                ref.position
                for ref in self._step_refs[step]
                if isinstance(ref, JournalRef) and ref.slot == slot
            )
        positions.extend(self._recipes.positions(slot, held))
        return min(positions, default=None)

    def claim_slot(self, slot: str, frontend_id: str) -> SlotClaim:
        """`claim_journaled` for the front-end: batches to load, stored steps to load (by
        position) or to build (by recipe, with the digests to check)."""
        batches, step_refs = self.claim_journaled(slot, frontend_id)
        claim = SlotClaim(batches=batches)
        for step, refs in sorted(step_refs.items()):
            if isinstance(refs[0], Rederive):
                digests = [(ref.crc32c, ref.size) for ref in refs]
                claim.derive.append((self._recipes.get(step), digests))
            else:
                claim.steps[step] = [ref.position for ref in refs]
        return claim

    def recipe(self, step: int) -> StepWork | None:
        """How a held step named by `Rederive`s is built again (batches as JournalRefs)."""
        return self._recipes.get(step)

    def step_refs(self) -> dict[int, list[Ref]]:
        """Where each held step's responses are journaled, per rank (a copy): what
        `orphan_frontend` turns a dead front-end's steps back into."""
        return {step: list(refs) for step, refs in self._step_refs.items()}

    def take_releases(self) -> tuple[list[Any], list[int]]:
        payloads, steps = super().take_releases()
        for step in steps:
            self._step_refs.pop(step, None)
        self._recipes.forget(steps)
        return payloads, steps

    def close(self) -> None:
        self._journal.close()

    def register_tasks(self, task_ids: list[str]) -> tuple[int, int]:
        added, total = super().register_tasks(task_ids)
        if added:
            self._record("register_tasks", list(task_ids))
        return added, total

    def sample_tasks(self, n: int) -> SampleResult:
        result = super().sample_tasks(n)
        self._record("sample_tasks", int(n))
        return result

    def ingest_batch(self, meta: BatchMeta, payload: Any) -> IngestResult:
        result = super().ingest_batch(meta, payload)
        ref = self._ref_of(payload) if payload is not None else None
        self._record(
            "ingest_batch",
            _ref(ref),
            list(meta.rollout_ids),
            list(meta.task_ids),
            list(meta.group_ids),
            meta.policy_versions.tolist(),
            meta.rewards.tolist(),
            meta.lengths.tolist(),
            meta.policy_tokens.tolist(),
        )
        return result

    def plan_ready_steps(self) -> list[StepWork]:
        # Not recorded: replaying the ingest that made the steps ready plans them again.
        return [self._recipes.keep(work, self._ref_of) for work in super().plan_ready_steps()]

    def store_step(
        self,
        step: int,
        responses: list[Any],
        response_bytes: int | None = None,
        refs: list[Ref] | None = None,
    ) -> StepRecord:
        """Also `refs`: where each rank's response comes from after a restart (replayed
        as the handles): its journal position, or a `Rederive` of a `derivable` step."""
        if refs is None or len(refs) != len(responses):
            raise ValueError(f"step {step}: store_step needs a journal reference per rank")
        if isinstance(refs[0], Rederive) and self._recipes.get(step) is None:
            raise ValueError(f"step {step}: its responses were not journaled, nor its recipe")
        record = super().store_step(step, responses, response_bytes)
        self._stored(step, refs)
        self._record("store_step", int(step), [_ref(r) for r in refs], record.response_bytes)
        return record

    def _stored(self, step: int, refs: list[Ref]) -> None:
        self._step_refs[step] = list(refs)
        if not isinstance(refs[0], Rederive):  # journaled bytes: no need to build them
            self._recipes.forget([step])

    def fetch_batch(self, step: int, rank: int) -> FetchResult:
        first = self.first_fetch(step, rank)
        result = super().fetch_batch(step, rank)
        if first:
            self._record("fetch_batch", int(step), int(rank))
        return result

    def ack_steps(self, rank: int, through_step: int | None) -> int:
        acked = super().ack_steps(rank, through_step)
        self._record("ack_steps", int(rank), through_step)
        return acked

    def record_report(self, rank: int, report: dict[str, float]) -> None:
        super().record_report(rank, report)
        self._record("record_report", int(rank), self.last_reports[int(rank)])

    def record_rejection(self) -> None:
        super().record_rejection()
        self._record("record_rejection")

    # ---- recovery -----------------------------------------------------------------------

    def _recover(self) -> list[StepWork]:
        """Load the newest valid snapshot, then replay the calls recorded after it; return
        the steps planned but not stored, in step order (to materialize again). Every
        bytes handle in the state is then a `JournalRef`."""
        snapshot = self._snapshots.load_latest()
        after = 0
        if snapshot is not None:
            if snapshot.version not in READS_STATE_VERSIONS:
                raise JournalVersionError(
                    self._snapshots.directory / f"snapshot at {snapshot.position}",
                    "scheduler state",
                    snapshot.version,
                    READS_STATE_VERSIONS,
                )
            self.restore_state(snapshot.state, _unref)
            self._recipes.restore(snapshot.state.get("recipes", {}))
            after = snapshot.position
        unstored, calls = self._replay(after)
        self._versions.take_unreported()  # the metrics of the process that dropped them are gone
        stored = self.held_steps(self._steps.numbers())  # their handles are references now
        self._step_refs = {step: list(self._steps.responses(step)) for step in stored}
        if snapshot is not None or calls:
            _log.info(
                "rlfeed: scheduler rebuilt from %s and %d journaled calls: next step %d, %d "
                "rollouts buffered, %d steps to materialize again",
                f"the snapshot at {snapshot.position}" if snapshot else "no snapshot",
                calls,
                self.next_step,
                self.status().buffered_rollouts,
                len(unstored),
            )
        return unstored

    def _replay(self, after: int) -> tuple[list[StepWork], int]:
        """Apply every call recorded after position `after`: (unstored steps, calls)."""
        unstored: dict[int, StepWork] = {}
        calls = 0
        self._replaying = True
        try:
            for record in self._journal.records_after(after):
                version, method, *args = msgpack.unpackb(
                    record.payload, raw=False, strict_map_key=False
                )
                if version not in READS_CALL_FORMATS:
                    raise JournalVersionError(
                        self._journal.directory / f"record {record.seq}",
                        "scheduler call format",
                        version,
                        READS_CALL_FORMATS,
                    )
                planned, stored = self._apply_recorded(method, args)
                unstored.update((work.step, work) for work in planned)
                unstored.pop(stored, None)
                calls += 1
        finally:
            self._replaying = False
        self.take_releases()  # they name handles of processes that are gone
        return [unstored[step] for step in sorted(unstored)], calls

    def _apply_recorded(self, method: str, args: list) -> tuple[list[StepWork], int | None]:
        """Apply one recorded call through the plain Scheduler: (steps it planned, step it
        stored)."""
        if method == "ingest_batch":
            ref, ids, tasks, groups, versions, rewards, lengths, policy_tokens = args
            meta = BatchMeta(
                rollout_ids=ids,
                task_ids=tasks,
                group_ids=groups,
                policy_versions=np.asarray(versions, dtype=np.int64),
                rewards=np.asarray(rewards, dtype=np.float64),
                lengths=np.asarray(lengths, dtype=np.int64),
                policy_tokens=np.asarray(policy_tokens, dtype=np.int64),
            )
            result = Scheduler.ingest_batch(self, meta, _unref(ref))
            planned = Scheduler.plan_ready_steps(self) if result.steps_ready else []
            return [self._recipes.keep(work, self._ref_of) for work in planned], None
        if method == "store_step":
            step, refs, response_bytes = args
            handles = [_unref(r) for r in refs]
            Scheduler.store_step(self, step, handles, response_bytes)
            self._stored(step, handles)
            return [], step
        if method == "fetch_batch":
            Scheduler.fetch_batch(self, *args)
        elif method == "ack_steps":
            Scheduler.ack_steps(self, *args)
        elif method == "register_tasks":
            Scheduler.register_tasks(self, *args)
        elif method == "sample_tasks":
            Scheduler.sample_tasks(self, *args)
        elif method == "record_report":
            Scheduler.record_report(self, *args)
        elif method == "record_rejection":
            Scheduler.record_rejection(self)
        else:
            raise ValueError(f"{self._journal.directory}: unknown journaled call {method!r}")
        return [], None


def _storage_config(section: JournalConfig) -> JournalConfig:
    """`[journal]` for the scheduler's journal: appends never wait (the actor syncs once
    per call, in `commit`)."""
    return replace(section, sync="none")
