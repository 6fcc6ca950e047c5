"""The gym: each family's verifier on hand-written right and wrong answers, the episode
layout (tool output is context, mask 0), and splits that are disjoint and reproducible."""

from __future__ import annotations

import numpy as np
import pytest
from rlfeed.service.gym.splits import (
    HELD_OUT_PER_FAMILY,
    MAX_TRAIN_TASKS,
    make_split,
)
from rlfeed.service.gym.tasks import (
    BOS,
    EOS,
    FAMILIES,
    FAMILY_MARKERS,
    SEP,
    TOOL_CALL,
    TOOL_END,
    TOOL_RESULT,
    VOCAB_SIZE,
    assemble,
    content_key,
    make_task,
    solved_episode,
    verify,
)

PICK = make_task("pick", [3, 1, 4, 1, 2], 0, "t")  # digits 3 1 4 1, k = 2 -> 4
ADD = make_task("add", [7, 8], 0, "t")  # (7 + 8) mod 10 = 5
REVERSE = make_task("reverse", [2, 0, 9], 0, "t")  # -> 9 0 2
LOOKUP = make_task("lookup", [3, 5, 6, 7, 8], 0, "t")  # k = 3, tool digits 5 6 7 8 -> 8


def test_prompts_are_what_the_family_says():
    assert PICK.prompt == (BOS, FAMILY_MARKERS["pick"], 3, 1, 4, 1, 2, SEP)
    assert ADD.prompt == (BOS, FAMILY_MARKERS["add"], 7, 8, SEP)
    assert REVERSE.prompt == (BOS, FAMILY_MARKERS["reverse"], 2, 0, 9, SEP)
    assert LOOKUP.prompt == (BOS, FAMILY_MARKERS["lookup"], 3, SEP)
    assert LOOKUP.tool_output == (TOOL_RESULT, 5, 6, 7, 8, TOOL_END)


@pytest.mark.parametrize(
    ("task", "right", "wrong"),
    [
        (PICK, [[4, EOS]], [[[3, EOS]], [[1, EOS]], [[4, 4]], [[4]], [[4, EOS, EOS]]]),
        (ADD, [[5, EOS]], [[[15 % 10 + 1, EOS]], [[1, 5]], [[5, SEP]], [[EOS, 5]]]),
        (REVERSE, [[9, 0, 2, EOS]], [[[2, 0, 9, EOS]], [[9, 0, 2, 9]], [[9, 2, 0, EOS]]]),
        (
            LOOKUP,
            [[TOOL_CALL], [8, EOS]],
            [
                [[8], [8, EOS]],  # answered without calling the tool
                [[TOOL_CALL], [5, EOS]],  # the 0-th digit, not the k-th
                [[TOOL_CALL], [8, 8]],  # no EOS
                [[TOOL_CALL]],  # called, never answered
                [[8, EOS]],  # one turn
            ],
        ),
    ],
    ids=["pick", "add", "reverse", "lookup"],
)
def test_verifier_passes_the_right_answer_only(task, right, wrong):
    assert verify(task, right) == 1.0
    for answer in wrong:
        assert verify(task, answer) == 0.0, answer


def test_tool_output_sits_between_the_turns_with_mask_zero():
    episode = assemble(LOOKUP, [[TOOL_CALL], [8, EOS]])
    tokens = [*LOOKUP.prompt, TOOL_CALL, *LOOKUP.tool_output, 8, EOS]
    mask = [0] * 4 + [1] + [0] * 6 + [1, 1]
    assert episode.token_ids.tolist() == tokens
    assert episode.action_mask.tolist() == mask
    assert episode.token_ids.dtype == np.int32 and episode.action_mask.dtype == np.uint8
    assert episode.reward == 1.0


def test_no_tool_call_ends_the_episode_after_the_first_turn():
    episode = assemble(LOOKUP, [[7], [8, EOS]])  # a second turn the env never asked for
    assert episode.token_ids.tolist() == [*LOOKUP.prompt, 7]
    assert episode.action_mask.tolist() == [0, 0, 0, 0, 1]
    assert episode.reward == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_solved_episodes_pass_and_stay_in_the_vocabulary(family):
    for task in make_split(200).train:
        if task.family == family:
            episode = solved_episode(task)
            assert episode.reward == 1.0
            assert episode.token_ids.max() < VOCAB_SIZE
            assert episode.action_mask[0] == 0
            # Fixed turn lengths per family: a group is a rectangle.
            assert int(episode.action_mask.sum()) == sum(task.turn_lengths)


def test_splits_are_disjoint_by_content():
    split = make_split(MAX_TRAIN_TASKS, seed=3)
    train = {content_key(t) for t in split.train}
    held_out = {content_key(t) for t in split.held_out}
    sft = {content_key(t) for t in split.sft_tasks(2000, seed=0)}
    assert len(train) == MAX_TRAIN_TASKS and len(held_out) == HELD_OUT_PER_FAMILY * 4
    assert not train & held_out and not train & sft and not held_out & sft


def test_the_small_train_split_is_part_of_the_large_one_with_the_same_held_out():
    small, large = make_split(20, seed=1), make_split(200, seed=1)
    assert set(small.train) <= set(large.train)
    assert small.held_out == large.held_out
    assert {t.family for t in small.train} == set(FAMILIES)
    assert sorted(t.family for t in small.train).count("add") == 5


def test_splits_are_deterministic_from_the_seed():
    assert make_split(50, seed=4) == make_split(50, seed=4)
    assert make_split(50, seed=4).sft_tasks(40, 1) == make_split(50, seed=4).sft_tasks(40, 1)
    assert make_split(50, seed=4).train != make_split(50, seed=5).train


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_train"):
        make_split(0)
    with pytest.raises(ValueError, match="num_train"):
        make_split(MAX_TRAIN_TASKS + 1)
    with pytest.raises(ValueError, match="unknown task family 'chess'"):
        make_task("chess", [1], 0, "t")
    with pytest.raises(KeyError, match="train-pick-9999"):
        make_split(20).task("train-pick-9999")
