"""A front-end's journal (`[journal] dir`/`frontend-N/`): the bytes it acknowledges.

Two kinds of record, each written (and synced per `[journal] sync`) before anyone relies
on it: an accepted ingest batch's Arrow IPC payload as received, before the scheduler
sees the batch (so before the producer's ack), and each rank's response of a step it
materialized, before its store note goes to the scheduler. A record's position is the
batch's key in this front-end's memory, so the scheduler's journal can name it
(`JournalRef(slot, position)`). One writer per slot (the directory lock): the front-end
that serves a slot after a restart finds its predecessor's records there.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grpc_health.v1 import health, health_pb2
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.journal import Journal, JournalCorruptError
from rlfeed.service.scheduler.client import SchedulerClient
from rlfeed.service.scheduler.records import SlotClaim

_log = logging.getLogger(__name__)

KIND_BATCH = 1  # an ingest batch's Arrow IPC stream, as received
KIND_RESPONSE = 2  # one rank's serialized GetBatchResponse of a step


def frontend_slot(index: int) -> str:
    """The journal folder of the `index`-th front-end (0: the first process)."""
    return f"frontend-{index}"


def open_slot_journal(config: SidecarConfig, slot: str) -> Journal | None:
    """This front-end's journal, or None when `[journal] dir` is unset."""
    if not config.journal.dir:
        return None
    return Journal.open(Path(config.journal.dir) / slot, config.journal)


def load_claim(
    journal: Journal, claim: SlotClaim, payloads: LocalPayloads, responses: ResponseCache
) -> tuple[int, int]:
    """Load into memory what the scheduler says this slot holds and memory lacks: ingest
    batches under their position as key, stored steps' responses into the cache. One
    sequential read from the oldest position needed. Returns (batches, steps) loaded;
    JournalCorruptError if a position is missing (the journal lost what it acknowledged)."""
    batches = {p for p in claim.batches if not payloads.holds(p)}
    rank_of = {
        position: (step, rank)
        for step, positions in claim.steps.items()
        if responses.get(step) is None
        for rank, position in enumerate(positions)
    }
    needed = batches | set(rank_of)
    if not needed:
        return 0, 0
    loaded: dict[int, list[bytes | None]] = {}
    found = set()
    for record in journal.records_after(min(needed) - 1):
        if record.seq in batches:
            payloads.put(record.seq, decode_rollout_batch(record.payload).columns)
        elif record.seq in rank_of:
            step, rank = rank_of[record.seq]
            loaded.setdefault(step, [None] * len(claim.steps[step]))[rank] = record.payload
        else:
            continue
        found.add(record.seq)
        if len(found) == len(needed):
            break
    missing = sorted(needed - found)
    if missing:
        raise JournalCorruptError(
            journal.directory, missing[0], f"{len(missing)} acknowledged records are missing"
        )
    for step in sorted(loaded):
        responses.put(step, loaded[step])
    return len(batches), len(loaded)


class SlotRetention:
    """Deletes the segments of a front-end's journal that nothing needs any more: every
    record before the oldest position the scheduler still refers to, and before any record
    on its way to the scheduler (appended, the actor not told yet: `appending`)."""

    def __init__(self, journal: Journal, slot: str) -> None:
        self.journal, self.slot = journal, slot
        self._pending: Counter[int] = Counter()  # lower bounds of records on their way
        self._lock = threading.Lock()

    @contextmanager
    def appending(self) -> Iterator[None]:
        """Around an append and the call that tells the scheduler of it."""
        with self._lock:
            bound = self.journal.last_position + 1  # what is appended now is at or past it
            self._pending[bound] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending[bound] -= 1
                if not self._pending[bound]:
                    del self._pending[bound]

    def trim(self, scheduler: SchedulerClient) -> int:
        """Delete what is not needed; returns the segments deleted."""
        with self._lock:  # first: a record appended after this is past `floor`
            floor = min(self._pending, default=self.journal.last_position + 1)
        needed = scheduler.journal_floor(self.slot)
        if needed is not None:
            floor = min(floor, needed)
        return len(self.journal.delete_before(floor))


INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["RolloutIngest"].full_name


class JournalHealth:
    """While the front-end's journal cannot write (disk full, I/O error), ingest's health
    is NOT_SERVING (batches are refused RESOURCE_EXHAUSTED; serving goes on) and a
    warning says why, once. The journal heals on the next append that the disk takes (a
    producer's retry), and then a line says so: only a real write shows the disk takes
    writes again (a sync with nothing to write would "heal" a disk that is still full)."""

    def __init__(self, journal: Journal, health_servicer: health.HealthServicer) -> None:
        self.journal, self.health, self.down = journal, health_servicer, False

    def __call__(self) -> None:
        fault = self.journal.fault
        answer = health_pb2.HealthCheckResponse
        if fault is not None and not self.down:
            self.down = True
            self.health.set(INGEST_SERVICE, answer.NOT_SERVING)
            _log.warning(
                "rlfeed: journal %s cannot write (%s): ingest refused until it can",
                self.journal.directory,
                fault,
            )
        elif fault is None and self.down:
            self.down = False
            self.health.set(INGEST_SERVICE, answer.SERVING)
            _log.warning("rlfeed: journal %s writes again: ingest resumed", self.journal.directory)
