"""The front-end serves steps from its memory and moves old ones to the object store; it
holds the ingest columns in its memory and frees them once the scheduler releases them.

Real gRPC on loopback and real local Ray, with the front-end's response memory shrunk to
one byte, so that every step beyond the newest leaves it: served bytes must not change,
re-fetches of retained steps must still work, released steps must still be NOT_FOUND.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import check_served_step, synthetic_groups
from rlfeed.service.testing import fetch_served_bytes as fetch

GROUPS = {"prompts_per_step": 2, "group_size": 4}


def test_steps_moved_out_of_memory_are_served_byte_identical(make_sidecar) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "retained_steps": 2})
    sidecar.frontend.responses.max_bytes = 1  # every older step moves out
    rollouts = synthetic_groups(num_groups=8, group_size=4, rng=np.random.default_rng(11))
    with grpc.insecure_channel(sidecar.address) as channel:
        ingest = pb_grpc.RolloutIngestStub(channel)
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        first = []
        for step in range(4):  # each batch completes one step; the previous ones move out
            rows = range(8 * step, 8 * step + 8)
            batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows), sequence=step)
            assert ingest.SubmitRolloutBatch(batch, timeout=30).accepted == 8
            first.append([fetch(channel, step, rank) for rank in range(2)])
        served = [rid for step in first for rid in check_served_step(step, rollouts)]
        assert sorted(served) == sorted(rollouts.rollout_ids)
        deadline = time.monotonic() + 30
        while sidecar.frontend.responses.get(2) is not None:  # moved out by the assembler
            assert time.monotonic() < deadline, "step 2 never left the front-end's memory"
            time.sleep(0.01)
        # Steps 2 and 3 are retained (retained_steps = 2): a re-fetch gives the same bytes,
        # whether from memory or from the object store.
        for step in (2, 3):
            assert [fetch(channel, step, rank) for rank in range(2)] == first[step]
        for step in (0, 1):  # released: fetched by every rank, two newer steps since
            with pytest.raises(grpc.RpcError) as error:
                fetch(channel, step, 0)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_released_steps_leave_the_front_ends_memory_at_the_next_ingest(make_sidecar) -> None:
    """A step every rank fetched, with retained_steps newer ones fetched since, is no longer
    servable: the front-end drops its responses as soon as the actor says so (the next
    ingest reply), instead of holding them until its cache limit."""
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "retained_steps": 1})
    rollouts = synthetic_groups(num_groups=7, group_size=4, rng=np.random.default_rng(13))
    with grpc.insecure_channel(sidecar.address) as channel:
        ingest = pb_grpc.RolloutIngestStub(channel)
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(range(24)), sequence=0)
        assert ingest.SubmitRolloutBatch(batch, timeout=30).accepted == 24  # steps 0, 1, 2
        for step in range(3):
            check_served_step([fetch(channel, step, rank) for rank in range(2)], rollouts)
        assert all(sidecar.frontend.responses.get(step) is not None for step in range(3))
        half_group = pb.RolloutBatch(arrow_ipc=rollouts.encode(range(24, 26)), sequence=1)
        assert ingest.SubmitRolloutBatch(half_group, timeout=30).accepted == 2
        held = [sidecar.frontend.responses.get(step) is not None for step in range(3)]
        assert held == [False, False, True]  # steps 0 and 1 released, step 2 retained
        for step in (0, 1):
            with pytest.raises(grpc.RpcError) as error:
                fetch(channel, step, 1)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert [fetch(channel, 2, rank) for rank in range(2)]  # re-fetch of the retained one


def test_an_unfetched_step_moved_out_is_served_from_the_object_store(make_sidecar) -> None:
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 1})
    sidecar.frontend.responses.max_bytes = 1
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(12))
    with grpc.insecure_channel(sidecar.address) as channel:
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(), sequence=0)  # two steps at once
        assert pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30).accepted
        deadline = time.monotonic() + 30
        while sidecar.frontend.responses.get(0) is not None:  # the assembler moves it out
            assert time.monotonic() < deadline, "step 0 never left the front-end's memory"
            time.sleep(0.01)
        steps = [[fetch(channel, step, 0)] for step in (0, 1)]  # first fetches
        served = [rid for step in steps for rid in check_served_step(step, rollouts)]
        assert sorted(served) == sorted(rollouts.rollout_ids)


def test_ingest_columns_are_freed_and_first_fetches_reach_the_actor(make_sidecar) -> None:
    """Batches split across steps, one of them half stale: once every step is fetched, the
    front-end holds only the batch whose group is still open, and the scheduler knows every
    first fetch it answered from memory (the notes reached the actor without another call)."""
    sidecar = make_sidecar(
        rollouts={**GROUPS, "max_policy_lag": 0}, batching={"world_size": 2, "retained_steps": 8}
    )
    rng = np.random.default_rng(12)
    rollouts = synthetic_groups(num_groups=6, group_size=4, rng=rng)
    newer = synthetic_groups(num_groups=3, group_size=4, rng=rng, prefix="v1-", policy_version=1)
    with grpc.insecure_channel(sidecar.address) as channel:
        ingest = pb_grpc.RolloutIngestStub(channel)
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted({*rollouts.task_ids, *newer.task_ids}))
        )
        # Batches of 6 rollouts: every batch but the last spans two groups, so steps share
        # batches; the last holds half of group 5, which a newer policy version makes stale.
        for sequence, start in enumerate(range(0, 24, 6)):
            rows = range(start, min(start + 6, 22))
            ingest.SubmitRolloutBatch(
                pb.RolloutBatch(arrow_ipc=rollouts.encode(rows), sequence=sequence), timeout=30
            )
        for step in range(2):
            check_served_step([fetch(channel, step, rank) for rank in range(2)], rollouts)
        # Groups 4 (complete, waiting for a partner; its batch also fed step 1) and 5 go
        # stale; newer groups 0 and 1 make a step, newer group 2 stays open.
        ack = ingest.SubmitRolloutBatch(
            pb.RolloutBatch(arrow_ipc=newer.encode(range(10)), sequence=9), timeout=30
        )
        assert (ack.accepted, ack.stale) == (10, 0)
        check_served_step([fetch(channel, 2, rank) for rank in range(2)], newer)
        status = pb_grpc.SidecarStatusStub(channel)
        deadline = time.monotonic() + 30
        while (
            len(sidecar.frontend.payloads) != 1
            or status.GetStatus(pb.GetStatusRequest(), timeout=10).steps_waiting
        ):
            assert time.monotonic() < deadline, (
                f"{len(sidecar.frontend.payloads)} batches held, waiting: "
                f"{status.GetStatus(pb.GetStatusRequest(), timeout=10).steps_waiting}"
            )
            time.sleep(0.01)
        final = status.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert final.buffered_rollouts == 2  # the open newer group's two rollouts
        assert final.counters.rollouts_stale == 6  # complete group 4 and half of group 5


def test_batches_arriving_during_an_ingest_call_share_the_next_call() -> None:
    """Group commit: while one call is in flight, later batches wait and then go together,
    in arrival order, and every thread gets its own batch's reply (or the call's error)."""
    from rlfeed.service.scheduler.client import IngestGroups

    calls, release = [], threading.Event()

    def send(batches: list) -> list:
        calls.append([meta for meta, _ in batches])
        if len(calls) == 1:
            release.wait(timeout=30)  # the first call is slow: the others queue behind it
        if "bad" in calls[-1]:
            raise RuntimeError("actor died")
        return [f"reply to {meta}" for meta, _ in batches]

    groups = IngestGroups(send)
    replies: dict[str, object] = {}

    def submit(name: str) -> None:
        try:
            replies[name] = groups.ingest(name, None)
        except RuntimeError as exc:
            replies[name] = exc

    first = threading.Thread(target=submit, args=("b0",))
    first.start()
    while not calls:
        time.sleep(0.001)
    later = [threading.Thread(target=submit, args=(f"b{i}",)) for i in (1, 2, 3)]
    for queued, thread in enumerate(later, start=1):
        thread.start()
        while len(groups._waiting) < queued:  # arrival order is the order sent
            time.sleep(0.001)
    release.set()
    for thread in (first, *later):
        thread.join(timeout=30)
    assert calls == [["b0"], ["b1", "b2", "b3"]]
    assert replies == {f"b{i}": f"reply to b{i}" for i in range(4)}
    # A failed call fails each of its batches, and the next batch leads a new call.
    failing = [threading.Thread(target=submit, args=(name,)) for name in ("bad", "b4")]
    for thread in failing:
        thread.start()
        thread.join(timeout=30)
    assert isinstance(replies["bad"], RuntimeError) and replies["b4"] == "reply to b4"


def test_a_refused_note_is_counted_and_shown_by_status() -> None:
    """A note the scheduler refuses is a bug of rlfeed, not of the input: it is skipped (the
    call it rode on goes on), counted, and `rlfeed status` says so loudly."""
    from rlfeed.service.cli.status import status_text
    from rlfeed.service.codec.messages import status_to_proto
    from rlfeed.service.config import SidecarConfig
    from rlfeed.service.scheduler.actor import SchedulerActor
    from rlfeed.service.scheduler.records import StoreStepNote

    actor = SchedulerActor(SidecarConfig())
    assert actor.status().notes_refused == 0
    actor.apply_notes([StoreStepNote(step=5, handles=[b"", b""], response_bytes=0)])
    status = status_to_proto(actor.status(), SidecarConfig())
    assert status.notes_refused == 1
    assert "NOTES REFUSED    1: a bug in rlfeed" in status_text("sidecar:1", "SERVING", status)
