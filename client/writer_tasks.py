"""The tasks a `RolloutWriter` registered, kept so that a sidecar restarted without a journal
(which lost its task pool) gets them again: registered anew when it answers "unknown task"
or when a task call went through an outage (`client/producer.py`'s docstring)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from rlfeed.client.retry import RetryPolicy
from rlfeed.client.transport import Transport

# The writer's logger: this warning is the writer's, wherever its code lives.
_log = logging.getLogger("rlfeed.client.producer")


class WriterTasks:
    """Task calls of one writer, with every task id it registered, in order."""

    def __init__(self, transport: Transport, retry: RetryPolicy) -> None:
        self._transport = transport
        self._retry = retry
        self._tasks: dict[str, None] = {}
        self._lock = threading.Lock()  # the sender threads restore too

    def register(self, task_ids: Sequence[str]) -> int:
        """See `RolloutWriter.register_tasks`."""
        ids = [str(t) for t in task_ids]
        with self._lock:
            self._tasks.update(dict.fromkeys(ids))
        outage = self._retry.outage()
        added = int(outage.call(lambda: self._transport.register_tasks(ids)).added)
        if outage.interrupted:  # the sidecar may have restarted: the earlier tasks too
            self.restore()
        return added

    def sample(self, n: int) -> list[str]:
        """See `RolloutWriter.sample_tasks`."""
        sample = lambda: self._transport.sample_tasks(int(n))  # noqa: E731
        outage = self._retry.outage()
        response = outage.call(sample)
        if outage.interrupted and self.restore():  # sampled from a pool it had lost
            response = self._retry.call(sample)
        return list(response.task_ids)

    def restore(self) -> int:
        """Register this writer's tasks again (idempotent); returns how many the sidecar
        did not know: > 0 only if it lost its pool (a restart without a journal)."""
        with self._lock:
            ids = list(self._tasks)
        if not ids:
            return 0
        added = int(self._retry.call(lambda: self._transport.register_tasks(ids)).added)
        if added:
            _log.warning(
                "rlfeed: the sidecar at %s had lost %d of the %d tasks this writer registered "
                "(restarted without a journal?); registered them again",
                self._retry.address,
                added,
                len(ids),
            )
        return added
