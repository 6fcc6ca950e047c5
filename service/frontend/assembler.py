"""The assembler thread: materializes the steps the actor planned, off the ingest path.

A producer's ack waits for planning (in the actor) but never for materialization: the
planned work comes back with the ack and this thread turns it into every rank's response
bytes, keeps them in the front-end's memory, notes the step stored for the actor, and
keeps that memory bounded by moving the oldest held steps into the object store.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from dataclasses import replace

import grpc
import ray
from rlfeed.sched.assembly import TokenColumns
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.frontend.journaling import journal_step
from rlfeed.service.frontend.state import FrontendState
from rlfeed.service.scheduler.records import (
    BatchHandle,
    JournalRef,
    Releases,
    StepWork,
    StoredObject,
    StoreStepNote,
)

_log = logging.getLogger("rlfeed.service.frontend.assembler")
ASSEMBLY_RETRY_SECONDS = 1.0  # after a failed step materialization (the step is kept)
# Notes wait for the front-end's next actor call; with none for this long, they go alone.
NOTE_FLUSH_SECONDS = 0.05
# An idle front-end asks the actor this often what it may free, notes or not.
RELEASES_POLL_SECONDS = 1.0


def _step_of(item: tuple[int, float, StepWork]) -> int:
    return item[0]


# What a round fails with while another front-end is away (a replica restarting: its peer
# port gone, its batches waiting in its journal slot): said in one line, no traceback.
_PEER_AWAY = (RuntimeError, grpc.RpcError)


class AssemblyFailures:
    """Failed assembly rounds in a row, logged so that a failure lasting as long as a
    replica's restart is one warning and one line when it ends, not a traceback a second:
    the first failure of a streak is a warning (with its traceback only if unexpected), the
    retries are debug lines, and the first round that succeeds after it says so. The
    scheduler actor not answering is the watch's to report (`watch.py`: a warning at once,
    then its restart or the sidecar stopping), so it is debug here throughout."""

    def __init__(self, logger: logging.Logger = _log) -> None:
        self._log = logger
        self.count = 0  # failed rounds in this streak
        self._since = 0.0
        self._warned: str | None = None  # what the streak's warning named

    def failed(self, exc: Exception, step: int | None) -> None:
        """A round failed: materializing `step`, or (None) its notes and releases."""
        if self.count == 0:
            self._since = time.monotonic()
        self.count += 1
        what = f"step {step}" if step is not None else "the notes and releases"
        cause = f"{type(exc).__name__}: {str(exc)[:300]}"
        if isinstance(exc, ray.exceptions.RayActorError) or self._warned is not None:
            self._log.debug("rlfeed: %s failed again (%s); retrying in 1 s", what, cause)
            return
        self._warned = what
        self._log.warning(
            "rlfeed: %s %s (%s); retrying every %.0f s, quiet until it succeeds",
            what,
            "cannot be assembled yet" if step is not None else "failed",
            cause,
            ASSEMBLY_RETRY_SECONDS,
            exc_info=not isinstance(exc, _PEER_AWAY),
        )

    def succeeded(self) -> None:
        """A round went through: the end of a streak, said if its start was."""
        if self._warned is not None:
            done = "went through" if self._warned.startswith("the ") else "assembled and stored"
            self._log.warning(
                "rlfeed: %s %s after %d failed attempts over %.1f s",
                self._warned,
                done,
                self.count,
                time.monotonic() - self._since,
            )
        self.count, self._warned = 0, None


class StepAssembler:
    """Owns the planned-but-unstored steps, the steps moved out of memory, and the thread."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend
        # Steps the actor planned (and so removed from its buffer) that are not stored yet,
        # in step order: kept until stored, so a failed materialization is retried.
        self._unstored: list[tuple[int, float, StepWork]] = []  # (step, planned at, work)
        self._unstored_lock = threading.Lock()
        # Steps moved out of memory: their object references (this process owns them)
        # until the actor releases the step; `hand_over` re-homes the held ones.
        self._moved_out: dict[int, list[StoredObject]] = {}
        self._last_sync = time.monotonic()
        self._work_ready = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first ready step
        self._thread_lock = threading.Lock()
        self.failures = AssemblyFailures()
        # The step whose materialization failed last round (None: not one): for the log.
        self.failing_step: int | None = None

    # ---- the thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread that materializes planned steps and, when idle, sends notes and
        collects releases (so a front-end that never plans a step still frees batches)."""
        with self._thread_lock:
            if self._thread is None and not self.frontend.signals.stopping:
                self._thread = threading.Thread(
                    target=self._loop, name="rlfeed-assembler", daemon=True
                )
                self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Wake the thread to leave (the front-end's signals say stopping); True once it has."""
        self._work_ready.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            return not self._thread.is_alive()
        return True

    def add_work(self, work: list[StepWork]) -> None:
        """Queue planned steps; a step already queued takes the newer work (a restarted
        actor hands back the steps it planned before, see `_take_over_slot`)."""
        planned_at = time.time()
        steps = {item.step for item in work}
        with self._unstored_lock:
            self._unstored = [entry for entry in self._unstored if entry[0] not in steps]
            for item in work:
                bisect.insort(self._unstored, (item.step, planned_at, item), key=_step_of)
        self.start()
        self._work_ready.set()

    def _loop(self) -> None:
        """With nothing to assemble for NOTE_FLUSH_SECONDS, send the notes no call took
        along (and, every RELEASES_POLL_SECONDS, ask even without notes). What to do is read
        from the state, not from the wake-up: work inserted just after a timed-out wait is
        still assembled."""
        signals = self.frontend.signals
        while True:
            self._work_ready.wait(timeout=NOTE_FLUSH_SECONDS)
            self._work_ready.clear()  # before reading the state: later work wakes us again
            if signals.stopping:
                return
            self.failing_step = None
            try:
                if self.has_unstored():
                    self.assemble()
                else:
                    due = time.monotonic() - self._last_sync > RELEASES_POLL_SECONDS
                    releases = self.frontend.scheduler.sync(force=due)
                    if releases is not None:
                        self.free(releases)
            except Exception as exc:  # a dead actor surfaces on the next handler call too
                if not signals.stopping:
                    self.failures.failed(exc, self.failing_step)
                    time.sleep(ASSEMBLY_RETRY_SECONDS)
                    self._work_ready.set()
            else:
                self.failures.succeeded()

    # ---- the work --------------------------------------------------------------------

    def has_unstored(self) -> bool:
        with self._unstored_lock:
            return bool(self._unstored)

    def assemble(self) -> None:
        """Materialize every planned step, lowest first, keep the responses in memory and
        note the step stored for the actor.

        The StoreStepNote is queued before the step enters the cache, so any FetchNote of
        the step is queued (and reaches the actor) after it; `storing` covers both, for a
        fetch answered with this front-end's marker in between."""
        frontend = self.frontend
        while True:
            with self._unstored_lock:
                if not self._unstored:
                    break
                step, planned_at, work = self._unstored[0]
            self.failing_step = step
            try:
                responses = materialize_work(work, resolve=self._resolve_payload)
            except Exception:
                self._refresh_payloads(step)  # a front-end holding a batch may have died
                raise
            self.failing_step = None
            size = sum(map(len, responses))
            # The record store_step returns, known without waiting; reported before any
            # fetch can see the step.
            record = replace(work.record, response_bytes=size)
            frontend.events.on_step(record, responses=responses, ready_time=planned_at)
            with self._journaling():
                # Digests, or (a step the scheduler cannot build again) the bytes, journaled
                # before the actor hears of the step: its journal names them.
                journal = frontend.journal
                positions, digests = journal_step(journal, work, responses) if journal else ([], [])
                with frontend.storing:
                    handles = [frontend.marker] * len(responses)
                    frontend.scheduler.note(StoreStepNote(step, handles, size, positions, digests))
                    frontend.responses.put(step, responses)
                    # Stored: never built again, whatever fails below (the actor will release
                    # the batches it read). Work for a lower step may have arrived meanwhile.
                    with self._unstored_lock:
                        index = bisect.bisect_left(self._unstored, step, key=_step_of)
                        del self._unstored[index]
            frontend.signals.stored_here(step)
            if frontend.announce:
                try:  # best effort: a waiting rank elsewhere then takes the actor's path
                    frontend.peers.announce_stored(step)
                except Exception:
                    _log.warning("rlfeed: announcing step %d to the other front-ends failed", step)
        self._move_out_old_steps()

    def _journaling(self) -> contextlib.AbstractContextManager:
        retention = self.frontend.retention
        return retention.appending() if retention is not None else contextlib.nullcontext()

    def _refresh_payloads(self, step: int) -> None:
        """Take the actor's current handles of what `step` reads: one naming a front-end
        that died is a journal reference now, and once the next front-end of its slot has
        claimed it, a handle to that one's memory (`SchedulerActor.orphan_slot`)."""
        payloads = self.frontend.scheduler.step_payloads(step)
        if not payloads:
            return  # stored or not planned: nothing to materialize with other handles
        with self._unstored_lock:
            index = bisect.bisect_left(self._unstored, step, key=_step_of)
            if index < len(self._unstored) and self._unstored[index][0] == step:
                _, planned_at, work = self._unstored[index]
                self._unstored[index] = (step, planned_at, replace(work, payloads=payloads))

    def _resolve_payload(self, handle: BatchHandle | StoredObject | JournalRef) -> TokenColumns:
        """An ingest batch's columns: from this front-end's memory, from the front-end that
        decoded it (the step being materialized holds it there until stored), or from the
        object store (its front-end has left, see `hand_over`). A journal reference is a
        batch whose front-end died and whose slot no front-end has claimed yet."""
        if isinstance(handle, JournalRef):
            raise RuntimeError(f"ingest batch {handle} waits for its slot's next front-end")
        if isinstance(handle, StoredObject):
            return ray.get(handle.ref)
        if handle.frontend_id != self.frontend.id:
            return self.frontend.peers.payload(handle.frontend_id, handle.key)
        return self.frontend.payloads.get(handle.key)

    def free(self, releases: Releases) -> None:
        """Free what the actor released: batches nothing reads any more, and responses of
        steps no longer servable (their memory goes to the next steps)."""
        self._last_sync = time.monotonic()
        self.frontend.payloads.release(releases.payload_keys)
        self.frontend.responses.drop(releases.steps)
        for step in releases.steps:
            self._moved_out.pop(step, None)

    def moved_out(self) -> dict[int, list[StoredObject]]:
        """Steps moved out of memory and not released yet, with their references (a copy)."""
        return dict(self._moved_out)

    def _move_out_old_steps(self) -> None:
        """Keep memory bounded: of the oldest steps beyond the cache size, put those the
        actor still holds into the object store and hand it the references (before dropping
        them here, so a fetch answered with the marker finds the bytes on its next ask);
        released ones are simply dropped."""
        responses_cache, scheduler = self.frontend.responses, self.frontend.scheduler
        oldest = responses_cache.oldest_beyond()
        if not oldest:
            return
        held = set(scheduler.held_steps(oldest))
        for step in oldest:
            responses = responses_cache.get(step)
            if step in held and responses is not None:
                refs = [StoredObject(ray.put(response)) for response in responses]
                self._moved_out[step] = refs
                if not scheduler.move_step(step, refs):
                    self._moved_out.pop(step, None)  # released meanwhile (maybe freed first)
        responses_cache.drop(oldest)
