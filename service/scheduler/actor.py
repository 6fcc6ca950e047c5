"""The named Ray actor that hosts the sidecar's `Scheduler`: a thin shell, no logic.

One actor per sidecar, named `config.ray.actor_name`, so every front-end and tool finds it
with `ray.get_actor`. Calls run one at a time, in order. Only metadata and handles pass
through it; how front-ends, notes and releases use it is told in `frontend/README.md`.
Expected failures come back as values (`IngestReply.kind`, `Fetch.kind`, `Refused`), not
as Ray-wrapped exceptions.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import BackpressureError, InvalidBatchError
from rlfeed.service.scheduler.frontends import FrontendRegistry
from rlfeed.service.scheduler.journaled import JournaledScheduler
from rlfeed.service.scheduler.notes import FrontendNotes
from rlfeed.service.scheduler.records import (
    BatchHandle,
    BatchMeta,
    Fetch,
    FetchKind,
    IngestKind,
    IngestReply,
    Refused,
    Releases,
    SampleResult,
    SlotClaim,
    StoredObject,
)
from rlfeed.service.scheduler.state import Scheduler

_log = logging.getLogger("rlfeed.service.scheduler.actor")


class SchedulerActor:
    """Ray actor body: forwards each call to a Scheduler (created with ray.remote)."""

    def __init__(self, config: SidecarConfig, peer_token: str = "") -> None:
        # Which start of this actor this is: a front-end that sees it change re-registers.
        self._incarnation = secrets.token_hex(8)
        self._journaled = bool(config.journal.dir)
        # Front-ends, their slots and the planned steps each materializes.
        self._registry = FrontendRegistry(self._journaled)
        # Never materializes (front-ends do); reports what it stops needing. With a journal
        # it starts from what the journal holds (Ray restarts it there after a crash).
        self._scheduler: Scheduler | JournaledScheduler
        self._recovered_work: list = []
        if config.journal.dir:
            self._scheduler = JournaledScheduler(
                config, Path(config.journal.dir), self._registry.ref_of, on_write_failure=_fail_stop
            )
            self._recovered_work = self._scheduler.recovered_work
        else:
            self._scheduler = Scheduler(config, track_releases=True)
        self._notes = FrontendNotes(self._scheduler, self._registry)
        self._sidecar_stopping = False  # see stop_sidecar
        # The front-ends' secret for their peer ports: shared through Ray (whoever can call
        # this actor is inside the Ray cluster already), never through config or files.
        # Made by `create_scheduler_actor`, so a restarted actor keeps it.
        self._peer_token = peer_token or secrets.token_urlsafe(32)

    def ping(self) -> bool:
        return True

    def peer_token(self) -> str:
        return self._peer_token

    def incarnation(self, frontend_id: str = "") -> str:
        """Which start of this actor answers; a front-end's watch asks every second, which
        is also how `rlfeed status` knows it is alive."""
        self._registry.touch(frontend_id)
        return self._incarnation

    def _require_registered(self, frontend_id: str) -> None:
        """`FrontendRegistry.require_registered` (UNAVAILABLE for a front-end to retry)."""
        self._registry.require_registered(frontend_id)

    def register_frontend(
        self,
        frontend_id: str,
        peer_address: str,
        slot: str = "",
        address: str = "",
        node_id: str = "",
    ) -> None:
        """A front-end joined: other front-ends reach the ingest batches and responses it
        holds at `peer_address`; releases are kept for it from now on. `slot`: the folder
        of its journal (its batch keys are positions there), if journaling. `address` and
        `node_id`: where clients reach it and its Ray node, for `rlfeed status`."""
        self._registry.register(frontend_id, peer_address, slot, address, node_id)

    def claim_slot(self, frontend_id: str, slot: str) -> SlotClaim:
        """The front-end serving `slot` takes over what recovery left in that slot's
        journal (`Scheduler.claim_journaled`) and the planned steps to materialize again;
        it must load those positions before it serves them."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return SlotClaim()
        claim = self._scheduler.claim_slot(slot, frontend_id)
        work = self._registry.claim(slot, frontend_id, self._recovered_work, self._scheduler)
        self._recovered_work = []
        return replace(claim, work=work)

    def orphan_slot(self, slot: str) -> list[str]:
        """The front-end serving `slot` died (its process exited without handing over):
        forget it, turn the handles naming its memory back into references to its journal
        (`Scheduler.orphan_frontend`) and keep the planned steps it was materializing for
        the next front-end of the slot (`claim_slot`). Returns the front-end ids let go.
        Until that one claims the slot, fetches of its steps and materializations reading
        its batches answer UNAVAILABLE and are retried."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return []
        return self._registry.orphan(slot, self._scheduler)

    def step_payloads(self, step: int) -> dict[int, Any]:
        """The current handles of what a planned, unstored step reads (see
        `Scheduler.step_payloads`): for a front-end whose materialization failed."""
        return self._scheduler.step_payloads(step)

    def journal_floor(self, slot: str) -> int | None:
        """The oldest position of `slot`'s journal still needed (None: none is). Committed
        first: the front-end deletes what it does not count, so it must count only what
        recovery will not need again (a note flush may have left records not yet synced)."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return None
        self._commit()
        return self._scheduler.journal_floor(slot)

    def _commit(self) -> None:
        """Make the calls this one recorded durable before it answers (no-op unjournaled)."""
        if isinstance(self._scheduler, JournaledScheduler):
            self._scheduler.commit()

    def unregister_frontend(self, frontend_id: str) -> None:
        """A front-end stopped: no more releases are kept for it."""
        self._registry.frontends.pop(frontend_id, None)

    def frontend_addresses(self) -> dict[str, str]:
        """Front-end id -> peer address, of every registered front-end."""
        return {fid: known.peer_address for fid, known in self._registry.frontends.items()}

    def register_tasks(self, task_ids: list[str]) -> tuple[int, int] | Refused:
        """(added, total), or Refused naming the bad task id."""
        try:
            added = self._scheduler.register_tasks(task_ids)
        except ValueError as exc:
            return Refused(str(exc))
        self._commit()
        return added

    def sample_tasks(self, n: int) -> SampleResult:
        result = self._scheduler.sample_tasks(n)
        self._commit()
        return result

    def sync(self, frontend_id: str, notes: list) -> Releases:
        """Apply a front-end's notes; returns what it may free now. Made durable before
        answering only when that frees something: a note's record not yet on disk when the
        machine fails is lost as a note lost with its front-end is (a step stored but not
        recorded is built again, byte-identical; a fetch or acknowledgement keeps a step a
        little longer). Every call that changes the state commits all records before it
        answers, and so does `journal_floor`, whose answer lets a front-end delete. The
        assembler's note flushes are most of the actor's calls: their fsyncs queued the
        ingest calls that producers wait for."""
        if frontend_id in self._registry.orphaned:  # late: its steps go to its slot's next one
            raise RuntimeError(f"front-end {frontend_id} was declared dead")
        self._notes.apply(notes)
        releases = self._take_releases(frontend_id)
        if releases.payload_keys or releases.steps:
            self._commit()
        return releases

    def apply_notes(self, notes: list, then: str = "", *args: Any) -> Any:
        """Apply a front-end's notes (StoreStepNote, FetchNote, AckNote) in order, then
        answer `then(*args)` if named (the notes ride along with its next call). The notes'
        records and `then`'s are made durable by one commit, after `then`: nothing leaves
        the actor in between, so the answer waits for both as before, with one fsync."""
        self._notes.apply(notes)
        try:
            if not then:
                return None
            if then.startswith("_") or not callable(getattr(self, then, None)):
                raise ValueError(f"apply_notes: {then!r} is not a call of the scheduler actor")
            return getattr(self, then)(*args)
        finally:
            self._commit()  # a no-op when `then` committed and wrote nothing since

    def _take_releases(self, frontend_id: str) -> Releases:
        """What `frontend_id` may free of what the scheduler released since the last call."""
        return self._registry.take_releases(frontend_id, *self._scheduler.take_releases())

    def ingest(
        self, frontend_id: str, notes: list, batches: list[tuple[BatchMeta, Any]]
    ) -> list[IngestReply]:
        """Apply `notes`, then each (metadata, payload handle) batch in order, exactly as
        that many single calls would: buffer it, plan every step it made ready. Batches
        that arrived at a front-end together share the call (`IngestGroups`). The last
        reply carries what the front-end may free."""
        self._require_registered(frontend_id)
        self._notes.apply(notes)  # committed with the batches: one fsync
        replies = [self._ingest_one(meta, payload) for meta, payload in batches]
        self._commit()
        if self._journaled:
            for reply in replies:
                self._registry.materializing.update((w.step, (frontend_id, w)) for w in reply.work)
        if replies:
            replies[-1] = replace(replies[-1], releases=self._take_releases(frontend_id))
        return replies

    def _ingest_one(self, meta: BatchMeta, payload: Any) -> IngestReply:
        try:
            result = self._scheduler.ingest_batch(meta, payload)
        except (InvalidBatchError, BackpressureError) as exc:
            invalid = isinstance(exc, InvalidBatchError)
            if invalid:  # a full buffer is backpressure, not a rejected batch
                self._scheduler.record_rejection()
            kind = IngestKind.INVALID if invalid else IngestKind.BACKPRESSURE
            return IngestReply(kind=kind, result=None, message=str(exc), reason=exc.reason)
        work = self._scheduler.plan_ready_steps() if result.steps_ready else []
        return IngestReply(kind=IngestKind.OK, result=result, work=work)

    def record_rejection(self, frontend_id: str, notes: list) -> None:
        if frontend_id in self._registry.orphaned:
            return
        self._notes.apply(notes)
        self._scheduler.record_rejection()
        self._commit()

    def held_steps(self, steps: list[int]) -> list[int]:
        """Those of `steps` still stored (not released)."""
        return self._scheduler.held_steps(steps)

    def adopt_payloads(self, frontend_id: str, notes: list, columns: dict[int, Any]) -> list[int]:
        """A front-end leaving hands over the ingest batches it holds (key -> TokenColumns):
        they go into the object store, put there by this actor so that they outlive that
        process, and their handles become StoredObjects. Returns the unstored steps whose
        work still names the old handles."""
        self.apply_notes(notes)
        return self._scheduler.rehome_payloads(
            {BatchHandle(frontend_id, key): StoredObject(ray.put(b)) for key, b in columns.items()}
        )

    def unstored_steps(self, steps: list[int]) -> list[int]:
        return self._scheduler.unstored_steps(steps)

    def adopt_step(self, step: int, responses: list[bytes]) -> bool:
        """A front-end leaving hands over a held step's bytes: they go into the object
        store, put there by this actor (they outlive the front-end), and that reference
        is served from now on. False if the step was released meanwhile (nothing kept)."""
        if not self._scheduler.held_steps([step]):
            return False
        return self._scheduler.move_step(step, [StoredObject(ray.put(r)) for r in responses])

    def move_step(self, step: int, responses: list[StoredObject]) -> bool:
        """A front-end moved a held step's bytes into the object store (its memory is
        full): one per rank; False if the step was released meanwhile."""
        return self._scheduler.move_step(step, responses)

    def close(self) -> None:
        """Close the scheduler's journal (releasing its directory lock): for a host that
        keeps this body in-process, such as the golden-journal tools; Ray's actor exits."""
        if isinstance(self._scheduler, JournaledScheduler):
            self._scheduler.close()

    def stop_sidecar(self) -> None:
        """The first front-end is stopping the whole sidecar: replicas stopping now have
        nothing to hand over."""
        self._sidecar_stopping = True

    def sidecar_stopping(self) -> bool:
        return self._sidecar_stopping

    def fetch_batch(self, step: int, rank: int) -> Fetch:
        try:
            result = self._scheduler.fetch_batch(step, rank)
        except ValueError as exc:
            return Fetch(FetchKind.INVALID, str(exc))
        self._commit()
        if result.ready:
            return Fetch(FetchKind.READY, result.response)
        kind = FetchKind.RELEASED if result.released else FetchKind.WAITING
        return Fetch(kind, self._scheduler.next_step)

    def ack_steps(self, rank: int, through_step: int | None) -> int | Refused:
        """The rank's acknowledged step afterwards, or Refused (a rank outside the world, a
        step not assembled yet)."""
        try:
            acked = self._scheduler.ack_steps(rank, through_step)
        except ValueError as exc:
            return Refused(str(exc))
        self._commit()
        return acked

    def record_report(self, rank: int, report: dict[str, float]) -> Refused | None:
        """Refused for a rank outside the world or a negative step."""
        try:
            self._scheduler.record_report(rank, report)
        except ValueError as exc:
            return Refused(str(exc))
        self._commit()
        return None

    def status(self) -> Any:
        return replace(
            self._scheduler.status(),
            front_ends=len(self._registry.frontends),
            notes_refused=self._notes.refused,
            front_end_list=self._registry.seen(),
        )

    def step_records(self, since_step: int = 0) -> list:
        """Step statistics with step >= since_step (for the metrics exporter)."""
        return [r for r in self._scheduler.step_records if r.step >= since_step]

    def pass_rate_estimates(self) -> Any:
        """float64 [tasks]: every task's pass-rate estimate (the metrics' histogram)."""
        return self._scheduler.pass_rate_estimates()


# Ray's resource of the head node: an actor asking a sliver of it runs there (Ray's own
# state actors are placed so).
HEAD_NODE_RESOURCE = "node:__internal_head__"

# Ray runs its worker processes at nice 15 (`RAY_worker_niceness`), below everything else
# on the node, the producers and trainers the sidecar serves included: on a busy node an
# actor of the sidecar then got the CPU last (a front-end actor ingested 10-19% less than a
# forked `rlfeed serve` process, `bench_producers.py`). Its actors run at nice 0, as `rlfeed
# serve` does; Ray starts its own job supervisor actor the same way.
SERVING_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}


def _fail_stop(error: Exception) -> None:
    """The scheduler's journal cannot write: exit this actor's process at once, so that
    Ray restarts it from the journal (what it answered is all there; the call that failed
    was not answered). Calls meanwhile get UNAVAILABLE and are retried by the clients."""
    _log.critical("rlfeed: the scheduler's journal cannot write (%s): restarting from it", error)
    os._exit(70)


def create_scheduler_actor(
    config: SidecarConfig, on_head: bool = False, detached: bool = False
) -> ray.actor.ActorHandle:
    """Start the named scheduler actor; RuntimeError if one with that name already runs.
    `on_head`: place it on the Ray head node (front-ends as actors live on workers, whose
    loss must not take the scheduler along). `detached`: it outlives this driver."""
    name, namespace = config.ray.actor_name, config.ray.namespace
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    else:
        raise RuntimeError(
            f"a scheduler actor named {name!r} already runs in Ray namespace {namespace!r} "
            "(another rlfeed serve?); set [ray] actor_name to run a second sidecar"
        )
    actor_class = ray.remote(SchedulerActor)
    # With a journal Ray restarts a crashed actor, which rebuilds its state from it; without
    # one a restarted actor would start empty under the same name: the sidecar stops instead.
    restarts = -1 if config.journal.dir else 0
    options = actor_class.options(
        name=name,
        namespace=namespace,
        max_restarts=restarts,
        resources={HEAD_NODE_RESOURCE: 0.001} if on_head else None,
        lifetime="detached" if detached else None,
        runtime_env=SERVING_RUNTIME_ENV,
    )
    handle = options.remote(config, secrets.token_urlsafe(32))
    ray.get(handle.ping.remote())  # surface construction errors here, not on first use
    return handle
