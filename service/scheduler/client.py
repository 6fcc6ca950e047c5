"""How a front-end talks to the scheduler actor: typed methods in one submission order,
with pending notes riding along (`SchedulerClient`), and group commit for ingest
(`IngestGroups`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import ray
from rlfeed.service.scheduler.records import (
    AckNote,
    BatchHandle,
    BatchMeta,
    Fetch,
    FetchNote,
    IngestReply,
    Refused,
    Releases,
    SampleResult,
    SlotClaim,
    StatusSnapshot,
    StoredObject,
    StoreStepNote,
)


class SchedulerClient:
    """One front-end's calls to the scheduler actor, each a typed method that waits for
    the answer (Ray errors propagate: the caller answers UNAVAILABLE).

    Pending notes (StoreStepNote / FetchNote / AckNote) ride along on the next call. Taking
    the notes and submitting the call happen under one lock: Ray runs one caller's calls to
    an actor in submission order, so the actor sees a step's StoreStepNote before any
    FetchNote of it, a rank's fetches before its acknowledgements, and all of them before
    any later call of this front-end."""

    def __init__(self, actor: ray.actor.ActorHandle, frontend_id: str) -> None:
        self.actor = actor
        self.frontend_id = frontend_id
        self._notes: list[StoreStepNote | FetchNote | AckNote] = []
        self._notes_lock = threading.Lock()
        self._submit_lock = threading.Lock()

    def note(self, note: StoreStepNote | FetchNote | AckNote) -> None:
        with self._notes_lock:
            self._notes.append(note)

    def _take_notes(self) -> list[StoreStepNote | FetchNote | AckNote]:
        with self._notes_lock:
            notes, self._notes = self._notes, []
            return notes

    def _with_notes(self, method: str, *args) -> Any:
        """`actor.method(frontend_id, notes, *args)`, for the methods that take the notes."""
        with self._submit_lock:
            ref = getattr(self.actor, method).remote(self.frontend_id, self._take_notes(), *args)
        return ray.get(ref)

    def _after_notes(self, method: str, *args) -> Any:
        """`actor.method(*args)`, after the pending notes: with any, in the same actor call
        (`apply_notes(notes, method, *args)`), as each Ray call costs the front-end and the
        actor about 1 ms of CPU (AckSteps, once a step per rank, went with two)."""
        with self._submit_lock:
            notes = self._take_notes()
            if notes:
                ref = self.actor.apply_notes.remote(notes, method, *args)
            else:
                ref = getattr(self.actor, method).remote(*args)
        return ray.get(ref)

    # ---- ingest and tasks ------------------------------------------------------------

    def ingest(self, batches: list[tuple[BatchMeta, BatchHandle | None]]) -> list[IngestReply]:
        return self._with_notes("ingest", batches)

    def record_rejection(self) -> None:
        """Count a batch this front-end refused before the actor saw it (not waited for)."""
        with self._submit_lock:
            self.actor.record_rejection.remote(self.frontend_id, self._take_notes())

    def register_tasks(self, task_ids: list[str]) -> tuple[int, int] | Refused:
        return self._after_notes("register_tasks", task_ids)

    def sample_tasks(self, n: int) -> SampleResult:
        return self._after_notes("sample_tasks", n)

    # ---- serving ---------------------------------------------------------------------

    def fetch_batch(self, step: int, rank: int) -> Fetch:
        return self._after_notes("fetch_batch", step, rank)

    def ack_steps(self, rank: int, through_step: int | None) -> int | Refused:
        # After the notes: the actor sees this front-end's fetches of the steps first.
        return self._after_notes("ack_steps", rank, through_step)

    def record_report(self, rank: int, report: dict[str, float]) -> Refused | None:
        return self._after_notes("record_report", rank, report)

    def status(self) -> StatusSnapshot:
        return self._after_notes("status")

    def sync(self, force: bool = False) -> Releases | None:
        """Send the pending notes (if any, or if `force`) in a call that answers with what
        this front-end may free; None if nothing was sent."""
        with self._submit_lock:
            notes = self._take_notes()
            if not (notes or force):
                return None
            ref = self.actor.sync.remote(self.frontend_id, notes)
        return ray.get(ref)

    # ---- stored steps and replicas -----------------------------------------------------

    def held_steps(self, steps: list[int]) -> list[int]:
        return self._after_notes("held_steps", steps)

    def move_step(self, step: int, responses: list[StoredObject]) -> bool:
        return self._after_notes("move_step", step, responses)

    def register(
        self, peer_address: str, slot: str = "", address: str = "", node_id: str = ""
    ) -> None:
        """Join the scheduler: peers reach this front-end at `peer_address`, clients at
        `address`; `slot` names its journal folder, `node_id` its Ray node."""
        ray.get(
            self.actor.register_frontend.remote(
                self.frontend_id, peer_address, slot, address, node_id
            )
        )

    def journal_floor(self, slot: str) -> int | None:
        """After the pending notes: the oldest position of `slot` the scheduler needs."""
        return self._after_notes("journal_floor", slot)

    def claim_slot(self, slot: str) -> SlotClaim:
        return self._after_notes("claim_slot", self.frontend_id, slot)

    def unregister(self, timeout_s: float) -> None:
        ray.get(self.actor.unregister_frontend.remote(self.frontend_id), timeout=timeout_s)

    def incarnation(self, timeout_s: float) -> str:
        """Which start of the actor answers (it changes when Ray restarts it)."""
        return ray.get(self.actor.incarnation.remote(self.frontend_id), timeout=timeout_s)

    def drop_notes(self) -> None:
        """Forget the pending notes: the actor they were for is gone, and the one that
        replaced it learns the truth from the journal (`claim_slot`)."""
        self._take_notes()

    def peer_token(self) -> str:
        """The secret every front-end of this sidecar presents on the others' peer ports."""
        return ray.get(self.actor.peer_token.remote())

    def frontend_addresses(self) -> dict[str, str]:
        return ray.get(self.actor.frontend_addresses.remote())

    def sidecar_stopping(self) -> bool:
        return self._after_notes("sidecar_stopping")

    def adopt_payloads(self, columns: dict[int, Any]) -> list[int]:
        return self._with_notes("adopt_payloads", columns)

    def adopt_step(self, step: int, responses: list[bytes]) -> bool:
        return self._after_notes("adopt_step", step, responses)

    def unstored_steps(self, steps: list[int]) -> list[int]:
        return self._after_notes("unstored_steps", steps)

    def step_payloads(self, step: int) -> dict[int, Any]:
        return self._after_notes("step_payloads", step)


class _PendingIngest:
    """One handler thread's batch waiting in `IngestGroups`."""

    def __init__(self, meta: BatchMeta, handle: BatchHandle | None) -> None:
        self.meta, self.handle = meta, handle
        self.done = threading.Event()  # answered, or asked to lead the next call
        self.lead = False
        self.reply: IngestReply | None = None
        self.error: BaseException | None = None


class IngestGroups:
    """Group commit for ingest: batches that reach this front-end while its ingest call is
    in flight go to the actor together, in one call, in arrival order; the actor applies
    them one by one exactly as single calls. A Ray call costs the same for one batch as
    for many, so with many producers the calls per batch fall instead of piling up.

    The thread whose batch finds no call in flight leads: it sends every waiting batch,
    answers their threads, and hands the lead to the first batch that arrived meanwhile."""

    def __init__(self, send: Callable[[list], list[IngestReply]]) -> None:
        self._send = send  # [(meta, handle)] -> one reply each, in order (one actor call)
        self._lock = threading.Lock()
        self._waiting: list[_PendingIngest] = []
        self._leading = False

    def ingest(self, meta: BatchMeta, handle: BatchHandle | None) -> IngestReply:
        mine = _PendingIngest(meta, handle)
        with self._lock:
            self._waiting.append(mine)
            lead = not self._leading
            self._leading = True
        if not lead:
            mine.done.wait()
        if lead or mine.lead:
            self._send_waiting()
        if mine.error is not None:
            raise mine.error
        return mine.reply

    def _send_waiting(self) -> None:
        with self._lock:
            group, self._waiting = self._waiting, []
        try:
            batches = [(pending.meta, pending.handle) for pending in group]
            replies = self._send(batches)
            for pending, reply in zip(group, replies, strict=True):
                pending.reply = reply
        except BaseException as exc:  # every thread of the group reports it (UNAVAILABLE)
            for pending in group:
                pending.error = exc
        with self._lock:
            successor = self._waiting[0] if self._waiting else None
            self._leading = successor is not None
        if successor is not None:
            successor.lead = True
            successor.done.set()
        for pending in group:
            pending.done.set()
