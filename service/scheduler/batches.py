"""The ingest batches the scheduler's state still reads, and where their columns are.

A batch is held while a buffered rollout of it waits for a step, or a planned step reads
it and its responses are not stored yet; the last holder letting go releases it. The
scheduler never sees a batch's columns: it keeps a handle to them (`BatchHandle` in a
front-end's memory, `JournalRef` in a journal, `StoredObject` in Ray's object store), and
the placement methods here move the handles when the bytes move (a front-end leaving,
recovery, a front-end dying). Keys are the scheduler's batch numbers, in ingest order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rlfeed.service.scheduler.records import BatchHandle, JournalRef


@dataclass(slots=True)
class HeldBatch:
    """One ingest batch something still reads (mutable: the holders come and go)."""

    handle: Any  # where its columns are: BatchHandle, JournalRef or StoredObject
    holders: int  # buffered rollouts of it, plus planned steps not yet stored reading it
    nbytes: int  # token bytes of the whole batch (a front-end keeps its columns whole)


class BatchTable(Mapping[int, HeldBatch]):
    """Batch key -> `HeldBatch`, every batch some rollout or unstored step reads. A read-only
    mapping to look at; changed only through the methods below."""

    def __init__(self, *, track_releases: bool) -> None:
        self._held: dict[int, HeldBatch] = {}
        self.nbytes = 0  # token bytes of the held batches (counted by the byte bound)
        self.next_key = 0
        # When tracking, the handles released since `take_released`, for the front-end
        # holding the columns to free them at once.
        self._released: list[Any] | None = [] if track_releases else None

    def __getitem__(self, key: int) -> HeldBatch:
        return self._held[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    # ---- holders -----------------------------------------------------------------------

    def new_key(self) -> int:
        """The next batch's key (every ingest call takes one, held or not)."""
        key = self.next_key
        self.next_key += 1
        return key

    def add(self, key: int, handle: Any, holders: int, nbytes: int) -> None:
        self._held[key] = HeldBatch(handle, holders, nbytes)
        self.nbytes += nbytes

    def hold(self, key: int) -> None:
        """One more holder: a planned step reading the batch until its responses are stored."""
        self._held[key].holders += 1

    def let_go(self, key: int) -> None:
        """One holder lets go of a batch; the last one releases it."""
        batch = self._held[key]
        batch.holders -= 1
        if batch.holders == 0:
            del self._held[key]
            self.nbytes -= batch.nbytes
            if self._released is not None:
                self._released.append(batch.handle)

    def bytes_freed(self, keys: Iterable[int], let_go: Counter[int]) -> int:
        """Token bytes of the batches that letting go of one holder per key in `keys` would
        release (a query). `let_go` counts the holders let go of so far per batch and is
        updated, so that successive calls add up."""
        freed = 0
        for key in keys:
            let_go[key] += 1
            batch = self._held[key]
            if let_go[key] == batch.holders:
                freed += batch.nbytes
        return freed

    def take_released(self) -> list[Any]:
        """The handles released since the last call (empty unless tracking)."""
        if self._released is None:
            return []
        released, self._released = self._released, []
        return released

    # ---- placement: where each batch's columns are ------------------------------------

    def handle(self, key: int) -> Any:
        return self._held[key].handle

    def handles(self) -> list[Any]:
        """The handle of every held batch (a query)."""
        return [batch.handle for batch in self._held.values()]

    def rehome(self, handles: dict[Any, Any]) -> set[int]:
        """Give held batches new handles to the same columns (a front-end leaving moves its
        batches into the object store): each batch whose `BatchHandle` is a key of
        `handles` takes its value. Returns the keys of the batches moved: the planned
        steps not yet stored that read one went out with the old handles, so the old
        holder keeps serving those until they are stored (`StepBook.reading`)."""
        moved = set()
        for key, batch in self._held.items():
            new = handles.get(batch.handle) if isinstance(batch.handle, BatchHandle) else None
            if new is not None:
                batch.handle = new
                moved.add(key)
        return moved

    def claim(self, slot: str, frontend_id: str) -> list[int]:
        """Hand what recovery left in `slot`'s journal to the front-end now serving that
        slot: every batch journaled in `slot` is now in `frontend_id`'s memory (the journal
        position is the batch's key there). Returns those positions, sorted, to load."""
        positions = []
        for batch in self._held.values():
            handle = batch.handle
            if isinstance(handle, JournalRef) and handle.slot == slot:
                batch.handle = BatchHandle(frontend_id, handle.position)
                positions.append(handle.position)
        return sorted(positions)

    def orphan(self, frontend_id: str, slot: str) -> None:
        """Front-end `frontend_id`, which journaled into `slot`, died: the handles naming its
        memory become references to its journal again (the inverse of `claim`), so the next
        front-end of `slot` claims them (the key is the journal position). Not a logical
        change: what is buffered stays the same; only where the bytes are."""
        for batch in self._held.values():
            handle = batch.handle
            if isinstance(handle, BatchHandle) and handle.frontend_id == frontend_id:
                batch.handle = JournalRef(slot, handle.key)

    # ---- snapshot (the "payloads" of `snapshot.py`'s format) ---------------------------

    def state(self, batch_ref: Any) -> dict[int, list]:
        """Key -> [batch_ref(handle), holders, nbytes]."""
        return {
            key: [batch_ref(batch.handle), batch.holders, batch.nbytes]
            for key, batch in self._held.items()
        }

    def restore(self, state: dict, unref: Any) -> None:
        """Take back what `state` wrote (`nbytes` and `next_key` come back with the counts)."""
        self._held = {
            int(key): HeldBatch(unref(ref), holders, nbytes)
            for key, (ref, holders, nbytes) in state.items()
        }
