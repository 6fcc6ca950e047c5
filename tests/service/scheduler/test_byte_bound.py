"""`[rollouts] max_buffered_bytes`: what the scheduler counts, when it refuses, and why it
can neither be bypassed by groups that never complete nor deadlock a producer.

Counted: the token bytes (`TOKEN_BYTES` a token) of every ingest batch a buffered rollout
reads, whole, plus the responses of the steps not yet fetched by every rank. Expected
figures are recomputed here from the rollouts and the responses themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.assembly import TOKEN_BYTES
from rlfeed.service.cli.status import status_text
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.messages import decode_rollout_batch, status_to_proto
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.errors import BackpressureError
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import SyntheticRollouts, check_served_step, synthetic_groups

MIB = 2**20
GROUP_SIZE = 4


def make_scheduler(bound: int = MIB, world_size: int = 2) -> Scheduler:
    config = with_overrides(
        SidecarConfig(),
        server={"max_message_bytes": MIB},
        rollouts={"prompts_per_step": 2, "group_size": GROUP_SIZE, "max_buffered_bytes": bound},
        batching={"world_size": world_size, "token_budget": 16384},
    )
    scheduler = Scheduler(config)
    scheduler.register_tasks([f"task-{i}" for i in range(400)])
    return scheduler


def rollouts_of(num_groups: int, seed: int, max_length: int = 8192) -> SyntheticRollouts:
    rng = np.random.default_rng(seed)
    return synthetic_groups(
        num_groups=num_groups, group_size=GROUP_SIZE, rng=rng, max_length=max_length
    )


def token_bytes(rollouts: SyntheticRollouts, rows) -> int:
    return TOKEN_BYTES * sum(len(rollouts.token_ids[row]) for row in rows)


def ingest(scheduler: Scheduler, rollouts: SyntheticRollouts, rows):
    arrays = decode_rollout_batch(rollouts.encode(list(rows)))
    return scheduler.ingest_batch(batch_meta(arrays), arrays.columns)


def store_ready_steps(scheduler: Scheduler) -> dict[int, list[bytes]]:
    """Plan, materialize and store every ready step: step -> its per-rank responses."""
    stored = {}
    for work in scheduler.plan_ready_steps():
        stored[work.step] = materialize_work(work, lambda columns: columns)
        scheduler.store_step(work.step, stored[work.step])
    return stored


def fetch_all(scheduler: Scheduler, step: int) -> list[bytes]:
    ranks = range(scheduler.config.batching.world_size)
    return [scheduler.fetch_batch(step, rank).response for rank in ranks]


def test_held_bytes_count_whole_batches_partial_groups_and_unfetched_steps() -> None:
    scheduler = make_scheduler(bound=64 * MIB)
    rollouts = rollouts_of(3, seed=1)
    ingest(scheduler, rollouts, [0, 1, 2])  # three rollouts of group 0: partial
    assert scheduler.held_bytes == token_bytes(rollouts, [0, 1, 2])
    # A batch completing g0 and g1 and opening g2: held whole while g2 is buffered.
    ingest(scheduler, rollouts, [3, 4, 5, 6, 7, 8])
    assert scheduler.held_bytes == token_bytes(rollouts, range(9))
    stored = store_ready_steps(scheduler)  # step 0 (g0, g1); the second batch still held
    response_bytes = sum(map(len, stored[0]))
    assert scheduler.held_bytes == token_bytes(rollouts, range(3, 9)) + response_bytes
    scheduler.fetch_batch(0, 0)
    assert scheduler.held_bytes == token_bytes(rollouts, range(3, 9)) + response_bytes
    scheduler.fetch_batch(0, 1)  # fetched by every rank: no longer counted
    assert scheduler.held_bytes == token_bytes(rollouts, range(3, 9))
    ingest(scheduler, rollouts, [9, 10, 11])  # completes g2: no step yet (2 groups a step)
    assert scheduler.held_bytes == token_bytes(rollouts, range(3, 12))


def test_partial_groups_cannot_pass_the_bound_the_oldest_expire() -> None:
    """A producer that never completes its groups: with no step possible, refusing would
    never end, so the oldest open groups are expired instead and memory stays bounded."""
    scheduler = make_scheduler(bound=MIB)
    rollouts = rollouts_of(300, seed=2)
    firsts = [GROUP_SIZE * g for g in range(300)]  # only the first rollout of each group
    for row in firsts:
        assert ingest(scheduler, rollouts, [row]).accepted == 1
        assert scheduler.held_bytes <= MIB
    status = scheduler.status()
    expired = status.counters.rollouts_expired
    assert expired > 0 and status.buffered_rollouts + expired == 300
    kept = firsts[expired:]  # the newest groups, oldest expired first
    assert scheduler.held_bytes == token_bytes(rollouts, kept)
    assert scheduler.held_bytes > MIB - 2 * 8192 * TOKEN_BYTES  # no more expired than needed
    # A late rollout of an expired group is dropped as stale, not an error.
    late = ingest(scheduler, rollouts, [1])
    assert (late.accepted, late.stale) == (0, 1)
    # `rlfeed status` shows both.
    shown = status_text(
        "sidecar:1", "SERVING", status_to_proto(scheduler.status(), scheduler.config)
    )
    assert f"expired {expired}," in shown
    assert f"memory held      {scheduler.held_bytes / MIB:.1f} MiB of max_buffered_bytes" in shown


def test_new_groups_stop_at_three_quarters_and_completing_rollouts_fill_the_rest() -> None:
    """While a step waits for ranks, fetching makes room: a batch opening a new group is
    refused past 3/4 of the bound, one that only completes buffered groups is taken up to
    the bound, and the refused batch is taken once the ranks fetch."""
    scheduler = make_scheduler(bound=MIB)
    rollouts = rollouts_of(200, seed=3, max_length=4096)
    ingest(scheduler, rollouts, range(8))  # step 0, waiting for both ranks
    store_ready_steps(scheduler)
    opened = 2
    with pytest.raises(BackpressureError) as refused:
        while True:  # the first half of a new group per batch, until refused
            first_half = range(GROUP_SIZE * opened, GROUP_SIZE * opened + 2)
            ingest(scheduler, rollouts, first_half)
            opened += 1
    held = scheduler.held_bytes
    assert held + token_bytes(rollouts, first_half) > MIB * 3 // 4 >= held
    message = str(refused.value)
    assert "max_buffered_bytes = 1.0 MiB" in message and "new groups stop at 3/4" in message
    for group in range(2, opened):  # second halves: past 3/4, until the bound itself
        second_half = range(GROUP_SIZE * group + 2, GROUP_SIZE * group + 4)
        if scheduler.held_bytes + token_bytes(rollouts, second_half) > MIB:
            with pytest.raises(BackpressureError, match="max_buffered_bytes"):
                ingest(scheduler, rollouts, second_half)
            break
        assert ingest(scheduler, rollouts, second_half).accepted == 2
    assert scheduler.held_bytes > MIB * 3 // 4
    fetch_all(scheduler, 0)
    for step in store_ready_steps(scheduler):  # the completed groups' steps
        fetch_all(scheduler, step)
    assert ingest(scheduler, rollouts, first_half).accepted == 2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch_size=st.integers(1, 9),
    bound_mib=st.integers(1, 3),
    fetch_every=st.integers(1, 6),
)
def test_the_bound_holds_nothing_accepted_is_lost_and_refusals_end_when_ranks_fetch(
    seed: int, batch_size: int, bound_mib: int, fetch_every: int
) -> None:
    """Producers far faster than the trainer (it fetches every `fetch_every` batches),
    groups interleaved across batches, and one in every five groups never completed: no
    ingest takes held bytes past the bound, but for the responses of the steps the batch
    completes (the stated slack, which stays until ranks fetch); every refusal comes
    while a step waits for ranks, and the batch is taken once they fetch; at the end every
    accepted rollout was served exactly once, is still buffered, or expired with its group."""
    scheduler = make_scheduler(bound=bound_mib * MIB)
    rng = np.random.default_rng(seed)
    rollouts = rollouts_of(60, seed=seed, max_length=4096)
    incomplete = {g for g in range(60) if g % 5 == 4}
    order = [
        row
        for row in rng.permutation(len(rollouts)).tolist()
        if row // GROUP_SIZE not in incomplete or row % GROUP_SIZE == 0
    ]
    served: list[str] = []

    def ranks_fetch() -> None:
        for step in scheduler.status().steps_waiting:
            served.extend(check_served_step(fetch_all(scheduler, step), rollouts))

    for number, start in enumerate(range(0, len(order), batch_size)):
        rows = order[start : start + batch_size]
        held_before = scheduler.held_bytes
        try:
            ingest(scheduler, rollouts, rows)
        except BackpressureError:
            assert scheduler.status().steps_waiting, "a refusal fetching cannot end"
            ranks_fetch()
            ingest(scheduler, rollouts, rows)
        new_steps = store_ready_steps(scheduler)
        slack = sum(len(response) for step in new_steps.values() for response in step)
        assert scheduler.held_bytes <= max(bound_mib * MIB, held_before) + slack
        if number % fetch_every == 0:
            ranks_fetch()
    ranks_fetch()
    status = scheduler.status()
    counters = status.counters
    assert len(served) == len(set(served)) == counters.rollouts_trained
    # One policy version throughout: stale rollouts are only late ones of expired groups,
    # dropped, never accepted.
    accepted = counters.rollouts_accepted
    assert accepted == len(served) + status.buffered_rollouts + counters.rollouts_expired
