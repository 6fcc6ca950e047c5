"""The scheduler's whole state written out: as a status, and in the snapshot format.

`status` is what `GetStatus`, the CLI and the metrics read. A snapshot is the whole state
as plain msgpack values, a journal's shortcut past its older records (`journaled.py` writes
and reads it); every bytes handle is written as a journal reference. The keys, in order:
"tasks", "pass_rates", "rng", "open", "complete", "closed", "rounds", "payloads" (the held
ingest batches), "steps", "counts" (the scalar state, under the attribute names it had
when this format was made: they are the format now), "acked_through", "done", "counters",
"step_records", "last_reports", "trainer_policy_version", and (the journaled scheduler's)
"recipes". Changing any of them means a new `STATE_VERSION` and a reader for the old one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from rlfeed.service.scheduler.admission import PolicyVersions
from rlfeed.service.scheduler.batches import BatchTable
from rlfeed.service.scheduler.groups import GroupBook
from rlfeed.service.scheduler.records import Counters, StatusSnapshot, StepRecord, typed_report
from rlfeed.service.scheduler.steps import StepBook
from rlfeed.service.scheduler.tasks import TaskPool

# Of this layout. 2 added "rounds"; 3 "recipes" and held steps' responses named as
# Rederive maps (`journaled._ref`), not only as journal positions.
STATE_VERSION = 3
# A version-1 snapshot restores with no rounds, 1 and 2 with no recipes.
READS_STATE_VERSIONS = (1, 2, STATE_VERSION)


class Parts(NamedTuple):
    """The scheduler's state, part by part (see `state.Scheduler`)."""

    tasks: TaskPool
    groups: GroupBook
    batches: BatchTable
    steps: StepBook
    versions: PolicyVersions


class Statistics(NamedTuple):
    """What the metrics read: the scheduler's public `counters`, `step_records` and
    `last_reports`."""

    counters: Counters
    step_records: Any  # an iterable of StepRecord, oldest first
    last_reports: dict[int, dict[str, float]]


# "counts": snapshot name -> (part, attribute). The names are the format's.
_COUNTS: dict[str, tuple[str, str]] = {
    "_next_batch_key": ("batches", "next_key"),
    "_next_arrival": ("groups", "next_arrival"),
    "_newest_version": ("versions", "newest"),
    "_buffered_rollouts": ("groups", "buffered_rollouts"),
    "_buffered_bytes": ("groups", "buffered_bytes"),
    "_payload_bytes": ("batches", "nbytes"),
    "_step_bytes": ("steps", "step_bytes"),
    "_rollouts_in_steps": ("steps", "rollouts_in_steps"),
    "_next_step": ("steps", "next_step"),
    "_zero_dropped_since_step": ("groups", "zero_dropped_since_step"),
}


def status(parts: Parts, statistics: Statistics) -> StatusSnapshot:
    """What the state looks like now (a copy, safe to hand out)."""
    groups, steps, versions = parts.groups, parts.steps, parts.versions
    records = statistics.step_records
    return StatusSnapshot(
        next_step=steps.next_step,
        buffered_rollouts=groups.buffered_rollouts,
        buffered_bytes=groups.buffered_bytes,
        held_bytes=parts.batches.nbytes + steps.step_bytes,
        open_groups=len(groups.open),
        complete_groups=len(groups.complete),
        tasks_total=len(parts.tasks.ids),
        tasks_inside_filter=parts.tasks.inside_filter_count(),
        newest_policy_version=max(versions.newest, 0),
        trainer_policy_version=versions.trainer,
        steps_waiting=steps.waiting(),
        counters=Counters(**vars(statistics.counters)),
        last_step=records[-1] if records else None,
        last_reports={rank: dict(r) for rank, r in statistics.last_reports.items()},
        remembered_rollout_ids=len(groups.seen),
        remembered_closed_groups=len(groups.closed),
    )


def snapshot_state(
    parts: Parts,
    statistics: Statistics,
    batch_ref: Callable[[Any], Any],
    step_refs: Callable[[int], Any],
) -> dict | None:
    """The whole state, every bytes handle as a journal reference: `batch_ref(handle)` ->
    [slot, position] of an ingest batch, `step_refs(step)` -> one per rank. None while
    that is not possible: a planned step is not stored yet (its work exists only in
    memory) or a handle has no reference."""
    if parts.steps.unstored_any():
        return None
    payloads = parts.batches.state(batch_ref)
    steps = parts.steps.state(step_refs)
    batch_refs = [ref for ref, _holders, _nbytes in payloads.values()]
    response_refs = [refs for _, _, _, refs, *_ in steps.values()]
    if any(ref is None for ref in batch_refs + response_refs):
        return None
    groups = parts.groups.state()
    return {
        "tasks": parts.tasks.ids,
        "pass_rates": parts.tasks.pass_rates_state(),
        "rng": parts.tasks.rng_state(),
        "open": groups["open"],
        "complete": groups["complete"],
        "closed": groups["closed"],
        "rounds": groups["rounds"],
        "payloads": payloads,
        "steps": steps,
        "counts": {name: getattr(getattr(parts, p), a) for name, (p, a) in _COUNTS.items()},
        "acked_through": parts.steps.retention.acked_through,
        "done": parts.steps.retention.done_steps(),
        "counters": dataclasses.asdict(statistics.counters),
        "step_records": [dataclasses.asdict(r) for r in statistics.step_records],
        "last_reports": statistics.last_reports,
        "trainer_policy_version": parts.versions.trainer,
    }


def restore_state(parts: Parts, state: dict, unref: Callable[[Any], Any]) -> Statistics:
    """Make fresh `parts` what `snapshot_state` described, the tasks registered already
    (through the scheduler, see `Scheduler.restore_state`); handles come back as
    `unref([slot, position])`, i.e. journal references. Returns the statistics."""
    parts.tasks.restore_pass_rates(state["pass_rates"])
    parts.tasks.restore_rng(state["rng"])
    parts.groups.restore(state)
    parts.batches.restore(state["payloads"], unref)
    parts.steps.restore(state["steps"], unref)
    for name, (part, attribute) in _COUNTS.items():
        setattr(getattr(parts, part), attribute, state["counts"][name])
    parts.steps.retention.restore(
        {int(rank): acked for rank, acked in state["acked_through"].items()}, state["done"]
    )
    parts.versions.trainer = state.get("trainer_policy_version", -1)  # older: none
    return Statistics(
        Counters(**state["counters"]),
        [StepRecord(**r) for r in state["step_records"]],
        {int(rank): typed_report(report) for rank, report in state["last_reports"].items()},
    )
