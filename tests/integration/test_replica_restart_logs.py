"""While a replica restarts, the front-end that survives it says so once, not every second.

A step the surviving front-end must materialize reads an ingest batch that only the dead
replica received: until the next front-end of the replica's journal slot has claimed it,
every attempt fails and is retried each second. The log gets one warning naming the step
and why, then nothing until the step is stored, then one line saying it was. (It used to
get a traceback every second for as long as the restart took.)

Real gRPC on loopback and real local Ray, both front-ends in this process as in
`test_replicas.py`; the replica "dies" by `abandon()` (its ports closed at once, nothing
said to the actor), and the actor is told as `rlfeed serve` tells it (`orphan_slot`).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import ray
from helpers import wait_until
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.frontend.journaling import frontend_slot
from rlfeed.service.frontend.server import start_server
from rlfeed.service.testing import check_served_step, synthetic_groups
from rlfeed.service.testing import fetch_served_bytes as fetch

_spec = importlib.util.spec_from_file_location(
    "test_replicas", Path(__file__).with_name("test_replicas.py")
)
test_replicas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_replicas)
GROUPS, submit_half = test_replicas.GROUPS, test_replicas.submit_half

ASSEMBLER = "rlfeed.service.frontend.assembler"
DOWN_S = 3.5  # the replica stays dead this long: three or four retries


@pytest.mark.timeout(180)
def test_a_surviving_front_end_warns_once_while_a_replica_restarts_and_once_when_back(
    make_sidecar, tmp_path, caplog
) -> None:
    sections = {"rollouts": GROUPS, "batching": {"world_size": 2, "retained_steps": 8}}
    primary = make_sidecar(journal={"dir": str(tmp_path)}, **sections)
    slot = frontend_slot(1)
    replica = start_server(primary.config, join=True, slot=slot)
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(31))
    with grpc.insecure_channel(primary.address) as channel:
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids))), timeout=30
        )
        with grpc.insecure_channel(replica.address) as to_replica:
            submit_half(to_replica, rollouts, range(8), (0, 1), sequence=0)
        replica.watch.stop()
        replica.abandon()  # as SIGKILL: nothing handed over, its peer port gone
        ray.get(primary.actor.orphan_slot.remote(slot), timeout=30)

        with caplog.at_level(logging.DEBUG, logger=ASSEMBLER):
            # The second halves complete step 0 here; it reads the dead replica's batch.
            submit_half(channel, rollouts, range(8), (2, 3), sequence=1)
            time.sleep(DOWN_S)
            assert primary.frontend.responses.get(0) is None  # not materialized meanwhile
            restarted = start_server(primary.config, join=True, slot=slot)
            try:
                wait_until(
                    lambda: primary.frontend.responses.get(0) is not None,
                    "step 0 not stored after the replica came back",
                    timeout_s=30,
                )
                served = [fetch(channel, 0, rank) for rank in range(2)]
            finally:
                restarted.stop(grace=0.5)
    assert sorted(check_served_step(served, rollouts)) == sorted(rollouts.rollout_ids)

    records = [r for r in caplog.records if r.name == ASSEMBLER]
    loud = [r for r in records if r.levelno >= logging.INFO]
    retries = [r for r in records if r.levelno == logging.DEBUG]
    print("\n".join(f"{r.levelname} {r.getMessage()}" for r in loud), f"{len(retries)} retries")
    assert len(retries) >= 2, "the step was not retried while the replica was down"
    assert [r.levelno for r in loud] == [logging.WARNING, logging.WARNING], loud
    failed, back = (r.getMessage() for r in loud)
    assert "step 0" in failed and f"{slot}" in failed and "retrying" in failed, failed
    assert "step 0" in back and "stored" in back, back
    assert not any(r.exc_info for r in loud), "a traceback for a replica restarting"
