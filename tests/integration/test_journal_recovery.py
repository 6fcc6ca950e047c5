"""With `[journal] dir` set, a restarted sidecar is the sidecar that stopped: the buffered
rollouts, the dedup memory, the curriculum, the step counter and every stored step come
back, and a (step, rank) is served with the same bytes as before.

Real local Ray and gRPC on loopback; the restart here is in-process (stop, start again on
the same journal). The crash tests (kill -9 at random points) are in test_crash_loop.py.
"""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import fetch_served_bytes, synthetic_groups

GROUPS = {"prompts_per_step": 2, "group_size": 4}
BATCHING = {"world_size": 2, "token_budget": 256}


def _sections(journal_dir) -> dict:
    return {"rollouts": GROUPS, "batching": BATCHING, "journal": {"dir": str(journal_dir)}}


def _digest(channel: grpc.Channel, step: int, rank: int) -> str:
    return hashlib.sha256(fetch_served_bytes(channel, step, rank)).hexdigest()


def _status(channel: grpc.Channel) -> pb.StatusResponse:
    return pb_grpc.SidecarStatusStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)


def _submit(channel: grpc.Channel, payload: bytes) -> pb.SubmitAck:
    stub = pb_grpc.RolloutIngestStub(channel)
    return stub.SubmitRolloutBatch(pb.RolloutBatch(arrow_ipc=payload), timeout=30)


@pytest.mark.timeout(180)
def test_a_restarted_sidecar_resumes_exactly_where_it_stopped(make_sidecar, tmp_path) -> None:
    rollouts = synthetic_groups(
        num_groups=7, group_size=4, rng=np.random.default_rng(3), tasks=["a", "b", "c"]
    )
    partial = list(range(26))  # 3 steps' groups and half of group 6
    first = make_sidecar(**_sections(tmp_path))
    with grpc.insecure_channel(first.address) as channel:
        tasks = pb_grpc.TaskSamplingStub(channel)
        tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=["a", "b", "c"]))
        for start in range(0, len(partial), 5):
            assert _submit(channel, rollouts.encode(partial[start : start + 5])).accepted
        before = {(s, r): _digest(channel, s, r) for s, r in [(0, 0), (0, 1), (1, 0)]}
        status = _status(channel)
    first.stop()

    second = make_sidecar(**_sections(tmp_path))
    with grpc.insecure_channel(second.address) as channel:
        again = _status(channel)
        assert again.next_step == status.next_step == 3
        assert again.buffered_rollouts == status.buffered_rollouts == 2
        assert again.tasks_total == 3
        # Served steps come back byte for byte, the unfetched rank too.
        for (step, rank), digest in before.items():
            assert _digest(channel, step, rank) == digest
        assert _digest(channel, 1, 1) and _digest(channel, 2, 0)
        # The dedup window survived: a resent acknowledged batch is a duplicate.
        ack = _submit(channel, rollouts.encode(partial[:5]))
        assert (ack.accepted, ack.duplicate) == (0, 5)
        # The half group completes with its other half.
        ack = _submit(channel, rollouts.encode(list(range(26, 28))))
        assert ack.accepted == 2
        assert (_status(channel).complete_groups, _status(channel).buffered_rollouts) == (1, 4)
    second.stop()


@pytest.mark.timeout(180)
def test_journal_segments_go_once_their_steps_are_released(make_sidecar, tmp_path) -> None:
    sections = _sections(tmp_path)
    sections["batching"] = {**BATCHING, "retained_steps": 1}
    sections["journal"].update(segment_bytes=4096, snapshot_every_records=10)
    rollouts = synthetic_groups(num_groups=24, group_size=4, rng=np.random.default_rng(5))
    sidecar = make_sidecar(**sections)
    frontend_dir, scheduler_dir = tmp_path / "frontend-0", tmp_path / "scheduler"
    with grpc.insecure_channel(sidecar.address) as channel:
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        for start in range(0, len(rollouts), 8):
            _submit(channel, rollouts.encode(list(range(start, start + 8))))
        digests = {(s, r): _digest(channel, s, r) for s in range(12) for r in range(2)}
        written = len(list(frontend_dir.glob("*.seg")))
        deleted = sidecar.frontend.retention.trim(sidecar.frontend.scheduler)
    assert written > 4 and deleted >= written - 3  # all but the newest segments
    assert len(list(scheduler_dir.glob("*.seg"))) < 4  # snapshots let the calls go too
    sidecar.stop()

    again = make_sidecar(**sections)
    with grpc.insecure_channel(again.address) as channel:
        assert _status(channel).next_step == 12
        assert _digest(channel, 11, 0) == digests[(11, 0)]  # the retained step survives
    again.stop()
