"""`FrontendNotes`: what a front-end tells the scheduler actor without waiting for an answer
(`StoreStepNote`, `FetchNote`, `AckNote`), applied in order when they ride along with its
next call (`frontend/README.md`, "Notes").

The actor records the notes' state changes here and commits them with the call they came
with, or (a flush of notes alone) when that call frees something (`SchedulerActor.sync`).
"""

from __future__ import annotations

import logging
from typing import Any

from rlfeed.service.scheduler.frontends import FrontendRegistry
from rlfeed.service.scheduler.journaled import JournaledScheduler
from rlfeed.service.scheduler.records import (
    AckNote,
    FetchNote,
    HeldBy,
    JournalRef,
    Rederive,
    StoreStepNote,
)
from rlfeed.service.scheduler.state import Scheduler

_log = logging.getLogger("rlfeed.service.scheduler.actor")  # where these lines came from


class FrontendNotes:
    """Applies the front-ends' notes to the scheduler: recorded, not committed. A note the
    scheduler refuses (a bug, never an input error) is logged, counted (`refused`, shown by
    the status) and skipped, so it cannot fail the call or take the notes after it down."""

    def __init__(self, scheduler: Scheduler | JournaledScheduler, registry: FrontendRegistry):
        self._scheduler = scheduler
        self._registry = registry
        self.refused = 0

    def apply(self, notes: list) -> None:
        for note in notes:
            try:
                if isinstance(note, StoreStepNote):
                    self._store_step(note)
                elif isinstance(note, FetchNote):
                    self._scheduler.fetch_batch(note.step, note.rank)
                elif isinstance(note, AckNote):
                    self._scheduler.ack_steps(note.rank, note.through_step)
                else:
                    raise ValueError("unknown kind of note")
            except ValueError:
                self.refused += 1
                _log.exception("rlfeed scheduler: note %r refused", note)

    def _store_step(self, note: StoreStepNote) -> None:
        self._registry.materializing.pop(note.step, None)
        if not isinstance(self._scheduler, JournaledScheduler):
            self._scheduler.store_step(note.step, note.handles, note.response_bytes)
            return
        frontend_id = _frontend_of(note.handles[0])
        slot = self._registry.slots.get(frontend_id, "")
        refs: list | None = None
        if slot and note.digests:  # built again from its batches after a restart
            refs = [Rederive(slot, crc, size) for crc, size in note.digests]
        elif slot:
            refs = [JournalRef(slot, position) for position in note.positions]
        # A late note of a front-end declared dead: its journal holds the bytes, not it.
        handles = refs if refs and frontend_id in self._registry.orphaned else note.handles
        self._scheduler.store_step(note.step, handles, note.response_bytes, refs)


def _frontend_of(handle: Any) -> str:
    return handle.frontend_id if isinstance(handle, HeldBy) else ""
