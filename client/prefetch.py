"""`Prefetcher`: the `BatchLoader`'s background thread that fetches the next steps while the
trainer works on the current one.

It fetches first_step, first_step + 1, ... at most `depth` steps ahead of what the consumer
has taken, and hands each step (or the error that ended the fetching) over in order. It is
started by the loader's first `iter()`, never at import or construction. `stop()` has to
interrupt a fetch that waits for a step not assembled yet: the loader's fetch checks
`stopping` between its server-side waits and raises `PrefetchStopped`, which ends the
thread quietly.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Generic, Protocol, TypeVar

_Step = TypeVar("_Step", covariant=True)


class PrefetchStopped(Exception):
    """Raised inside the prefetch thread to abandon a wait when the loader stops it."""


class _Source(Protocol[_Step]):
    """What the thread fetches from (a `BatchLoader`): read at every step, so a changed
    `stop_step` is seen."""

    stop_step: int | None

    def fetch(self, step: int) -> _Step: ...


class Prefetcher(Generic[_Step]):
    """A thread fetching steps first_step, first_step + 1, ... at most `depth` ahead of
    what the consumer has taken."""

    def __init__(self, loader: _Source[_Step], first_step: int, depth: int) -> None:
        self._loader = loader
        self._next = first_step
        self._slots = threading.Semaphore(depth)
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlfeed-batch-prefetch", daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while True:
            self._slots.acquire()
            if self._stop.is_set() or (
                self._loader.stop_step is not None and self._next >= self._loader.stop_step
            ):
                return
            try:
                item: Any = self._loader.fetch(self._next)
            except PrefetchStopped:
                return
            except BaseException as exc:  # handed to the consumer, which re-raises it
                self._ready.put(exc)
                return
            self._ready.put(item)
            self._next += 1

    def take(self) -> _Step:
        """The next step in order (waiting for it), or raise the error that ended fetching."""
        item = self._ready.get()
        self._slots.release()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop fetching and wait for the thread to end."""
        self._stop.set()
        self._slots.release()  # wake a thread waiting for a slot
        self._thread.join()
