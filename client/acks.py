"""`Acknowledgements`: how a `BatchLoader` tells the sidecar which steps its rank is done
with, and the acknowledgement it owes until a fetch carries it.

Why: acknowledging step s as its own AckSteps call cost every rank one round trip per step
(in the 8k-token benchmark, 33 calls per rank and run, each ~9 ms of the trainer's loop on
the loaded 2-core machine and ~0.5 ms of the sidecar's CPU). A sidecar that answers the
rank's declaration (AckSteps without a step) with `acks_with_get_batch` takes it with the
rank's next GetBatch instead (`GetBatchRequest.acked_through_step`): the loop notes s here
when it asks for s + 1, and the prefetch thread's next fetch (s + 2, which it starts only
once the loop has taken s + 1) sends it. Acknowledgements are cumulative, so only the
newest one is kept, and one sent twice (a fetch retried after UNAVAILABLE) changes nothing.
What no fetch carries (the loop's last step, a loop left by a break, a loader closing) goes
by an AckSteps call of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfeed.proto import rlfeed_pb2 as pb

_log = logging.getLogger(__name__)


class Acknowledgements:
    """One rank's acknowledgements. `call(step)` is AckSteps as the loader retries it
    (`None`: the declaration); `call_once(step)` one try of it. The loop notes steps
    (`done_with`); the thread that fetches sends `unsent()` along and clears it (`sent`)."""

    def __init__(
        self,
        call: Callable[[int | None], pb.AckStepsResponse],
        call_once: Callable[[int], object],
    ) -> None:
        self._call, self._call_once = call, call_once
        self.with_fetch = False  # the sidecar takes them with GetBatch (its declaration answer)
        self._step: int | None = None  # the newest step done that no call has carried yet
        self._lock = threading.Lock()

    def declare(self) -> None:
        """Tell the sidecar this rank acknowledges (before any fetch can count as done)."""
        self.with_fetch = bool(self._call(None).acks_with_get_batch)

    def done_with(self, step: int) -> None:
        """The loop asked for the step after `step`: noted for the next fetch where the
        sidecar takes it so, else sent now."""
        if not self.with_fetch:
            self._call(step)
            return
        with self._lock:
            self._step = step if self._step is None else max(self._step, step)

    def unsent(self) -> int | None:
        """The step to send with the next call, if any (kept until `sent`)."""
        with self._lock:
            return self._step

    def sent(self, step: int) -> None:
        """A call carrying `step` was answered: forget it, unless a newer one was noted."""
        with self._lock:
            if self._step == step:
                self._step = None

    def flush(self, retry: bool) -> None:
        """Send the unsent step, if any, by a call of its own. `retry` False (a loop left
        by a break or an error, a loader closing): one try, a failure logged at debug level
        and the step kept, not raised: a later acknowledgement, cumulative, covers it, and
        until then the sidecar only keeps the step a little longer."""
        step = self.unsent()
        if step is None:
            return
        send = self._call if retry else self._call_once
        try:
            send(step)
        except Exception as exc:
            if retry:
                raise
            _log.debug("rlfeed: the acknowledgement of step %d was not sent: %s", step, exc)
            return
        self.sent(step)
