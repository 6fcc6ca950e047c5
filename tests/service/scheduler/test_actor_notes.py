"""A front-end's notes riding along with its next call (`SchedulerActor.apply_notes` with
`then`): one actor call that answers as the two calls it replaces, notes first. The actor's
body runs in-process here (no Ray), as the golden-journal tests run it."""

from __future__ import annotations

import numpy as np
import pytest
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.records import (
    AckNote,
    BatchHandle,
    FetchNote,
    HeldBy,
    StoreStepNote,
)
from rlfeed.service.testing import synthetic_groups

FRONTEND = "frontend-0"


def actor_with_a_stored_step() -> SchedulerActor:
    """An actor body (world size 2) whose step 0 is stored at FRONTEND, fetched by no rank."""
    config = with_overrides(
        SidecarConfig(),
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": 2, "token_budget": 256},
    )
    actor = SchedulerActor(config)
    actor.register_frontend(FRONTEND, "")
    actor.register_tasks([f"task-{i}" for i in range(64)])
    groups = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(0))
    arrays = decode_rollout_batch(groups.encode())
    (reply,) = actor.ingest(FRONTEND, [], [(batch_meta(arrays), BatchHandle(FRONTEND, 0))])
    assert [work.step for work in reply.work] == [0]
    actor.apply_notes([StoreStepNote(0, [HeldBy(FRONTEND)] * 2, 100)])
    return actor


def test_a_call_after_notes_answers_as_if_the_notes_had_gone_first() -> None:
    riding, alone = actor_with_a_stored_step(), actor_with_a_stored_step()
    assert riding.status().steps_waiting == {0: [0, 1]}
    alone.apply_notes([FetchNote(0, 1)])
    expected = alone.ack_steps(0, 0)
    assert riding.apply_notes([FetchNote(0, 1)], "ack_steps", 0, 0) == expected == 0
    # Rank 1's fetch and rank 0's acknowledgement both counted: no rank waits for step 0.
    assert riding.status().steps_waiting == alone.status().steps_waiting == {}


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
