"""256 trainer ranks long-polling one step on one front-end: a waiting GetBatch holds no
thread (the public server is asyncio), every rank gets its bytes once the step is stored,
and health and status answer within 1 s meanwhile. The latency figures are
tests/bench/bench_long_poll.py's."""

from __future__ import annotations

import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.frontend.call_guard import CallKind

RANKS = 256
MAX_WORKERS = 16  # the pool; 256 waiting calls each holding a thread could not fit


def _threads() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))


def _produce_step(address: str) -> None:
    from rlfeed.client.producer import RolloutWriter

    mask = np.ones(32, np.uint8)
    mask[:8] = 0  # a prompt, then policy tokens
    with RolloutWriter(address) as writer:
        writer.register_tasks(["t"])
        for g in range(RANKS // 8):
            for k in range(8):
                writer.write(
                    rollout_id=f"g{g}/{k}",
                    task_id="t",
                    group_id=f"g{g}",
                    policy_version=0,
                    reward=float(k % 2),
                    token_ids=np.full(32, g, np.int32),
                    action_mask=mask,
                    sampler_logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                )


def test_256_waiting_get_batch_calls_hold_no_thread_and_all_get_their_bytes(
    make_sidecar,
) -> None:
    sidecar = make_sidecar(
        server={
            "max_workers": MAX_WORKERS,
            "max_streams": 4,
            "max_unary_calls": 8,
            "max_long_polls": RANKS,
            "max_calls_per_client": 0,  # every rank comes from 127.0.0.1
        },
        batching={"world_size": RANKS, "token_budget": 1024},
        rollouts={"prompts_per_step": RANKS // 8, "group_size": 8},
    )
    with grpc.insecure_channel(sidecar.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = channel.unary_unary(
            "/rlfeed.v1.SidecarStatus/GetStatus",
            request_serializer=pb.GetStatusRequest.SerializeToString,
            response_deserializer=pb.StatusResponse.FromString,
        )
        get_batch = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=pb.GetBatchResponse.FromString,
        )
        status(pb.GetStatusRequest(), timeout=5)  # connected, every lazy thread started
        before = _threads()
        polls = [
            get_batch.future(pb.GetBatchRequest(step=0, rank=rank, timeout_ms=30_000), timeout=60)
            for rank in range(RANKS)
        ]
        deadline = time.monotonic() + 20
        while sidecar.guard.limits.in_flight().get(CallKind.LONG_POLL, 0) < RANKS:
            assert time.monotonic() < deadline, sidecar.guard.limits.in_flight()
            time.sleep(0.02)
        time.sleep(0.6)  # past POLL_SECONDS: every wait timed out once and re-asked
        waiting = _threads()
        started = time.monotonic()
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        status(pb.GetStatusRequest(), timeout=1.0)
        answered_s = time.monotonic() - started
        assert not any(poll.done() for poll in polls)

        _produce_step(sidecar.address)
        responses = [poll.result(timeout=30) for poll in polls]

    print(
        f"\n{RANKS} waiting GetBatch: threads {before} -> {waiting}; health + status "
        f"{answered_s * 1000:.0f} ms"
    )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING and answered_s < 1.0
    assert waiting - before <= MAX_WORKERS < RANKS  # bounded by the pool, not by the calls
    assert all(r.ready and r.step == 0 for r in responses)
    assert [r.rank for r in responses] == list(range(RANKS))
    assert all(r.num_rollouts == RANKS and len(r.microbatches) >= 1 for r in responses)
