"""Clients ride through a sidecar killed and restarted on the same port, with no change to
user code: a `RolloutWriter` keeps writing and a `BatchLoader` keeps waiting; both log a
warning naming the address, neither raises, the batch sent into the outage is re-sent
until the restarted sidecar answers it, and the loader is served by the new sidecar.

Without a journal the restarted sidecar has lost what the old one held (the rollouts
acknowledged before the kill, the task pool): that is expected here; the writer registers
its tasks again. Two sidecars: the in-process one behind a real gRPC port (stopped and
started in milliseconds; the default run) and a real `rlfeed serve` killed with SIGKILL
(Ray start-up twice: marked slow).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import free_port
from rlfeed.client.loader import BatchLoader, TrainStep
from rlfeed.client.producer import RolloutWriter
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport
from rlfeed.service.inprocess_server import serve_in_process

GROUP_SIZE = 4
SIDECAR = {
    "batching": {"token_budget": 256, "world_size": 1},
    "rollouts": {"prompts_per_step": 2, "group_size": GROUP_SIZE, "vocab_size": 100},
}
TASKS = [f"task-{i}" for i in range(4)]


def write_group(writer: RolloutWriter, group: int) -> list[str]:
    """One complete group (one batch: max_batch_rollouts = GROUP_SIZE); its rollout ids."""
    ids = [f"g{group}/{k}" for k in range(GROUP_SIZE)]
    for k, rollout_id in enumerate(ids):
        writer.write(
            rollout_id=rollout_id,
            task_id=TASKS[group % len(TASKS)],
            group_id=f"g{group}",
            policy_version=0,
            reward=float(k % 2),
            token_ids=np.arange(1, 9, dtype=np.int32),
            action_mask=np.array([0, 0, 1, 1, 1, 1, 1, 1], np.uint8),
            sampler_logprobs=np.full(8, -0.5, np.float32),
        )
    return ids


def ride_through_a_restart(
    address: str, kill: Callable[[], None], restart: Callable[[], None], caplog
) -> None:
    """The scenario: a group acknowledged, a loader waiting for step 0, the kill, a group
    written into the outage, the restart, one more group; then the checks."""
    writer = RolloutWriter(address, max_batch_rollouts=GROUP_SIZE)
    writer.register_tasks(TASKS)
    write_group(writer, 0)
    assert [ack.accepted for ack in writer.flush(timeout_s=30)] == [GROUP_SIZE]
    loader = BatchLoader(address, 0, 1, prefetch=0, poll_s=0.2)
    served: list[TrainStep | BaseException] = []

    def wait_for_step_0() -> None:
        try:
            served.append(loader.fetch(0))
        except BaseException as exc:  # the test fails on it below
            served.append(exc)

    waiting = threading.Thread(target=wait_for_step_0, daemon=True)
    with caplog.at_level(logging.WARNING, logger="rlfeed"):
        waiting.start()
        time.sleep(0.5)  # the loader has been answered "not ready" by the old sidecar
        kill()
        into_the_outage = write_group(writer, 1)  # sent at once, re-sent until answered
        time.sleep(1.0)
        restart()
        after = write_group(writer, 2)
        acks = writer.flush(timeout_s=180)  # raises what the writer met, if anything
        waiting.join(timeout=180)
    writer.close()
    loader.close()

    assert [ack.accepted for ack in acks] == [GROUP_SIZE, GROUP_SIZE]  # both answered, new
    (step,) = served
    assert isinstance(step, TrainStep), f"the loader raised {step!r}"
    # Step 0 of the restarted sidecar: the groups it was sent, not the one it lost.
    assert sorted(r for mb in step for r in mb.rollout_ids) == sorted(into_the_outage + after)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    outage = [w for w in warnings if f"the sidecar at {address} does not answer" in w]
    assert len(outage) >= 2  # the writer's and the loader's (each at most every 10 s)
    assert any("had lost 4 of the 4 tasks this writer registered" in w for w in warnings)


def test_clients_ride_through_an_in_process_sidecar_restarted_on_its_port(caplog):
    config = config_from_dict(SIDECAR)
    server, port = serve_in_process(InProcessTransport(config))
    restarted = []

    def restart() -> None:  # a new sidecar on the same port, with nothing of the old one
        restarted.append(serve_in_process(InProcessTransport(config), f"127.0.0.1:{port}")[0])

    try:
        ride_through_a_restart(f"127.0.0.1:{port}", lambda: server.stop(0), restart, caplog)
    finally:
        server.stop(0)
        for again in restarted:
            again.stop(0)


def _serve(config_path, port: int) -> subprocess.Popen:
    """`rlfeed serve` on `port` in its own process group (the kill takes its Ray along),
    once it is listening."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfeed",
            "serve",
            "--config",
            str(config_path),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        assert line or server.poll() is None, "rlfeed serve exited during start-up"
        if line.startswith("rlfeed serve: listening on "):
            return server
    raise AssertionError("rlfeed serve did not print its address")


def _kill(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


@pytest.mark.slow
def test_clients_ride_through_rlfeed_serve_killed_and_restarted(tmp_path, caplog):
    config = tmp_path / "sidecar.toml"
    config.write_text(
        "[batching]\ntoken_budget = 256\nworld_size = 1\n"
        f"[rollouts]\nprompts_per_step = 2\ngroup_size = {GROUP_SIZE}\nvocab_size = 100\n"
        '[ray]\nactor_name = "restart-under-test"\n'
    )
    port = free_port()
    servers = [_serve(config, port)]
    try:
        ride_through_a_restart(
            f"127.0.0.1:{port}",
            lambda: _kill(servers[0]),
            lambda: servers.append(_serve(config, port)),
            caplog,
        )
    finally:
        for server in servers:
            _kill(server)
