"""`WriterThread`: a journal's one thread for appends handed over (`Journal.append_later`).

Why: a front-end must journal an ingest batch before it acknowledges it, and the write of
an 8 MiB record is device time (O_DIRECT: 5-30 ms on the dev VM), during which the
handler thread would wait idle. Handed over, the write runs while the handler decodes and
validates the same batch, then the handler waits for the write and the fsync. Writes stay
in the order they were handed over (one thread, a FIFO), and the queue never holds more
than the appends whose callers are waiting for them (each caller waits on its own).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

Write = Callable[[int, Any], tuple[int, int]]  # (kind, payload) -> (position, epoch)


class PendingWrite:
    """A record handed to the writer thread: `result()` waits for its write."""

    def __init__(self, kind: int, payload: Any) -> None:
        self.kind, self.payload = kind, payload
        self._done = threading.Event()
        self._result: tuple[int, int] | None = None
        self._error: BaseException | None = None

    def finish(self, result: tuple[int, int] | None, error: BaseException | None) -> None:
        self._result, self._error, self.payload = result, error, None
        self._done.set()

    def result(self) -> tuple[int, int]:
        """(position, epoch) once written; raises what the write raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class WriterThread:
    """Writes the records handed to it with `write`, one at a time, in order. Started at
    the first `submit`; `close` writes what was handed over before it, then stops."""

    def __init__(self, write: Write, name: str) -> None:
        self._write, self._name = write, name
        self._queue: queue.SimpleQueue[PendingWrite | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, kind: int, payload: Any) -> PendingWrite:
        pending = PendingWrite(kind, payload)
        with self._lock:
            if self._closed:  # written here: the journal raises its own error for it
                pending.finish(*_attempt(self._write, pending))
                return pending
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put(pending)
        return pending

    def close(self) -> None:
        with self._lock:
            self._closed, thread = True, self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            pending.finish(*_attempt(self._write, pending))


def _attempt(write: Write, pending: PendingWrite) -> tuple[tuple[int, int] | None, Any]:
    try:
        return write(pending.kind, pending.payload), None
    except BaseException as error:  # the caller waiting on it raises it
        return None, error
