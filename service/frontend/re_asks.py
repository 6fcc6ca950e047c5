"""`ReAsks`: which of the GetBatch calls waiting for a step asks the scheduler actor again
once their waits time out (`serving.py`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

# A waiting GetBatch re-asks the actor this often even without a local "step stored"
# signal (a step this front-end did not store; with replicas, another front-end's).
POLL_SECONDS = 0.25


# Steps whose re-asks `ReAsks` remembers (the newest ones; a step is waited for briefly).
_REMEMBERED_STEPS = 1024


class ReAsks:
    """Who re-asks the actor about a step once waits time out: one waiting call per step
    per POLL_SECONDS, not each of them (256 ranks waiting would ask ~1000 times a second,
    each taking a pool thread for a round trip). The actor's answer to one rank about a
    step not stored is every rank's; once a re-ask got anything else (the bytes, or an
    answer that ends the call, e.g. released), every waiting call of that step asks for
    itself, woken at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: OrderedDict[int, float] = OrderedDict()  # step -> when last re-asked
        self._answered: OrderedDict[int, None] = OrderedDict()  # steps every call asks

    def claim(self, step: int) -> bool:
        """Whether this call re-asks about `step` now (and others hold off)."""
        now = time.monotonic()
        with self._lock:
            if step in self._answered:
                return True
            last = self._asked.get(step)
            if last is not None and now - last < POLL_SECONDS:
                return False
            self._asked[step] = now
            self._asked.move_to_end(step)
            while len(self._asked) > _REMEMBERED_STEPS:
                self._asked.popitem(last=False)
            return True

    def answered(self, step: int) -> None:
        """A re-ask about `step` was answered: from now on every call asks for itself."""
        with self._lock:
            self._answered[step] = None
            while len(self._answered) > _REMEMBERED_STEPS:
                self._answered.popitem(last=False)
