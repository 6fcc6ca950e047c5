"""`[rollouts] step_groups`: with "sampled", a step takes as many groups as the curriculum
handed out (the chapter's 14.5: a filtered curriculum samples fewer episodes per step);
with "fixed" (the default), prompts_per_step whatever SampleTasks answered. The scheduler
alone (no Ray, no gRPC); journal replay in `test_journaled_scheduler.py`, the served step
through the client in `tests/integration/test_sampled_step_size.py`."""

from __future__ import annotations

import numpy as np
import pytest
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.errors import BackpressureError
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import SyntheticRollouts, synthetic_groups

GROUP_SIZE = 4
TASKS = [f"task-{i}" for i in range(32)]


def make_scheduler(step_groups: str = "sampled", **sections) -> Scheduler:
    base = {
        "rollouts": {"prompts_per_step": 8, "group_size": GROUP_SIZE, "step_groups": step_groups},
        "batching": {"world_size": 1, "token_budget": 256},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    scheduler = Scheduler(with_overrides(SidecarConfig(), **base))
    scheduler.register_tasks(TASKS)
    return scheduler


def groups_for(
    task_ids: list[str], prefix: str, *, policy_version: int = 0, mixed: bool = True
) -> SyntheticRollouts:
    """One group per task; rewards 1, 0, 1, 0 (mixed) or all 1 (zero advantage)."""
    rollouts = synthetic_groups(
        num_groups=len(task_ids),
        group_size=GROUP_SIZE,
        rng=np.random.default_rng(len(prefix)),
        tasks=task_ids,
        prefix=prefix,
        policy_version=policy_version,
    )
    rollouts.rewards = [float(i % 2 == 0 or not mixed) for i in range(len(rollouts))]
    return rollouts


def ingest(scheduler: Scheduler, rollouts: SyntheticRollouts, rows=None):
    return scheduler.ingest_batch(batch_meta(decode_rollout_batch(rollouts.encode(rows))), None)


def step_sizes(scheduler: Scheduler) -> list[int]:
    """Plan the ready steps; the number of groups in each."""
    return [int(work.plan.num_groups) for work in scheduler.plan_ready_steps()]


def test_a_round_of_3_tasks_makes_a_3_group_step() -> None:
    scheduler = make_scheduler()
    assert scheduler.sample_tasks(3).task_ids  # a round of 3 (all 32 tasks pass the filter)
    rollouts = groups_for(TASKS[:3], "a-")
    partial = ingest(scheduler, rollouts, range(2 * GROUP_SIZE))
    assert (partial.steps_ready, step_sizes(scheduler)) == (0, [])
    done = ingest(scheduler, rollouts, range(2 * GROUP_SIZE, 3 * GROUP_SIZE))
    assert done.steps_ready == 1
    (work,) = scheduler.plan_ready_steps()
    assert work.plan.num_groups == 3 and len(work.rollout_ids) == 3 * GROUP_SIZE
    assert scheduler.step_rounds() == []


def test_rounds_of_8_2_5_make_steps_of_8_2_5_whatever_the_arrival_order() -> None:
    scheduler = make_scheduler()
    handed_out = [scheduler.sample_tasks(k).task_ids for k in (8, 2, 5)]
    assert [len(tasks) for tasks in handed_out] == [8, 2, 5]
    assert scheduler.step_rounds() == [[8, 1], [2, 1], [5, 1]]
    rollouts = groups_for([t for tasks in handed_out for t in tasks], "r-")
    order = np.random.default_rng(0).permutation(len(rollouts))  # groups interleave
    sizes = []
    for start in range(0, len(order), 3):
        ingest(scheduler, rollouts, order[start : start + 3])
        sizes += step_sizes(scheduler)
    assert sizes == [8, 2, 5]


def test_a_stale_group_is_deducted_from_its_round() -> None:
    scheduler = make_scheduler(rollouts={"max_policy_lag": 1})
    scheduler.sample_tasks(3)
    old = groups_for(TASKS[:1], "old-", policy_version=0)
    new = groups_for(TASKS[1:3], "new-", policy_version=2)
    ingest(scheduler, old, range(2))  # the old group is still incomplete
    result = ingest(scheduler, new)  # version 2 leaves it behind: it will never come
    assert result.stale_buffered == 2 and result.steps_ready == 1
    assert step_sizes(scheduler) == [2]
    ingest(scheduler, old, range(2, GROUP_SIZE))  # its late rollouts: deducted once only
    scheduler.sample_tasks(2)
    ingest(scheduler, groups_for(TASKS[3:5], "next-", policy_version=2))
    assert step_sizes(scheduler) == [2]


def test_zero_advantage_groups_dropped_are_deducted_from_their_round() -> None:
    scheduler = make_scheduler(advantages={"drop_zero_advantage": True})
    scheduler.sample_tasks(3)
    ingest(scheduler, groups_for(TASKS[:1], "flat-", mixed=False))
    assert scheduler.step_rounds() == [[2, 1]]
    assert ingest(scheduler, groups_for(TASKS[1:3], "mixed-")).steps_ready == 1
    assert step_sizes(scheduler) == [2]


def test_a_round_whose_groups_all_drop_is_removed_and_no_step_waits_for_it() -> None:
    scheduler = make_scheduler(advantages={"drop_zero_advantage": True})
    scheduler.sample_tasks(2)
    scheduler.sample_tasks(1)
    ingest(scheduler, groups_for(TASKS[:2], "flat-", mixed=False))
    assert scheduler.step_rounds() == [[1, 1]]
    ingest(scheduler, groups_for(TASKS[2:3], "mixed-"))
    assert step_sizes(scheduler) == [1]
    assert scheduler.status().next_step == 1


def test_a_filtered_curriculum_makes_the_step_smaller() -> None:
    """The chapter's case: most tasks saturated, prompts_per_step asked, 2 tasks inside the
    filter and 1 revisit handed out: the step holds those 3 groups, not 8."""
    scheduler = make_scheduler(curriculum={"estimator": "last", "revisits": 1})
    first = scheduler.sample_tasks(len(TASKS)).task_ids
    inside = set(first[:2])
    rollouts = groups_for(first, "warm-", mixed=False)
    rollouts.rewards = [
        0.0 if task in inside and i % 2 else 1.0
        for i, task in enumerate(rollouts.task_ids)  # all-pass but for 2 tasks
    ]
    ingest(scheduler, rollouts)
    assert step_sizes(scheduler) == [len(TASKS)]
    sample = scheduler.sample_tasks(0)  # 0: prompts_per_step
    assert set(sample.task_ids[:2]) == inside and sample.revisit == [False, False, True]
    assert ingest(scheduler, groups_for(sample.task_ids, "late-")).steps_ready == 1
    assert step_sizes(scheduler) == [3]


def test_fixed_mode_ignores_the_rounds() -> None:
    scheduler = make_scheduler("fixed")
    assert len(scheduler.sample_tasks(3).task_ids) == 3
    result = ingest(scheduler, groups_for(TASKS[:3], "a-"))
    assert result.steps_ready == 0 and scheduler.step_rounds() == []
    result = ingest(scheduler, groups_for(TASKS[3:16], "b-"))
    assert result.steps_ready == 2
    assert step_sizes(scheduler) == [8, 8]


def test_groups_of_a_producer_that_never_samples_go_prompts_per_step_to_a_step() -> None:
    scheduler = make_scheduler()
    result = ingest(scheduler, groups_for(TASKS[:12], "free-"))
    assert result.steps_ready == 1 and step_sizes(scheduler) == [8]
    scheduler.sample_tasks(2)  # queued behind the 4 groups' fallback step
    assert scheduler.step_rounds() == [[8, 0], [2, 1]]
    ingest(scheduler, groups_for(TASKS[12:18], "more-"))
    assert step_sizes(scheduler) == [8, 2]


def test_a_producer_dead_mid_round_leaves_its_step_to_later_rounds_groups() -> None:
    scheduler = make_scheduler()
    scheduler.sample_tasks(3)
    ingest(scheduler, groups_for(TASKS[:1], "dies-"))  # 1 of its 3 groups, then nothing
    scheduler.sample_tasks(3)
    ingest(scheduler, groups_for(TASKS[3:6], "lives-"))
    assert step_sizes(scheduler) == [3]  # 1 + 2: a step of 3 groups, not the same 3 tasks
    assert scheduler.step_rounds() == [[3, 1]]  # 1 of 3 complete, 2 owed
    assert scheduler.status().complete_groups == 1


def test_a_batch_whose_drops_would_complete_a_round_is_taken_not_refused() -> None:
    """`max_buffered_rollouts` refuses a batch opening new groups only while ranks fetching
    can make room. A stale drop that would let a round's step be planned happens only if
    the batch is taken: refused, it would wait for a step that needs it."""
    scheduler = make_scheduler(rollouts={"max_buffered_rollouts": 32, "max_policy_lag": 1})
    scheduler.sample_tasks(3)
    ingest(scheduler, groups_for(TASKS[:2], "a-", policy_version=1))
    ingest(scheduler, groups_for(TASKS[2:3], "old-"), range(3))  # 11 rollouts buffered
    newer = groups_for(TASKS[3:10], "b-", policy_version=2)  # 28 more, 36 > 32
    result = ingest(scheduler, newer)
    assert (result.accepted, result.stale_buffered, result.steps_ready) == (28, 3, 1)
    assert step_sizes(scheduler) == [2]  # the round, less its stale group
    with pytest.raises(BackpressureError, match="max_buffered_rollouts = 32"):
        ingest(scheduler, groups_for(TASKS[10:11], "c-", policy_version=2))


def test_steps_of_a_sampled_run_serve_their_groups_whole() -> None:
    scheduler = make_scheduler()
    tasks = scheduler.sample_tasks(5).task_ids
    rollouts = groups_for(tasks, "w-")
    arrays = decode_rollout_batch(rollouts.encode())
    scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    assert assemble_ready_steps(scheduler) == [0]
    record = scheduler.status().last_step
    assert record.num_rollouts == 5 * GROUP_SIZE
