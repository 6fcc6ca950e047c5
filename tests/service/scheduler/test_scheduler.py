"""The scheduler's logic without Ray or gRPC: grouping, steps, staleness, idempotency,
zero-advantage handling, backpressure, release of fetched steps and the curriculum."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.codec.validation import validate_rollout_batch
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.errors import BackpressureError, InvalidBatchError
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import SyntheticRollouts, check_served_step, synthetic_groups


def make_scheduler(*, track_releases: bool = False, **sections) -> Scheduler:
    base = {
        "rollouts": {"prompts_per_step": 2, "group_size": 4},
        "batching": {"world_size": 2, "token_budget": 256},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    scheduler = Scheduler(with_overrides(SidecarConfig(), **base), track_releases=track_releases)
    scheduler.register_tasks([f"task-{i}" for i in range(64)])
    return scheduler


def ingest(scheduler: Scheduler, rollouts: SyntheticRollouts, rows=None):
    arrays = decode_rollout_batch(rollouts.encode(rows))
    validate_rollout_batch(arrays, token_budget=scheduler.config.batching.token_budget)
    return scheduler.ingest_batch(batch_meta(arrays), arrays.columns)


def fetch_step(scheduler: Scheduler, step: int) -> list[bytes]:
    results = [scheduler.fetch_batch(step, r) for r in range(scheduler.config.batching.world_size)]
    assert all(result.ready for result in results)
    return [result.response for result in results]


def test_step_serves_every_policy_token_of_its_groups_exactly_once() -> None:
    scheduler = make_scheduler()
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(0))
    ack = ingest(scheduler, rollouts)
    assert (ack.accepted, ack.steps_ready) == (8, 1)
    assert assemble_ready_steps(scheduler) == [0]
    served = check_served_step(fetch_step(scheduler, 0), rollouts)
    assert sorted(served) == sorted(rollouts.rollout_ids)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 13),
    budget=st.integers(200, 600),
)
def test_groups_split_across_batches_make_the_same_checked_steps(
    seed: int, world_size: int, batch_size: int, budget: int
) -> None:
    scheduler = make_scheduler(batching={"world_size": world_size, "token_budget": budget})
    rng = np.random.default_rng(seed)
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=rng, max_length=200)
    order = rng.permutation(len(rollouts))  # groups interleave across batches
    steps = []
    for start in range(0, len(order), batch_size):
        ingest(scheduler, rollouts, order[start : start + batch_size])
        steps += assemble_ready_steps(scheduler)
    assert steps == [0, 1, 2]
    served = [check_served_step(fetch_step(scheduler, s), rollouts) for s in steps]
    assert sorted(r for ids in served for r in ids) == sorted(rollouts.rollout_ids)
    for ids in served:  # a step holds whole groups
        assert len({rollout_id.split("-")[0] for rollout_id in ids}) == 2


def test_refetching_a_step_returns_identical_bytes() -> None:
    scheduler = make_scheduler()
    ingest(scheduler, synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(1)))
    assemble_ready_steps(scheduler)
    assert fetch_step(scheduler, 0) == fetch_step(scheduler, 0)


def test_replaying_the_same_calls_reproduces_the_same_bytes() -> None:
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(2))
    outputs = []
    for _ in range(2):
        scheduler = make_scheduler()
        ingest(scheduler, rollouts, range(0, 9))
        ingest(scheduler, rollouts, range(9, 16))
        assemble_ready_steps(scheduler)
        outputs.append(fetch_step(scheduler, 0) + fetch_step(scheduler, 1))
    assert outputs[0] == outputs[1]


def test_resubmitted_rollouts_are_duplicates_not_double_counted() -> None:
    scheduler = make_scheduler()
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(3))
    ingest(scheduler, rollouts, range(6))
    again = ingest(scheduler, rollouts, range(8))
    assert (again.accepted, again.duplicate) == (2, 6)
    assert assemble_ready_steps(scheduler) == [0]
    assert scheduler.status().counters.rollouts_accepted == 8
    check_served_step(fetch_step(scheduler, 0), rollouts)


def test_a_rollout_too_far_behind_drops_its_whole_group_as_stale() -> None:
    scheduler = make_scheduler(rollouts={"max_policy_lag": 1})
    rng = np.random.default_rng(4)
    old = synthetic_groups(num_groups=2, group_size=4, rng=rng, prefix="old", policy_version=0)
    new = synthetic_groups(num_groups=2, group_size=4, rng=rng, prefix="new", policy_version=2)
    ingest(scheduler, old, range(3))  # group old-g0 is still incomplete
    ack = ingest(scheduler, new)
    assert ack.stale == 0 and scheduler.status().counters.rollouts_stale == 3
    late = ingest(scheduler, old, range(3, 8))  # the rest of old-g0 and all of old-g1
    assert (late.accepted, late.stale) == (0, 5)
    assert assemble_ready_steps(scheduler) == [0]
    served = check_served_step(fetch_step(scheduler, 0), new)
    assert sorted(served) == sorted(new.rollout_ids)
    assert scheduler.status().counters.rollouts_stale == 8


def test_one_bogus_policy_version_is_rejected_and_cannot_make_the_run_stale() -> None:
    scheduler = make_scheduler(rollouts={"max_version_jump": 16})
    rng = np.random.default_rng(14)
    honest = synthetic_groups(num_groups=2, group_size=4, rng=rng, policy_version=0)
    bogus = synthetic_groups(
        num_groups=1, group_size=1, rng=rng, prefix="x", policy_version=10**12, tasks=["task-0"]
    )
    ingest(scheduler, honest, range(3))
    before = scheduler.status()
    with pytest.raises(
        InvalidBatchError,
        match=r"rollout 'xg0-r0': field policy_version: 1000000000000 is more than "
        r"max_version_jump 16 ahead of the newest policy version seen, 0",
    ) as error:
        ingest(scheduler, bogus)
    assert error.value.reason == "bad_policy_version"
    assert scheduler.status() == before  # the batch is rejected as a whole
    ack = ingest(scheduler, honest, range(3, 8))
    assert (ack.accepted, ack.stale, ack.stale_buffered) == (5, 0, 0)
    assert assemble_ready_steps(scheduler) == [0]


def test_the_first_rollout_sets_the_version_baseline_and_jumps_up_to_the_limit_pass() -> None:
    scheduler = make_scheduler(rollouts={"max_version_jump": 3, "max_policy_lag": 100})
    rollouts = synthetic_groups(num_groups=6, group_size=1, rng=np.random.default_rng(15))
    rollouts.policy_versions[:] = [5, 9, 8, 12, 11, 14]
    with pytest.raises(InvalidBatchError, match="rollout 'g1-r0': field policy_version: 9 "):
        ingest(scheduler, rollouts, [0, 1])  # 9 is 4 ahead of this first rollout's 5
    assert ingest(scheduler, rollouts, [0, 2]).newest_policy_version == 8  # 5, then 8 = 5 + 3
    with pytest.raises(InvalidBatchError, match="rollout 'g3-r0': field policy_version: 12 "):
        ingest(scheduler, rollouts, [3])
    assert ingest(scheduler, rollouts, [4]).newest_policy_version == 11
    assert ingest(scheduler, rollouts, [0, 5]).accepted == 1  # a duplicate is not checked


def test_a_configured_initial_version_rejects_a_bogus_very_first_rollout() -> None:
    """Without it the first rollout sets the baseline (above); with it, a bogus version on
    the very first rollout is rejected and rollouts behind the start are stale."""
    scheduler = make_scheduler(
        rollouts={"initial_policy_version": 40, "max_version_jump": 3, "max_policy_lag": 2}
    )
    rollouts = synthetic_groups(num_groups=3, group_size=1, rng=np.random.default_rng(16))
    rollouts.policy_versions[:] = [10**12, 37, 43]
    with pytest.raises(
        InvalidBatchError,
        match=r"rollout 'g0-r0': field policy_version: 1000000000000 is more than "
        r"max_version_jump 3 ahead of the newest policy version seen, 40",
    ):
        ingest(scheduler, rollouts, [0])
    assert ingest(scheduler, rollouts, [1]).stale == 1  # 37 < 40 - max_policy_lag
    assert ingest(scheduler, rollouts, [2]).newest_policy_version == 43


def test_zero_advantage_groups_are_counted_and_dropped_when_configured() -> None:
    rng = np.random.default_rng(5)
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=rng)
    rollouts.rewards[:4] = [1.0] * 4  # group g0: all pass
    rollouts.rewards[4:8] = [0.0, 1.0, 0.0, 0.0]
    rollouts.rewards[8:12] = [0.0] * 4  # group g2: all fail
    rollouts.rewards[12:16] = [1.0, 0.0, 1.0, 1.0]
    kept = make_scheduler()
    ingest(kept, rollouts)
    assert assemble_ready_steps(kept) == [0, 1]
    assert kept.status().counters.zero_advantage_groups == 2
    dropping = make_scheduler(advantages={"drop_zero_advantage": True})
    ingest(dropping, rollouts)
    assert assemble_ready_steps(dropping) == [0]
    served = check_served_step(fetch_step(dropping, 0), rollouts)
    assert {r.split("-")[0] for r in served} == {"g1", "g3"}
    status = dropping.status()
    assert status.counters.zero_advantage_groups == 2
    assert status.counters.zero_advantage_rollouts_dropped == 8
    assert status.last_step.zero_advantage_groups_dropped == 2


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.task_ids.__setitem__(0, "no-such-task"), "task_id"),
        (lambda r: r.task_ids.__setitem__(1, "task-7"), "group_id"),  # group spans two tasks
    ],
)
def test_state_dependent_errors_name_the_rollout_and_leave_no_trace(mutate, field) -> None:
    scheduler = make_scheduler()
    rollouts = synthetic_groups(
        num_groups=2, group_size=4, rng=np.random.default_rng(6), tasks=["task-0", "task-1"]
    )
    mutate(rollouts)
    before = scheduler.status()
    with pytest.raises(InvalidBatchError, match=f"rollout '.*': field {field}"):
        ingest(scheduler, rollouts)
    assert scheduler.status() == before


def test_a_group_beyond_group_size_is_rejected() -> None:
    scheduler = make_scheduler()
    rollouts = synthetic_groups(num_groups=1, group_size=5, rng=np.random.default_rng(7))
    ingest(scheduler, rollouts, range(4))
    with pytest.raises(InvalidBatchError, match=r"rollout 'g0-r4': field group_id"):
        ingest(scheduler, rollouts, [4])


def test_full_buffer_refuses_the_batch_until_ranks_fetch() -> None:
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": 8})
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(8))
    ingest(scheduler, rollouts, range(8))
    assemble_ready_steps(scheduler)
    with pytest.raises(BackpressureError, match="max_buffered_rollouts"):
        ingest(scheduler, rollouts, range(8, 12))
    fetch_step(scheduler, 0)  # both ranks fetched step 0: its rollouts no longer count
    assert ingest(scheduler, rollouts, range(8, 16)).accepted == 8


def test_rollouts_joining_buffered_groups_are_taken_even_when_the_buffer_is_full() -> None:
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": 12})
    rollouts = synthetic_groups(num_groups=5, group_size=4, rng=np.random.default_rng(12))
    ingest(scheduler, rollouts, [8, 9, 12, 13])  # half of g2 and g3
    ingest(scheduler, rollouts, range(8))  # g0 and g1: step 0, not fetched yet
    assert assemble_ready_steps(scheduler) == [0]
    assert ingest(scheduler, rollouts, [10, 11]).accepted == 2  # completes g2 beyond the bound
    with pytest.raises(BackpressureError, match="opening new groups"):
        ingest(scheduler, rollouts, [14, 16])  # the rest of g3 with g4's first rollout
    assert ingest(scheduler, rollouts, [14, 15]).accepted == 2  # g3 alone
    assert assemble_ready_steps(scheduler) == [1]
    fetch_step(scheduler, 0)
    fetch_step(scheduler, 1)
    assert ingest(scheduler, rollouts, range(16, 20)).accepted == 4


def test_new_groups_are_taken_beyond_the_bound_when_no_step_waits_for_ranks() -> None:
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": 8})
    rollouts = synthetic_groups(num_groups=5, group_size=4, rng=np.random.default_rng(13))
    ingest(scheduler, rollouts, [g * 4 + i for g in range(4) for i in range(2)])  # 4 half groups
    assert scheduler.status().steps_waiting == {}  # fetching could never make room
    assert ingest(scheduler, rollouts, [16, 2]).accepted == 2  # opens g4, adds to g0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch_size=st.integers(1, 7),
    max_buffered=st.integers(8, 20),
)
def test_a_refused_batch_is_taken_once_ranks_fetch_so_producers_never_deadlock(
    seed: int, batch_size: int, max_buffered: int
) -> None:
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": max_buffered})
    rng = np.random.default_rng(seed)
    rollouts = synthetic_groups(num_groups=8, group_size=4, rng=rng, max_length=60)
    order = rng.permutation(len(rollouts))  # groups interleave across batches
    served: list[str] = []

    def ranks_fetch_every_waiting_step() -> None:
        for step in scheduler.status().steps_waiting:
            served.extend(check_served_step(fetch_step(scheduler, step), rollouts))

    for start in range(0, len(order), batch_size):  # one producer, batches in order
        rows = order[start : start + batch_size]
        try:
            ingest(scheduler, rollouts, rows)
        except BackpressureError:
            assert scheduler.status().steps_waiting  # a refusal that fetching can end
            ranks_fetch_every_waiting_step()
            ingest(scheduler, rollouts, rows)
        assemble_ready_steps(scheduler)
    ranks_fetch_every_waiting_step()
    assert sorted(served) == sorted(rollouts.rollout_ids)


def test_steps_fetched_by_every_rank_are_released_after_retained_steps() -> None:
    scheduler = make_scheduler(batching={"retained_steps": 1})
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=np.random.default_rng(9))
    ingest(scheduler, rollouts)
    assert assemble_ready_steps(scheduler) == [0, 1, 2]
    assert scheduler.status().steps_waiting == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    scheduler.fetch_batch(0, 0)
    assert scheduler.status().steps_waiting[0] == [1]
    fetch_step(scheduler, 0)
    fetch_step(scheduler, 1)  # step 0 is now the second fully fetched step: released
    assert scheduler.fetch_batch(0, 0).released
    assert scheduler.fetch_batch(1, 1).ready
    assert not scheduler.fetch_batch(3, 0).ready and not scheduler.fetch_batch(3, 0).released
    with pytest.raises(ValueError, match="rank 2"):
        scheduler.fetch_batch(0, 2)


def test_released_steps_are_reported_once_each_in_release_order() -> None:
    """What a front-end holding the responses is told it may drop: exactly the steps that
    fetch_batch answers as released, each once."""
    scheduler = make_scheduler(batching={"retained_steps": 1}, track_releases=True)
    ingest(scheduler, synthetic_groups(num_groups=8, group_size=4, rng=np.random.default_rng(3)))
    assert assemble_ready_steps(scheduler) == [0, 1, 2, 3]
    reported = []
    for step in (0, 2, 1, 3):
        fetch_step(scheduler, step)
        reported += scheduler.take_releases()[1]
        assert scheduler.take_releases() == ([], [])
    assert reported == [0, 2, 1]  # the newest fully fetched step is retained
    assert all(scheduler.fetch_batch(step, 0).released for step in reported)
    assert scheduler.fetch_batch(3, 1).ready
    untracked = make_scheduler()
    assert untracked.take_releases() == ([], [])


def assembled_steps(num_steps: int, **batching) -> Scheduler:
    """A scheduler (world_size 2) with `num_steps` steps stored and nobody done with any."""
    scheduler = make_scheduler(batching=batching, track_releases=True)
    groups = synthetic_groups(num_groups=2 * num_steps, group_size=4, rng=np.random.default_rng(7))
    ingest(scheduler, groups)
    assert assemble_ready_steps(scheduler) == list(range(num_steps))
    return scheduler


def test_a_step_every_rank_fetched_is_kept_until_every_rank_acknowledges_it() -> None:
    scheduler = assembled_steps(3, retained_steps=1)
    assert scheduler.ack_steps(0, 0) == 0
    assert scheduler.ack_steps(1, 0) == 0  # both ranks acknowledge: fetches no longer count
    fetch_step(scheduler, 1)
    fetch_step(scheduler, 2)  # fetched by every rank (prefetch, say), acknowledged by none
    assert scheduler.held_steps([0, 1, 2]) == [0, 1, 2]
    assert scheduler.ack_steps(0, 2) == 2
    assert scheduler.held_steps([0, 1, 2]) == [0, 1, 2]  # rank 1 is still at step 0
    assert scheduler.ack_steps(1, 1) == 1  # steps 0 and 1 done: the newest one stays
    assert scheduler.held_steps([0, 1, 2]) == [1, 2]
    assert scheduler.take_releases()[1] == [0]
    assert scheduler.fetch_batch(0, 0).released
    assert scheduler.fetch_batch(1, 1).ready


@settings(max_examples=25, deadline=None)
@given(
    acks=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), max_size=12),
    retained=st.integers(1, 3),
)
def test_a_step_is_held_until_retained_steps_newer_ones_are_acknowledged_by_every_rank(
    acks: list[tuple[int, int]], retained: int
) -> None:
    """Whatever the order of the acknowledgements: step s is released exactly when every
    rank acknowledged s + retained_steps (cumulative acknowledgements, resends included)."""
    scheduler = assembled_steps(6, retained_steps=retained)
    steps = list(range(6))
    acked = {0: -1, 1: -1}
    for rank, through_step in acks:
        acked[rank] = max(acked[rank], through_step)
        assert scheduler.ack_steps(rank, through_step) == acked[rank]
        every_rank = min(acked.values())
        assert scheduler.held_steps(steps) == [s for s in steps if s > every_rank - retained]


def test_a_rank_that_never_acknowledges_is_counted_by_its_fetches() -> None:
    """A trainer that does not acknowledge (rank 1 here) still lets steps go: its fetch
    stands for its acknowledgement. One that says it acknowledges (rank 0, before its first
    fetch) is never counted by its fetches."""
    scheduler = assembled_steps(3, retained_steps=1)
    assert scheduler.ack_steps(0, None) == -1
    fetch_step(scheduler, 0)
    fetch_step(scheduler, 1)
    assert scheduler.held_steps([0, 1, 2]) == [0, 1, 2]
    scheduler.ack_steps(0, 2)
    assert scheduler.held_steps([0, 1, 2]) == [1, 2]  # rank 1 fetched 0 and 1


def test_an_acknowledgement_of_a_step_not_assembled_is_refused_and_changes_nothing() -> None:
    scheduler = assembled_steps(2, retained_steps=1)
    with pytest.raises(ValueError, match=r"field through_step: step 2 has not been assembled"):
        scheduler.ack_steps(0, 2)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        scheduler.ack_steps(2, 0)
    scheduler.ack_steps(1, 1)
    assert scheduler.held_steps([0, 1]) == [0, 1]  # rank 0 acknowledged nothing


def test_a_step_acknowledged_while_it_is_materialized_is_released_in_turn() -> None:
    scheduler = make_scheduler(batching={"retained_steps": 1})
    ingest(scheduler, synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(5)))
    work = scheduler.plan_ready_steps()  # steps 0 and 1 planned, their bytes not stored yet
    for rank in (0, 1):
        scheduler.ack_steps(rank, 1)
    for item in work:
        scheduler.store_step(item.step, [b"rank 0", b"rank 1"])
    assert scheduler.held_steps([0, 1]) == [1]


def test_steps_fetched_or_acknowledged_do_not_hold_producers_back() -> None:
    """Backpressure counts a step while a rank has neither fetched nor acknowledged it, not
    until its release: a trainer acknowledging only at checkpoints must still get the steps
    up to the next one, and one resuming past a step never fetches it."""
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": 8})
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=np.random.default_rng(8))
    ingest(scheduler, rollouts, range(8))
    assert assemble_ready_steps(scheduler) == [0]
    with pytest.raises(BackpressureError, match="max_buffered_rollouts"):
        ingest(scheduler, rollouts, range(8, 16))
    for rank in (0, 1):
        scheduler.ack_steps(rank, 0)  # acknowledged unfetched (resumed past it): room
    ingest(scheduler, rollouts, range(8, 16))
    assert assemble_ready_steps(scheduler) == [1]
    with pytest.raises(BackpressureError, match="max_buffered_rollouts"):
        ingest(scheduler, rollouts, range(16, 24))
    fetch_step(scheduler, 1)  # fetched, not acknowledged: held for re-fetch, and room
    assert scheduler.held_steps([1]) == [1]
    assert ingest(scheduler, rollouts, range(16, 24)).accepted == 8


def run_groups_through(scheduler: Scheduler, rollouts: SyntheticRollouts, rows) -> None:
    """Ingest `rows`, assemble what is ready and let every rank fetch it."""
    ingest(scheduler, rollouts, rows)
    for step in assemble_ready_steps(scheduler):
        fetch_step(scheduler, step)


def test_idempotency_memory_stays_bounded_over_a_long_run() -> None:
    scheduler = make_scheduler(
        rollouts={"prompts_per_step": 1, "group_size": 2, "dedup_window_groups": 5}
    )
    rollouts = synthetic_groups(
        num_groups=150, group_size=2, rng=np.random.default_rng(16), tasks=["task-0", "task-1"]
    )
    for start in range(0, len(rollouts), 6):
        run_groups_through(scheduler, rollouts, range(start, start + 5))  # leaves a half group
        run_groups_through(scheduler, rollouts, [start + 5])
        status = scheduler.status()
        assert status.remembered_closed_groups <= 5
        assert status.remembered_rollout_ids <= status.buffered_rollouts + 5 * 2
    status = scheduler.status()
    assert (status.remembered_closed_groups, status.remembered_rollout_ids) == (5, 10)
    assert status.counters.rollouts_trained == 300


def test_a_resend_is_a_duplicate_while_its_group_is_remembered_and_new_data_after() -> None:
    scheduler = make_scheduler(
        rollouts={"prompts_per_step": 1, "group_size": 2, "dedup_window_groups": 2}
    )
    rollouts = synthetic_groups(num_groups=4, group_size=2, rng=np.random.default_rng(17))
    ingest(scheduler, rollouts, [6])  # g3 stays buffered, half complete, all along
    run_groups_through(scheduler, rollouts, [0, 1])  # g0 trained: step 0
    assert ingest(scheduler, rollouts, [0, 1, 6]).duplicate == 3
    run_groups_through(scheduler, rollouts, [2, 3, 4, 5])  # g1, g2 trained: g0 forgotten
    assert ingest(scheduler, rollouts, [4, 6]).duplicate == 2  # g2 remembered, g3 buffered
    ack = ingest(scheduler, rollouts, [0, 1])  # the documented price of bounded memory
    assert (ack.accepted, ack.duplicate, ack.steps_ready) == (2, 0, 1)


def test_late_rollouts_of_a_stale_group_are_forgotten_with_it() -> None:
    scheduler = make_scheduler(
        rollouts={"group_size": 2, "max_policy_lag": 0, "dedup_window_groups": 1}
    )
    rng = np.random.default_rng(18)
    old = synthetic_groups(num_groups=1, group_size=2, rng=rng, prefix="old", policy_version=0)
    new = synthetic_groups(num_groups=2, group_size=2, rng=rng, prefix="new", policy_version=1)
    ingest(scheduler, old, [0])
    ingest(scheduler, new, [0])  # old-g0 goes stale
    assert ingest(scheduler, old, [1]).stale == 1  # a late rollout of the stale group
    assert scheduler.status().remembered_rollout_ids == 3
    run_groups_through(scheduler, new, [1, 2, 3])  # step 0 closes new-g0 and new-g1
    assert (
        scheduler.status().remembered_closed_groups,
        scheduler.status().remembered_rollout_ids,
    ) == (1, 2)


@pytest.mark.parametrize(
    ("rank", "step", "message"),
    [
        (2, 0, r"field rank: 2 is outside \[0, 2\)"),
        (4_000_000_000, 0, r"field rank: 4000000000 is outside \[0, 2\)"),
        (-1, 0, r"field rank: -1 is outside \[0, 2\)"),
        (1, -1, r"trainer report of rank 1: field step: -1 < 0"),
    ],
)
def test_a_report_from_outside_the_world_or_for_a_negative_step_is_refused(
    rank: int, step: int, message: str
) -> None:
    scheduler = make_scheduler()
    before = scheduler.status()
    with pytest.raises(ValueError, match=message):
        scheduler.record_report(rank, {"step": step, "loss": 0.5})
    assert scheduler.status() == before
    scheduler.record_report(1, {"step": 0, "loss": 0.5})
    assert scheduler.status().last_reports == {1: {"step": 0, "loss": 0.5}}


def test_step_metadata_is_the_global_count_and_newest_policy_version() -> None:
    scheduler = make_scheduler(rollouts={"max_policy_lag": 5})
    rng = np.random.default_rng(10)
    first = synthetic_groups(num_groups=1, group_size=4, rng=rng, prefix="a", policy_version=3)
    second = synthetic_groups(num_groups=1, group_size=4, rng=rng, prefix="b", policy_version=5)
    ingest(scheduler, first)
    ingest(scheduler, second)
    assemble_ready_steps(scheduler)
    responses = [pb.GetBatchResponse.FromString(p) for p in fetch_step(scheduler, 0)]
    expected_tokens = sum(int(m.sum()) for m in first.action_mask + second.action_mask)
    for response in responses:
        assert response.policy_token_count == expected_tokens
        assert (response.policy_version, response.min_policy_version) == (5, 3)
    record = scheduler.status().last_step
    assert record.policy_token_count == expected_tokens
    assert record.real_tokens == sum(t.size for t in first.token_ids + second.token_ids)


def test_task_sampling_drops_saturated_tasks_and_revisits_them() -> None:
    scheduler = make_scheduler(
        curriculum={"estimator": "last", "revisits": 1, "seed": 3},
        rollouts={"prompts_per_step": 1, "group_size": 2},
    )
    scheduler = Scheduler(scheduler.config)
    scheduler.register_tasks(["easy", "hard", "mixed"])
    rng = np.random.default_rng(11)
    rollouts = synthetic_groups(
        num_groups=3, group_size=2, rng=rng, tasks=["easy", "hard", "mixed"]
    )
    rollouts.rewards[:] = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    ingest(scheduler, rollouts)
    status = scheduler.status()
    assert (status.tasks_total, status.tasks_inside_filter) == (3, 1)
    sample = scheduler.sample_tasks(3)
    assert sample.task_ids[0] == "mixed" and sample.revisit == [False, True]
    assert sample.task_ids[1] in ("easy", "hard")
    replay = Scheduler(scheduler.config)
    replay.register_tasks(["easy", "hard", "mixed"])
    ingest(replay, rollouts)
    assert replay.sample_tasks(3) == sample  # deterministic given the seed


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch_size=st.integers(1, 9),
    drop_zero=st.booleans(),
    stale_from=st.integers(0, 12),
    store_lag=st.integers(0, 3),
)
def test_a_payload_is_released_once_nothing_buffered_or_unstored_reads_it(
    seed: int, batch_size: int, drop_zero: bool, stale_from: int, store_lag: int
) -> None:
    """The front-end that holds an ingest batch's columns frees them on release: never while
    a buffered rollout or a planned step whose responses are not stored yet (whichever
    front-end materializes it) still reads them, exactly once, and for every batch once
    nothing is buffered and every step is stored. Steps are stored `store_lag` ingest calls
    after they are planned, lowest first."""
    config = {
        "rollouts": {"prompts_per_step": 2, "group_size": 4, "max_policy_lag": 0},
        "batching": {"world_size": 2, "token_budget": 256},
        "advantages": {"drop_zero_advantage": drop_zero},
    }
    scheduler = Scheduler(with_overrides(SidecarConfig(), **config), track_releases=True)
    scheduler.register_tasks([f"task-{i}" for i in range(64)])
    rng = np.random.default_rng(seed)
    old = synthetic_groups(num_groups=12, group_size=4, rng=rng, pass_rate=0.6)
    # Groups from stale_from on are one policy version newer: older open groups go stale.
    rollouts = replace(old, policy_versions=[int(i // 4 >= stale_from) for i in range(len(old))])
    order = rng.permutation(len(rollouts))
    accepted, released, unstored = [], [], []  # unstored: [(calls left, work)]

    def store_due(everything: bool = False) -> None:
        for entry in list(unstored):
            entry[0] -= 1
            if entry[0] < 0 or everything:
                unstored.remove(entry)
                scheduler.store_step(entry[1].step, [b"r0", b"r1"])

    def check_released() -> None:
        released.extend(scheduler.take_releases()[0])
        held = {batch.handle for batch in scheduler._batches.values()}
        buffered = {
            row.batch_key
            for group in (*scheduler._groups.open.values(), *scheduler._groups.complete.values())
            for row in group.rows
        }
        read = {handle for _, work in unstored for handle in work.payloads.values()}
        assert buffered <= set(scheduler._batches), "a buffered rollout lost its payload"
        assert not read & set(released), "released while an unstored step reads it"
        assert not held & set(released), "released while still held"

    for start in range(0, len(order), batch_size):
        handle = f"batch-{start}"
        arrays = decode_rollout_batch(rollouts.encode(order[start : start + batch_size]))
        validate_rollout_batch(arrays, token_budget=256)
        if scheduler.ingest_batch(batch_meta(arrays), handle).accepted:
            accepted.append(handle)
        store_due()
        unstored.extend([store_lag, work] for work in scheduler.plan_ready_steps())
        check_released()
    store_due(everything=True)
    check_released()
    assert len(released) == len(set(released)), "a payload released twice"
    # Every accepted batch is either still held (a buffered rollout needs it) or released.
    held = {batch.handle for batch in scheduler._batches.values()}
    assert sorted(released + sorted(held)) == sorted(accepted)
    buffered = {
        row.batch_key
        for group in (*scheduler._groups.open.values(), *scheduler._groups.complete.values())
        for row in group.rows
    }
    assert set(scheduler._batches) == buffered


def test_a_fleet_lagging_the_trainers_published_version_is_dropped_as_stale() -> None:
    """Every rollout carries version 0, so the newest version in a rollout stays 0; the
    trainer's published version 3 (max_policy_lag 1) still makes them stale: at ingest,
    and the groups already buffered, at once (no step ever takes them)."""
    scheduler = make_scheduler(rollouts={"max_policy_lag": 1})
    rng = np.random.default_rng(40)
    buffered = synthetic_groups(num_groups=2, group_size=4, rng=rng, prefix="a")
    late = synthetic_groups(num_groups=2, group_size=4, rng=rng, prefix="b")
    ingest(scheduler, buffered, range(7))  # one complete group, one open
    scheduler.record_report(0, {"step": 0, "loss": 0.1, "policy_version": 3})
    status = scheduler.status()
    assert status.trainer_policy_version == 3 and status.newest_policy_version == 0
    assert (status.buffered_rollouts, status.open_groups, status.complete_groups) == (0, 0, 0)
    assert status.counters.rollouts_stale == 7
    ack = ingest(scheduler, late)
    assert (ack.accepted, ack.stale) == (0, 8)
    # The 7 dropped by the report reach the metrics with this ingest (stale_buffered).
    tokens = [len(t) for t in buffered.token_ids[:7] + late.token_ids]
    assert ack.stale_buffered == 7 and ack.stale_tokens == sum(tokens)
    assert assemble_ready_steps(scheduler) == []
    assert scheduler.status().counters.rollouts_stale == 15


def test_rollouts_within_max_policy_lag_of_the_trainer_are_kept() -> None:
    scheduler = make_scheduler(rollouts={"max_policy_lag": 2})
    rng = np.random.default_rng(41)
    scheduler.record_report(1, {"step": 4, "loss": 0.1, "policy_version": 5})
    ok = synthetic_groups(num_groups=2, group_size=4, rng=rng, prefix="ok", policy_version=3)
    old = synthetic_groups(num_groups=1, group_size=4, rng=rng, prefix="old", policy_version=2)
    assert ingest(scheduler, ok).accepted == 8
    assert ingest(scheduler, old).stale == 4
    assert assemble_ready_steps(scheduler) == [0]
    # A late retry of an older report does not move the trainer's version back.
    scheduler.record_report(0, {"step": 1, "loss": 0.1, "policy_version": 1})
    assert scheduler.status().trainer_policy_version == 5
    assert scheduler.status().last_reports[0]["policy_version"] == 1


def test_max_version_jump_counts_from_the_trainers_version() -> None:
    scheduler = make_scheduler(rollouts={"max_version_jump": 3, "max_policy_lag": 100})
    rollouts = synthetic_groups(num_groups=2, group_size=1, rng=np.random.default_rng(42))
    rollouts.policy_versions[:] = [24, 23]
    scheduler.record_report(0, {"step": 0, "loss": 0.0, "policy_version": 20})
    with pytest.raises(
        InvalidBatchError,
        match=r"rollout 'g0-r0': field policy_version: 24 is more than max_version_jump 3 "
        r"ahead of the newest policy version seen, 20 \(in a rollout or published by the trainer\)",
    ):
        ingest(scheduler, rollouts, [0])
    assert ingest(scheduler, rollouts, [1]).accepted == 1


def test_a_negative_published_version_is_refused_keeping_nothing() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="trainer report of rank 0: field policy_version: -1 < 0"):
        scheduler.record_report(0, {"step": 0, "loss": 0.0, "policy_version": -1})
    status = scheduler.status()
    assert status.trainer_policy_version == -1 and status.last_reports == {}
