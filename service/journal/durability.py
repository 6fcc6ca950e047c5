"""What a journal's appenders wait on: how far records are durable, the fault or the close
that fails them, and whose turn it is to fsync for a group.

`Journal` keeps the file (descriptor, size, segment list) under its write lock; this keeps
the state threads wait on, under a condition of its own, so that a thread waiting for its
record to be durable never holds the write lock (other appends go on meanwhile) and one
leader's fsync can cover a whole group while the others sleep. The journal may hold its
write lock when it calls in; nothing here calls back out, so the two locks cannot deadlock.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rlfeed.service.journal.errors import JournalClosedError, JournalWriteError


class Durability:
    """The durable position, fault, close and group-commit turn of one journal."""

    def __init__(self, directory: Path, durable_position: int) -> None:
        self.directory = directory
        self.position = durable_position  # every record up to here is on stable storage
        self.retry_after_s = 0.5  # an append heals a faulted journal at most this often
        # A failed write or fsync (healed by a later append), when, and how many heals so
        # far (records written before one are never marked durable after it). The journal
        # changes the epoch under its write lock, when it cuts the file back.
        self.fault: OSError | None = None
        self.fault_at = 0.0
        self.epoch = 0
        self.failure: BaseException | None = None  # closed: for good
        self._syncing = False  # a leader is in its group-commit window or fsync
        self._cond = threading.Condition()  # position, _syncing, failure, fault

    def mark(self, position: int) -> None:
        """Records up to `position` are on stable storage: wake whoever waits for them."""
        with self._cond:
            self.position = max(self.position, position)
            self._cond.notify_all()

    def faulted(self, error: OSError) -> JournalWriteError:
        """Note a failed write or fsync (waiters of records not durable fail); the error
        to raise."""
        with self._cond:
            self.fault, self.fault_at = error, time.monotonic()
            self._cond.notify_all()
        return JournalWriteError(self.directory, error, self.retry_after_s)

    def healed(self) -> None:
        """The file is cut back to its durable records and synced: appends work again."""
        with self._cond:
            self.fault = None
            self._cond.notify_all()

    def close(self) -> None:
        """Fail every wait from now on (`JournalClosedError`); the first reason stays."""
        with self._cond:
            self.failure = self.failure or JournalClosedError("journal is closed")
            self._cond.notify_all()

    def check_open(self) -> None:
        if self.failure is not None:
            raise JournalClosedError(str(self.failure)) from self.failure

    def check_retry_due(self) -> None:
        """Raise the fault while `retry_after_s` has not passed since it: a disk that just
        failed is not written to again at every append."""
        if time.monotonic() - self.fault_at < self.retry_after_s:
            raise self.write_error()

    def write_error(self) -> JournalWriteError:
        """The error for records a fault or a heal since left not durable."""
        return JournalWriteError(self.directory, self.fault or OSError(), self.retry_after_s)

    def lead_or_wait(self, position: int, epoch: int) -> bool:
        """Wait until record `position`, written in `epoch`, is durable (False), or until it
        is this thread's turn to lead the group's fsync (True: call `done_leading` after).

        Raises `JournalWriteError` if a fault or a heal came first, `JournalClosedError`
        once the journal is closed.
        """
        with self._cond:
            while True:
                if epoch != self.epoch:  # healed since: the record was cut
                    raise self.write_error()
                if self.position >= position:
                    return False
                self.check_open()
                if self.fault is not None:
                    raise self.write_error()
                if not self._syncing:
                    self._syncing = True
                    return True
                self._cond.wait()

    def done_leading(self) -> None:
        """The leader's fsync is over (done or failed): the next waiter may lead."""
        with self._cond:
            self._syncing = False
            self._cond.notify_all()
