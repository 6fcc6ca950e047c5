"""RoundQueue: the groups each step takes, fixed or following the curriculum's rounds.

Checked against the straightforward bookkeeping: with whole rounds and no drops, step i
is round i; with drops, every handed-out group is planned into a step, still owed, or
dropped (never lost or counted twice); "fixed" is `complete // prompts_per_step` whatever
the sampling calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.rounds import RoundQueue


def take_all(queue: RoundQueue) -> list[int]:
    """Plan every ready step, as the scheduler does after each call."""
    steps = []
    while groups := queue.take_step():
        steps.append(groups)
    return steps


def test_rounds_of_8_2_5_make_steps_of_8_2_5() -> None:
    queue = RoundQueue(8, "sampled")
    for k in (8, 2, 5):
        queue.open_round(k)
    steps = []
    for _ in range(15):
        queue.add_complete()
        steps += take_all(queue)
    assert steps == [8, 2, 5]
    assert queue.entries() == [] and queue.complete == 0


def test_a_drop_is_deducted_from_the_oldest_round_still_waiting() -> None:
    queue = RoundQueue(8, "sampled")
    queue.open_round(3)
    queue.open_round(5)
    for _ in range(3):
        queue.add_complete()
    assert take_all(queue) == [3]
    queue.add_complete()
    queue.drop(was_complete=False)  # one of the second round's groups goes stale
    assert queue.entries() == [[4, 1]]
    for _ in range(3):
        queue.add_complete()
    assert take_all(queue) == [4]


def test_a_drop_after_a_round_filled_is_not_taken_from_that_round() -> None:
    """Within one ingest batch the round's last group completes and another group is
    dropped before steps are planned: the drop belongs to a later round."""
    queue = RoundQueue(8, "sampled")
    queue.open_round(3)
    queue.open_round(5)
    for _ in range(3):
        queue.add_complete()
    queue.drop(was_complete=False)
    assert queue.entries() == [[3, 1], [4, 1]]
    assert take_all(queue) == [3]


def test_a_round_reduced_to_zero_is_removed_and_the_next_one_steps() -> None:
    queue = RoundQueue(8, "sampled")
    queue.open_round(1)
    queue.open_round(2)
    queue.drop(was_complete=False)
    assert queue.entries() == [[2, 1]]
    queue.add_complete()
    queue.add_complete()
    assert take_all(queue) == [2]


def test_a_complete_group_dropped_is_no_longer_counted_or_waited_for() -> None:
    queue = RoundQueue(8, "sampled")
    queue.open_round(3)
    queue.add_complete()
    queue.add_complete()
    queue.drop(was_complete=True)  # went stale while waiting for the third
    assert (queue.complete, queue.entries()) == (1, [[2, 1]])
    queue.add_complete()
    assert take_all(queue) == [2]


def test_groups_with_no_round_waiting_go_prompts_per_step_to_a_step() -> None:
    queue = RoundQueue(4, "sampled")
    for _ in range(5):  # a producer that never asked for tasks
        queue.add_complete()
    assert take_all(queue) == [4]
    queue.open_round(2)  # behind the fallback step that holds the fifth group
    assert queue.entries() == [[4, 0], [2, 1]] and queue.steps_ready() == 0
    queue.drop(was_complete=False)  # deducted from the round, not the fallback entry
    assert queue.entries() == [[4, 0], [1, 1]]
    for _ in range(4):
        queue.add_complete()
    assert take_all(queue) == [4, 1]


def test_a_drop_with_only_fallback_steps_waiting_changes_only_the_count() -> None:
    queue = RoundQueue(4, "sampled")
    queue.add_complete()
    queue.add_complete()
    queue.drop(was_complete=True)
    queue.drop(was_complete=False)
    assert (queue.complete, queue.entries()) == (1, [[4, 0]])


def test_only_a_step_ready_before_the_drops_counts_as_ready_despite_them() -> None:
    queue = RoundQueue(8, "sampled")
    queue.open_round(3)
    queue.add_complete()
    queue.add_complete()
    before = (queue.complete, queue.entries())
    # One drop would make the round's 2 complete groups a step, but only once it happened.
    assert not queue.ready_despite(dropped=1, dropped_complete=0)
    queue.add_complete()
    assert queue.ready_despite(dropped=1, dropped_complete=1)  # [2]: 2 of 2 complete
    fallback = RoundQueue(2, "sampled")
    fallback.add_complete()
    fallback.add_complete()
    assert fallback.ready_despite(0, 0) and not fallback.ready_despite(1, 1)
    assert (queue.complete - 1, queue.entries()) == before  # queries changed nothing
    with pytest.raises(ValueError, match="2 complete groups of 1 dropped"):
        queue.ready_despite(dropped=1, dropped_complete=2)


def test_bad_settings_and_snapshots_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="step_groups"):
        RoundQueue(8, "dynamic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompts_per_step"):
        RoundQueue(0)
    with pytest.raises(ValueError, match="an entry of 0 groups"):
        RoundQueue(8, "sampled").restore([[0, 1]], 0)
    with pytest.raises(ValueError, match="no group is complete"):
        RoundQueue(8, "sampled").drop(was_complete=True)


# A producer's group: its round (index) and its fate.
FATES = st.sampled_from(["complete", "drop_open", "drop_after_complete"])


@st.composite
def round_workloads(draw):
    """Rounds of 1-8 groups, each group with a fate, the events of all groups interleaved
    in any order that keeps a round's opening before its groups' events."""
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=8))
    groups = [(r, draw(FATES)) for r, k in enumerate(sizes) for _ in range(k)]  # (round, fate)
    events = []  # ("open", round) or (fate step, group index)
    pending = list(range(len(groups)))
    opened = 0
    stages = {i: 0 for i in range(len(groups))}
    while pending or opened < len(sizes):
        ready = [i for i in pending if groups[i][0] < opened]
        if opened < len(sizes) and (not ready or draw(st.booleans())):
            events.append(("open", opened))
            opened += 1
            continue
        i = ready[draw(st.integers(0, len(ready) - 1))]
        fate = groups[i][1]
        if fate == "drop_after_complete" and stages[i] == 0:
            events.append(("complete", i))
            stages[i] = 1
            continue
        events.append(("drop_complete" if stages[i] else fate, i))
        pending.remove(i)
    # Whether steps are planned after each event: the scheduler plans after each ingest
    # batch, and one batch may complete a round's last group and drop another.
    plans = draw(st.lists(st.booleans(), min_size=len(events), max_size=len(events)))
    return sizes, groups, list(zip(events, plans, strict=True))


@settings(max_examples=300, deadline=None)
@given(workload=round_workloads(), prompts_per_step=st.integers(1, 8))
def test_every_handed_out_group_is_planned_owed_or_dropped(workload, prompts_per_step) -> None:
    sizes, _, events = workload
    queue = RoundQueue(prompts_per_step, "sampled")
    handed_out = dropped = 0
    waiting: list[int] = []  # complete groups in completion order, as the scheduler holds
    steps: list[int] = []
    for (kind, index), plan in events:
        if kind == "open":
            queue.open_round(sizes[index])
            handed_out += sizes[index]
        elif kind == "complete":
            queue.add_complete()
            waiting.append(index)
        elif kind == "drop_open":
            queue.drop(was_complete=False)
            dropped += 1
        elif index in waiting:  # drop_complete; else it reached a step before it went stale
            waiting.remove(index)
            queue.drop(was_complete=True)
            dropped += 1
        for step in take_all(queue) if plan else []:
            steps.append(step)
            del waiting[:step]
        assert queue.complete == len(waiting)
        assert sum(steps) + queue.complete + queue.owed == handed_out - dropped
        assert all(groups >= 1 for groups, _ in queue.entries())
        assert all(is_round for _, is_round in queue.entries())  # every group had a round
    steps += take_all(queue)
    assert min(steps, default=1) >= 1  # never a 0-group step
    assert sum(steps) == handed_out - dropped  # all resolved: nothing owed or left over
    assert queue.entries() == [] and queue.complete == 0
    if dropped == 0:
        assert steps == sizes


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 9)),
        st.tuples(st.just("complete"), st.just(0)),
        st.tuples(st.just("drop_open"), st.just(0)),
        st.tuples(st.just("drop_complete"), st.just(0)),
    ),
    max_size=80,
)


def apply(queue: RoundQueue, op: tuple[str, int]) -> int:
    """Apply one call; returns the change in groups complete-and-not-dropped."""
    kind, k = op
    if kind == "open":
        queue.open_round(k)
    elif kind == "complete":
        queue.add_complete()
        return 1
    elif kind == "drop_open":
        queue.drop(was_complete=False)
    elif queue.complete:  # a complete group can only be dropped if one is buffered
        queue.drop(was_complete=True)
        return -1
    return 0


@settings(max_examples=300, deadline=None)
@given(ops=OPS, prompts_per_step=st.integers(1, 8), eager=st.booleans())
def test_any_calls_keep_the_invariants_and_fixed_mode_is_todays_rule(
    ops, prompts_per_step, eager
) -> None:
    """Producers that skip SampleTasks, drop more than was handed out, or call it and never
    write: still no 0-group step, no complete group lost or planned twice, and "fixed" is
    today's rule (complete // prompts_per_step steps of prompts_per_step groups)."""
    queues = {mode: RoundQueue(prompts_per_step, mode) for mode in ("fixed", "sampled")}
    kept = dict.fromkeys(queues, 0)  # completed and not dropped
    planned = dict.fromkeys(queues, 0)
    for op in ops:
        for mode, queue in queues.items():
            kept[mode] += apply(queue, op)
            assert queue.owed >= 0 and all(g >= 1 for g, _ in queue.entries())
            waiting = kept[mode] - planned[mode]
            assert queue.complete == waiting
            if mode == "fixed":
                assert queue.entries() == []
                assert queue.steps_ready() == waiting // prompts_per_step
            if eager:
                for step in take_all(queue):
                    assert step >= 1 and (mode == "sampled" or step == prompts_per_step)
                    planned[mode] += step
    for mode, queue in queues.items():
        steps = take_all(queue)
        assert all(step >= 1 for step in steps)
        assert planned[mode] + sum(steps) + queue.complete == kept[mode]
    assert queues["fixed"].complete < prompts_per_step


@settings(max_examples=200, deadline=None)
@given(ops=OPS, prompts_per_step=st.integers(1, 8))
def test_a_restored_queue_steps_as_the_original(ops, prompts_per_step) -> None:
    queue = RoundQueue(prompts_per_step, "sampled")
    for op in ops:
        apply(queue, op)
        take_all(queue)
    copy = RoundQueue(prompts_per_step, "sampled")
    copy.restore(queue.entries(), queue.complete)
    assert (copy.entries(), copy.complete, copy.owed) == (
        queue.entries(),
        queue.complete,
        queue.owed,
    )
    for op in ops:  # the same calls again, on both
        apply(queue, op)
        apply(copy, op)
        assert take_all(copy) == take_all(queue)


def test_a_snapshot_without_rounds_steps_its_complete_groups_as_fallback() -> None:
    queue = RoundQueue(4, "sampled")
    queue.restore([], 6)
    assert queue.entries() == [[4, 0], [4, 0]] and take_all(queue) == [4]
    fixed = RoundQueue(4, "fixed")
    fixed.restore([[3, 1]], 6)  # a "sampled" run restarted as "fixed": today's rule
    assert fixed.entries() == [] and take_all(fixed) == [4]
