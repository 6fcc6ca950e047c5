"""A front-end's notes riding along with its next call (`SchedulerActor.apply_notes` with
`then`): one actor call that answers as the two calls it replaces, notes first. The actor's
body runs in-process here (no Ray), as the golden-journal tests run it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.journal.files import JOURNAL_IO
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.records import (
    AckNote,
    BatchHandle,
    FetchNote,
    HeldBy,
    Releases,
    StoreStepNote,
)
from rlfeed.service.testing import synthetic_groups

FRONTEND = "frontend-0"


def sidecar_config(journal_dir: Path | None = None) -> SidecarConfig:
    """World size 2, steps of 2 groups of 4; journaled in `journal_dir` if given."""
    return with_overrides(
        SidecarConfig(),
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": 2, "token_budget": 256},
        journal={"dir": str(journal_dir) if journal_dir else ""},
    )


def actor_with_a_stored_step(journal_dir: Path | None = None) -> SchedulerActor:
    """An actor body whose step 0 is stored at FRONTEND, fetched by no rank."""
    actor = SchedulerActor(sidecar_config(journal_dir))
    if journal_dir:  # it journals into a slot of its own
        actor.register_frontend(FRONTEND, "", slot=FRONTEND)
    else:
        actor.register_frontend(FRONTEND, "")
    actor.register_tasks([f"task-{i}" for i in range(64)])
    groups = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(0))
    arrays = decode_rollout_batch(groups.encode())
    (reply,) = actor.ingest(FRONTEND, [], [(batch_meta(arrays), BatchHandle(FRONTEND, 0))])
    assert [work.step for work in reply.work] == [0]
    # Journaled, the store names each rank's digest: the step can be built again.
    digests = [(0, 50), (0, 50)] if journal_dir else []
    actor.apply_notes([StoreStepNote(0, [HeldBy(FRONTEND)] * 2, 100, digests=digests)])
    return actor


def test_a_call_after_notes_answers_as_if_the_notes_had_gone_first() -> None:
    riding, alone = actor_with_a_stored_step(), actor_with_a_stored_step()
    assert riding.status().steps_waiting == {0: [0, 1]}
    alone.apply_notes([FetchNote(0, 1)])
    expected = alone.ack_steps(0, 0)
    assert riding.apply_notes([FetchNote(0, 1)], "ack_steps", 0, 0) == expected == 0
    # Rank 1's fetch and rank 0's acknowledgement both counted: no rank waits for step 0.
    assert riding.status().steps_waiting == alone.status().steps_waiting == {}


def test_notes_and_the_call_they_ride_with_are_made_durable_by_one_fsync(tmp_path) -> None:
    actor = actor_with_a_stored_step(tmp_path)
    actor.ack_steps(0, None)
    syncs = JOURNAL_IO.syncs
    assert actor.apply_notes([FetchNote(0, 0), FetchNote(0, 1)], "ack_steps", 0, 0) == 0
    assert JOURNAL_IO.syncs == syncs + 1  # not one for the notes and one for the call
    syncs = JOURNAL_IO.syncs
    assert actor.apply_notes([AckNote(1, 0)]) is None
    assert JOURNAL_IO.syncs == syncs + 1  # notes alone: synced before the (empty) answer
    # What it recorded is what the actor did: one started again from it is where it is.
    waiting = actor.status().steps_waiting
    actor.close()
    again = SchedulerActor(sidecar_config(tmp_path))
    assert again.status().steps_waiting == waiting == {}
    assert [again.ack_steps(rank, None) for rank in (0, 1)] == [0, 0]
    again.close()


def test_a_note_flush_is_synced_before_its_answer_only_when_it_frees_something(
    tmp_path,
) -> None:
    actor = SchedulerActor(sidecar_config(tmp_path))
    actor.register_frontend(FRONTEND, "", slot=FRONTEND)
    actor.register_tasks([f"task-{i}" for i in range(64)])
    groups = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(0))
    arrays = decode_rollout_batch(groups.encode())
    actor.ingest(FRONTEND, [], [(batch_meta(arrays), BatchHandle(FRONTEND, 0))])
    stored = StoreStepNote(0, [HeldBy(FRONTEND)] * 2, 100, digests=[(0, 50), (0, 50)])
    syncs = JOURNAL_IO.syncs
    # Step 0 stored: nothing reads batch 0 any more, and the front-end frees it only once
    # the store is on disk (else a restart would read the batch to build the step again).
    assert actor.sync(FRONTEND, [stored]) == Releases(payload_keys=[0])
    assert JOURNAL_IO.syncs == syncs + 1
    # A fetch noted, nothing to free: recorded, answered without waiting for the disk...
    assert actor.sync(FRONTEND, [FetchNote(0, 0)]) == Releases()
    assert JOURNAL_IO.syncs == syncs + 1
    # ...and made durable by the next call that changes the state, or that lets a
    # front-end delete journal segments (it must not count on records not yet synced).
    assert actor.journal_floor(FRONTEND) is not None
    assert JOURNAL_IO.syncs == syncs + 2
    assert actor.ack_steps(1, None) == -1
    assert JOURNAL_IO.syncs == syncs + 3
    actor.close()
    again = SchedulerActor(sidecar_config(tmp_path))
    assert again.status().steps_waiting == {0: [1]}  # rank 0's fetch was recorded
    again.close()


def test_notes_alone_answer_nothing() -> None:
    actor = actor_with_a_stored_step()
    assert actor.apply_notes([FetchNote(0, 0)]) is None
    assert actor.status().steps_waiting == {0: [1]}


@pytest.mark.parametrize("then", ["_commit", "no_such_call", "_scheduler"])
def test_only_the_actors_public_calls_can_follow_notes(then: str) -> None:
    actor = actor_with_a_stored_step()
    with pytest.raises(ValueError, match=f"apply_notes: '{then}' is not a call"):
        actor.apply_notes([], then)


def test_a_noted_acknowledgement_is_the_call_it_stands_for() -> None:
    noted, called = actor_with_a_stored_step(), actor_with_a_stored_step()
    for actor in (noted, called):
        assert [actor.ack_steps(0, None), actor.ack_steps(1, None)] == [-1, -1]
    noted.apply_notes([AckNote(0, 0), AckNote(1, 0)])
    assert [called.ack_steps(0, 0), called.ack_steps(1, 0)] == [0, 0]
    # Both ranks are done with step 0 either way, and acknowledged through it.
    assert noted.status().steps_waiting == called.status().steps_waiting == {}
    assert [noted.ack_steps(rank, None) for rank in (0, 1)] == [0, 0]
