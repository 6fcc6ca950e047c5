"""The release rule on its own (`StepRetention`): a rank is done with a step once it
acknowledged it, or, if it never acknowledged anything, once it fetched it; the steps every
rank is done with leave memory oldest first, the newest `retained_steps` staying."""

from __future__ import annotations

from rlfeed.service.scheduler.retention import StepRetention


def test_an_acknowledgement_covers_every_earlier_step_and_never_goes_back() -> None:
    retention = StepRetention(world_size=2, retained_steps=1)
    assert retention.ack(0, 5) == 5
    assert retention.ack(0, 3) == 5  # an older (or resent) acknowledgement changes nothing
    assert retention.ack(0, 5) == 5
    assert retention.ack(1, 2) == 2
    assert retention.acked_through == {0: 5, 1: 2}


def test_a_step_is_done_when_every_rank_acknowledged_it_whoever_fetched_it() -> None:
    retention = StepRetention(world_size=2, retained_steps=1)
    retention.ack(0, 4)
    retention.ack(1, 2)
    assert retention.done_by_every_rank(2, fetched=set())
    assert not retention.done_by_every_rank(3, fetched={0, 1})  # rank 1 only fetched it


def test_a_rank_that_never_acknowledged_is_done_with_the_steps_it_fetched() -> None:
    retention = StepRetention(world_size=2, retained_steps=1)
    retention.ack(0, 9)
    assert not retention.done_by_every_rank(3, fetched={0})
    assert retention.done_by_every_rank(3, fetched={1})
    assert retention.ack(1, -1) == -1  # "none yet, but I acknowledge": fetches stop counting
    assert not retention.done_by_every_rank(3, fetched={1})
    retention.ack(1, 3)
    assert retention.done_by_every_rank(3, fetched=set())


def test_the_newest_retained_steps_done_stay_and_older_ones_are_released_in_order() -> None:
    retention = StepRetention(world_size=1, retained_steps=2)
    assert retention.done(0) == []
    assert retention.done(1) == []
    assert retention.done(2) == [0]
    assert retention.done(3) == [1]
