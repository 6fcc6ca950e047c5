"""What a gRPC front-end keeps in its own memory: the ingest columns the scheduler may still
need (`LocalPayloads`) and the responses of the steps it materialized (`ResponseCache`).

Both are shared by the front-end's handler threads and its assembler thread, so each
guards its state with its own lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from rlfeed.sched.assembly import TokenColumns


class ResponseCache:
    """step -> every rank's response bytes, in the order stored; it also remembers which
    ranks this front-end has served each step to. Nothing leaves it on its own: the
    assembler moves old steps out (`oldest_beyond`, `drop`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._steps: OrderedDict[int, tuple[list[bytes], set[int]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, step: int, responses: list[bytes], *, restored: bool = False) -> None:
        """`restored`: loaded or rebuilt from the journal after a restart. Which ranks
        fetched the step before, and whether the actor has released it since, only the
        actor knows, so none of its fetches is a first fetch here: each asks the actor."""
        with self._lock:
            served = set(range(len(responses))) if restored else set()
            self._steps[step] = (responses, served)
            self._bytes += sum(map(len, responses))

    def get(self, step: int) -> list[bytes] | None:
        with self._lock:
            held = self._steps.get(step)
            return held[0] if held is not None else None

    def first_fetch(self, step: int, rank: int) -> bytes | None:
        """The response if the step is here and this is the rank's first fetch of it from
        this front-end (then noted); None otherwise. 0 <= rank < world_size is the caller's
        check."""
        with self._lock:
            held = self._steps.get(step)
            if held is None or rank in held[1]:
                return None
            held[1].add(rank)
            return held[0][rank]

    def serve_to_peer(self, step: int, rank: int) -> bytes | None:
        """The response for a peer that answers `rank` with it (the actor recorded that
        fetch), noted as served like a first fetch: a later fetch of the rank here asks the
        actor, which may have released the step meanwhile. None if not here."""
        with self._lock:
            held = self._steps.get(step)
            if held is None or not 0 <= rank < len(held[0]):
                return None
            held[1].add(rank)
            return held[0][rank]

    def stored(self) -> list[tuple[int, list[bytes]]]:
        """Every held step with its responses, oldest first (a snapshot)."""
        with self._lock:
            return [(step, responses) for step, (responses, _) in self._steps.items()]

    def oldest_beyond(self) -> list[int]:
        """Oldest steps to drop for the rest to fit in 3/4 of max_bytes (none while the
        whole fits in max_bytes): a few large rounds, not one per step."""
        with self._lock:
            if self._bytes <= self.max_bytes:
                return []
            steps, remaining = [], self._bytes
            for step, (responses, _) in self._steps.items():
                if remaining <= self.max_bytes * 3 // 4:
                    break
                steps.append(step)
                remaining -= sum(map(len, responses))
            return steps

    def drop(self, steps: list[int]) -> None:
        with self._lock:
            for step in steps:
                held = self._steps.pop(step, None)
                if held is not None:
                    self._bytes -= sum(map(len, held[0]))


class LocalPayloads:
    """The TokenColumns of the ingest batches this front-end decoded, by key, kept here
    (not copied into the object store) until the scheduler releases them: it does so only
    once no buffered rollout and no step still to be stored reads a batch, so a release
    frees at once, whichever front-end materializes the steps."""

    def __init__(self) -> None:
        self._columns: dict[int, TokenColumns] = {}
        self._next_key = 0
        self._lock = threading.Lock()

    def add(self, columns: TokenColumns) -> int:
        with self._lock:
            key = self._next_key
            self._next_key += 1
            self._columns[key] = columns
            return key

    def put(self, key: int, columns: TokenColumns) -> None:
        """Hold `columns` under a key chosen by the caller: its journal position (keys
        from `add` are then never used)."""
        with self._lock:
            self._columns[key] = columns

    def holds(self, key: int) -> bool:
        with self._lock:
            return key in self._columns

    def get(self, key: int) -> TokenColumns:
        """KeyError if the key is not held (never added, or released)."""
        with self._lock:
            return self._columns[key]

    def discard(self, key: int) -> None:
        """Free a batch the scheduler did not keep (rejected, or nothing accepted)."""
        with self._lock:
            self._columns.pop(key, None)

    def release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._columns.pop(key, None)

    def held(self) -> dict[int, TokenColumns]:
        """Every batch held, by key (a snapshot)."""
        with self._lock:
            return dict(self._columns)

    def __len__(self) -> int:
        with self._lock:
            return len(self._columns)
