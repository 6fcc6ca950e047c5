"""The chapter's point (Section 14.5), through the client over gRPC: when few tasks pass
the pass-rate filter, the step samples fewer episodes. With `[rollouts] step_groups =
"sampled"`, a SampleTasks that hands out 2 tasks inside the filter and 1 revisit makes a
step of exactly those 3 groups, served to the trainer by `BatchLoader`; with "fixed", the
same 3 groups wait for prompts_per_step.

A real `RolloutWriter` and `BatchLoader` talk gRPC on loopback to the in-process sidecar
(`serve_in_process`: the front-end's codec and validation and a `Scheduler`, no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
from rlfeed.client.loader import BatchLoader
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.transport import GrpcTransport
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.inprocess_server import serve_in_process

GROUP_SIZE = 8
TASKS = [f"task-{i}" for i in range(10)]


def sidecar_config(step_groups: str):
    return config_from_dict(
        {
            "batching": {"token_budget": 256, "world_size": 1},
            "rollouts": {
                "prompts_per_step": 8,
                "group_size": GROUP_SIZE,
                "vocab_size": 100,
                "step_groups": step_groups,
            },
            # The chapter's filter: the last group's pass rate, inside (0, 1), 1 revisit.
            "curriculum": {"estimator": "last", "low": 0.0, "high": 1.0, "revisits": 1},
        }
    )


def write_group(writer: RolloutWriter, task_id: str, prefix: str, passes: int) -> list[str]:
    """One group of GROUP_SIZE rollouts of `task_id`, `passes` of them rewarded 1."""
    ids = [f"{prefix}/{task_id}/{k}" for k in range(GROUP_SIZE)]
    for k, rollout_id in enumerate(ids):
        writer.write(
            rollout_id=rollout_id,
            task_id=task_id,
            group_id=f"{prefix}/{task_id}",
            policy_version=0,
            reward=float(k < passes),
            token_ids=np.arange(1, 9, dtype=np.int32),
            action_mask=np.array([0, 0, 1, 1, 1, 1, 1, 1], np.uint8),
            sampler_logprobs=np.full(8, -0.5, np.float32),
        )
    return ids


def served_status(address: str) -> tuple[int, int]:
    """(next step, complete groups buffered) as GetStatus answers them."""
    transport = GrpcTransport(address)
    try:
        status = transport.status()
    finally:
        transport.close()
    return status.next_step, status.complete_groups


def saturate_all_but_two(writer: RolloutWriter) -> list[str]:
    """Round 1: every task is inside the filter (estimates start at 0.5); all but two of
    them pass in all 8 attempts and leave it. Returns the two still inside."""
    writer.register_tasks(TASKS)
    first = writer.sample_tasks(len(TASKS))
    assert sorted(first) == TASKS
    for task_id in first:
        write_group(writer, task_id, "warm", passes=4 if task_id in first[:2] else GROUP_SIZE)
    writer.flush()
    return first[:2]


def test_a_filtered_round_of_2_tasks_and_1_revisit_is_a_step_of_3_groups() -> None:
    server, port = serve_in_process(InProcessTransport(sidecar_config("sampled")))
    address = f"127.0.0.1:{port}"
    try:
        with RolloutWriter(address, max_batch_rollouts=GROUP_SIZE) as writer:
            inside = saturate_all_but_two(writer)
            tasks = writer.sample_tasks(8)  # prompts_per_step asked, 3 handed out
            assert set(tasks[:2]) == set(inside) and len(tasks) == 3
            written = [i for task in tasks for i in write_group(writer, task, "late", 3)]
            writer.flush()
        with BatchLoader(address, rank=0, world_size=1, stop_step=2, timeout_s=60) as loader:
            warm, late = list(loader)
        assert warm.num_rollouts == len(TASKS) * GROUP_SIZE  # round 1: 10 groups
        assert late.num_rollouts == 3 * GROUP_SIZE == 24
        served = sorted(rollout_id for mb in late for rollout_id in mb.rollout_ids)
        assert served == sorted(written)
        assert served_status(address) == (2, 0)  # (next step, complete groups buffered)
    finally:
        server.stop(0)


def test_fixed_step_size_holds_the_same_3_groups_back_for_prompts_per_step() -> None:
    server, port = serve_in_process(InProcessTransport(sidecar_config("fixed")))
    address = f"127.0.0.1:{port}"
    try:
        with RolloutWriter(address, max_batch_rollouts=GROUP_SIZE) as writer:
            saturate_all_but_two(writer)  # step 0: 8 of the 10 groups, 2 left over
            tasks = writer.sample_tasks(8)
            assert len(tasks) == 3
            for task in tasks:
                write_group(writer, task, "late", 3)
            writer.flush()
        assert served_status(address) == (1, 5)  # 5 complete groups < 8: no step 1
        with BatchLoader(address, rank=0, world_size=1, stop_step=1, timeout_s=60) as loader:
            (step,) = list(loader)
        assert step.num_rollouts == 8 * GROUP_SIZE
        loader = BatchLoader(address, rank=0, world_size=1, start_step=1, timeout_s=1.0)
        with loader, pytest.raises(TimeoutError):
            loader.fetch(1)
    finally:
        server.stop(0)
