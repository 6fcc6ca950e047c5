"""`rlfeed demo` as a user runs it: a real subprocess, real Ray, gRPC and trainer processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SUMMARY_KEYS = (
    "steps",
    "tokens",
    "padding share",
    "zero-advantage share",
    "rollouts saved by the filter",
    "step-0 ratio outlier share",
    "predicted GPU-hours per step",
)


def run_demo(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfeed.service.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, RAY_DEDUP_LOGS="0"),
    )


def summary_of(stdout: str) -> dict[str, str]:
    assert "\nsummary\n" in stdout, stdout
    block = stdout.split("\nsummary\n", 1)[1]
    return dict(
        re.match(r"\s+(\S.*?)\s{2,}(\S.*)", line).groups() for line in block.splitlines() if line
    )


def test_demo_trains_two_steps_and_prints_the_summary():
    result = run_demo("--steps", "2")
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
