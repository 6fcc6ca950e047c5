"""A stored step's responses are never journaled, only their digests: after a restart the
front-end of the step's slot builds them again from the journaled ingest batches, its own
slot's and other slots', byte-identical to what was first served, or refuses to serve them.

The sidecar's pieces run in one process, in order, as the golden-journal test drives them:
two front-end slots journal batches (kind 1) and hand their metadata to a `SchedulerActor`
body; the steps it plans read batches of both slots; each is materialized and noted stored
with digests (`journal_step`). Then everything is rebuilt from the journals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.rollout_batch import batch_meta, decode_batch
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.frontend.journaling import (
    KIND_BATCH,
    RederiveMismatchError,
    journal_step,
    load_claim,
)
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.journal import Journal
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.records import BatchHandle, HeldBy, IngestKind, StoreStepNote
from rlfeed.service.testing import synthetic_groups

SLOTS = ("frontend-0", "frontend-1")


def _config(directory: Path, snapshot_every: int) -> SidecarConfig:
    return with_overrides(
        SidecarConfig(),
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": 2, "token_budget": 256, "retained_steps": 2},
        journal={"dir": str(directory), "sync": "none", "snapshot_every_records": snapshot_every},
    )


class TwoSlots:
    """A scheduler actor body and two front-ends' journals; the run's served bytes."""

    def __init__(self, directory: Path, snapshot_every: int) -> None:
        self.config = _config(directory, snapshot_every)
        self.actor = SchedulerActor(self.config)
        journal = self.config.journal
        self.journals = {slot: Journal.open(directory / slot, journal) for slot in SLOTS}
        for slot in SLOTS:
            self.actor.register_frontend(slot, "", slot=slot)  # front-end id = its slot
        self.columns: dict[tuple[str, int], object] = {}
        self.served: dict[int, list[bytes]] = {}
        self.stored_by: dict[int, str] = {}  # the slot whose batch made the step ready

    def submit(self, slot: str, payload: bytes) -> None:
        arrays = decode_batch(payload)
        key = self.journals[slot].append(KIND_BATCH, payload)
        self.columns[slot, key] = arrays.columns
        (reply,) = self.actor.ingest(slot, [], [(batch_meta(arrays), BatchHandle(slot, key))])
        assert reply.kind is IngestKind.OK, reply.message
        for work in reply.work:  # stored by the front-end that made it ready
            responses = materialize_work(
                work, resolve=lambda handle: self.columns[handle.frontend_id, handle.key]
            )
            journal = self.journals[slot]
            before = journal.last_position
            positions, digests = journal_step(journal, work, responses)
            assert work.derivable and positions == [] and journal.last_position == before
            size = sum(map(len, responses))
            note = StoreStepNote(work.step, [HeldBy(slot)] * 2, size, positions, digests)
            self.actor.apply_notes([note])
            self.served[work.step] = responses
            self.stored_by[work.step] = slot

    def close(self) -> None:
        self.actor.close()
        for journal in self.journals.values():
            journal.close()


def _run(directory: Path, snapshot_every: int) -> tuple[TwoSlots, set[int]]:
    """Groups split across both slots, so steps read batches of both; returns the run and
    the steps still held (servable)."""
    run = TwoSlots(directory, snapshot_every)
    run.actor.register_tasks(["a", "b", "c"])
    rollouts = synthetic_groups(
        num_groups=8, group_size=4, rng=np.random.default_rng(3), tasks=["a", "b", "c"]
    )
    for start in range(0, len(rollouts), 2):  # half a group from each slot
        run.submit(SLOTS[(start // 2) % 2], rollouts.encode(range(start, start + 2)))
    held = set(run.actor.held_steps(list(run.served)))
    assert len(held) >= 3
    run.close()
    return run, held


@pytest.mark.parametrize("snapshot_every", [20_000, 5], ids=["replayed", "from-snapshot"])
def test_stored_steps_are_built_again_byte_identical_from_both_slots_journals(
    tmp_path, snapshot_every
) -> None:
    run, held = _run(tmp_path, snapshot_every)
    if snapshot_every == 5:
        assert list((tmp_path / "scheduler").glob("snapshot-*.msgpack"))

    actor = SchedulerActor(run.config)  # a restarted sidecar
    rebuilt: dict[int, list[bytes]] = {}
    try:
        for slot in SLOTS:
            actor.register_frontend(f"new-{slot}", "", slot=slot)
            claim = actor.claim_slot(f"new-{slot}", slot)
            journal = Journal.open(tmp_path / slot, run.config.journal)
            responses = ResponseCache(1 << 30)
            load_claim(journal, claim, LocalPayloads(), responses)
            journal.close()
            for work, _ in claim.derive:
                rebuilt[work.step] = responses.get(work.step)
                # every step reads batches of both slots, so one slot alone could not
                assert {ref.slot for ref in work.payloads.values()} == set(SLOTS)
        assert set(rebuilt) == held
        for step in held:
            assert rebuilt[step] == run.served[step], step
            for rank in (0, 1):  # and the actor names the new holder
                assert actor.fetch_batch(step, rank).value == HeldBy(f"new-{run.stored_by[step]}")
    finally:
        actor.close()


def test_a_response_that_is_built_differently_is_refused_not_served(tmp_path) -> None:
    run, held = _run(tmp_path, 20_000)
    slot = run.stored_by[min(held)]
    actor = SchedulerActor(run.config)
    try:
        actor.register_frontend("new", "", slot=slot)
        claim = actor.claim_slot("new", slot)
        work, digests = claim.derive[0]
        crc, size = digests[1]
        claim.derive[0] = (work, [digests[0], (crc ^ 1, size)])  # what another encoder left
        journal = Journal.open(tmp_path / slot, run.config.journal)
        responses = ResponseCache(1 << 30)
        with pytest.raises(RederiveMismatchError, match=f"step {work.step} rank 1: .* not served"):
            load_claim(journal, claim, LocalPayloads(), responses)
        journal.close()
        assert responses.get(work.step) is None  # nothing of it is kept
    finally:
        actor.close()


def test_a_held_steps_batches_stay_journaled_until_the_step_is_released(tmp_path) -> None:
    """Retention (the scheduler's `journal_floor`) keeps every batch a held step is built
    from, in whichever slot; once every rank acknowledged it and it is released, its
    recipe goes and the floor may move past its batches."""
    run = TwoSlots(tmp_path, 20_000)
    run.actor.register_tasks(["a", "b", "c"])
    rollouts = synthetic_groups(
        num_groups=8, group_size=4, rng=np.random.default_rng(3), tasks=["a", "b", "c"]
    )
    for start in range(0, len(rollouts), 2):
        run.submit(SLOTS[(start // 2) % 2], rollouts.encode(range(start, start + 2)))
    scheduler = run.actor._scheduler

    def floor_holds(steps: list[int]) -> None:
        for slot in SLOTS:
            read = [
                ref.position
                for step in steps
                for ref in scheduler.recipe(step).payloads.values()
                if ref.slot == slot
            ]
            floor = run.actor.journal_floor(slot)
            assert not read or (floor is not None and floor <= min(read)), slot

    stored = sorted(run.served)
    floor_holds(stored)
    last = stored[-1]
    for rank in (0, 1):
        run.actor.ack_steps(rank, last)
    run.actor.sync(SLOTS[0], [])  # the actor hands out what it released
    held = run.actor.held_steps(stored)
    assert held == stored[-2:]  # retained_steps = 2
    assert all(scheduler.recipe(step) is None for step in stored if step not in held)
    floor_holds(held)
    run.close()
