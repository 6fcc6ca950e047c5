"""`rlfeed demo` as a user runs it: a real subprocess, real Ray, gRPC, producer and trainer
processes; by default a Hugging Face policy learns, `--synthetic` runs the synthetic fleet."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rlfeed.service.demo.learn import LEARNING_OVERRIDES

SUMMARY_KEYS = (
    "steps",
    "tokens",
    "padding share",
    "zero-advantage share",
    "rollouts saved by the filter",
    "step-0 ratio outlier share",
    "predicted GPU-hours per step",
)


LEARNING_KEYS = ("held-out pass rate", "step-0 ratio check", "time per step", "wall time")
ROLLOUTS = LEARNING_OVERRIDES["rollouts"]
STEP_ROLLOUTS = ROLLOUTS["prompts_per_step"] * ROLLOUTS["group_size"]
STEP_FIGURES = (
    "step",
    "rollouts_trained",
    "mean_reward",
    "held_out_pass_rate",
    "zero_advantage_share",
    "episodes_sampled",
)


def run_demo(*args: str, timeout: float = 180, cache: Path | None = None):
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    if cache is not None:  # the warm-started policy's cache, not the user's
        env["RLFEED_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "rlfeed.service.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def strict_json(path: Path):
    def refuse(name):
        raise ValueError(f"{path} holds {name}, not strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def summary_of(stdout: str) -> dict[str, str]:
    assert "\nsummary\n" in stdout, stdout
    block = stdout.split("\nsummary\n", 1)[1]
    return dict(
        re.match(r"\s+(\S.*?)\s{2,}(\S.*)", line).groups() for line in block.splitlines() if line
    )


def test_demo_trains_the_policy_and_prints_what_it_learned(tmp_path):
    summary_json = tmp_path / "summary.json"
    result = run_demo("--steps", "5", "--summary-json", str(summary_json), cache=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    step_lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["0", "1", "2", "3", "4"]
    assert all(" reward " in line for line in step_lines)
    assert "held-out pass rate" in step_lines[-1]  # evaluated every 5 steps and at the end
    summary = summary_of(result.stdout)
    for key in (*SUMMARY_KEYS, *LEARNING_KEYS):
        assert key in summary, f"summary lacks {key!r}: {summary}"
    assert summary["steps"] == "5"
    assert float(summary["step-0 ratio outlier share"]) == 0.0
    before, after = re.findall(r"(\d\.\d+) \(add", summary["held-out pass rate"])
    assert 0.1 < float(before) < 0.9  # mixed groups at the start: neither chance nor solved
    assert re.match(
        r"max \|trainer - sampler log-prob\| \d\.\d+e-0[5-9]", summary["step-0 ratio check"]
    )
    document = strict_json(summary_json)
    assert document["summary"] == summary
    assert [f["step"] for f in document["steps"]] == [0, 1, 2, 3, 4]
    for figures in document["steps"]:
        assert set(STEP_FIGURES) <= set(figures)
        assert figures["rollouts_trained"] == STEP_ROLLOUTS and 0 <= figures["mean_reward"] <= 1
    assert document["steps"][-1]["held_out_pass_rate"] == pytest.approx(float(after), abs=1e-3)
    assert document["steps"][0]["held_out_pass_rate"] is None  # not evaluated: null, not NaN
    assert document["held_out_pass_rate"]["before"]["all"] == pytest.approx(float(before), abs=1e-3)


def test_demo_synthetic_fleet_trains_two_steps_and_prints_the_summary(tmp_path):
    summary_json = tmp_path / "summary.json"
    result = run_demo("--synthetic", "--steps", "2", "--summary-json", str(summary_json))
    assert result.returncode == 0, result.stdout + result.stderr
    step_lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["0", "1"]  # one progress line per step
    summary = summary_of(result.stdout)
    for key in SUMMARY_KEYS:
        assert key in summary, f"summary lacks {key!r}: {summary}"
    assert summary["steps"] == "2"
    # Correct packing: before any update the trainer reproduces the sampler's log-probs.
    assert float(summary["step-0 ratio outlier share"]) == 0.0
    assert summary["padding share"].startswith("0.0% packed")
    assert "held-out pass rate" not in summary  # nothing learns
    document = strict_json(summary_json)
    assert [f["step"] for f in document["steps"]] == [0, 1]
    assert document["steps"][0]["mean_reward"] is None


@pytest.mark.slow
def test_demo_drives_a_running_sidecar(make_sidecar):
    sidecar = make_sidecar(
        batching={"token_budget": 2048, "world_size": 2},
        rollouts={"prompts_per_step": 4, "group_size": 4, "vocab_size": 512},
    )
    result = run_demo("--address", sidecar.address, "--steps", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary_of(result.stdout)["steps"] == "1"
    assert "starting the sidecar" not in result.stdout
