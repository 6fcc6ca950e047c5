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
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import BackpressureError, InvalidBatchError
from rlfeed.service.scheduler.journaled import JournaledScheduler
from rlfeed.service.scheduler.records import (
    BatchHandle,
    BatchMeta,
    Fetch,
    FetchKind,
    FetchNote,
    FrontendSeen,
    HeldBy,
    IngestKind,
    IngestReply,
    JournalRef,
    Refused,
    Releases,
    SampleResult,
    SlotClaim,
    StepWork,
    StoredObject,
    StoreStepNote,
)
from rlfeed.service.scheduler.state import Scheduler

_log = logging.getLogger("rlfeed.service.scheduler.actor")
_MAX_PENDING_STEP_RELEASES = 4096  # per front-end, see SchedulerActor._take_releases
# A front-end whose watch (it asks every second) has not asked for this long is shown
# "unresponsive" by `rlfeed status`.
_SERVING_WITHIN_S = 3.0


@dataclass
class _Frontend:
    """A registered front-end: where its peers reach it, and what it may free, kept until
    its next call that answers with `Releases`."""

    peer_address: str
    address: str = ""  # where clients reach it (host:port of its public port)
    node_id: str = ""  # the Ray node it runs on
    last_seen: float = field(default_factory=time.monotonic)  # its watch's last question
    released_keys: list[int] = field(default_factory=list)
    released_steps: list[int] = field(default_factory=list)

    def seen(self, frontend_id: str, slot: str, state: str | None = None) -> FrontendSeen:
        ago = time.monotonic() - self.last_seen
        if state is None:
            state = "serving" if ago <= _SERVING_WITHIN_S else "unresponsive"
        return FrontendSeen(frontend_id, self.address, self.node_id, slot, state, ago)


class SchedulerActor:
    """Ray actor body: forwards each call to a Scheduler (created with ray.remote)."""

    def __init__(self, config: SidecarConfig, peer_token: str = "") -> None:
        # Which start of this actor this is: a front-end that sees it change re-registers.
        self._incarnation = secrets.token_hex(8)
        self._journaled = bool(config.journal.dir)
        self._frontends: dict[str, _Frontend] = {}  # the registered ones, by id
        # Each front-end's journal slot, kept after it leaves: its journal outlives it.
        self._slots: dict[str, str] = {}
        # Never materializes (front-ends do); reports what it stops needing. With a journal
        # it starts from what the journal holds (Ray restarts it there after a crash).
        self._scheduler: Scheduler | JournaledScheduler
        self._recovered_work: list = []
        # Planned steps not stored yet: who materializes each, and its work, so that the
        # work of a front-end that dies goes to the next front-end of its slot.
        self._materializing: dict[int, tuple[str, StepWork]] = {}
        self._orphaned_work: dict[str, list[StepWork]] = {}  # slot -> work of its dead one
        self._orphaned: set[str] = set()  # front-ends declared dead: their calls are refused
        self._restarting: dict[str, tuple[str, _Frontend]] = {}  # slot -> the dead one
        if config.journal.dir:
            self._scheduler = JournaledScheduler(
                config, Path(config.journal.dir), self._ref_of, on_write_failure=_fail_stop
            )
            self._recovered_work = self._scheduler.recovered_work
        else:
            self._scheduler = Scheduler(config, track_releases=True)
        self._notes_refused = 0  # shown by status: each one is a bug, see apply_notes
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
        if frontend_id in self._frontends:
            self._frontends[frontend_id].last_seen = time.monotonic()
        return self._incarnation

    def _require_registered(self, frontend_id: str) -> None:
        """With a journal, a front-end this actor does not know (it restarted since) must
        register again first: its batches could not be journaled by their slot. Raised
        as an error, so the call answers UNAVAILABLE and the producer retries. A call of a
        front-end declared dead (`orphan_slot`) that arrives late is refused the same way."""
        if frontend_id in self._orphaned:
            raise RuntimeError(f"front-end {frontend_id} was declared dead")
        if self._journaled and frontend_id not in self._frontends:
            raise RuntimeError(
                f"front-end {frontend_id} is not registered with this scheduler (it restarted); "
                "the front-end registers again within a second"
            )

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
        known = self._frontends.setdefault(frontend_id, _Frontend(peer_address))
        known.address, known.node_id = address, node_id
        known.last_seen = time.monotonic()
        if slot:
            self._slots[frontend_id] = slot
            self._restarting.pop(slot, None)

    def claim_slot(self, frontend_id: str, slot: str) -> SlotClaim:
        """The front-end serving `slot` takes over what recovery left in that slot's
        journal (`Scheduler.claim_journaled`) and the planned steps to materialize again;
        it must load those positions before it serves them."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return SlotClaim()
        batches, steps = self._scheduler.claim_journaled(slot, frontend_id)
        work = [*self._recovered_work, *self._orphaned_work.pop(slot, [])]
        self._recovered_work = []
        # The handles as they are now: batches of this slot are this front-end's again.
        work = [replace(w, payloads=self._scheduler.step_payloads(w.step)) for w in work]
        for item in work:
            self._materializing[item.step] = (frontend_id, item)
        return SlotClaim(batches=batches, steps=steps, work=work)

    def orphan_slot(self, slot: str) -> list[str]:
        """The front-end serving `slot` died (its process exited without handing over):
        forget it, turn the handles naming its memory back into references to its journal
        (`Scheduler.orphan_frontend`) and keep the planned steps it was materializing for
        the next front-end of the slot (`claim_slot`). Returns the front-end ids let go.
        Until that one claims the slot, fetches of its steps and materializations reading
        its batches answer UNAVAILABLE and are retried."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return []
        dead = [fid for fid, s in self._slots.items() if s == slot and fid in self._frontends]
        for frontend_id in dead:
            self._restarting[slot] = (frontend_id, self._frontends.pop(frontend_id))
            self._orphaned.add(frontend_id)
            self._scheduler.orphan_frontend(frontend_id, slot, self._scheduler.step_refs())
            unstored = set(self._scheduler.unstored_steps(list(self._materializing)))
            orphaned = self._orphaned_work.setdefault(slot, [])
            for step, (owner, work) in sorted(self._materializing.items()):
                if owner == frontend_id and step in unstored:
                    orphaned.append(work)
                    del self._materializing[step]
        return dead

    def step_payloads(self, step: int) -> dict[int, Any]:
        """The current handles of what a planned, unstored step reads (see
        `Scheduler.step_payloads`): for a front-end whose materialization failed."""
        return self._scheduler.step_payloads(step)

    def journal_floor(self, slot: str) -> int | None:
        """The oldest position of `slot`'s journal still needed (None: none is)."""
        if not isinstance(self._scheduler, JournaledScheduler):
            return None
        return self._scheduler.journal_floor(slot)

    def _ref_of(self, handle: Any) -> JournalRef | None:
        """Where a payload handle's bytes are journaled (the scheduler's journal names it)."""
        if isinstance(handle, BatchHandle) and handle.frontend_id in self._slots:
            return JournalRef(self._slots[handle.frontend_id], handle.key)
        return handle if isinstance(handle, JournalRef) else None

    def _commit(self) -> None:
        """Make the calls this one recorded durable before it answers (no-op unjournaled)."""
        if isinstance(self._scheduler, JournaledScheduler):
            self._scheduler.commit()

    def unregister_frontend(self, frontend_id: str) -> None:
        """A front-end stopped: no more releases are kept for it."""
        self._frontends.pop(frontend_id, None)

    def frontend_addresses(self) -> dict[str, str]:
        """Front-end id -> peer address, of every registered front-end."""
        return {frontend_id: f.peer_address for frontend_id, f in self._frontends.items()}

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
        """Apply a front-end's notes; returns what it may free now."""
        if frontend_id in self._orphaned:  # late: its steps go to its slot's next one
            raise RuntimeError(f"front-end {frontend_id} was declared dead")
        self.apply_notes(notes)
        return self._take_releases(frontend_id)

    def apply_notes(self, notes: list) -> None:
        """Apply a front-end's StoreStepNote / FetchNote records, in order. A note the
        scheduler refuses (a bug, never an input error) is logged and skipped, so it cannot
        fail the call it rode along with or take the notes after it down."""
        for note in notes:
            try:
                if isinstance(note, StoreStepNote):
                    self._store_step(note)
                elif isinstance(note, FetchNote):
                    self._scheduler.fetch_batch(note.step, note.rank)
                else:
                    raise ValueError("unknown kind of note")
            except ValueError:
                self._notes_refused += 1
                _log.exception("rlfeed scheduler: note %r refused", note)
        self._commit()

    def _store_step(self, note: StoreStepNote) -> None:
        self._materializing.pop(note.step, None)
        if not isinstance(self._scheduler, JournaledScheduler):
            self._scheduler.store_step(note.step, note.handles, note.response_bytes)
            return
        frontend_id = self._frontend_of(note.handles[0])
        slot = self._slots.get(frontend_id, "")
        refs = [JournalRef(slot, position) for position in note.positions] if slot else None
        # A late note of a front-end declared dead: its journal holds the bytes, not it.
        handles = refs if refs and frontend_id in self._orphaned else note.handles
        self._scheduler.store_step(note.step, handles, note.response_bytes, refs)

    @staticmethod
    def _frontend_of(handle: Any) -> str:
        return handle.frontend_id if isinstance(handle, HeldBy) else ""

    def _take_releases(self, frontend_id: str) -> Releases:
        """Sort what the scheduler released since the last call by front-end (a batch goes
        to the front-end holding it, a step to every front-end: any may hold its bytes)
        and hand `frontend_id` its share."""
        payloads, steps = self._scheduler.take_releases()
        for handle in payloads:
            if not isinstance(handle, BatchHandle):  # StoredObject: freed with its reference
                continue
            owner, key = handle
            if owner in self._frontends:  # a front-end that left took its memory along
                self._frontends[owner].released_keys.append(key)
        if steps:
            for front_end in self._frontends.values():
                front_end.released_steps.extend(steps)
                # A front-end that stopped calling must not grow this without bound; a step
                # it misses leaves its memory with the cache limit instead.
                del front_end.released_steps[:-_MAX_PENDING_STEP_RELEASES]
        front_end = self._frontends.get(frontend_id)
        if front_end is None:
            return Releases()
        releases = Releases(payload_keys=front_end.released_keys, steps=front_end.released_steps)
        front_end.released_keys, front_end.released_steps = [], []
        return releases

    def ingest(
        self, frontend_id: str, notes: list, batches: list[tuple[BatchMeta, Any]]
    ) -> list[IngestReply]:
        """Apply `notes`, then each (metadata, payload handle) batch in order, exactly as
        that many single calls would: buffer it, plan every step it made ready. Batches
        that arrived at a front-end together share the call (`IngestGroups`). The last
        reply carries what the front-end may free."""
        self._require_registered(frontend_id)
        self.apply_notes(notes)
        replies = [self._ingest_one(meta, payload) for meta, payload in batches]
        self._commit()
        if self._journaled:
            for reply in replies:
                self._materializing.update((w.step, (frontend_id, w)) for w in reply.work)
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
        if frontend_id in self._orphaned:
            return
        self.apply_notes(notes)
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
        front_end_list = [
            known.seen(fid, self._slots.get(fid, "")) for fid, known in self._frontends.items()
        ]
        front_end_list += [
            dead.seen(fid, slot, "restarting") for slot, (fid, dead) in self._restarting.items()
        ]
        return replace(
            self._scheduler.status(),
            front_ends=len(self._frontends),
            notes_refused=self._notes_refused,
            front_end_list=tuple(sorted(front_end_list, key=lambda f: (f.slot, f.frontend_id))),
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


def _fail_stop(error: Exception) -> None:
    """The scheduler's journal cannot write: exit this actor's process at once, so that
    Ray restarts it from the journal (what it answered is all there; the call that failed
    was not answered). Calls meanwhile get UNAVAILABLE and are retried by the clients."""
    _log.critical("rlfeed: the scheduler's journal cannot write (%s): restarting from it", error)
    os._exit(70)


def create_scheduler_actor(config: SidecarConfig, on_head: bool = False) -> ray.actor.ActorHandle:
    """Start the named scheduler actor; RuntimeError if one with that name already runs.
    `on_head`: place it on the Ray head node (front-ends as actors live on workers, whose
    loss must not take the scheduler along)."""
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
    )
    handle = options.remote(config, secrets.token_urlsafe(32))
    ray.get(handle.ping.remote())  # surface construction errors here, not on first use
    return handle
