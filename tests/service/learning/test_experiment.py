"""The curriculum experiment: its table against hand-computed figures, its outputs, and (slow)
one seed per arm through the real service."""

from __future__ import annotations

import json
import math

import pytest
from rlfeed.service.learning.experiment import (
    ARMS,
    MIN_SAVING,
    UNFILTERED,
    ExperimentConfig,
    RunResult,
    results_json,
    run_experiment,
    summarize,
    table_markdown,
)
from rlfeed.service.learning.experiment_figure import draw, held_out_curve


def _run(arm: str, seed: int, episodes: list[int], final: float, zero: int = 0) -> RunResult:
    steps = len(episodes)
    return RunResult(
        arm=arm,
        seed=seed,
        episodes_per_step=episodes,
        zero_advantage_groups=[zero] * steps,
        groups=[n // 8 for n in episodes],
        held_out={0: 0.4, steps // 2: 0.45, steps: final},
        train_pass_rate={0: 0.3, steps // 2: 0.6, steps: 0.9},
        episodes_sampled_all=sum(episodes) + 64,
    )


def test_the_table_compares_each_arm_with_the_unfiltered_one_seed_by_seed() -> None:
    results = [
        _run(UNFILTERED, 0, [64] * 4, final=0.70, zero=4),
        _run(UNFILTERED, 1, [64] * 4, final=0.80, zero=6),
        _run("filtered", 0, [64, 64, 8, 8], final=0.68, zero=1),
        _run("filtered", 1, [64, 32, 8, 8], final=0.70, zero=1),
    ]
    base, filtered = summarize(results)
    assert (base.arm, base.episodes, base.saving, base.keeps_shape) == (UNFILTERED, 256, 0, None)
    assert base.held_out == pytest.approx(0.75) and base.held_out_std == pytest.approx(0.0707, 1e-3)
    assert filtered.episodes == 128 and filtered.episodes_std == pytest.approx(22.627, 1e-4)
    assert filtered.saving == pytest.approx(0.5)
    # Paired by seed: (0.68 - 0.70 + 0.70 - 0.80) / 2.
    assert filtered.held_out_delta == pytest.approx(-0.06)
    # 6 of 8 groups per step were zero-advantage in the unfiltered arm at seed 1, ...
    assert base.zero_share_last == pytest.approx((4 / 8 + 6 / 8) / 2)
    # ... 1 of (8, 8, 1, 1) or (8, 4, 1, 1) in the filtered one.
    assert filtered.zero_share_last == pytest.approx((4 / 18 + 4 / 14) / 2)
    # Saves >= 35% and loses less than one seed's std (0.0707) of the unfiltered arm.
    assert filtered.keeps_shape is True


def test_an_arm_that_loses_more_than_a_seed_std_or_saves_too_little_breaks_the_shape() -> None:
    base = [_run(UNFILTERED, s, [64] * 4, final=f) for s, f in ((0, 0.70), (1, 0.72))]
    losing = [_run("losing", s, [64, 8, 8, 8], final=f) for s, f in ((0, 0.60), (1, 0.62))]
    thrifty = [_run("thrifty", s, [64, 64, 64, 32], final=0.71) for s in (0, 1)]
    rows = {row.arm: row for row in summarize(base + losing + thrifty)}
    assert rows["losing"].saving >= MIN_SAVING and rows["losing"].keeps_shape is False
    assert rows["thrifty"].saving < MIN_SAVING and rows["thrifty"].keeps_shape is False
    with pytest.raises(ValueError, match="unfiltered"):
        summarize(losing)


def test_outputs_are_strict_json_a_markdown_table_and_a_picture(tmp_path) -> None:
    results = [_run(UNFILTERED, 0, [64] * 6, 0.7), _run("filtered", 0, [64, 64, 8, 8, 8, 8], 0.7)]
    rows = summarize(results)
    document = json.loads(json.dumps(results_json(ExperimentConfig(), results, rows)))
    assert [run["episodes"] for run in document["runs"]] == [384, 160]
    assert document["runs"][1]["held_out"] == {"0": 0.4, "3": 0.45, "6": 0.7}
    table = table_markdown(rows)
    assert table.count("\n") == 3 and "| filtered | 1 | 160 ± 0 | 58.3% |" in table
    # The evaluation after 3 steps sits at those steps' episodes: 64 + 64 + 8.
    assert held_out_curve(results[1]) == ([0, 136, 160], [0.4, 0.45, 0.7])
    picture = draw(results, tmp_path / "curriculum.png", "test")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_seed_per_arm_through_the_real_service() -> None:
    config = ExperimentConfig(seeds=(0,), steps=60)
    results = run_experiment(config, ARMS)
    by_arm = {result.arm: result for result in results}
    # Every task passes the unfiltered arm's filter: every step is a full round.
    assert by_arm[UNFILTERED].episodes_per_step == [64] * 60
    # Soft sampling changes which tasks, never how many.
    assert by_arm["soft p(1-p)"].episodes == 60 * 64
    for result in results:
        assert len(result.episodes_per_step) == 60 and min(result.episodes_per_step) >= 8
        assert sorted(result.held_out) == list(range(0, 61, 5))
        assert result.max_abs_logprob_diff_step0 is not None
        assert result.max_abs_logprob_diff_step0 < 1e-4  # sampler and trainer agree at step 0
        assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in result.held_out.values())
    for arm in ("last-group (0, 1)", "EMA 0.5 (0.1, 0.9)"):
        assert by_arm[arm].episodes < by_arm[UNFILTERED].episodes  # the filter saved some
    json.dumps(results_json(config, results, summarize(results)), allow_nan=False)
