"""AckSteps answered by a front-end that is its sidecar's only one, without waiting for the
scheduler actor: the acknowledgement reaches the actor as an `AckNote` riding along with
the front-end's next actor call (or the assembler's note flush within 50 ms), as a rank's
first fetch does (`FetchNote`).

Why: a rank acknowledges every step it trained on (`BatchLoader`, when its loop asks for
the next step) and is given the next step only once the answer is back. Asked of the actor,
each answer queued behind the ingest calls that plan steps, so an actor round trip (p50
8-20 ms on the loaded 2-core machine, one Ray call in the front-end and one in the actor,
~1 ms of CPU each) stood between every two steps of every rank; in the 8k-token benchmark
the ranks fell behind the producers and finished 0.2 s after them, not 0.1 s.

The answer given here is the one the actor would give, or the actor is asked:
- the front-end is alone (`[server] replicas` 1, not joined, not a front-end actor), so
  every acknowledgement of a rank passes through it and the rank's acknowledged step is
  the largest this front-end answered or heard the actor answer;
- the rank already had one acknowledgement answered by the actor (its first, usually the
  declaration without a step, `through_step` unset: always asked), so that largest is known;
- the step was assembled: this front-end stored it or a later step (steps are planned in
  order), so the actor cannot refuse it as "not assembled yet".
An acknowledgement lost with a crash before its note reached the actor only keeps steps
servable longer (the next one, cumulative, covers it), as a lost FetchNote would.
"""

from __future__ import annotations

import threading


class LoneAcks:
    """Each rank's acknowledged step as far as this front-end knows it; `answer` decides
    whether it answers an AckSteps call itself (module docstring)."""

    def __init__(self, world_size: int, alone: bool) -> None:
        self._world_size = world_size
        self._alone = alone
        self._acked: dict[int, int] = {}  # rank -> its acknowledged step (-1: none yet)
        self._lock = threading.Lock()

    def answer(self, rank: int, through_step: int | None, newest_stored: int) -> int | None:
        """The rank's acknowledged step after acknowledging every step <= `through_step`,
        as the actor would answer it, when this front-end knows it (then remembered, and
        the caller notes the acknowledgement for the actor); None: ask the actor.
        `newest_stored`: the newest step stored here (-1: none)."""
        if not self._alone or through_step is None or not 0 <= rank < self._world_size:
            return None
        if not 0 <= through_step <= newest_stored:
            return None
        with self._lock:
            known = self._acked.get(rank)
            if known is None:
                return None
            acked = self._acked[rank] = max(known, through_step)
            return acked

    def heard(self, rank: int, acked: int) -> None:
        """The actor answered an acknowledgement of `rank` with `acked` (it had every note
        sent before)."""
        with self._lock:
            self._acked[rank] = max(self._acked.get(rank, -1), acked)
