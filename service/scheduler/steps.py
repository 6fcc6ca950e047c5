"""The step lifecycle: planned, stored, fetched by ranks, acknowledged, released.

A step is planned from complete groups (`plan`) and holds the ingest batches it reads
until a front-end stores its per-rank responses (`store`); ranks fetch it (`fetch`) and
acknowledge it (`ack`); once every rank is done with it, `retention.StepRetention` keeps
it for `retained_steps` newer done steps, then it is released. Until every rank fetched it
a step counts against backpressure (its token bytes while planned, its response bytes once
stored). The placement methods move the handles of stored responses when the bytes move.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from rlfeed.sched.assembly import TOKEN_BYTES, StepConfig, StepRollouts, assemble_step
from rlfeed.service.config import BatchingConfig
from rlfeed.service.scheduler.batches import BatchTable
from rlfeed.service.scheduler.groups import BufferedRollout
from rlfeed.service.scheduler.records import (
    FetchResult,
    HeldBy,
    JournalRef,
    Rederive,
    StepRecord,
    StepWork,
)
from rlfeed.service.scheduler.retention import StepRetention


@dataclass
class PlannedStep:
    record: StepRecord
    num_rollouts: int
    # Counted against max_buffered_bytes until every rank fetched it: its token bytes while
    # it is planned (its batches are held too), its response bytes once stored.
    nbytes: int
    responses: list[Any] | None = None  # per rank, once stored: bytes or a handle
    fetched: set[int] = field(default_factory=set)
    done: bool = False  # every rank is done with it (`StepRetention`): released in turn
    # The ingest batches the step reads, held until its responses are stored (whichever
    # front-end materializes it, the columns must outlive that).
    reads: list[int] = field(default_factory=list)


class StepBook:
    """Every step planned and not yet released, with the counts backpressure reads."""

    def __init__(
        self, batching: BatchingConfig, batches: BatchTable, *, track_releases: bool
    ) -> None:
        self.world_size = batching.world_size
        self._batches = batches
        self._steps: dict[int, PlannedStep] = {}
        self.retention = StepRetention(batching.world_size, batching.retained_steps)
        # Backpressure counts a step until every rank fetched it, not until it is released:
        # fetching is what frees room, and a trainer acknowledging only at checkpoints must
        # still be able to fetch the steps up to its next checkpoint.
        self.rollouts_in_steps = 0  # assembled, not yet fetched by every rank
        self.step_bytes = 0  # `PlannedStep.nbytes` of the steps not yet fetched by every rank
        self.next_step = 0
        self._released: list[int] | None = [] if track_releases else None

    def numbers(self) -> list[int]:
        """Every step not yet released, in planning order."""
        return list(self._steps)

    # ---- planned -> stored -------------------------------------------------------------

    def plan(
        self, rows: list[BufferedRollout], group_of: np.ndarray, config: StepConfig, zero: int
    ) -> StepWork:
        """Plan the next step from `rows` (arrival order; `group_of` their group index),
        holding the batches they read; `zero`: zero-advantage groups dropped since the
        previous step (for its record). The caller releases the rows from the buffer."""
        versions = np.array([row.policy_version for row in rows], dtype=np.int64)
        step_rollouts = StepRollouts(
            lengths=np.array([row.length for row in rows], dtype=np.int64),
            policy_tokens=np.array([row.policy_tokens for row in rows], dtype=np.int64),
            rewards=np.array([row.reward for row in rows], dtype=np.float64),
            group_ids=group_of,
        )
        plan = assemble_step(step_rollouts, config)
        step = self.next_step
        reads = sorted({row.batch_key for row in rows})  # the ingest batches the step reads
        work = StepWork(
            step=step,
            plan=plan,
            rows=[(row.batch_key, row.row) for row in rows],
            rollout_ids=[row.rollout_id for row in rows],
            policy_versions=versions,
            payloads={key: self._batches.handle(key) for key in reads},
        )
        for key in reads:  # the step holds its batches until `store`
            self._batches.hold(key)
        record = StepRecord.from_plan(
            plan,
            step=step,
            zero_advantage_groups_dropped=zero,
            policy_versions=plan.policy_version_range(versions),
        )
        nbytes = TOKEN_BYTES * int(step_rollouts.lengths.sum())
        self._steps[step] = PlannedStep(record, num_rollouts=len(rows), nbytes=nbytes, reads=reads)
        self.rollouts_in_steps += len(rows)
        self.step_bytes += nbytes
        self.next_step += 1
        return replace(work, record=record)  # the front-end reports the step with it

    def store(self, step: int, responses: list[Any], response_bytes: int | None) -> StepRecord:
        """Keep every rank's response of a planned step: the serialized bytes (served as-is),
        or a handle to them (the actor keeps object references; `response_bytes` then gives
        their total size for the step's record), and let go of the ingest batches the step
        read. Returns the step's record."""
        held = self._steps.get(step)
        if held is None or held.responses is not None:
            raise ValueError(f"step {step} is not waiting for its responses")
        if len(responses) != self.world_size:
            raise ValueError(f"step {step}: {len(responses)} responses for world_size ranks")
        held.responses = list(responses)
        for key in held.reads:
            self._batches.let_go(key)
        held.reads = []
        if response_bytes is None:
            response_bytes = sum(len(r) for r in responses)
        self.step_bytes += int(response_bytes) - held.nbytes  # no rank can have fetched it
        held.nbytes = int(response_bytes)
        self._settle(step)  # every rank may have acknowledged it while it was materialized
        return replace(held.record, response_bytes=int(response_bytes))

    # ---- stored -> fetched -> acknowledged -> released ---------------------------------

    def fetch(self, step: int, rank: int) -> FetchResult:
        """Rank `rank`'s stored response of `step`, and note the fetch (a state change: it
        counts towards backpressure, and for a rank that never acknowledged a step, towards
        release; see `ack`)."""
        self.check_rank(rank)
        held = self._steps.get(step)
        if held is None or held.responses is None:  # not planned, released, or materializing
            return FetchResult(ready=False, released=held is None and step < self.next_step)
        if rank not in held.fetched:
            self._served(held, rank)
            self._settle(step)
        return FetchResult(ready=True, response=held.responses[rank])

    def first_fetch(self, step: int, rank: int) -> bool:
        """Whether `fetch(step, rank)` would change the state (a query)."""
        held = self._steps.get(step)
        return held is not None and held.responses is not None and rank not in held.fetched

    def ack(self, rank: int, through_step: int | None) -> int:
        """Rank `rank` is done with every step <= `through_step` (AckSteps; None: with none
        yet, but from now on only its acknowledgements count, not its fetches); returns its
        acknowledged step afterwards (-1: none). A step every rank is done with is released
        once `retained_steps` newer ones are done too (`retention.StepRetention`).
        Idempotent; ValueError, changing nothing, for a rank outside the world or a step
        not assembled yet (a trainer cannot have trained it)."""
        self.check_rank(rank)
        if through_step is None:
            return self.retention.ack(rank, -1)
        if not 0 <= through_step < self.next_step:
            raise ValueError(
                f"acknowledgement of rank {rank}: field through_step: step {through_step} "
                f"has not been assembled (the next step is {self.next_step}; did the sidecar "
                "restart without a journal?)"
            )
        acked = self.retention.ack(rank, through_step)
        for step in sorted(self._steps):
            if step > acked:
                break
            self._served(self._steps[step], rank)  # e.g. resumed past it: never fetched
            self._settle(step)
        return acked

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")

    def _served(self, held: PlannedStep, rank: int) -> None:
        """`rank` fetched the step or acknowledged it: it waits for that rank no more (the
        backpressure rule counts a step until no rank waits)."""
        if rank not in held.fetched:
            held.fetched.add(rank)
            if len(held.fetched) == self.world_size:
                self.rollouts_in_steps -= held.num_rollouts
                self.step_bytes -= held.nbytes

    def _settle(self, step: int) -> None:
        """Mark a stored step done once every rank is done with it, and release the done
        steps beyond the newest `retained_steps`."""
        held = self._steps.get(step)
        if held is None or held.responses is None or held.done:
            return
        if not self.retention.done_by_every_rank(step, held.fetched):
            return
        held.done = True
        for released in self.retention.done(step):
            del self._steps[released]
            if self._released is not None:
                self._released.append(released)

    def take_released(self) -> list[int]:
        """The steps released since the last call (empty unless tracking)."""
        if self._released is None:
            return []
        released, self._released = self._released, []
        return released

    def waiting(self) -> dict[int, list[int]]:
        """Step -> the ranks that have not fetched it yet, for the steps some rank lacks."""
        return {
            step: sorted(set(range(self.world_size)) - held.fetched)
            for step, held in sorted(self._steps.items())
            if len(held.fetched) < self.world_size
        }

    # ---- placement: where each step's response bytes are ------------------------------

    def held(self, steps: list[int]) -> list[int]:
        """Those of `steps` whose responses are stored and not yet released (a query)."""
        return [
            step
            for step in steps
            if (held := self._steps.get(step)) is not None and held.responses is not None
        ]

    def unstored(self, steps: list[int]) -> list[int]:
        """Those of `steps` planned and still waiting for their responses (a query)."""
        return [
            step
            for step in steps
            if (held := self._steps.get(step)) is not None and held.responses is None
        ]

    def responses(self, step: int) -> list[Any] | None:
        """A held step's per-rank response handles (None: unstored or released)."""
        held = self._steps.get(step)
        return None if held is None else held.responses

    def reads(self, step: int) -> list[int]:
        """The batch keys a planned, unstored step reads (empty otherwise)."""
        held = self._steps.get(step)
        return [] if held is None or held.responses is not None else held.reads

    def reading(self, keys: set[int]) -> list[int]:
        """The unstored steps that read one of the batches `keys`, sorted (a query)."""
        return sorted(
            step
            for step, held in self._steps.items()
            if held.responses is None and keys.intersection(held.reads)
        )

    def move(self, step: int, responses: list[Any]) -> bool:
        """Replace a stored step's per-rank handles with others to the same bytes (a
        front-end moving them out of its memory into the object store). Returns False and
        changes nothing if the step is no longer held (released in the meantime)."""
        held = self._steps.get(step)
        if held is None or held.responses is None:
            return False
        if len(responses) != self.world_size:
            raise ValueError(f"step {step}: {len(responses)} responses for world_size ranks")
        held.responses = list(responses)
        return True

    def claim(self, slot: str, frontend_id: str) -> dict[int, list[JournalRef | Rederive]]:
        """Every stored step whose responses `slot` keeps (journaled there, or built again
        there) is now held by `frontend_id`; returns step -> those references, per rank."""
        steps = {}
        for step, held in self._steps.items():
            refs = held.responses or []
            if refs and isinstance(refs[0], JournalRef | Rederive) and refs[0].slot == slot:
                steps[step] = list(refs)
                held.responses = [HeldBy(frontend_id)] * len(refs)
        return steps

    def orphan(self, slot: str, step_refs: dict[int, list[JournalRef | Rederive]]) -> None:
        """The front-end of `slot` died: each held step whose responses `step_refs` places
        in `slot` (step -> one reference per rank; also steps moved into the object store by
        the dead process, which owned those objects) is in its journal again (the inverse
        of `claim`)."""
        for step, refs in step_refs.items():
            held = self._steps.get(step)
            if held is not None and held.responses is not None and refs[0].slot == slot:
                held.responses = list(refs)

    # ---- snapshot ("steps"; "acked_through" and "done" are `retention`'s) -------------

    def unstored_any(self) -> bool:
        return any(held.responses is None for held in self._steps.values())

    def state(self, step_refs: Any) -> dict[int, list]:
        """Step -> [record, num_rollouts, nbytes, step_refs(step), fetched, reads, done]."""
        return {
            step: [
                asdict(held.record),
                held.num_rollouts,
                held.nbytes,
                step_refs(step),
                sorted(held.fetched),
                held.reads,
                held.done,
            ]
            for step, held in self._steps.items()
        }

    def restore(self, state: dict, unref: Any) -> None:
        for step, values in state.items():
            record, num_rollouts, nbytes, refs, fetched, reads, done = values
            handles = [unref(r) for r in refs]
            self._steps[int(step)] = PlannedStep(
                StepRecord(**record), num_rollouts, nbytes, handles, set(fetched), done, reads
            )
