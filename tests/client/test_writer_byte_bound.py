"""RolloutWriter's byte bound: a producer writing huge rollouts to a sidecar that applies
backpressure stops at `max_buffered_bytes` of unacknowledged token payload (blocks, or
raises BufferFullError naming the bound), not at `max_buffered_rollouts`; nothing written
is lost once the sidecar takes rollouts again.

The sidecar is the real in-process one (`InProcessTransport`): it holds one step for a
trainer that has not fetched it and refuses every batch after (RESOURCE_EXHAUSTED) until
the trainer fetches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from rlfeed.client.producer import DEFAULT_MAX_BUFFERED_BYTES, RolloutWriter
from rlfeed.client.transport import BufferFullError
from rlfeed.proto.arrow_schemas import TOKEN_BYTES
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport

LENGTH = 100_000  # tokens a rollout: 900 kB of token payload
ROLLOUT_BYTES = LENGTH * TOKEN_BYTES
BOUND = 4 << 20  # the writer's max_buffered_bytes: room for 4 of them, not 5


def rollout(i: int, length: int = LENGTH) -> dict:
    mask = np.ones(length, np.uint8)
    mask[0] = 0
    return {
        "rollout_id": f"r{i}",
        "task_id": "t0",
        "group_id": f"g{i // 2}",
        "policy_version": 0,
        "reward": float(i % 2),
        "token_ids": np.full(length, i % 100, np.int32),
        "action_mask": mask,
        "sampler_logprobs": np.where(mask > 0, -0.5, 0.0).astype(np.float32),
    }


def full_sidecar() -> InProcessTransport:
    """A sidecar holding one unfetched step (group r0, r1): every batch after is refused."""
    sidecar = InProcessTransport(
        config_from_dict(
            {
                "batching": {"token_budget": 1 << 18, "world_size": 1},
                "rollouts": {
                    "prompts_per_step": 1,
                    "group_size": 2,
                    "vocab_size": 100,
                    "max_buffered_rollouts": 2,
                },
            }
        )
    )
    sidecar.register_tasks(["t0"])
    with RolloutWriter(sidecar) as writer:
        writer.write(**rollout(0))
        writer.write(**rollout(1))
    return sidecar


@contextlib.contextmanager
def trainer_fetching(sidecar: InProcessTransport) -> Iterator[None]:
    """A trainer rank fetching every step as it is assembled: the sidecar takes batches."""
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            step += bool(sidecar.get_batch(step, 0, 0.05).ready)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        yield
    finally:
        stop.set()
        trainer.join()


def writer_on(sidecar: InProcessTransport, **options) -> RolloutWriter:
    return RolloutWriter(
        sidecar,
        max_batch_bytes=1 << 20,  # sealed every 2 rollouts
        max_buffered_bytes=BOUND,
        retry_backoff_s=0.001,
        **options,
    )


def test_a_writer_of_huge_rollouts_blocks_at_its_byte_bound_and_loses_nothing() -> None:
    sidecar = full_sidecar()
    writer = writer_on(sidecar)
    assert writer.max_buffered_rollouts >= 4096  # the rollout bound is nowhere near
    written = []

    def produce() -> None:
        for i in range(2, 14):
            writer.write(**rollout(i))
            written.append(i)

    producer = threading.Thread(target=produce)
    producer.start()
    deadline = time.monotonic() + 10
    while len(written) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the sidecar refuses all along: the writer stays blocked
    assert written == [2, 3, 4, 5]  # 4 x 900 kB held; a 5th would pass 4 MiB
    assert writer.unacknowledged == 4
    assert writer.unacknowledged_bytes == 4 * ROLLOUT_BYTES <= BOUND

    most = 0
    with trainer_fetching(sidecar):  # room again
        while producer.is_alive():
            most = max(most, writer.unacknowledged_bytes)
            time.sleep(0.001)
        producer.join()
        writer.close()  # every ack in
    assert written == list(range(2, 14))
    assert most <= BOUND
    assert writer.unacknowledged == 0 and writer.unacknowledged_bytes == 0
    assert sidecar.status().counters.rollouts_accepted == 14  # every rollout written, once


def test_a_full_writer_raises_naming_its_byte_bound_when_asked_to() -> None:
    sidecar = full_sidecar()
    writer = writer_on(sidecar, on_full="raise")
    for i in range(2, 6):
        writer.write(**rollout(i))
    with pytest.raises(BufferFullError) as refused:
        writer.write(**rollout(6))
    message = str(refused.value)
    assert f"4 unacknowledged rollouts of {4 * ROLLOUT_BYTES} token bytes" in message
    assert f"max_buffered_bytes={BOUND}" in message
    assert f"no room for a rollout of {ROLLOUT_BYTES} bytes" in message
    with trainer_fetching(sidecar):  # the writer drains and takes rollouts again
        writer.flush(timeout_s=20)
        writer.write(**rollout(6))
        writer.write(**rollout(7))
        writer.close()
    assert sidecar.status().counters.rollouts_accepted == 8


def test_a_rollout_larger_than_the_whole_bound_goes_alone() -> None:
    sidecar = full_sidecar()
    writer = RolloutWriter(
        sidecar, max_batch_bytes=1 << 20, max_buffered_bytes=1 << 20, on_full="raise"
    )
    writer.write(**rollout(2, length=200_000))  # 1.8 MB > 1 MiB: taken, nothing else held
    assert writer.unacknowledged_bytes == 200_000 * TOKEN_BYTES
    with pytest.raises(BufferFullError, match="max_buffered_bytes=1048576"):
        writer.write(**rollout(3, length=10))
    with trainer_fetching(sidecar):
        writer.close()


def test_the_byte_bound_defaults_to_64_mib_and_holds_at_least_a_batch() -> None:
    sidecar = InProcessTransport()
    assert RolloutWriter(sidecar).max_buffered_bytes == DEFAULT_MAX_BUFFERED_BYTES == 64 << 20
    with pytest.raises(ValueError, match=r"max_buffered_bytes \(1000\) must be >= max_batch"):
        RolloutWriter(sidecar, max_batch_bytes=4096, max_buffered_bytes=1000)
    # A writer made for batches larger than the default bound (as before the bound) starts:
    # unset, the bound is its batch size.
    assert RolloutWriter(sidecar, max_batch_bytes=1 << 30).max_buffered_bytes == 1 << 30
