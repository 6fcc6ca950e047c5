"""How a gRPC front-end talks to the scheduler actor: one submission order for all its
calls, with pending notes riding along (`ActorCalls`), and group commit for ingest
(`IngestGroups`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import ray
from rlfeed.service.scheduler.records import BatchMeta, FetchNote, IngestReply, StoreStepNote


class ActorCalls:
    """This front-end's calls to the scheduler actor, submitted in one order, with the
    pending notes (StoreStepNote / FetchNote) riding along on the next call.

    Taking the notes and submitting the call happen under one lock: Ray runs one caller's
    calls to an actor in submission order, so the actor sees a step's StoreStepNote before
    any FetchNote of it, and both before any later call of this front-end."""

    def __init__(self, actor: ray.actor.ActorHandle, frontend_id: str) -> None:
        self.actor = actor
        self.frontend_id = frontend_id
        self._notes: list = []
        self._notes_lock = threading.Lock()
        self._submit_lock = threading.Lock()

    def note(self, note: StoreStepNote | FetchNote) -> None:
        with self._notes_lock:
            self._notes.append(note)

    def _take_notes(self) -> list:
        with self._notes_lock:
            notes, self._notes = self._notes, []
            return notes

    def submit_with_notes(self, method: str, *args) -> ray.ObjectRef:
        """`actor.method(frontend_id, notes, *args)`, for the methods that take the notes."""
        with self._submit_lock:
            return getattr(self.actor, method).remote(self.frontend_id, self._take_notes(), *args)

    def submit(self, method: str, *args) -> ray.ObjectRef:
        """`actor.method(*args)`, after the pending notes (sent alone if there are any)."""
        with self._submit_lock:
            notes = self._take_notes()
            if notes:
                self.actor.apply_notes.remote(notes)
            return getattr(self.actor, method).remote(*args)

    def sync(self, force: bool = False) -> ray.ObjectRef | None:
        """Send the pending notes (if any, or if `force`) in a call that answers with what
        this front-end may free (`Releases`); None if nothing was sent."""
        with self._submit_lock:
            notes = self._take_notes()
            if notes or force:
                return self.actor.sync.remote(self.frontend_id, notes)
            return None


class _PendingIngest:
    """One handler thread's batch waiting in `IngestGroups`."""

    def __init__(self, meta: BatchMeta, handle: tuple[str, int] | None) -> None:
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

    def ingest(self, meta: BatchMeta, handle: tuple[str, int] | None) -> IngestReply:
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
