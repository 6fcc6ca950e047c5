"""`UnsentAck`: the acknowledgement a `BatchLoader` owes the sidecar, until a fetch carries it.

Why: acknowledging step s as its own AckSteps call cost every rank one round trip per step
(in the 8k-token benchmark, 33 calls per rank and run, each ~9 ms of the trainer's loop on
the loaded 2-core machine and ~0.5 ms of the sidecar's CPU). A sidecar that answers
`acks_with_get_batch` takes it with the rank's next GetBatch instead
(`GetBatchRequest.acked_through_step`): the loop notes s here when it asks for s + 1, and
the prefetch thread's next fetch (s + 2, which it starts only once the loop has taken
s + 1) sends it. Acknowledgements are cumulative, so only the newest one is kept, and one
sent twice (a fetch retried after UNAVAILABLE) changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_log = logging.getLogger(__name__)


class UnsentAck:
    """The newest step the loop is done with that no call has told the sidecar yet. The
    loop notes steps; the thread that fetches takes them along and clears what it sent."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._lock = threading.Lock()

    def note(self, step: int) -> None:
        with self._lock:
            self._step = step if self._step is None else max(self._step, step)

    def peek(self) -> int | None:
        """The step to send with the next call, if any (kept until `sent`)."""
        with self._lock:
            return self._step

    def sent(self, step: int) -> None:
        """A call carrying `step` was answered: forget it, unless a newer one was noted."""
        with self._lock:
            if self._step == step:
                self._step = None

    def send(self, acknowledge: Callable[[int], object], quietly: bool = False) -> None:
        """Send the step, if any, by `acknowledge(step)` (an AckSteps call) and forget it.
        `quietly`: a failure is logged at debug level and the step kept, not raised (a
        loop left by a break, a loader closing): a later acknowledgement, cumulative,
        covers it, and until then the sidecar only keeps the step a little longer."""
        step = self.peek()
        if step is None:
            return
        try:
            acknowledge(step)
        except Exception as exc:
            if not quietly:
                raise
            _log.debug("rlfeed: the acknowledgement of step %d was not sent: %s", step, exc)
            return
        self.sent(step)
