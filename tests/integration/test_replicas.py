"""Several front-ends (replicas) on one scheduler actor: a step reads ingest batches that
reached different front-ends, and any front-end serves any step, byte-identical.

Real gRPC on loopback and real local Ray. The in-process test runs two front-ends in this
process (one interpreter, so no speed-up, but every cross-front-end path: peer fetch of
batches, peer fetch of responses, releases routed to the batch's holder); the CLI test runs
`rlfeed serve --replicas 2`, two processes sharing one port, under `rlfeed demo --address`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import ray
from helpers import free_port, wait_until
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config import with_overrides
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.frontend.server import start_server
from rlfeed.service.scheduler.records import FetchKind
from rlfeed.service.testing import check_served_step, synthetic_groups
from rlfeed.service.testing import fetch_served_bytes as fetch

GROUPS = {"prompts_per_step": 2, "group_size": 4}


def submit_half(
    channel: grpc.Channel, rollouts, groups: range, half: tuple[int, int], sequence: int
) -> None:
    """Rollouts `half` of each 4-rollout group in `groups` to one front-end, all accepted."""
    rows = [row for row in groups if row % 4 in half]
    batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows), sequence=sequence)
    assert pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30).accepted == 4


def submit_halves(channels: list[grpc.Channel], rollouts) -> None:
    """Four steps of groups 2s and 2s+1 (GROUPS), each front-end getting half of every
    group; the second half completes the step, so the replica stores the even steps and
    the primary the odd ones."""
    pb_grpc.TaskSamplingStub(channels[0]).RegisterTasks(
        pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
    )
    sequence = 0
    for step in range(4):
        first, second = (0, 1) if step % 2 == 0 else (1, 0)
        groups = range(8 * step, 8 * step + 8)
        for front_end, half in ((first, (0, 1)), (second, (2, 3))):
            submit_half(channels[front_end], rollouts, groups, half, sequence)
            sequence += 1


def test_steps_read_batches_from_both_front_ends_and_either_serves_them(make_sidecar) -> None:
    primary = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "retained_steps": 8})
    replica = start_server(primary.config, join=True)  # same actor, its own port (port 0)
    try:
        front_ends = (primary, replica)
        rollouts = synthetic_groups(num_groups=8, group_size=4, rng=np.random.default_rng(21))
        channels = [grpc.insecure_channel(sidecar.address) for sidecar in front_ends]
        submit_halves(channels, rollouts)
        # Rank 0 asks the primary, rank 1 the replica, whoever stored the step.
        served = [[fetch(channels[rank], step, rank) for rank in range(2)] for step in range(4)]
        ids = [rid for step in served for rid in check_served_step(step, rollouts)]
        assert sorted(ids) == sorted(rollouts.rollout_ids)
        stored_by = {
            side: [s for s in range(4) if sidecar.frontend.responses.get(s) is not None]
            for side, sidecar in zip(("primary", "replica"), front_ends, strict=True)
        }
        assert stored_by == {"primary": [1, 3], "replica": [0, 2]}  # the completing side
        for step in range(4):  # re-fetches, each rank now from the other front-end
            assert [fetch(channels[1 - rank], step, rank) for rank in range(2)] == served[step]
        # Without the holder's "stored" announcement, the actor's handle leads to the bytes.
        for sidecar in front_ends:
            sidecar.frontend.signals.forget_holder()
        for step in range(4):
            assert [fetch(channels[rank], step, rank) for rank in range(2)] == served[step]
        # Every group is complete and every step stored: each front-end frees the batches
        # it decoded, although the other front-end materialized half of the steps.
        wait_until(
            lambda: len(primary.frontend.payloads) == len(replica.frontend.payloads) == 0,
            f"batches still held: {len(primary.frontend.payloads)}, "
            f"{len(replica.frontend.payloads)}",
            timeout_s=30.0,
        )
        status = pb_grpc.SidecarStatusStub(channels[0])
        assert status.GetStatus(pb.GetStatusRequest(), timeout=10).front_ends == 2
        replica.stop(grace=0.5)  # leaves the actor running, and unregisters
        assert status.GetStatus(pb.GetStatusRequest(), timeout=10).front_ends == 1
        for channel in channels:
            channel.close()
    finally:
        replica.stop(grace=0.5)


@pytest.mark.parametrize("cache_bytes", [None, 1], ids=["in-memory", "moved-out"])
def test_a_replica_that_stops_hands_its_data_over_and_the_sidecar_serves_on(
    make_sidecar, cache_bytes
) -> None:
    """A replica stopping mid-run takes nothing along: a step it stored that no rank has
    fetched, a step it stored and served (re-fetched byte-identical), and a step not yet
    planned whose first halves only it received are all served by the front-end left.
    With a 1-byte response cache its steps were already moved to the object store under
    references it owns (they would die with its process): the actor holds new ones."""
    primary = make_sidecar(rollouts=GROUPS, batching={"world_size": 2, "retained_steps": 8})
    replica_config = primary.config
    if cache_bytes is not None:
        replica_config = with_overrides(
            primary.config, server={"max_held_response_bytes": cache_bytes}
        )
    replica = start_server(replica_config, join=True)
    try:
        rollouts = synthetic_groups(num_groups=10, group_size=4, rng=np.random.default_rng(24))
        channels = [grpc.insecure_channel(sidecar.address) for sidecar in (primary, replica)]
        submit_halves(channels, rollouts)  # steps 0-3; the replica stores steps 0 and 2
        step_0 = [fetch(channels[1], 0, rank) for rank in range(2)]
        wait_until(
            lambda: replica.frontend.signals.newest_stored_here >= 2,
            "step 2 not stored",
            timeout_s=30.0,
        )

        step_4 = range(32, 40)  # its groups
        submit_half(channels[1], rollouts, step_4, (0, 1), 100)  # only the replica has these
        moved_out = replica.assembler.moved_out()
        assert bool(moved_out) == (cache_bytes is not None)
        replica.stop(grace=0.5)
        assert replica.handed_over
        assert len(replica.frontend.payloads) > 0  # it held batches, and left them behind
        for step, refs in moved_out.items():
            kind, handle = ray.get(primary.actor.fetch_batch.remote(step, 0))
            assert kind is FetchKind.READY and handle.ref != refs[0].ref, (step, handle)
        submit_half(channels[0], rollouts, step_4, (2, 3), 101)  # completes it at the primary
        served = [[fetch(channels[0], step, rank) for rank in range(2)] for step in range(5)]
        assert served[0] == step_0
        ids = [rid for step in served for rid in check_served_step(step, rollouts)]
        assert sorted(ids) == sorted(rollouts.rollout_ids)
        status = pb_grpc.SidecarStatusStub(channels[0]).GetStatus(pb.GetStatusRequest())
        assert status.front_ends == 1
        for channel in channels:
            channel.close()
    finally:
        replica.stop(grace=0.5)


class RecordedFetches(ServerEvents):
    def __init__(self) -> None:
        self.fetches: list[tuple[int, int]] = []

    def on_served(self, step: int, rank: int, response: bytes) -> None:
        self.fetches.append((step, rank))


def test_each_fetch_is_reported_once_by_the_front_end_holding_the_step(make_sidecar) -> None:
    """With the holders' "stored" announcements lost, a rank asking the other front-end
    gets the bytes through the actor's handle, from the holder: the holder reports that
    fetch, so every rank of a step counts at the front-end that stored it (what makes a
    step "served" in its metrics), and no fetch counts twice."""
    recorded = {"primary": RecordedFetches(), "replica": RecordedFetches()}
    primary = make_sidecar(
        events=lambda config: recorded["primary"],
        server={"replicas": 2},  # announces its steps too (no replica process is started)
        rollouts=GROUPS,
        batching={"world_size": 2, "retained_steps": 8},
    )
    replica = start_server(primary.config, join=True, events=recorded["replica"])
    try:
        rollouts = synthetic_groups(num_groups=8, group_size=4, rng=np.random.default_rng(23))
        channels = [grpc.insecure_channel(sidecar.address) for sidecar in (primary, replica)]
        submit_halves(channels, rollouts)
        stored_by = {"replica": [0, 2], "primary": [1, 3]}
        other = {"replica": primary, "primary": replica}
        for holder, steps in stored_by.items():  # announced, then forgotten
            wait_until(
                lambda holder=holder, steps=steps: all(
                    other[holder].frontend.signals.holder(step) is not None for step in steps
                ),
                f"{holder}'s steps not announced",
                timeout_s=30.0,
            )
            other[holder].frontend.signals.forget_holder()
        for step in range(4):  # rank 0 asks the primary, rank 1 the replica
            for rank in range(2):
                fetch(channels[rank], step, rank)
        for holder, steps in stored_by.items():
            assert sorted(recorded[holder].fetches) == [(s, r) for s in steps for r in range(2)]
        for channel in channels:
            channel.close()
    finally:
        replica.stop(grace=0.5)


def test_a_front_end_that_never_completes_a_step_still_frees_its_batches(make_sidecar) -> None:
    """The replica only ever decodes first halves of groups; the primary completes, and so
    materializes, every step. The replica learns of the releases without an ingest of its
    own (its idle poll), and ends holding nothing."""
    primary = make_sidecar(rollouts=GROUPS, batching={"world_size": 1, "retained_steps": 1})
    replica = start_server(primary.config, join=True)
    try:
        rollouts = synthetic_groups(num_groups=6, group_size=4, rng=np.random.default_rng(22))
        channels = [grpc.insecure_channel(sidecar.address) for sidecar in (primary, replica)]
        pb_grpc.TaskSamplingStub(channels[0]).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        for step in range(3):
            for front_end, half in ((1, (0, 1)), (0, (2, 3))):
                rows = [r for r in range(8 * step, 8 * step + 8) if r % 4 in half]
                batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows), sequence=2 * step)
                pb_grpc.RolloutIngestStub(channels[front_end]).SubmitRolloutBatch(batch, timeout=30)
        served = [fetch(channels[0], step, 0) for step in range(3)]
        ids = [rid for step in served for rid in check_served_step([step], rollouts)]
        assert sorted(ids) == sorted(rollouts.rollout_ids)
        wait_until(
            lambda: len(replica.frontend.payloads) == 0,
            f"the replica still holds {len(replica.frontend.payloads)} batches",
            timeout_s=30.0,
        )
        for channel in channels:
            channel.close()
    finally:
        replica.stop(grace=0.5)


def test_the_peer_service_is_not_on_the_public_port_and_a_lost_holder_falls_back(
    make_sidecar,
) -> None:
    """Only front-ends, at their peer address, reach the peer service; an announcement
    naming a front-end that is gone costs nothing but the actor's path."""
    sidecar = make_sidecar(rollouts=GROUPS, batching={"world_size": 1})
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(23))
    with grpc.insecure_channel(sidecar.address) as channel:
        pb_grpc.TaskSamplingStub(channel).RegisterTasks(
            pb.RegisterTasksRequest(task_ids=sorted(set(rollouts.task_ids)))
        )
        announce = channel.unary_unary("/rlfeed.internal.v1.FrontEndPeer/StepStored")
        with pytest.raises(grpc.RpcError) as error:
            announce(b"\0" * 8 + b"nobody", timeout=10)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(), sequence=0)
        pb_grpc.RolloutIngestStub(channel).SubmitRolloutBatch(batch, timeout=30)
        first = fetch(channel, 0, 0)
        check_served_step([first], rollouts)
        sidecar.peer_queries.stored_by(0, "a-front-end-that-left")
        assert fetch(channel, 0, 0) == first  # the re-fetch would be forwarded: falls back
        assert sidecar.frontend.signals.holder(0) is None  # and the announcement is gone


def _status(address: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfeed", "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_rlfeed_serve_with_two_replicas_runs_the_demo_and_stops_both(tmp_path) -> None:
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", "--port", str(port), "--replicas", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    try:
        lines = []
        for line in serve.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        assert "2 front-ends" in lines[-1], "".join(lines[-20:])
        joined = subprocess.run(  # this sidecar's children only: other runs may share the host
            ["pgrep", "-P", str(serve.pid), "-f", "rlfeed serve --join"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(joined) == 1, joined  # the one other front-end
        address = f"127.0.0.1:{port}"
        demo = subprocess.run(
            [sys.executable, "-m", "rlfeed", "demo", "--address", address, "--steps", "3"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        status = _status(address)
        assert "front-ends       2" in status.stdout, status.stdout + status.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        rest, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0, rest[-3000:]
    assert "rlfeed serve: stopped" in rest
    for pid in joined:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"replica {pid} outlived the sidecar")


def _serve_with_a_replica(port: int) -> tuple[subprocess.Popen, str]:
    """`rlfeed serve --replicas 2` on `port`, once listening, and its replica's pid."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", "--port", str(port), "--replicas", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in serve.stdout:
        if "listening on" in line:
            break
    (replica,) = subprocess.run(  # this sidecar's children only
        ["pgrep", "-P", str(serve.pid), "-f", "rlfeed serve --join"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return serve, replica


def test_a_replica_told_to_stop_hands_over_and_the_sidecar_runs_on() -> None:
    """SIGTERM to a replica: it hands what it holds to the actor and exits 0; the first
    process says so and serves on (another demo run completes), then stops cleanly."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    serve, replica = _serve_with_a_replica(port)

    def demo(steps: int) -> None:
        run = subprocess.run(
            [sys.executable, "-m", "rlfeed", "demo", "--address", address, "--steps", str(steps)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    try:
        demo(2)
        os.kill(int(replica), signal.SIGTERM)
        wait_until(lambda: not os.path.exists(f"/proc/{replica}"), "the replica still runs", 60)
        status = _status(address)
        assert "front-ends       1" in status.stdout, status.stdout + status.stderr
        demo(2)
    finally:
        serve.send_signal(signal.SIGTERM)
        rest, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0, rest[-3000:]
    assert f"replica 1 (pid {replica}) left, its data handed over" in rest


def test_without_a_journal_a_replica_that_dies_stops_the_whole_sidecar() -> None:
    """A replica holds data the other front-ends need: killed, it cannot hand it over, and
    without a journal nothing else holds it, so the sidecar does not run on without it
    (exit 1, saying which replica and why), nor leave any process behind. With a journal
    it is restarted instead (`test_crash_loop.py`)."""
    serve, replica = _serve_with_a_replica(free_port())
    try:
        os.kill(int(replica), signal.SIGKILL)
        rest, _ = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 1, rest[-3000:]
    assert (
        f"replica 1 (pid {replica}) exited with code -9; without [journal] dir what it held "
        "is lost: stopping the sidecar"
    ) in rest


def test_a_replica_that_cannot_start_fails_the_start_naming_it() -> None:
    """Replica 1 serves metrics on metrics_port + 1; with that port taken it exits at once,
    and `rlfeed serve` fails its start (exit 1) instead of running short of a front-end."""
    metrics_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics_port + 1))
        taken.listen()
        command = [sys.executable, "-m", "rlfeed", "serve", "--port", str(free_port())]
        serve = subprocess.run(
            [*command, "--replicas", "2", "--metrics-port", str(metrics_port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert serve.returncode == 1, serve.stdout[-2000:] + serve.stderr[-3000:]
    assert "cannot start the front-end replicas: replica 1" in serve.stderr
    assert f"cannot serve metrics on 127.0.0.1:{metrics_port + 1}" in serve.stderr
    assert "listening on" not in serve.stdout


def _running(pid: str) -> bool:
    """Whether process `pid` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _port_free(port: int) -> bool:
    """Whether `port` can be bound as a new `rlfeed serve` checks it (no SO_REUSEPORT)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("journal", [False, True])
def test_replicas_do_not_outlive_their_first_process(tmp_path, journal: bool) -> None:
    """SIGKILL of the first process alone (not its group: nothing stops the replica, and
    Ray goes with the first process): the replica notices within seconds and exits, so
    the port is free for the next `rlfeed serve`."""
    port = free_port()
    flags = ["--journal-dir", str(tmp_path / "journal")] if journal else []
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", "--port", str(port), "--replicas", "2", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    replica, lines = None, []
    try:
        for line in serve.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        assert "listening on" in lines[-1], "".join(lines[-30:])
        (replica,) = subprocess.run(
            ["pgrep", "-P", str(serve.pid), "-f", "rlfeed serve --join"],
            capture_output=True,
            text=True,
        ).stdout.split()
        serve.kill()
        serve.wait()
        killed = time.monotonic()
        wait_until(lambda: not _running(replica), "the replica outlived it", 10)
        wait_until(
            lambda: _port_free(port), "the port is still held", 10 - (time.monotonic() - killed)
        )
        print(f"replica gone and port free {time.monotonic() - killed:.1f} s after the kill")
    finally:
        if replica is not None and _running(replica):
            os.kill(int(replica), signal.SIGKILL)
        if serve.poll() is None:
            serve.kill()
        serve.communicate()
