"""A rank's acknowledgement rides on its next GetBatch (`acked_through_step`): one call per
step, not two, with the same effect as AckSteps: steps are released once every rank is
done with them, a refused acknowledgement fails the call, naming the field. Real gRPC on
loopback, real local Ray; a lone front-end answers acknowledgements itself, one that
shares the actor (`replicas` 2) asks the actor."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from helpers import wait_until
from rlfeed.client.loader import BatchLoader
from rlfeed.client.transport import GrpcTransport
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import synthetic_groups

WORLD_SIZE = 2
STEPS = 8


class CountingTransport(GrpcTransport):
    """The gRPC transport, recording the acknowledgement each call carried."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.fetch_acks: list[int] = []  # acked_through of each answered fetch carrying one
        self.ack_calls: list[int | None] = []  # through_step of each AckSteps
        self.answered: list[int] = []  # the step of each fetch answered ready
        self.failed: list[int] = []  # the step of each fetch that raised

    def get_batch(self, step, rank, wait_s, acked_through=None):
        raise AssertionError("the loader uses get_batch_view")

    def get_batch_view(self, step, rank, wait_s, acked_through=None):
        try:
            response = super().get_batch_view(step, rank, wait_s, acked_through)
        except Exception:
            self.failed.append(step)
            raise
        if acked_through is not None:
            self.fetch_acks.append(acked_through)
        if response.ready:
            self.answered.append(step)
        return response

    def ack_steps(self, rank, through_step):
        self.ack_calls.append(through_step)
        return super().ack_steps(rank, through_step)


def _sidecar_with_steps(make_sidecar, **sections):
    sidecar = make_sidecar(
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": WORLD_SIZE, "retained_steps": 1},
        **sections,
    )
    rollouts = synthetic_groups(num_groups=2 * STEPS, group_size=4, rng=np.random.default_rng(9))
    with grpc.insecure_channel(sidecar.address) as channel:
        tasks = sorted(set(rollouts.task_ids))
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(pb.RegisterTasksRequest(task_ids=tasks))
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(), sequence=0)
        pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30)
    return sidecar


def _assert_acks_rode_on_fetches(transport: CountingTransport) -> None:
    acks = transport.fetch_acks
    assert acks == sorted(set(acks)) and acks[0] <= 1 and acks[-1] in (STEPS - 3, STEPS - 2)
    assert transport.ack_calls == [None, STEPS - 1]
    assert transport.answered == list(range(STEPS))  # each step answered once


def _fetch_code(address: str, step: int) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        request = pb.GetBatchRequest(step=step, rank=0, timeout_ms=5_000)
        try:
            pb_grpc.BatchServingStub(channel).GetBatch(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("server", [{}, {"replicas": 2}], ids=["lone", "shared-actor"])
def test_a_step_is_acknowledged_with_the_fetch_after_next_and_released_as_before(
    make_sidecar, server
) -> None:
    sidecar = _sidecar_with_steps(make_sidecar, server=server)
    transports = [CountingTransport(sidecar.address) for _ in range(WORLD_SIZE)]
    loaders = [
        BatchLoader(transport, rank, WORLD_SIZE, stop_step=STEPS, prefetch=1, timeout_s=60)
        for rank, transport in enumerate(transports)
    ]
    for steps in zip(*loaders, strict=True):
        step = steps[0].step
        # Both ranks hold `step`: their fetches of it answered, so the acknowledgements of
        # step - 2 (carried by those fetches) were applied; step - 1's may be on its way.
        # With retained_steps 1, a step is released once every rank is done with it and
        # with the next one too.
        if step >= 3:
            assert _fetch_code(sidecar.address, step - 3) == grpc.StatusCode.NOT_FOUND
        if step >= 1:
            assert _fetch_code(sidecar.address, step - 1) == grpc.StatusCode.OK
    for transport in transports:
        # Step s goes with the next fetch, of s + 2 (or a later one with a newer step, as
        # they are cumulative); the last step with a call when the loop ends (no fetch
        # follows it), after the declaration that this rank acknowledges.
        _assert_acks_rode_on_fetches(transport)
        transport.close()
    assert _fetch_code(sidecar.address, STEPS - 2) == grpc.StatusCode.NOT_FOUND
    assert _fetch_code(sidecar.address, STEPS - 1) == grpc.StatusCode.OK


@pytest.mark.parametrize("server", [{}, {"replicas": 2}], ids=["lone", "shared-actor"])
def test_a_refused_acknowledgement_fails_the_fetch_naming_the_field(make_sidecar, server) -> None:
    sidecar = _sidecar_with_steps(make_sidecar, server=server)
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.BatchServingStub(channel)
        declared = stub.AckSteps(pb.AckStepsRequest(rank=0), timeout=10)
        assert declared.acks_with_get_batch and declared.acked_through == -1
        request = pb.GetBatchRequest(step=0, rank=0, timeout_ms=5_000, acked_through_step=99)
        with pytest.raises(grpc.RpcError) as error:
            stub.GetBatch(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "acked_through_step" in error.value.details()
        assert "step 99 has not been assembled" in error.value.details()
        # Nothing was acknowledged: the step is served, and an acknowledgement of it rides
        # along with a fetch of the next.
        assert stub.GetBatch(pb.GetBatchRequest(step=0, rank=0, timeout_ms=5_000), timeout=10).ready
        request = pb.GetBatchRequest(step=1, rank=0, timeout_ms=5_000, acked_through_step=0)
        assert stub.GetBatch(request, timeout=10).ready
        assert stub.AckSteps(pb.AckStepsRequest(rank=0), timeout=10).acked_through == 0


def test_an_acknowledgement_whose_fetch_meets_a_restart_is_sent_again(
    make_sidecar, tmp_path
) -> None:
    """The fetch carrying step 3's acknowledgement starts while the sidecar is down: it is
    asked again until the restarted sidecar (same journal, same port) answers, and the
    acknowledgement then counts there."""
    sidecar = _sidecar_with_steps(make_sidecar, journal={"dir": str(tmp_path)})
    transports = [CountingTransport(sidecar.address) for _ in range(WORLD_SIZE)]
    loaders = [
        BatchLoader(transport, rank, WORLD_SIZE, stop_step=STEPS, prefetch=1, timeout_s=120)
        for rank, transport in enumerate(transports)
    ]
    iterators = [iter(loader) for loader in loaders]
    for expected in range(4):
        assert [next(steps).step for steps in iterators] == [expected] * WORLD_SIZE
    # Step 4 prefetched by both ranks: the next fetch, of step 5, carries step 3's ack.
    wait_until(lambda: all(t.answered.count(4) for t in transports), timeout_s=30)
    port = int(sidecar.address.rsplit(":", 1)[1])
    sidecar.stop()
    assert [next(steps).step for steps in iterators] == [4] * WORLD_SIZE  # prefetched
    wait_until(lambda: all(5 in t.failed for t in transports), timeout_s=30)
    restarted = make_sidecar(
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": WORLD_SIZE, "retained_steps": 1},
        server={"port": port},
        journal={"dir": str(tmp_path)},
    )
    # The loop has not asked for step 5 yet, so no newer acknowledgement was noted: the
    # fetch of step 5 answered by the restarted sidecar carried step 3's, sent again.
    wait_until(lambda: all(5 in t.answered for t in transports), timeout_s=60)
    assert all(t.fetch_acks[-1] == 3 for t in transports)
    assert _fetch_code(restarted.address, 2) == grpc.StatusCode.NOT_FOUND  # done with 2 and 3
    assert _fetch_code(restarted.address, 3) == grpc.StatusCode.OK
    for expected in range(5, STEPS):
        assert [next(steps).step for steps in iterators] == [expected] * WORLD_SIZE
    for steps in iterators:
        assert next(steps, None) is None
    for transport in transports:
        _assert_acks_rode_on_fetches(transport)
        transport.close()


def test_a_loop_left_by_a_break_still_acknowledges_the_steps_it_finished(make_sidecar) -> None:
    """Broken out of at step 4 of stop_step 5: step 3 was noted when the loop asked for
    step 4, and no fetch follows to carry it (the prefetch stops at stop_step)."""
    sidecar = _sidecar_with_steps(make_sidecar)
    transport = CountingTransport(sidecar.address)
    loader = BatchLoader(transport, 0, WORLD_SIZE, stop_step=5, prefetch=1, timeout_s=60)
    for step in loader:
        if step.step == 4:
            break
        time.sleep(0.2)  # training on the step: the prefetch of the next one is answered
    loader.close()
    # Sent by the call at the break (or, if the fetch of step 4 had to poll again after
    # the loop noted 3, by that fetch); never step 4, which the loop did not finish.
    sent = transport.fetch_acks + [step for step in transport.ack_calls if step is not None]
    assert max(sent) == 3 and transport.ack_calls[0] is None
    with grpc.insecure_channel(sidecar.address) as channel:
        answer = pb_grpc.BatchServingStub(channel).AckSteps(pb.AckStepsRequest(rank=0))
        assert answer.acked_through == 3
    transport.close()
