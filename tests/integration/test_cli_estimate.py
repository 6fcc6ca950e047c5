"""`rlfeed estimate`, run as a subprocess: the chapter's Section 14.6 figures and the errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rlfeed.sched.compute import model_attention_weight
from rlfeed.sched.throughput import GPUS, MODELS, EpisodeShape, param_count, step_gpu_hours

CHAPTER_TOLERANCE = 0.02
QWEN3_8B_ARCH_FLAGS = [
    "--layers=36",
    "--hidden=4096",
    "--heads=32",
    "--kv-heads=8",
    "--head-dim=128",
    "--intermediate=12288",
    "--vocab=151936",
]


def _estimate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfeed", "estimate", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _estimate_json(*flags: str) -> dict:
    done = _estimate("--json", *flags)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_defaults_are_qwen3_8b_on_h200_at_batch_64_and_2k_context():
    result = _estimate_json()
    assert result["model"] == "qwen3-8b" and result["gpu"] == "h200"
    assert result["kv_bytes_per_token"] == 147_456
    assert result["params"] == param_count(MODELS["qwen3-8b"])
    assert (result["decode_batch"], result["decode_context"], result["mfu"]) == (64, 2048, 0.4)
    assert result["decode_tokens_per_s"] == pytest.approx(8600, rel=CHAPTER_TOLERANCE)
    assert result["train_tokens_per_s"] == pytest.approx(8000, rel=CHAPTER_TOLERANCE)
    assert result["attention_weight"] == pytest.approx(model_attention_weight("qwen3-8b"))
    assert "step_gpu_hours" not in result


@pytest.mark.parametrize(
    ("batch", "chapter_tokens_per_s"),
    [(64, 1800), (256, 1935)],
)
def test_long_context_decode_matches_chapter(batch, chapter_tokens_per_s):
    result = _estimate_json(f"--batch={batch}", "--context=16384")
    assert result["decode_tokens_per_s"] == pytest.approx(
        chapter_tokens_per_s, rel=CHAPTER_TOLERANCE
    )


def test_training_outpaces_long_context_decode_4_5x():
    result = _estimate_json("--context=16384")
    assert result["train_tokens_per_s"] / result["decode_tokens_per_s"] == pytest.approx(
        4.5, rel=CHAPTER_TOLERANCE
    )


def test_steps_flag_prints_the_chapter_step_and_run_total():
    result = _estimate_json("--steps=300")
    hours = result["step_gpu_hours"]
    assert round(hours["total"], 1) == 1.6
    assert result["run_gpu_hours"] == pytest.approx(490, rel=CHAPTER_TOLERANCE)
    assert hours["decode"] / hours["total"] == pytest.approx(0.59, abs=0.03)
    assert hours["train"] / hours["total"] == pytest.approx(0.25, abs=0.02)
    assert hours["total"] == pytest.approx(hours["decode"] + hours["train"] + hours["logprob"])
    # the step decodes at the shape's long context, not the 2k of the printed rate
    assert result["step"]["decode_tokens_per_s"] == pytest.approx(1800, rel=CHAPTER_TOLERANCE)


def test_busy_fraction_flag_adds_about_one_gpu_hour_at_a_quarter():
    half = _estimate_json("--busy-fraction=0.5")["step_gpu_hours"]["total"]
    quarter = _estimate_json("--busy-fraction=0.25")["step_gpu_hours"]["total"]
    assert quarter - half == pytest.approx(1.0, abs=0.1)


def test_cli_step_agrees_with_the_library_for_every_shape_flag():
    flags = {
        "--prompts": 32,
        "--group-size": 16,
        "--prompt-tokens": 1000,
        "--policy-tokens": 3000,
        "--tool-tokens": 8000,
        "--busy-fraction": 0.6,
        "--logprob-passes": 1,
        "--batch": 128,
        "--context": 8192,
        "--mfu": 0.35,
    }
    result = _estimate_json(
        "--model=qwen3-32b", "--gpu=h100", *(f"{k}={v}" for k, v in flags.items())
    )
    shape = EpisodeShape(
        prompts_per_step=32,
        group_size=16,
        prompt_tokens=1000,
        policy_tokens=3000,
        tool_tokens=8000,
        busy_fraction=0.6,
        logprob_forward_passes=1,
        decode_batch=128,
        decode_context=8192,
        mfu=0.35,
    )
    cost = step_gpu_hours(MODELS["qwen3-32b"], GPUS["h100"], shape)
    assert result["step_gpu_hours"] == pytest.approx(
        {
            "decode": cost.decode_gpu_hours,
            "train": cost.train_gpu_hours,
            "logprob": cost.logprob_gpu_hours,
            "total": cost.total_gpu_hours,
        }
    )
    assert "run_gpu_hours" not in result


REVIEW_SHAPE = ["--prompts=64", "--group-size=8", "--prompt-tokens=2000", "--policy-tokens=4000",
                "--tool-tokens=2000", "--busy-fraction=0.6"]  # fmt: skip


def test_the_step_decodes_at_the_context_of_the_episode_given_and_says_so():
    """8,000-token episodes are not priced at the chapter's 16,384-token context: the step
    decodes at their mean context, 2,000 + (4,000 + 2,000) / 2, unless --context says."""
    derived = _estimate_json(*REVIEW_SHAPE)
    assert derived["step"]["decode_context"] == 5000 == derived["episode_shape"]["decode_context"]
    assert derived["step"]["decode_context_from"] == "episode"
    shape = EpisodeShape(prompts_per_step=64, group_size=8, prompt_tokens=2000, policy_tokens=4000,
                         tool_tokens=2000, busy_fraction=0.6, decode_context=5000)  # fmt: skip
    library = step_gpu_hours(MODELS["qwen3-8b"], GPUS["h200"], shape)
    assert derived["step_gpu_hours"]["total"] == pytest.approx(library.total_gpu_hours)
    flagged = _estimate_json(*REVIEW_SHAPE, "--context=8000")
    assert (flagged["step"]["decode_context"], flagged["step"]["decode_context_from"]) == (
        8000,
        "flag",
    )
    chapter = _estimate_json("--steps=300")  # no token counts: the chapter's context
    assert (chapter["step"]["decode_context"], chapter["step"]["decode_context_from"]) == (
        16384,
        "default",
    )
    text = _estimate(*REVIEW_SHAPE).stdout
    assert "context 5,000" in text and "context from: prompt + (policy + tool) / 2" in text


def test_custom_architecture_and_gpu_flags_reproduce_the_presets():
    custom = _estimate_json(*QWEN3_8B_ARCH_FLAGS, "--bandwidth=4.8", "--flops=989")
    preset = _estimate_json()
    assert custom["kv_bytes_per_token"] == preset["kv_bytes_per_token"]
    # custom architectures carry no q/k norms: 2 x 128 weights per layer fewer
    assert preset["params"] - custom["params"] == 36 * 2 * 128
    for key in ("decode_tokens_per_s", "train_tokens_per_s"):
        assert custom[key] == pytest.approx(preset[key], rel=1e-5)


def test_text_output_names_every_figure():
    done = _estimate("--steps=300")
    assert done.returncode == 0, done.stderr
    for key in (
        "kv_bytes_per_token",
        "params",
        "decode_tokens_per_s",
        "train_tokens_per_s",
        "attention_weight",
        "step_gpu_hours",
        "run_gpu_hours",
    ):
        assert key in done.stdout
    assert "147,456 B" in done.stdout


@pytest.mark.parametrize(
    ("flags", "expected_in_stderr"),
    [
        (["--model=qwen9"], ["--model", "qwen9", "qwen3-8b", "llama3-70b"]),
        (["--gpu=b200"], ["--gpu", "b200", "h100", "h200", "a100"]),
        (["--model=qwen3-8b", "--layers=36"], ["--model", "--layers"]),
        (["--model=qwen3-8b", "--tied-embeddings"], ["--model", "--tied-embeddings"]),
        (["--layers=36", "--hidden=4096"], ["--heads", "--kv-heads", "--vocab"]),
        (["--gpu=h200", "--bandwidth=4.8"], ["--gpu", "--bandwidth"]),
        (["--bandwidth=4.8"], ["--flops"]),
        (["--mfu=0"], ["--mfu"]),
        (["--batch=0"], ["--batch"]),
        ([*QWEN3_8B_ARCH_FLAGS[:3], "--kv-heads=7", *QWEN3_8B_ARCH_FLAGS[4:]], ["num_kv_heads"]),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, expected_in_stderr):
    done = _estimate("--json", *flags)
    assert done.returncode == 2
    assert done.stdout == ""
    for text in expected_in_stderr:
        assert text in done.stderr
