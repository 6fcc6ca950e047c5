"""How many groups each step takes: fixed, or as many as the curriculum handed out.

The chapter's curriculum (Section 14.5) samples `prompts_per_step` tasks from those inside
the pass-rate filter, plus revisits; when few tasks pass the filter, the step is smaller.
`RoundQueue` keeps that bookkeeping for a scheduler that assembles steps from complete
groups in completion order:

- "fixed": every step takes `prompts_per_step` groups (sampling calls are ignored).
- "sampled": each sampling call that hands out k > 0 tasks opens a *round* of k groups;
  step i takes as many groups as round i still expects. Groups complete into the queue in
  order, filling the oldest round first (a step holds k groups, not necessarily its own k
  tasks). A group that completes when no round expects it (a producer that never asked
  for tasks) opens a *fallback* entry of `prompts_per_step` groups. A group that leaves
  without reaching a step (dropped stale, expired, zero-advantage) is deducted from the
  oldest round still waiting for groups, so no step waits for a group that will not come;
  a round reduced to 0 is removed. Fallback entries are never deducted from: with no round
  waiting, a drop changes only the count of complete groups, as in "fixed".

Invariants: every entry expects >= 1 group; the entries expect at least as many groups as
are complete (so opening a round never makes a step ready: only completions and drops
do); a step is ready when the complete groups cover the oldest entry. Pure Python, no I/O;
the state is a list of pairs for snapshots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

StepGroups = Literal["fixed", "sampled"]


@dataclass
class RoundQueue:
    """The groups each future step takes (see the module docstring).

    complete: groups complete and not yet planned into a step (the scheduler's queue).
    _entries: per future step, [groups it takes, 1 if a round else 0 (fallback)], oldest
      first; empty in "fixed" mode. `_expected` is the sum of their group counts."""

    prompts_per_step: int
    mode: StepGroups = "fixed"
    complete: int = 0
    _entries: deque[list[int]] = field(default_factory=deque)
    _expected: int = 0

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.mode not in ("fixed", "sampled"):
            raise ValueError(f"step_groups must be 'fixed' or 'sampled', got {self.mode!r}")

    @property
    def sampled(self) -> bool:
        return self.mode == "sampled"

    def open_round(self, k: int) -> None:
        """A sampling call handed out k tasks: in "sampled" mode, a step of k groups."""
        if self.sampled and k > 0:
            self._entries.append([k, 1])
            self._expected += k

    def add_complete(self) -> None:
        """A group completed and waits for a step."""
        self.complete += 1
        if self.sampled and self.complete > self._expected:
            self._entries.append([self.prompts_per_step, 0])
            self._expected += self.prompts_per_step

    def drop(self, was_complete: bool) -> None:
        """A group left without reaching a step (`was_complete`: it was counted complete)."""
        if was_complete:
            if self.complete < 1:
                raise ValueError("drop of a complete group, but no group is complete")
            self.complete -= 1
        if not self.sampled:
            return
        covered = 0
        for index, entry in enumerate(self._entries):
            covered += entry[0]
            if entry[1] and covered > self.complete:  # the oldest round still waiting
                entry[0] -= 1
                self._expected -= 1
                if entry[0] == 0:
                    del self._entries[index]
                return

    def steps_ready(self) -> int:
        """Steps the complete groups can make now (a query)."""
        if not self.sampled:
            return self.complete // self.prompts_per_step
        ready = covered = 0
        for groups, _ in self._entries:
            covered += groups
            if covered > self.complete:
                break
            ready += 1
        return ready

    def take_step(self) -> int:
        """Groups of the next step, taken out of the complete ones; 0 if it is not ready."""
        if not self.sampled:
            groups = self.prompts_per_step if self.complete >= self.prompts_per_step else 0
        elif self._entries and self._entries[0][0] <= self.complete:
            groups = self._entries.popleft()[0]
            self._expected -= groups
        else:
            groups = 0
        self.complete -= groups
        return groups

    def ready_despite(self, dropped: int, dropped_complete: int) -> bool:
        """Whether a step is ready now and stays ready after `dropped` groups leave,
        `dropped_complete` of them complete (a query; the complete ones leave first). A
        step that only the drops would make ready does not count: a caller deciding
        whether to refuse the call that causes them must not count on them."""
        if dropped_complete > dropped:
            raise ValueError(f"{dropped_complete} complete groups of {dropped} dropped")
        if not self.steps_ready():
            return False
        after = RoundQueue(self.prompts_per_step, self.mode, self.complete)
        after._entries = deque(list(entry) for entry in self._entries)
        after._expected = self._expected
        for index in range(dropped):
            after.drop(was_complete=index < dropped_complete)
        return after.steps_ready() > 0

    @property
    def owed(self) -> int:
        """Groups the entries expect beyond those complete: not arrived yet ("sampled")."""
        return self._expected - self.complete if self.sampled else 0

    def entries(self) -> list[list[int]]:
        """[groups, is_round] per future step, oldest first (a copy, for snapshots)."""
        return [list(entry) for entry in self._entries]

    def restore(self, entries: list[list[int]], complete: int) -> None:
        """Become the queue `entries()` described, with `complete` groups complete. A
        "fixed" queue ignores the entries; a "sampled" one adds fallback entries for complete
        groups no entry expects (a snapshot from before rounds existed, or a "fixed" run)."""
        self._entries = deque()
        self._expected = 0
        self.complete = 0
        if self.sampled:
            for groups, is_round in entries:
                if groups < 1:
                    raise ValueError(f"round queue: an entry of {groups} groups")
                self._entries.append([int(groups), int(bool(is_round))])
                self._expected += int(groups)
        for _ in range(complete):
            self.add_complete()
