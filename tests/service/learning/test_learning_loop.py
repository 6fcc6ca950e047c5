"""A policy learns through the real service: embedded sidecar (gRPC + Ray actor), two
producer processes sampling a Hugging Face Qwen3, two DDP trainer ranks, weights handed
from rank 0 to the producers after every step (what `rlfeed demo` runs by default).

One short run (20 training tasks, fixed seed) is checked for three things: the policy
learns (training reward and the exact training-task pass rate rise over their start),
every accepted rollout is trained exactly once or accounted for by the sidecar, and the
step-0 ratio check holds for real (trainer and sampler log-probs agree to float32).
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("transformers")

from rlfeed.service.demo.learn import LEARNING_OVERRIDES, PRODUCERS, train_policy
from rlfeed.service.learning.processes import Running
from rlfeed.service.learning.run_records import RunRecords
from rlfeed.service.learning.run_spec import RunSpec

STEPS = 16
LOGPROB_TOLERANCE = 1e-5  # float32 rounding of two forwards (KV-cached vs packed)


@pytest.fixture(scope="module")
def run(make_module_sidecar, tmp_path_factory):
    """(run directory, sidecar status after the run, exit code) of one short learning run."""
    sidecar = make_module_sidecar
    run_dir = tmp_path_factory.mktemp("run")
    running = Running()
    try:
        code = train_policy(
            running,
            sidecar.address,
            steps=STEPS,
            seed=0,
            workdir=run_dir,
            sidecar=sidecar,
            config=sidecar.config,
            started=time.monotonic(),
            summary_json=str(run_dir / "summary.json"),
            train_tasks=20,
            cache_dir=tmp_path_factory.mktemp("cache"),
        )
        from rlfeed.client.transport import GrpcTransport

        transport = GrpcTransport(sidecar.address)
        status = transport.status()
        transport.close()
    finally:
        running.stop()
    return run_dir, status, code


@pytest.fixture(scope="module")
def make_module_sidecar(ray_local):
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.server import start_server

    sections = {k: dict(v) for k, v in LEARNING_OVERRIDES.items()}
    sections["server"].update(host="127.0.0.1")
    sections["ray"] = {"actor_name": "rlfeed-scheduler-test-learning"}
    sidecar = start_server(with_overrides(SidecarConfig(), **sections))
    try:
        yield sidecar
    finally:
        sidecar.stop(grace=0.5)


def test_the_run_trains_every_step(run):
    run_dir, _, code = run
    assert code == 0
    records = RunRecords.load(run_dir, PRODUCERS)
    assert [r["step"] for r in records.steps] == list(range(STEPS))
    summary = json.loads((run_dir / "summary.json").read_text())  # strict JSON: no NaN
    assert len(summary["steps"]) == STEPS
    assert summary["summary"]["steps"] == str(STEPS)


def test_the_policy_learns(run):
    run_dir, _, _ = run
    records = RunRecords.load(run_dir, PRODUCERS)
    spec = RunSpec.read(run_dir)
    before = records.evals[spec.start_step]["train"]["all"]
    after = records.evals[spec.end_step]["train"]["all"]
    rewards = [f["mean_reward"] for f in records.all_step_figures()]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"training-task pass rate {before:.3f} -> {after:.3f}; reward {first:.3f} -> {last:.3f}")
    # Exact pass probabilities (no sampling noise) of the 20 training tasks.
    assert after > before + 0.1
    # The rollouts' own rewards, sampled by the producers from the evolving policy.
    assert last > first + 0.05


def test_every_accepted_rollout_is_trained_once_or_accounted_for(run):
    run_dir, status, _ = run
    records = RunRecords.load(run_dir, PRODUCERS)
    trained = [rid for record in records.steps for rid in records.trained_ids(record)]
    assert records.duplicates_trained() == []
    assert len(set(trained)) == len(trained) == sum(r["rollouts"] for r in records.steps)
    written = set(records.rollout_group)
    assert set(trained) <= written
    counters = status.counters
    accepted = sum(a["accepted"] for a in records.acks)
    stale_on_arrival = sum(a["stale"] for a in records.acks)
    assert accepted == counters.rollouts_accepted == len(written) - stale_on_arrival
    # Whatever was accepted and not trained is still in the sidecar: buffered, or in steps
    # assembled beyond the run's last (producers in flight may complete one more).
    in_later_steps = counters.rollouts_trained - len(trained)
    assert counters.steps_assembled >= STEPS and in_later_steps >= 0
    assert accepted == len(trained) + in_later_steps + status.buffered_rollouts + (
        counters.zero_advantage_rollouts_dropped
        + (counters.rollouts_stale - stale_on_arrival)
        + counters.rollouts_expired
    )
    # Paced producers stay within [rollouts] max_policy_lag: nothing went stale.
    assert counters.rollouts_stale == 0


def test_trained_rollouts_were_sampled_by_recent_versions(run):
    run_dir, _, _ = run
    records = RunRecords.load(run_dir, PRODUCERS)
    for record in records.steps:
        versions = {
            records.groups[records.rollout_group[rid]]["policy_version"]
            for rid in records.trained_ids(record)
        }
        assert max(versions) == record["policy_version"]
        assert min(versions) == record["min_policy_version"]
        assert record["trainer_version"] - 4 <= min(versions) <= max(versions)
        assert max(versions) <= record["trainer_version"]


def test_step_zero_trainer_logprobs_reproduce_the_samplers(run):
    run_dir, _, _ = run
    records = RunRecords.load(run_dir, PRODUCERS)
    first = records.steps[0]
    assert first["policy_version"] == first["min_policy_version"] == first["trainer_version"]
    print(f"step-0 max |trainer - sampler log-prob| = {first['max_abs_logprob_diff']:.3e}")
    assert first["max_abs_logprob_diff"] < LOGPROB_TOLERANCE
    assert first["ratio_outlier_share"] == 0.0
    later = [r["max_abs_logprob_diff"] for r in records.steps if r["max_abs_logprob_diff"]]
    assert max(later) < LOGPROB_TOLERANCE  # every step trained on its own version's rollouts
