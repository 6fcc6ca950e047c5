"""How to build a stored step's responses again, so a journal need not hold them.

Materializing a step is deterministic: its `StepWork` (the plan, which row of which batch
each rollout is, their ids and policy versions) and the batches' columns give the same
bytes every time (`codec.materialize`). So with a journal the scheduler keeps each held
step's work, its batches named by journal reference, and a front-end journals only the
(CRC32C, size) of each response: about 2.3x fewer bytes than journaling responses, which
were the larger part of what the front-end wrote. After a restart the front-end of the
step's slot builds the responses again from the journaled batches and checks the digests
(`frontend.journaling.load_claim`), so a (step, rank) is re-served byte-identically or not
at all.

A recipe lives from planning to the step's release (its batches stay in their journals
that long: `positions` feeds the scheduler's `journal_floor`), and is written into
snapshots (`state`, a plain msgpack value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from rlfeed.sched.assembly import StepPlan
from rlfeed.service.scheduler.records import JournalRef, StepWork

RefOf = Callable[[Any], JournalRef | None]  # a payload handle -> where it is journaled


class StepRecipes:
    """Step -> its work with every batch as a `JournalRef` (see the module docstring)."""

    def __init__(self) -> None:
        self._recipes: dict[int, StepWork] = {}

    def keep(self, work: StepWork, ref_of: RefOf) -> StepWork:
        """Keep a planned step's recipe if every batch it reads is journaled; returns the
        work marked `derivable` then (else unchanged: its responses are journaled)."""
        refs = {key: ref_of(handle) for key, handle in work.payloads.items()}
        if any(ref is None for ref in refs.values()):
            return work
        self._recipes[work.step] = replace(work, payloads=refs, record=None, derivable=True)
        return replace(work, derivable=True)

    def get(self, step: int) -> StepWork | None:
        return self._recipes.get(step)

    def forget(self, steps: Iterable[int]) -> None:
        for step in steps:
            self._recipes.pop(step, None)

    def positions(self, slot: str, steps: Iterable[int]) -> list[int]:
        """Journal positions in `slot` of the batches that `steps` read."""
        return [
            ref.position
            for step in steps
            if (recipe := self._recipes.get(step)) is not None
            for ref in recipe.payloads.values()
            if ref.slot == slot
        ]

    def state(self, steps: Iterable[int]) -> dict[int, dict]:
        """The recipes of `steps` as plain msgpack values (for a snapshot)."""
        return {step: _encode(self._recipes[step]) for step in steps if step in self._recipes}

    def restore(self, state: dict) -> None:
        for step, value in state.items():
            self._recipes[int(step)] = _decode(int(step), value)


def _encode(work: StepWork) -> dict:
    return {
        "plan": {f.name: _pack(getattr(work.plan, f.name)) for f in dataclasses.fields(StepPlan)},
        "rows": [list(row) for row in work.rows],
        "rollout_ids": list(work.rollout_ids),
        "policy_versions": _pack(work.policy_versions),
        "payloads": [[key, ref.slot, ref.position] for key, ref in work.payloads.items()],
    }


def _decode(step: int, value: dict) -> StepWork:
    return StepWork(
        step=step,
        plan=StepPlan(**{name: _unpack(v) for name, v in value["plan"].items()}),
        rows=[(int(key), int(row)) for key, row in value["rows"]],
        rollout_ids=list(value["rollout_ids"]),
        policy_versions=_unpack(value["policy_versions"]),
        payloads={int(key): JournalRef(slot, int(pos)) for key, slot, pos in value["payloads"]},
        derivable=True,
    )


def _pack(value: Any) -> Any:
    """numpy arrays (also inside lists) as {dtype, shape, data}; numpy scalars as Python's."""
    if isinstance(value, np.ndarray):
        return {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.tobytes()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_pack(item) for item in value]
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, dict):
        array = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))
        return array.reshape(value["shape"]).copy()
    if isinstance(value, list):
        return [_unpack(item) for item in value]
    return value
