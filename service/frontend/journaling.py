"""A front-end's journal (`[journal] dir`/`frontend-N/`): the bytes it acknowledges.

An accepted ingest batch's Arrow IPC payload as received is written (and synced per
`[journal] sync`) before the scheduler sees the batch, so before the producer's ack. A
record's position is the batch's key in this front-end's memory, so the scheduler's journal
can name it (`JournalRef(slot, position)`). A step's responses are not written: they are
built from those batches, deterministically, so the scheduler keeps the step's recipe and
the (CRC32C, size) of each rank's bytes, and after a restart the front-end of the slot
builds them again and checks them (`load_claim`; `scheduler/recipes.py`). Only a step
reading a batch that is in no journal has its responses journaled (a second record kind,
also what journals of earlier versions hold). One writer per slot (the directory lock):
the front-end that serves a slot after a restart finds its predecessor's records there.
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
from rlfeed.sched.assembly import TokenColumns
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.journal import Journal, JournalCorruptError, JournalError
from rlfeed.service.journal.records import crc32c
from rlfeed.service.journal.segments import read_positions
from rlfeed.service.scheduler.client import SchedulerClient
from rlfeed.service.scheduler.records import JournalRef, SlotClaim, StepWork

_log = logging.getLogger(__name__)

KIND_BATCH = 1  # an ingest batch's Arrow IPC stream, as received
KIND_RESPONSE = 2  # one rank's serialized GetBatchResponse of a step (not `derivable`)

Digest = tuple[int, int]  # (CRC32C, size) of a response


class RederiveMismatchError(JournalError):
    """A stored step's response built again after a restart differs from the bytes first
    served: never served (a rank that fetched it must get the same bytes again)."""

    def __init__(self, step: int, rank: int, found: Digest, expected: Digest) -> None:
        self.step, self.rank = step, rank
        super().__init__(
            f"step {step} rank {rank}: the response built again from the journaled batches "
            f"has CRC32C {found[0]:#010x} and {found[1]} bytes, not {expected[0]:#010x} and "
            f"{expected[1]} as first served (a journal written by an rlfeed that encodes "
            "steps differently?). It is not served. Finish the run's stored steps with the "
            "rlfeed that wrote [journal] dir (until the trainer acknowledged them), or "
            "start on an empty [journal] dir"
        )


def digests(responses: list[bytes]) -> list[Digest]:
    """What the scheduler's journal keeps of a `derivable` step's responses."""
    return [(crc32c(response), len(response)) for response in responses]


def journal_step(
    journal: Journal, work: StepWork, responses: list[bytes]
) -> tuple[list[int], list[Digest]]:
    """Before a materialized step's store note: its responses' (positions, digests), the
    responses journaled only when the scheduler cannot build them again."""
    if work.derivable:
        return [], digests(responses)
    return journal.append_all(KIND_RESPONSE, responses), []


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
    JournalCorruptError if a position is missing (the journal lost what it acknowledged).
    Then builds the stored steps the claim names by recipe (`derive_steps`)."""
    loaded = _load_journaled(journal, claim, payloads, responses)
    return loaded[0], loaded[1] + derive_steps(journal, claim.derive, payloads, responses)


def _load_journaled(
    journal: Journal, claim: SlotClaim, payloads: LocalPayloads, responses: ResponseCache
) -> tuple[int, int]:
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
        responses.put(step, loaded[step], restored=True)
    return len(batches), len(loaded)


def derive_steps(
    journal: Journal,
    derive: list[tuple[StepWork, list[Digest]]],
    payloads: LocalPayloads,
    responses: ResponseCache,
) -> int:
    """Build each stored step of `derive` that the cache lacks from its journaled batches
    (this slot's in memory or on disk, other slots' read from their folders under
    `[journal] dir`), check every rank against its digest and put the step in the cache.
    Returns the steps built; RederiveMismatchError for a rank whose bytes differ (nothing
    of it is kept)."""
    derive = [item for item in derive if responses.get(item[0].step) is None]  # not in memory
    if not derive:  # (a front-end that lives on through the actor's restart has them)
        return 0
    columns = _batch_columns(journal, [work for work, _ in derive], payloads)
    for work, expected in derive:
        built = materialize_work(work, resolve=columns.__getitem__)
        for rank, (found, wanted) in enumerate(zip(digests(built), expected, strict=True)):
            if tuple(found) != tuple(wanted):
                raise RederiveMismatchError(work.step, rank, found, tuple(wanted))
        responses.put(work.step, built, restored=True)
    return len(derive)


def _batch_columns(
    journal: Journal, works: list[StepWork], payloads: LocalPayloads
) -> dict[JournalRef, TokenColumns]:
    """The columns of every batch `works` read (their handles are JournalRefs)."""
    own_slot, root = journal.directory.name, journal.directory.parent
    columns: dict[JournalRef, TokenColumns] = {}
    wanted: dict[str, set[int]] = {}
    for ref in {ref for work in works for ref in work.payloads.values()}:
        if ref.slot == own_slot and payloads.holds(ref.position):
            columns[ref] = payloads.get(ref.position)
        else:
            wanted.setdefault(ref.slot, set()).add(ref.position)
    for slot, positions in wanted.items():
        found = read_positions(root / slot, positions, journal.config.max_record_bytes)
        missing = sorted(positions - set(found))
        if missing:
            raise JournalCorruptError(
                root / slot, missing[0], f"{len(missing)} batches a stored step reads are missing"
            )
        for position, payload in found.items():
            columns[JournalRef(slot, position)] = decode_rollout_batch(payload).columns
    return columns


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
