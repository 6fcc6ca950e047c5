"""The layout picture: faithful to the served step, and a real, non-blank PNG."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.sched.assembly import (
    StepConfig,
    StepRollouts,
    TokenColumns,
    assemble_step,
    materialize_microbatch,
)
from rlfeed.service.demo.fleet import FleetConfig, SyntheticTasks
from rlfeed.service.metrics.layout_plot import (
    COLORS,
    OTHER,
    PADDING,
    POLICY,
    StepLayout,
    figure_size_px,
    layout_from_lengths,
    layout_from_microbatches,
    layout_from_plan,
    render_layout,
)


def demo_step(groups: int = 8, seed: int = 0):
    """One step of the demo's synthetic fleet: `groups` groups of long-tailed episodes."""
    tasks = SyntheticTasks(FleetConfig(seed=seed))
    rng = np.random.default_rng(seed)
    episodes, group_ids = [], []
    for g, task_id in enumerate(tasks.task_ids[:groups]):
        group = tasks.roll_group(task_id, rng)
        episodes += group
        group_ids += [g] * len(group)
    lengths = np.array([e.token_ids.size for e in episodes], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    mask = np.concatenate([e.action_mask for e in episodes])
    columns = TokenColumns(
        offsets,
        np.concatenate([e.token_ids for e in episodes]),
        mask,
        np.where(mask > 0, -0.5, 0.0).astype(np.float32),
    )
    rollouts = StepRollouts(
        lengths=lengths,
        policy_tokens=np.add.reduceat(mask.astype(np.int64), offsets[:-1]),
        rewards=np.array([e.reward for e in episodes]),
        group_ids=np.array(group_ids),
    )
    return rollouts, columns


def served(plan, columns):
    return [
        [materialize_microbatch(columns, plan.microbatches[m], plan.advantages) for m in rank]
        for rank in plan.ranks
    ]


def test_served_loss_masks_give_back_each_sequences_own_policy_tokens():
    rollouts, columns = demo_step()
    plan = assemble_step(rollouts, StepConfig(token_budget=4096, world_size=2))
    ranks = served(plan, columns)
    layout = layout_from_microbatches(
        [[(mb.cu_seqlens, mb.loss_mask) for mb in rank] for rank in ranks], token_budget=4096
    )
    in_row_order = np.concatenate([mb.rollout_index for rank in ranks for mb in rank])
    expected = np.concatenate(
        [columns.action_mask[columns.offsets[i] : columns.offsets[i + 1]] for i in in_row_order]
    )
    np.testing.assert_array_equal(layout.action_mask, expected)
    np.testing.assert_array_equal(layout.lengths, rollouts.lengths[in_row_order])
    assert layout.padded_positions == plan.padded_positions
    assert layout.real_tokens == plan.real_tokens
    assert [int(r) for r in layout.row_ranks] == [
        rank for rank, mbs in enumerate(plan.ranks) for _ in mbs
    ]


def test_layout_from_plan_keeps_the_plans_rows_and_ranks():
    rollouts, columns = demo_step(groups=6, seed=1)
    plan = assemble_step(
        rollouts, StepConfig(token_budget=3000, world_size=3, drop_zero_advantage=True)
    )
    layout = layout_from_plan(
        plan,
        rollouts.lengths,
        token_budget=3000,
        offsets=columns.offsets,
        action_mask=columns.action_mask,
    )
    rows = [plan.kept[r] for r in layout.rows]
    assert [list(r) for r in rows] == [
        list(plan.microbatches[m]) for rank in plan.ranks for m in rank
    ]
    assert int(layout.action_mask.sum()) == plan.policy_token_count
    assert layout.padded_positions == plan.padded_positions


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80),
    world_size=st.integers(1, 4),
)
def test_layout_from_lengths_places_every_sequence_once_within_the_budget(lengths, world_size):
    layout = layout_from_lengths(lengths, token_budget=300, world_size=world_size)
    placed = np.sort(np.concatenate(layout.rows))
    np.testing.assert_array_equal(placed, np.arange(len(lengths)))
    assert all(int(layout.lengths[r].sum()) <= 300 for r in layout.rows)
    per_rank = np.bincount(layout.row_ranks, minlength=world_size)
    assert len(set(per_rank.tolist())) == 1


def test_step_layout_rejects_rows_that_lose_a_sequence_or_overflow_the_budget():
    with pytest.raises(ValueError, match="every sequence exactly once"):
        StepLayout(
            lengths=np.array([3, 4]),
            action_mask=None,
            rows=[np.array([0])],
            row_ranks=np.array([0]),
            token_budget=10,
        )
    with pytest.raises(ValueError, match="more than token_budget 5"):
        StepLayout(
            lengths=np.array([3, 4]),
            action_mask=None,
            rows=[np.array([0, 1])],
            row_ranks=np.array([0]),
            token_budget=5,
        )
    with pytest.raises(ValueError, match=r"action_masks\[1\] has 1 entries, not 2"):
        layout_from_lengths([2, 2], token_budget=8, action_masks=[[0, 1], [0]])


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))


def test_demo_step_picture_has_the_right_size_and_shows_all_three_token_kinds():
    image_module = pytest.importorskip("matplotlib.image")
    rollouts, columns = demo_step(groups=8)
    plan = assemble_step(rollouts, StepConfig(token_budget=4096, world_size=2))
    ranks = served(plan, columns)
    layout = layout_from_microbatches(
        [[(mb.cu_seqlens, mb.loss_mask) for mb in rank] for rank in ranks],
        token_budget=4096,
        step=12,
    )
    png = render_layout(layout)
    pixels = image_module.imread(io.BytesIO(png), format="png")
    width, height = figure_size_px(layout)
    assert pixels.shape[:2] == (height, width)
    rgb_pixels = np.round(pixels[..., :3] * 255).astype(np.int64)
    packed = rgb_pixels[..., 0] << 16 | rgb_pixels[..., 1] << 8 | rgb_pixels[..., 2]
    colours, counts = np.unique(packed, return_counts=True)
    assert colours.size > 20
    present = dict(zip(colours.tolist(), counts.tolist(), strict=True))
    for kind in (POLICY, OTHER, PADDING):
        r, g, b = rgb(COLORS[kind])
        assert present.get(r << 16 | g << 8 | b, 0) > 1000, f"too little {COLORS[kind]}"
    assert rgb_pixels.std() > 30


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_layout_command_draws_the_example_and_a_lengths_file_offline(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from rlfeed.service.cli import main

    assert main(["layout", "--synthetic-step", "-o", str(tmp_path / "example.png")]) == 0
    assert png_size(tmp_path / "example.png")[0] == 1600
    assert "64 sequences" in capsys.readouterr().out
    spec = {"lengths": [5, 3, 8], "action_masks": [[0, 1, 1, 0, 1], [0, 0, 1], [0] * 8]}
    (tmp_path / "lengths.json").write_text(json.dumps(spec))
    assert main(["layout", "--lengths", str(tmp_path / "lengths.json"), "--budget", "8",
                 "--world-size", "1", "-o", str(tmp_path / "json.png")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "3 sequences, 16 tokens; padded 24 positions (33% padding)" in out
    (tmp_path / "lengths.txt").write_text("# lengths\n40\n12\n")
    code = main(["layout", "--lengths", str(tmp_path / "lengths.txt"), "--budget", "20",
                 "-o", str(tmp_path / "x.png")])  # fmt: skip
    assert code == 2
    assert "lengths[0] = 40 is longer than --budget 20" in capsys.readouterr().err
    code = main(["layout", "--synthetic-step", "--step", "3", "-o", str(tmp_path / "y.png")])
    assert code == 2


def test_layout_command_draws_a_served_step_of_a_running_sidecar(make_sidecar, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.proto import rlfeed_pb2 as pb
    from rlfeed.service.cli import main
    from rlfeed.service.testing import synthetic_groups

    sidecar = make_sidecar(
        rollouts={"prompts_per_step": 2, "group_size": 4},
        batching={"world_size": 2, "token_budget": 256},
    )
    rollouts = synthetic_groups(num_groups=4, group_size=4, rng=np.random.default_rng(0))
    transport = GrpcTransport(sidecar.address)
    try:
        transport.register_tasks(sorted(set(rollouts.task_ids)))
        transport.submit(pb.RolloutBatch(arrow_ipc=rollouts.encode()))
        for rank in range(2):  # the trainers take step 0; step 1 waits for them
            assert transport.get_batch(0, rank, 10.0).ready
    finally:
        transport.close()
    output = tmp_path / "served.png"
    assert main(["layout", "--address", sidecar.address, "-o", str(output)]) == 0
    assert "step 0, 8 sequences" in capsys.readouterr().out
    assert png_size(output)[0] == 1600
    assert main(["layout", "--address", sidecar.address, "--step", "1", "-o", str(output)]) == 1
    assert "still waiting for ranks [0, 1]" in capsys.readouterr().err
    code = main(["layout", "--address", sidecar.address, "--step", "1", "--force", "-o",
                 str(output)])  # fmt: skip
    assert code == 0
