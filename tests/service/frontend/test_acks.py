"""A lone front-end answers AckSteps itself only with the answer the scheduler gives
(`frontend/acks.py`), and asks the scheduler whenever it cannot know that answer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.frontend.acks import LoneAcks
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import synthetic_groups

WORLD_SIZE = 2


def scheduler_with_steps(steps: int) -> Scheduler:
    """A scheduler (world size 2) with `steps` steps assembled and stored."""
    config = with_overrides(
        SidecarConfig(),
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": WORLD_SIZE, "token_budget": 256, "retained_steps": 1},
    )
    scheduler = Scheduler(config)
    scheduler.register_tasks([f"task-{i}" for i in range(64)])
    groups = synthetic_groups(num_groups=2 * steps, group_size=4, rng=np.random.default_rng(3))
    arrays = decode_rollout_batch(groups.encode())
    scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    assert assemble_ready_steps(scheduler) == list(range(steps))
    return scheduler


@settings(max_examples=40, deadline=None)
@given(
    acks=st.lists(st.tuples(st.integers(0, WORLD_SIZE - 1), st.integers(0, 7)), max_size=20),
    newest_stored=st.integers(-1, 5),
)
def test_every_answer_given_here_is_the_schedulers(acks, newest_stored) -> None:
    scheduler = scheduler_with_steps(6)
    lone = LoneAcks(WORLD_SIZE, alone=True)
    for rank in range(WORLD_SIZE):  # the loader's declaration: always the scheduler's
        assert lone.answer(rank, None, newest_stored) is None
        lone.heard(rank, scheduler.ack_steps(rank, None))
    for rank, step in acks:
        answered = lone.answer(rank, step, newest_stored)
        if answered is not None:  # the note the actor applies later answers the same
            assert step <= newest_stored
            assert scheduler.ack_steps(rank, step) == answered
            continue
        try:
            lone.heard(rank, scheduler.ack_steps(rank, step))
        except ValueError:  # not assembled: the scheduler's refusal reaches the caller
            assert step >= 6


def test_what_a_front_end_cannot_know_is_asked() -> None:
    lone = LoneAcks(WORLD_SIZE, alone=True)
    assert lone.answer(0, 3, newest_stored=5) is None  # rank 0's acknowledged step unknown
    lone.heard(0, -1)
    assert lone.answer(0, 3, newest_stored=5) == 3
    assert lone.answer(0, 1, newest_stored=5) == 3  # cumulative: it never goes back
    assert lone.answer(0, 6, newest_stored=5) is None  # maybe not assembled yet
    assert lone.answer(0, None, newest_stored=5) is None
    assert lone.answer(WORLD_SIZE, 3, newest_stored=5) is None  # the scheduler refuses it
    lone.heard(0, 7)  # answered by the scheduler: its word is the rank's step from now on
    assert lone.answer(0, 4, newest_stored=5) == 7


@pytest.mark.parametrize("newest_stored", [-1, 5])
def test_a_front_end_with_peers_always_asks(newest_stored: int) -> None:
    shared = LoneAcks(WORLD_SIZE, alone=False)  # another front-end may have heard more
    shared.heard(0, -1)
    assert shared.answer(0, 0, newest_stored) is None
