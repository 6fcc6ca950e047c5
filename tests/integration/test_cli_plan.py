"""`rlfeed plan`: the planner from the command line, checked against the library it wraps."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from rlfeed.sched.assembly import StepRollouts, assemble_step
from rlfeed.sched.balance import balance_ranks
from rlfeed.sched.budgets import microbatch_positions, token_budget_microbatches
from rlfeed.sched.compute import model_attention_weight, sequence_flops
from rlfeed.sched.models import MODELS
from rlfeed.sched.planning import plan_microbatches
from rlfeed.service.cli import main
from rlfeed.service.cli.plan import DEFAULT_BUDGET, example_path
from rlfeed.service.config import SidecarConfig, with_overrides

LENGTHS = [900, 120, 4000, 35, 35, 2600, 1800, 700, 3999, 64, 4000, 10]


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths of one step\n" + "\n".join(map(str, LENGTHS)) + "\n")
    return path


def test_console_script_prints_one_json_plan_of_the_example():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfeed",
            "plan",
            "--bundled-lengths",
            "--world-size",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    example = [
        int(line) for line in example_path().read_text().splitlines() if not line.startswith("#")
    ]
    assert plan["num_sequences"] == len(example) == 512
    assert plan["token_budget"] == DEFAULT_BUDGET
    members = sorted(i for m in plan["microbatches"] for i in m)
    assert members == list(range(512))
    assert {len(slots) for slots in plan["ranks"]} == {plan["num_microbatches"] // 8}
    assert plan["lower_bound"] == math.ceil(sum(example) / DEFAULT_BUDGET)
    assert plan["largest_microbatch_tokens"] <= DEFAULT_BUDGET


@pytest.mark.parametrize("cost", ["packed", "padded"])
@pytest.mark.parametrize("world_size", ["1", "3"])
def test_json_plan_is_the_library_plan(capsys, lengths_file, cost, world_size):
    code, out, err = run_plan(
        capsys,
        "--lengths",
        str(lengths_file),
        "--budget",
        "5000",
        "--cost",
        cost,
        "--world-size",
        world_size,
        "--attention-weight",
        "0.001",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    library = plan_microbatches(
        LENGTHS,
        5000,
        int(world_size),
        cost=cost,
        attention_weight=0.001,
        compute_weight=model_attention_weight("qwen3-8b"),
    )
    expected = library.assignment
    assert plan["attention_weight"] == 0.001 and plan["attention_weight_from"] == "flag"
    assert plan["microbatches"] == [m.tolist() for m in expected.microbatches]
    assert plan["ranks"] == expected.ranks
    assert plan["num_microbatches"] == len(expected.microbatches)
    assert plan["rank_imbalance"] == pytest.approx(library.tokens.rank_imbalance)
    assert plan["lockstep_efficiency"] == pytest.approx(library.tokens.lockstep_efficiency)
    assert plan["compute_rank_imbalance"] == pytest.approx(library.compute.rank_imbalance)
    assert plan["compute_lockstep_efficiency"] == pytest.approx(library.compute.lockstep_efficiency)
    positions = microbatch_positions(LENGTHS, expected.microbatches, cost)
    assert plan["largest_microbatch_tokens"] == int(positions.max())
    assert plan["lower_bound"] == math.ceil(sum(LENGTHS) / 5000)
    assert plan["padding_share"] == pytest.approx(1 - sum(LENGTHS) / int(positions.sum()))
    assert plan["fill"] == pytest.approx(sum(LENGTHS) / (len(expected.microbatches) * 5000))
    assert isinstance(plan["plan_seconds"], float)


def test_no_spread_plan_keeps_the_plain_budget_bins(capsys, lengths_file):
    code, out, err = run_plan(
        capsys,
        "--lengths",
        str(lengths_file),
        "--budget",
        "8000",
        "--world-size",
        "4",
        "--no-spread",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    microbatches = token_budget_microbatches(LENGTHS, 8000)
    expected = balance_ranks(
        LENGTHS, microbatches, 4, attention_weight=model_attention_weight("qwen3-8b")
    )
    assert plan["spread"] is False
    assert plan["microbatches"] == [m.tolist() for m in expected.microbatches]
    assert plan["ranks"] == expected.ranks


def test_plan_is_what_step_assembly_serves(capsys, lengths_file):
    code, out, err = run_plan(
        capsys, "--lengths", str(lengths_file), "--budget", "8000", "--world-size", "4", "--json"
    )
    assert code == 0, err
    plan = json.loads(out)
    n = len(LENGTHS)
    step = assemble_step(
        StepRollouts(
            lengths=np.asarray(LENGTHS),
            policy_tokens=np.ones(n, dtype=np.int64),
            rewards=np.arange(n, dtype=np.float64),  # no zero-advantage group: all kept
            group_ids=np.zeros(n, dtype=np.int64),
        ),
        # The service's defaults: balanced on [accounting] model's FLOPs, like the CLI's.
        with_overrides(
            SidecarConfig(), batching={"token_budget": 8000, "world_size": 4}
        ).step_config(),
    )
    assert plan["microbatches"] == [m.tolist() for m in step.microbatches]
    assert plan["ranks"] == step.ranks
    assert plan["rank_imbalance"] == pytest.approx(step.rank_imbalance)
    assert plan["compute_lockstep_efficiency"] == pytest.approx(step.compute_lockstep_efficiency)


LLAMA3_8B_FLAGS = (
    "--layers=32", "--hidden=4096", "--heads=32", "--kv-heads=8", "--head-dim=128",
    "--intermediate=14336", "--vocab=128256",
)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "flags"),
    [("qwen3-0.6b", ("--model", "qwen3-0.6b")), ("llama3-8b", LLAMA3_8B_FLAGS)],
)
def test_model_flags_set_the_weight_and_per_rank_flops(capsys, lengths_file, model, flags):
    code, out, err = run_plan(
        capsys, "--lengths", str(lengths_file), "--budget", "8000", "--world-size", "3",
        *flags, "--json",
    )  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    weight = model_attention_weight(model)
    assert plan["attention_weight"] == pytest.approx(weight, rel=1e-12)
    assert plan["attention_weight_from"] == "model"
    expected = plan_microbatches(LENGTHS, 8000, 3, attention_weight=weight).assignment
    assert plan["ranks"] == expected.ranks
    # Each rank's predicted compute is the FLOP count of the sequences it runs.
    flops = sequence_flops(MODELS[model], LENGTHS)
    for slots, predicted in zip(plan["ranks"], plan["rank_compute_flops"], strict=True):
        members = [i for slot in slots for i in plan["microbatches"][slot]]
        assert predicted == pytest.approx(float(flops[members].sum()), rel=1e-9)
    assert plan["rank_tokens"] == [
        sum(LENGTHS[i] for slot in slots for i in plan["microbatches"][slot])
        for slots in plan["ranks"]
    ]


def test_bad_model_flags_exit_2(capsys, lengths_file):
    code, out, err = run_plan(capsys, "--lengths", str(lengths_file), "--model", "qwen9")
    assert code == 2 and out == ""
    assert "argument --model: invalid choice 'qwen9'" in err
    code, _, err = run_plan(capsys, "--lengths", str(lengths_file), "--layers", "4")
    assert code == 2
    assert "a custom architecture needs every architecture flag" in err


def test_stdin_blank_lines_and_comments_are_ignored(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("# header\n\n300\n  200  # a comment\n\n"))
    code, out, _ = run_plan(capsys, "--lengths", "-", "--budget", "500", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["num_sequences"] == 2
    assert plan["microbatches"] == [[0, 1]]


def test_human_table_names_the_figures(capsys, lengths_file):
    code, out, _ = run_plan(capsys, "--lengths", str(lengths_file), "--world-size", "2")
    assert code == 0
    for figure in ("microbatches", "lower bound", "padding share", "rank imbalance"):
        assert figure in out
    assert "in tokens" in out and "in compute" in out
    assert "qwen3-8b's FLOPs" in out
    assert f"budget {DEFAULT_BUDGET:,}" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("100\n\n12x\n", ":3: expected one whole number of tokens, got '12x'"),
        ("100\n0\n", ":2: length must be >= 1, got 0"),
        ("100\n1 2\n", ":2: expected one whole number"),
        ("10\n6000\n", ":2: sequence 1 has length 6000, longer than the token budget 5000"),
    ],
)
def test_bad_input_exits_2_naming_the_line(capsys, tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    code, out, err = run_plan(capsys, "--lengths", str(path), "--budget", "5000")
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_errors_from_the_real_process_have_no_traceback(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("5\nseven\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlfeed", "plan", "--lengths", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "rlfeed plan: error:" in result.stderr and ":2:" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file_exits_2(capsys, tmp_path):
    code, _, err = run_plan(capsys, "--lengths", str(tmp_path / "absent.txt"))
    assert code == 2
    assert "cannot read --lengths" in err


def test_bundled_example_is_the_long_tailed_workload():
    lengths = np.array(
        [int(line) for line in example_path().read_text().splitlines() if not line.startswith("#")]
    )
    assert lengths.size == 512
    assert lengths.min() >= 1 and lengths.max() <= 65_536
    assert 0.8 * 8192 <= np.median(lengths) <= 1.2 * 8192
