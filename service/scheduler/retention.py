"""When an assembled step may leave memory: once every rank is done with it, and then only
after `retained_steps` newer steps are done too.

A rank is done with a step once it acknowledges it (`AckSteps`: its optimizer stepped on
it), not when it fetches or prefetches it, so a trainer resuming from a checkpoint up to
`retained_steps` steps back is served its steps again. Acknowledgements are cumulative
("every step <= s"), so a rank is one number, its acknowledged step; a resent or older
acknowledgement changes nothing. A rank that has never acknowledged anything is counted
done with a step once it fetched it: trainers that do not acknowledge keep the release
rule they were written for (release after `retained_steps` fully fetched steps). One that
does declares it before its first fetch (an acknowledgement of step -1, "none yet").

Pure bookkeeping over step numbers and rank sets; deterministic, so a journal replaying
the scheduler's calls rebuilds it. `Scheduler` owns the steps and asks this class.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set


class StepRetention:
    """The acknowledged step of every rank that has acknowledged one, and the steps every
    rank is done with, oldest first, of which the newest `retained_steps` stay held."""

    def __init__(self, world_size: int, retained_steps: int) -> None:
        self.world_size = world_size
        self.retained_steps = retained_steps
        self.acked_through: dict[int, int] = {}  # rank -> every step <= it is done there
        self._done: deque[int] = deque()  # done by every rank and still held, in that order

    def ack(self, rank: int, through_step: int) -> int:
        """Rank `rank` is done with every step <= `through_step` (-1: none, but the rank
        acknowledges from now on); returns its acknowledged step afterwards (it never goes
        back)."""
        acked = max(self.acked_through.get(rank, -1), through_step)
        self.acked_through[rank] = acked
        return acked

    def done_by_every_rank(self, step: int, fetched: Set[int]) -> bool:
        """Whether each rank is done with `step`: acknowledged it, or (a rank that never
        acknowledged anything) fetched it; `fetched` are the ranks that fetched it."""
        for rank in range(self.world_size):
            acked = self.acked_through.get(rank)
            if (step > acked) if acked is not None else (rank not in fetched):
                return False
        return True

    def done(self, step: int) -> list[int]:
        """Record `step` as done by every rank (once); returns the steps to release now:
        the oldest done ones beyond the newest `retained_steps`."""
        self._done.append(step)
        released = []
        while len(self._done) > self.retained_steps:
            released.append(self._done.popleft())
        return released

    def done_steps(self) -> list[int]:
        """The steps done by every rank and still held, oldest first (for a snapshot)."""
        return list(self._done)

    def restore(self, acked_through: dict[int, int], done: list[int]) -> None:
        """Take back what `acked_through` and `done_steps` said (a snapshot's restore)."""
        self.acked_through = dict(acked_through)
        self._done = deque(done)
