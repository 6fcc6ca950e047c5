"""Any front-end answers any (step, rank) that exists, whoever stored it: `ready = false`
only ever means "not assembled yet". A front-end's view of which steps exist never rests
on what it stored itself; it asks the scheduler actor, the authority, at least once in
every GetBatch before answering "not ready", and a long poll whose wait keeps being woken
(by other steps, other calls) still asks it within a bound.

Two front-ends on one actor in this process (a replica joined with `join=True`, as
test_replicas.py does); every step is stored by the replica, so the primary has stored
nothing (and, after a restart, its own journal slot holds no step). The replica's "stored"
announcements to the other front-ends, a best-effort shortcut, are turned off (`_replica`):
they are lost across a restart, or to a peer that cannot be reached.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.frontend.journaling import frontend_slot
from rlfeed.service.frontend.re_asks import POLL_SECONDS
from rlfeed.service.frontend.server import start_server
from rlfeed.service.frontend.serving import BatchServing
from rlfeed.service.testing import fetch_served_bytes, synthetic_groups

GROUPS = {"prompts_per_step": 2, "group_size": 4}
BATCHING = {"world_size": 2, "retained_steps": 8}
STEPS = 2


def _replica(primary, **options):
    """Another front-end on `primary`'s actor that does not announce the steps it stores."""
    replica = start_server(primary.config, join=True, **options)
    replica.frontend.announce = False
    return replica


def _raw_get_batch(channel: grpc.Channel):
    return channel.unary_unary(
        "/rlfeed.v1.BatchServing/GetBatch",
        request_serializer=pb.GetBatchRequest.SerializeToString,
        response_deserializer=None,
    )


def _store_steps_at(channel: grpc.Channel, rollouts) -> None:
    """STEPS steps, every rollout sent to (and so every step stored by) `channel`'s end."""
    pb_grpc.TaskSamplingStub(channel).RegisterTasks(
        pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids))), timeout=30
    )
    batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(), sequence=0)
    ack = pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30)
    assert ack.accepted == len(rollouts.rollout_ids)


def _wait_stored(sidecar, channel: grpc.Channel, steps: int) -> None:
    """Until `sidecar` stored `steps` steps and the actor heard of them: a front-end's
    "stored" notes ride along on its next call to the actor (here GetStatus; else within
    NOTE_FLUSH_SECONDS), and until then the step exists at that front-end only."""
    deadline = time.monotonic() + 30
    while sidecar.frontend.signals.newest_stored_here < steps - 1:
        assert time.monotonic() < deadline, "the replica did not store the steps"
        time.sleep(0.01)
    pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)


def _at_once(channel: grpc.Channel, step: int, rank: int) -> bytes:
    """GetBatch(step, rank, timeout_ms=0): the raw bytes of the answer."""
    request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=0)
    return _raw_get_batch(channel)(request, timeout=10)


def test_a_front_end_answers_at_once_for_steps_another_front_end_stored(make_sidecar) -> None:
    primary = make_sidecar(rollouts=GROUPS, batching=BATCHING)
    replica = _replica(primary)
    try:
        rollouts = synthetic_groups(
            num_groups=2 * STEPS, group_size=4, rng=np.random.default_rng(7)
        )
        with (
            grpc.insecure_channel(primary.address) as first,
            grpc.insecure_channel(replica.address) as other,
        ):
            _store_steps_at(other, rollouts)
            _wait_stored(replica, other, STEPS)
            assert primary.frontend.signals.newest_stored_here == -1
            for step in range(STEPS):
                for rank in range(2):
                    answer = _at_once(first, step, rank)
                    assert pb.GetBatchResponse.FromString(answer).ready, (step, rank)
                    assert answer == fetch_served_bytes(other, step, rank)  # byte-identical
    finally:
        replica.stop(grace=0.5)


@pytest.mark.timeout(240)
def test_after_a_restart_a_front_end_answers_at_once_for_the_other_ones_steps(
    make_sidecar, tmp_path
) -> None:
    sections = {"rollouts": GROUPS, "batching": BATCHING, "journal": {"dir": str(tmp_path)}}
    primary = make_sidecar(**sections)
    replica = _replica(primary, slot=frontend_slot(1))
    rollouts = synthetic_groups(num_groups=2 * STEPS, group_size=4, rng=np.random.default_rng(8))
    try:
        with grpc.insecure_channel(replica.address) as other:
            _store_steps_at(other, rollouts)
            _wait_stored(replica, other, STEPS)
            before = {(s, r): fetch_served_bytes(other, s, r) for s in range(STEPS) for r in (0,)}
    finally:
        replica.stop(grace=0.5)
    primary.stop()

    primary = make_sidecar(**sections)
    replica = _replica(primary, slot=frontend_slot(1))
    try:
        assert primary.frontend.signals.newest_stored_here == -1  # its own slot: no step
        with (
            grpc.insecure_channel(primary.address) as first,
            grpc.insecure_channel(replica.address) as other,
        ):
            for step in range(STEPS):
                for rank in range(2):
                    answer = _at_once(first, step, rank)
                    assert pb.GetBatchResponse.FromString(answer).ready, (step, rank)
                    assert answer == fetch_served_bytes(other, step, rank)
                    if (step, rank) in before:
                        assert answer == before[(step, rank)]
    finally:
        replica.stop(grace=0.5)


class _Context:
    """What `BatchServing` reads of a gRPC context (the threaded path, called directly)."""

    def time_remaining(self) -> float:
        return 30.0

    def abort(self, code, details):
        raise AssertionError(f"aborted {code}: {details}")


def _nudging(sidecar, stop: threading.Event) -> threading.Thread:
    """Wake the front-end's waiting calls every 20 ms, as other steps being stored do."""

    def nudge() -> None:
        while not stop.wait(0.02):
            sidecar.frontend.signals.nudge()

    thread = threading.Thread(target=nudge, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("path", ["asyncio", "threaded"])
def test_a_long_poll_woken_again_and_again_still_gets_its_step_within_a_bound(
    make_sidecar, path
) -> None:
    primary = make_sidecar(rollouts=GROUPS, batching=BATCHING)
    replica = _replica(primary)
    stop = threading.Event()
    try:
        rollouts = synthetic_groups(
            num_groups=2 * STEPS, group_size=4, rng=np.random.default_rng(9)
        )
        with (
            grpc.insecure_channel(primary.address) as first,
            grpc.insecure_channel(replica.address) as other,
        ):
            nudger = _nudging(primary, stop)
            request = pb.GetBatchRequest(step=STEPS - 1, rank=1, timeout_ms=20_000)
            answers: list[bytes] = []
            if path == "asyncio":  # the public server's GetBatch
                poll = _raw_get_batch(first).future(request, timeout=30)
            else:  # the thread's form (a peer's forwarded fetch), on the primary's state
                serving = BatchServing(primary.frontend)
                poll = threading.Thread(
                    target=lambda: answers.append(serving._get_batch(request, _Context()))
                )
                poll.start()
            time.sleep(0.5)  # the poll waits, woken every 20 ms
            _store_steps_at(other, rollouts)
            _wait_stored(replica, other, STEPS)
            stored = time.monotonic()
            if path == "asyncio":
                answer = poll.result(timeout=30)
            else:
                poll.join(timeout=30)
                (answer,) = answers
                if isinstance(answer, pb.GetBatchResponse):  # not ready: a message, no bytes
                    answer = answer.SerializeToString()
            took = time.monotonic() - stored
            assert pb.GetBatchResponse.FromString(bytes(answer)).ready
            assert bytes(answer) == fetch_served_bytes(other, STEPS - 1, 1)
            assert took < 4 * POLL_SECONDS + 1.0, f"served {took:.2f} s after it was stored"
    finally:
        stop.set()
        replica.stop(grace=0.5)
    nudger.join(timeout=5)
