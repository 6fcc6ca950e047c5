"""A sidecar restarted from its journal answers every RPC and CLI command as one that never
stopped.

Two `rlfeed serve --journal-dir` processes (twins) get the same calls in the same order:
ingest (stream and unary), task registration and sampling, fetches, acknowledgements and
trainer reports. One twin is then stopped (SIGTERM, later SIGKILL) and started again on its
journal. After each restart every RPC of the .proto and every CLI command that reads a
sidecar (`status`, `status --json`, `layout --step`) is asked of both twins, and the
answers must be equal; last, `demo --address` runs against the restarted one. Comparing
answers, not the scheduler's state, is the point: the state was equal before, and
`GetStatus` still failed after a restart because a replayed trainer report came back with a
float step.

What may differ between twins is only what names a process: a front-end's id and Ray
node id, and the sidecar's address in the CLI's first line.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from rlfeed.client import RolloutWriter
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.testing import synthetic_groups

_spec = importlib.util.spec_from_file_location(
    "serve_process", Path(__file__).with_name("serve_process.py")
)
serve_process = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_process)

TASKS = [f"task-{i}" for i in range(6)]
GROUP_SIZE, PROMPTS_PER_STEP, WORLD_SIZE = 4, 2, 2
CONFIG = f"""
[server]
host = "127.0.0.1"
[batching]
world_size = {WORLD_SIZE}
token_budget = 512
[rollouts]
group_size = {GROUP_SIZE}
prompts_per_step = {PROMPTS_PER_STEP}
vocab_size = 1000
[advantages]
drop_zero_advantage = false
[journal]
sync = "group"
"""


def _stub(channel: grpc.Channel, service: str):
    return getattr(pb_grpc, f"{service}Stub")(channel)


def _drive(address: str, rollouts, rows: range, *, sample: int) -> None:
    """The calls a run makes, in one deterministic order: tasks, sampling, ingest through
    the real writer (stream), one unary batch."""
    with RolloutWriter(address) as writer:
        writer.register_tasks(TASKS)
        writer.sample_tasks(sample)
    with grpc.insecure_channel(address) as channel:
        ingest = _stub(channel, "RolloutIngest")
        stream = iter([pb.RolloutBatch(arrow_ipc=rollouts.encode(list(rows)[:-4]))])
        for ack in ingest.SubmitRollouts(stream, timeout=30):
            assert ack.accepted == len(rows) - 4
        ack = ingest.SubmitRolloutBatch(
            pb.RolloutBatch(arrow_ipc=rollouts.encode(list(rows)[-4:])), timeout=30
        )
        assert ack.accepted == 4


def _train(address: str, steps: range) -> None:
    """Both ranks fetch, acknowledge and report each step, as BatchLoader does."""
    with grpc.insecure_channel(address) as channel:
        serving = _stub(channel, "BatchServing")
        for step in steps:
            for rank in range(WORLD_SIZE):
                if step == steps.start:
                    serving.AckSteps(pb.AckStepsRequest(rank=rank), timeout=10)
                serving.GetBatch(pb.GetBatchRequest(step=step, rank=rank, timeout_ms=10_000))
                serving.AckSteps(pb.AckStepsRequest(rank=rank, through_step=step), timeout=10)
                report = pb.TrainerReport(
                    step=step, rank=rank, loss=0.25 * step, tokens_per_second=1e4, step_seconds=1
                )
                if step % 2 == 0:  # an optional field both set and unset
                    report.ratio_outlier_share = 0.01
                serving.ReportTrainerMetrics(report, timeout=10)


def _status_plain(status: pb.StatusResponse) -> pb.StatusResponse:
    """The status without what names a process (front-end ids, Ray node ids)."""
    status = pb.StatusResponse.FromString(status.SerializeToString())
    for front_end in status.front_end_list:
        front_end.id = front_end.node_id = front_end.address = ""
        front_end.last_seen_seconds = 0.0
    return status


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfeed", *args], capture_output=True, text=True, timeout=240
    )


def _answers(address: str, rollouts, tmp_path: Path, *, next_rows: range) -> dict:
    """Every RPC's answer and every read-only CLI command's output at `address`. Calls that
    change state (sampling, new rollouts, a report) are asked identically of both twins."""
    answers: dict = {}
    with grpc.insecure_channel(address) as channel:
        status = _stub(channel, "SidecarStatus").GetStatus(pb.GetStatusRequest(), timeout=10)
        answers["GetStatus"] = _status_plain(status)
        serving = _stub(channel, "BatchServing")
        for step in range(status.next_step):
            for rank in range(WORLD_SIZE):
                request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=0)
                answers[f"GetBatch {step}/{rank}"] = serving.GetBatch(request, timeout=10)
        for rank in range(WORLD_SIZE):
            answers[f"AckSteps {rank}"] = serving.AckSteps(pb.AckStepsRequest(rank=rank))
        tasks = _stub(channel, "TaskSampling")
        answers["RegisterTasks"] = tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=TASKS))
        answers["SampleTasks"] = tasks.SampleTasks(pb.SampleTasksRequest(n=3))
        ingest = _stub(channel, "RolloutIngest")
        resent = pb.RolloutBatch(arrow_ipc=rollouts.encode([0, 1, 2]))
        answers["SubmitRolloutBatch resent"] = ingest.SubmitRolloutBatch(resent, timeout=30)
        fresh = pb.RolloutBatch(arrow_ipc=rollouts.encode(list(next_rows)))
        answers["SubmitRollouts new"] = list(ingest.SubmitRollouts(iter([fresh]), timeout=30))
        # Assembly runs after the acknowledgement: wait for the step the new groups make.
        waited = pb.GetBatchRequest(step=status.next_step, rank=1, timeout_ms=30_000)
        answers["GetBatch new step"] = serving.GetBatch(waited, timeout=40)
        report = pb.TrainerReport(step=status.next_step, rank=0, loss=1.5, step_seconds=2)
        answers["ReportTrainerMetrics"] = serving.ReportTrainerMetrics(report, timeout=10)
        answers["GetStatus after"] = _status_plain(
            _stub(channel, "SidecarStatus").GetStatus(pb.GetStatusRequest(), timeout=10)
        )
    text = _cli("status", "--address", address)
    assert text.returncode == 0, text.stderr
    node = re.compile(r" node [0-9a-f]{12}$")
    answers["rlfeed status"] = [
        node.sub(" node NODE", line.replace(address, "ADDRESS"))
        for line in text.stdout.splitlines()
    ]
    plain = _cli("status", "--address", address, "--json")
    assert plain.returncode == 0, plain.stderr
    as_json = json.loads(plain.stdout)
    assert as_json.pop("address") == address
    for front_end in as_json.pop("front_end_list"):
        assert front_end["state"] == "serving"
    answers["rlfeed status --json"] = as_json
    assert answers["rlfeed status"][0].endswith(": SERVING (rlfeed 0.1.0)")
    picture = tmp_path / f"layout-{address.rsplit(':', 1)[1]}.png"
    drawn = _cli("layout", "--address", address, "--step", "1", "-o", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    answers["rlfeed layout --step 1"] = drawn.stdout.replace(str(picture), "FILE")
    return answers


def _assert_same(restarted: dict, reference: dict, when: str) -> None:
    assert restarted.keys() == reference.keys()
    for name, answer in reference.items():
        if restarted[name] != answer:
            diff = difflib.unified_diff(str(answer).splitlines(), str(restarted[name]).splitlines())
            raise AssertionError(f"{when}: {name} answered differently:\n" + "\n".join(diff))


@pytest.mark.timeout(600)
def test_a_restarted_sidecar_answers_every_rpc_and_command_as_one_that_never_stopped(
    tmp_path: Path,
) -> None:
    rollouts = synthetic_groups(
        num_groups=12, group_size=GROUP_SIZE, rng=np.random.default_rng(7), tasks=TASKS
    )
    twins = [
        serve_process.ServeProcess(tmp_path / name, config=CONFIG) for name in ("kept", "restarted")
    ]
    kept, restarted = twins
    try:
        for twin in twins:
            twin.start()
            _drive(twin.address, rollouts, range(0, 26), sample=4)  # 3 steps and a half group
            _train(twin.address, range(0, 2))
        rounds = (("SIGTERM", range(26, 32), [1, 1]), ("SIGKILL", range(32, 40), [3, 1]))
        for stop, rows, reported_steps in rounds:
            if stop == "SIGTERM":
                assert restarted.terminate() == 0  # `rlfeed serve`'s normal stop
            else:
                restarted.kill()
            restarted.start()
            reference = _answers(kept.address, rollouts, tmp_path, next_rows=rows)
            again = _answers(restarted.address, rollouts, tmp_path, next_rows=rows)
            _assert_same(again, reference, f"after a {stop} restart")
            reports = again["GetStatus"].last_reports
            assert [r.step for r in reports] == reported_steps  # replayed reports, typed
            assert not reports[1].HasField("ratio_outlier_share")  # step 1 left it unset
        # The demo's fleet against the restarted sidecar, whose pool holds tasks of ours.
        demo = _cli("demo", "--address", restarted.address, "--steps", "1")
        assert demo.returncode == 0, demo.stderr[-2000:]
        assert "rollouts trained" in demo.stdout
    finally:
        for twin in twins:
            twin.stop()
