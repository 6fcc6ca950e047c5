"""The scheduler actor's register of front-ends: who serves which journal slot, which
planned steps each materializes, who was declared dead, and what each may free.

Kept apart from `SchedulerActor` (actor.py) so the actor stays a shell that forwards calls;
this is the bookkeeping it keeps about its callers, never journaled itself (a restarted
actor learns it again as front-ends register and claim their slots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from rlfeed.service.scheduler.journaled import JournaledScheduler
from rlfeed.service.scheduler.records import (
    BatchHandle,
    FrontendSeen,
    JournalRef,
    Releases,
    StepWork,
)

_MAX_PENDING_STEP_RELEASES = 4096  # per front-end, see FrontendRegistry.take_releases
# A front-end whose watch (it asks every second) has not asked for this long is shown
# "unresponsive" by `rlfeed status`.
_SERVING_WITHIN_S = 3.0


@dataclass
class _Frontend:
    """A registered front-end: where its peers reach it, and what it may free, kept until
    its next call that answers with `Releases`."""

    peer_address: str
    address: str = ""  # where clients reach it (host:port of its public port)
    node_id: str = ""  # the Ray node it runs on
    last_seen: float = field(default_factory=time.monotonic)  # its watch's last question
    released_keys: list[int] = field(default_factory=list)
    released_steps: list[int] = field(default_factory=list)

    def seen(self, frontend_id: str, slot: str, state: str | None = None) -> FrontendSeen:
        ago = time.monotonic() - self.last_seen
        if state is None:
            state = "serving" if ago <= _SERVING_WITHIN_S else "unresponsive"
        return FrontendSeen(frontend_id, self.address, self.node_id, slot, state, ago)


class FrontendRegistry:
    """Front-ends by id, their journal slots, and the planned steps they materialize."""

    def __init__(self, journaled: bool) -> None:
        self.journaled = journaled
        self.frontends: dict[str, _Frontend] = {}  # the registered ones, by id
        # Each front-end's journal slot, kept after it leaves: its journal outlives it.
        self.slots: dict[str, str] = {}
        # Planned steps not stored yet: who materializes each, and its work, so that the
        # work of a front-end that dies goes to the next front-end of its slot.
        self.materializing: dict[int, tuple[str, StepWork]] = {}
        self.orphaned_work: dict[str, list[StepWork]] = {}  # slot -> work of its dead one
        self.orphaned: set[str] = set()  # front-ends declared dead: their calls are refused
        self.restarting: dict[str, tuple[str, _Frontend]] = {}  # slot -> the dead one

    def touch(self, frontend_id: str) -> None:
        """Its watch asked: it is alive (`rlfeed status`)."""
        if frontend_id in self.frontends:
            self.frontends[frontend_id].last_seen = time.monotonic()

    def require_registered(self, frontend_id: str) -> None:
        """With a journal, a front-end the actor does not know (it restarted since) must
        register again first: its batches could not be journaled by their slot. Raised as
        an error, so the call answers UNAVAILABLE and the producer retries. A call of a
        front-end declared dead (`orphan_slot`) that arrives late is refused the same way."""
        if frontend_id in self.orphaned:
            raise RuntimeError(f"front-end {frontend_id} was declared dead")
        if self.journaled and frontend_id not in self.frontends:
            raise RuntimeError(
                f"front-end {frontend_id} is not registered with this scheduler (it restarted); "
                "the front-end registers again within a second"
            )

    def register(
        self, frontend_id: str, peer_address: str, slot: str, address: str, node_id: str
    ) -> None:
        known = self.frontends.setdefault(frontend_id, _Frontend(peer_address))
        known.address, known.node_id = address, node_id
        known.last_seen = time.monotonic()
        if slot:
            self.slots[frontend_id] = slot
            self.restarting.pop(slot, None)

    def claim(
        self, slot: str, frontend_id: str, recovered: list[StepWork], scheduler: JournaledScheduler
    ) -> list[StepWork]:
        """`recovered` work and the work the slot's dead front-end left, now `frontend_id`'s
        to materialize again, with the handles as they are now (batches of this slot are
        this front-end's again)."""
        work = [*recovered, *self.orphaned_work.pop(slot, [])]
        work = [replace(w, payloads=scheduler.step_payloads(w.step)) for w in work]
        for item in work:
            self.materializing[item.step] = (frontend_id, item)
        return work

    def orphan(self, slot: str, scheduler: JournaledScheduler) -> list[str]:
        """See `SchedulerActor.orphan_slot`."""
        dead = [fid for fid, s in self.slots.items() if s == slot and fid in self.frontends]
        for frontend_id in dead:
            self.restarting[slot] = (frontend_id, self.frontends.pop(frontend_id))
            self.orphaned.add(frontend_id)
            scheduler.orphan_frontend(frontend_id, slot, scheduler.step_refs())
            unstored = set(scheduler.unstored_steps(list(self.materializing)))
            orphaned = self.orphaned_work.setdefault(slot, [])
            for step, (owner, work) in sorted(self.materializing.items()):
                if owner == frontend_id and step in unstored:
                    orphaned.append(work)
                    del self.materializing[step]
        return dead

    def ref_of(self, handle: Any) -> JournalRef | None:
        """Where a payload handle's bytes are journaled (the scheduler's journal names it)."""
        if isinstance(handle, BatchHandle) and handle.frontend_id in self.slots:
            return JournalRef(self.slots[handle.frontend_id], handle.key)
        return handle if isinstance(handle, JournalRef) else None

    def take_releases(self, frontend_id: str, payloads: list[Any], steps: list[int]) -> Releases:
        """Sort what the scheduler released since the last call by front-end (a batch goes
        to the front-end holding it, a step to every front-end: any may hold its bytes)
        and hand `frontend_id` its share."""
        for handle in payloads:
            if not isinstance(handle, BatchHandle):  # StoredObject: freed with its reference
                continue
            owner, key = handle
            if owner in self.frontends:  # a front-end that left took its memory along
                self.frontends[owner].released_keys.append(key)
        if steps:
            for front_end in self.frontends.values():
                front_end.released_steps.extend(steps)
                # A front-end that stopped calling must not grow this without bound; a step
                # it misses leaves its memory with the cache limit instead.
                del front_end.released_steps[:-_MAX_PENDING_STEP_RELEASES]
        front_end = self.frontends.get(frontend_id)
        if front_end is None:
            return Releases()
        releases = Releases(payload_keys=front_end.released_keys, steps=front_end.released_steps)
        front_end.released_keys, front_end.released_steps = [], []
        return releases

    def seen(self) -> tuple[FrontendSeen, ...]:
        """Every front-end registered or restarting, by slot, for `rlfeed status`."""
        front_end_list = [
            known.seen(fid, self.slots.get(fid, "")) for fid, known in self.frontends.items()
        ]
        front_end_list += [
            dead.seen(fid, slot, "restarting") for slot, (fid, dead) in self.restarting.items()
        ]
        return tuple(sorted(front_end_list, key=lambda f: (f.slot, f.frontend_id)))
