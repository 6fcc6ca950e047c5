"""The clients of the exactly-once tests, and the check over what they saw.

Producers retry a batch with the same rollout ids until it is acknowledged (the
idempotent-producer contract); ranks re-ask for the same (step, rank) until served.
Clients are raw gRPC stubs from the .proto, so the check sees every byte. Over the whole
history: every acknowledged rollout is served, in exactly one step; nothing is served that
was not acknowledged; a (step, rank) is never served with two different contents.
Loaded by `test_crash_loop.py`, `test_frontend_actors.py` and `tests/bench/bench_chaos.py`
(tests import by path here).
"""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import numpy as np
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import synthetic_groups

GROUP_SIZE, PROMPTS_PER_STEP, WORLD_SIZE = 4, 2, 2
TASKS = [f"task-{i}" for i in range(8)]
CONFIG = f"""
[server]
host = "127.0.0.1"
[batching]
world_size = {WORLD_SIZE}
token_budget = 512
[rollouts]
group_size = {GROUP_SIZE}
prompts_per_step = {PROMPTS_PER_STEP}
[advantages]
drop_zero_advantage = false
[journal]
sync = "group"
segment_bytes = 65536
snapshot_every_records = 40
"""


class History:
    """What the clients saw: acknowledged rollout ids, and every (step, rank) served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acknowledged: set[str] = set()
        self.served: dict[tuple[int, int], set[str]] = {}  # (step, rank) -> content digests
        self.rollouts_of: dict[int, list[str]] = {}  # step -> rollout ids (rank order)

    def ack(self, rollout_ids: list[str]) -> None:
        with self.lock:
            self.acknowledged.update(rollout_ids)

    def serve(self, step: int, rank: int, response: bytes) -> None:
        message = pb.GetBatchResponse.FromString(response)
        ids = [i for mb in message.microbatches for i in mb.rollout_ids]
        self.serve_content(step, rank, hashlib.sha256(response).hexdigest(), ids)

    def serve_content(self, step: int, rank: int, digest: str, ids: list[str]) -> None:
        """(step, rank) served with content `digest` holding rollouts `ids`. Served again
        (a rank resuming from a checkpoint), its rollouts count once; another digest is
        a second content, which the check refuses."""
        with self.lock:
            first = (step, rank) not in self.served
            self.served.setdefault((step, rank), set()).add(digest)
            if first:
                self.rollouts_of.setdefault(step, []).extend(ids)


def _retrying(call, stop: threading.Event):
    """`call()` until it answers; every gRPC error (the sidecar is down) is retried."""
    while not stop.is_set():
        try:
            return call()
        except grpc.RpcError:
            time.sleep(0.2)
    return None


def _producer(address: str, batches: list[tuple[bytes, list[str]]], history, stop) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RolloutIngestStub(channel)
        tasks = pb_grpc.TaskSamplingStub(channel)
        _retrying(lambda: tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=TASKS)), stop)
        for payload, ids in batches:
            request = pb.RolloutBatch(arrow_ipc=payload)
            if _retrying(lambda r=request: stub.SubmitRolloutBatch(r, timeout=10), stop):
                history.ack(ids)
            time.sleep(0.05)


def _trainer(address: str, rank: int, steps: int, history, stop) -> None:
    with grpc.insecure_channel(address) as channel:
        get = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,
        )
        for step in range(steps):
            while not stop.is_set():
                request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=1000)
                response = _retrying(lambda r=request: get(r, timeout=5), stop)
                if response is not None and pb.GetBatchResponse.FromString(response).ready:
                    history.serve(step, rank, response)
                    break


def _workload(num_groups: int, rng: np.random.Generator) -> tuple:
    """The rollouts, and two producers' batches of 3 (a group's rollouts span batches)."""
    rollouts = synthetic_groups(
        num_groups=num_groups, group_size=GROUP_SIZE, rng=rng, tasks=TASKS, max_length=120
    )
    order = np.arange(len(rollouts))
    halves = [order[: len(order) // 2], order[len(order) // 2 :]]
    work = [
        [(rollouts.encode(rows.tolist()), [rollouts.rollout_ids[r] for r in rows]) for rows in
         np.array_split(half, max(1, len(half) // 3))]
        for half in halves
    ]  # fmt: skip
    return rollouts, work


def run_clients(address: str | list[str], crash, kills: int, num_groups: int, seed: int) -> dict:
    """Producers and trainers against `address` while `crash()` is called `kills` times at
    random points (it returns once the sidecar answers again); then drain. With a list of
    addresses, producer i and rank i use address i (modulo their number)."""
    rng = np.random.default_rng(seed)
    rollouts, work = _workload(num_groups, rng)
    steps = num_groups // PROMPTS_PER_STEP
    history, stop = History(), threading.Event()
    addresses = [address] if isinstance(address, str) else address
    threads = [
        threading.Thread(target=_producer, args=(addresses[i % len(addresses)], w, history, stop))
        for i, w in enumerate(work)
    ] + [
        threading.Thread(
            target=_trainer, args=(addresses[r % len(addresses)], r, steps, history, stop)
        )
        for r in range(WORLD_SIZE)
    ]
    try:
        for thread in threads:
            thread.start()
        mid_ingest = 0  # kills while producers were still sending
        for _ in range(kills):
            time.sleep(float(rng.uniform(0.5, 3.0)))
            mid_ingest += any(t.is_alive() for t in threads[: len(work)])
            crash()
        deadline = time.monotonic() + 240
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "clients did not finish draining"
    finally:
        stop.set()
    return {
        "history": history,
        "rollouts": rollouts,
        "steps": steps,
        "kills": kills,
        "mid_ingest": mid_ingest,
    }


def check_exactly_once(run: dict) -> None:
    history: History = run["history"]
    served = [i for step in sorted(history.rollouts_of) for i in history.rollouts_of[step]]
    assert len(history.acknowledged) == len(run["rollouts"])  # every batch got its ack
    assert len(served) == len(set(served)), "a rollout was served twice"
    assert set(served) == history.acknowledged, (
        f"acknowledged but never served: {len(history.acknowledged - set(served))}, "
        f"served but never acknowledged: {len(set(served) - history.acknowledged)}"
    )
    assert len(history.served) == run["steps"] * WORLD_SIZE
    two_contents = {key for key, digests in history.served.items() if len(digests) > 1}
    assert not two_contents, f"(step, rank) served with two different contents: {two_contents}"


def report(run: dict) -> None:
    print(
        f"crash loop: {run['kills']} kills ({run['mid_ingest']} during ingest), "
        f"{len(run['rollouts'])} rollouts, {run['steps']} steps"
    )
