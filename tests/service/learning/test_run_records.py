"""Per-step figures joined from the processes' logs: rewards by rollout id, the zero-
advantage share, episodes per policy version, and the time split, on hand-written logs."""

from __future__ import annotations

import json

import pytest
from rlfeed.service.learning.run_records import JsonLinesTail, RunRecords
from rlfeed.service.learning.run_spec import STEPS_FILE, producer_log


def group(group_id, version, rewards, start, end):
    return {
        "group_id": group_id,
        "task_id": group_id.split("-", 2)[2],
        "family": "pick",
        "policy_version": version,
        "rewards": rewards,
        "rollout_ids": [f"{group_id}/{k}" for k in range(len(rewards))],
        "tokens": 10 * len(rewards),
        "t_decode_start": start,
        "t_decode_end": end,
    }


def rank(ids, asked, served, trained):
    return {"rollout_ids": ids, "t_asked": asked, "t_served": served, "t_trained": trained}


def write_lines(path, entries, partial=""):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + partial)


@pytest.fixture
def run_dir(tmp_path):
    a, b, c = (
        group("p0-r0-t1", 0, [1, 0], 10.0, 10.5),
        group("p1-r0-t2", 0, [1, 1], 10.0, 11.0),
        (group("p0-r1-t1", 1, [0, 0], 12.0, 12.2)),
    )
    write_lines(
        producer_log(tmp_path, 0),
        [a, {"acked": ["p0-r0-t1"], "t_acked": 10.6, "accepted": 2, "stale": 0, "duplicate": 0}, c],
    )
    write_lines(
        producer_log(tmp_path, 1),
        [b, {"acked": ["p1-r0-t2"], "t_acked": 11.2, "accepted": 2, "stale": 0, "duplicate": 0}],
    )
    step0 = {
        "step": 0,
        "trainer_version": 0,
        "loss": 0.5,
        "max_abs_logprob_diff": 1e-6,
        "ranks": [
            rank(a["rollout_ids"], 9.0, 11.3, 11.8),
            rank(b["rollout_ids"], 9.5, 11.25, 11.7),
        ],
        "eval": {"held_out": {"all": 0.4}, "train": {"all": 0.5}},
    }
    write_lines(tmp_path / STEPS_FILE, [{"version": 0, "eval": {"held_out": {"all": 0.3}}}, step0])
    return tmp_path


def test_step_figures_join_rewards_and_split_the_time(run_dir):
    records = RunRecords.load(run_dir, producers=2)
    (figures,) = records.all_step_figures()
    assert figures["rollouts_trained"] == 4
    assert figures["mean_reward"] == 0.75  # [1, 0] and [1, 1]
    assert figures["zero_advantage_share"] == 0.5  # the all-pass group
    assert figures["episodes_sampled"] == 4  # version 0's groups; version 1's is not step 0's
    assert figures["held_out_pass_rate"] == 0.4 and figures["train_pass_rate"] == 0.5
    assert records.evals[0]["held_out"]["all"] == 0.3
    assert figures["decode_s"] == pytest.approx((0.5 + 1.0) / 2)  # two producers side by side
    # Last group acknowledged at 11.2, both ranks asking since 9.5; last rank served at 11.3.
    assert figures["sidecar_s"] == pytest.approx(0.1)
    assert figures["trainer_s"] == pytest.approx(0.5)
    assert records.sampled_groups() == (3, 2)
    assert records.duplicates_trained() == []


def test_a_rollout_in_two_steps_is_reported(run_dir):
    records = RunRecords.load(run_dir, producers=2)
    again = dict(records.steps[0], step=1, trainer_version=1)
    again["ranks"] = [rank(["p0-r0-t1/1"], 12.0, 12.1, 12.2)]
    with open(run_dir / STEPS_FILE, "a") as handle:
        handle.write(json.dumps(again) + "\n")
    records.update()
    assert records.duplicates_trained() == ["p0-r0-t1/1"]


def test_a_line_still_being_written_is_read_once_it_is_complete(tmp_path):
    path = tmp_path / "log.jsonl"
    write_lines(path, [{"a": 1}], partial='{"b": ')
    tail = JsonLinesTail(path)
    assert tail.read_new() == [{"a": 1}]
    assert tail.read_new() == []
    with open(path, "a") as handle:
        handle.write('2}\n{"c": 3}\n')
    assert tail.read_new() == [{"b": 2}, {"c": 3}]
    assert JsonLinesTail(tmp_path / "missing.jsonl").read_new() == []
