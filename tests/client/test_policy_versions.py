"""The policy-version contract through the client library, over gRPC on loopback: a
producer writes the version of the weights it sampled with, the trainer publishes the
version its weights have after each update (`BatchLoader.report(policy_version=...)`), and
the sidecar drops what lags the higher of the two by more than max_policy_lag, even when
every producer lags (then no rollout carries a newer version)."""

from __future__ import annotations

import numpy as np
import pytest
from rlfeed.client import BatchLoader, RolloutWriter
from rlfeed.client.transport import GrpcTransport, InvalidRequestError
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.cli.status import status_text
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.inprocess_server import serve_in_process

GROUP_SIZE = 4


@pytest.fixture
def address():
    config = config_from_dict(
        {
            "batching": {"token_budget": 512, "world_size": 1},
            "rollouts": {
                "prompts_per_step": 2,
                "group_size": GROUP_SIZE,
                "vocab_size": 1000,
                "max_policy_lag": 2,
            },
        }
    )
    server, port = serve_in_process(InProcessTransport(config))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def write_group(writer: RolloutWriter, group_id: str, version: int, rollouts: int = GROUP_SIZE):
    rng = np.random.default_rng([ord(c) for c in group_id])
    for k in range(rollouts):
        mask = (np.arange(40) >= 8).astype(np.uint8)
        writer.write(
            rollout_id=f"{group_id}/{k}",
            task_id="task-0",
            group_id=group_id,
            policy_version=version,
            reward=float(k % 2),
            token_ids=rng.integers(1, 1000, 40).astype(np.int32),
            action_mask=mask,
            sampler_logprobs=np.where(mask, -1.0, 0.0).astype(np.float32),
        )


def test_a_fleet_lagging_the_trainer_is_dropped_as_stale(address):
    status = GrpcTransport(address)
    with RolloutWriter(address) as writer, BatchLoader(address, rank=0, world_size=1) as loader:
        writer.register_tasks(["task-0"])
        write_group(writer, "a", version=0)
        write_group(writer, "b", version=0)
        write_group(writer, "c", version=0, rollouts=3)  # buffered, not complete
        writer.flush()
        step = next(iter(loader))
        assert step.step == 0 and step.policy_version == 0
        assert not status.status().HasField("trainer_policy_version")  # none published yet

        # The step's update moves the weights from version 0 to 3 (say, three optimizer
        # steps per served step); the fleet has not loaded them yet.
        loader.report(step.step, loss=0.1, policy_version=3)
        after_report = status.status()
        assert after_report.trainer_policy_version == 3
        assert after_report.newest_policy_version == 0  # no rollout carries a newer one
        assert after_report.buffered_rollouts == 0  # group c: 0 < 3 - max_policy_lag
        assert after_report.counters.rollouts_stale == 3

        write_group(writer, "c", version=0, rollouts=GROUP_SIZE)  # its rest, and ...
        write_group(writer, "d", version=0)  # ... a new group: both still at version 0
        acks = writer.flush()
        assert sum(ack.stale for ack in acks) == 5 and sum(ack.accepted for ack in acks) == 0

        write_group(writer, "e", version=1)  # the fleet caught up to within the lag
        write_group(writer, "f", version=1)
        acks = writer.flush()
        assert sum(ack.accepted for ack in acks) == 2 * GROUP_SIZE
        final = status.status()
    status.close()
    assert final.next_step == 2  # steps 0 (a, b) and 1 (e, f): c and d never reached one
    assert final.counters.rollouts_stale == 8
    assert [(r.rank, r.policy_version) for r in final.last_reports] == [(0, 3)]
    text = status_text(address, "SERVING", final)
    assert "policy version   newest in a rollout 1, trainer 3" in text


def test_a_version_outside_int64_is_refused_naming_the_field(address):
    """The client refuses a negative version before sending; the sidecar refuses one over
    2^63 - 1 (the proto field is uint64) with INVALID_ARGUMENT, keeping nothing."""
    loader = BatchLoader(address, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"report: policy_version -1 is outside \[0, 2\^63\)"):
        loader.report(0, loss=0.0, policy_version=-1)
    loader.close()
    transport = GrpcTransport(address)
    report = pb.TrainerReport(step=0, rank=0, loss=0.0, policy_version=2**63)
    with pytest.raises(
        InvalidRequestError,
        match=r"trainer report of rank 0: field policy_version: 9223372036854775808 is over",
    ):
        transport.report(report)
    assert not transport.status().HasField("trainer_policy_version")
    transport.close()
