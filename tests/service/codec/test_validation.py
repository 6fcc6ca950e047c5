"""Each broken rule of the ingest contract is reported with the rollout id and the field,
whether the front-end's validation or the scheduler (unknown tasks) finds it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.codec.validation import LOGPROB_TOLERANCE, validate_rollout_batch
from rlfeed.service.config import BatchingConfig, RolloutsConfig, SidecarConfig
from rlfeed.service.errors import InvalidBatchError, RejectReason
from rlfeed.service.frontend.ingest import RolloutIngest
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import SyntheticRollouts, synthetic_groups

BUDGET = 256
VOCAB = 1000


def _rollouts(seed: int = 0) -> SyntheticRollouts:
    return synthetic_groups(
        num_groups=3, group_size=3, rng=np.random.default_rng(seed), max_length=100
    )


def _validate(rollouts: SyntheticRollouts, known=("task-0", "task-1", "task-2")) -> None:
    """The sidecar's checks in its order: the front-end's validation, then the scheduler's."""
    arrays = decode_rollout_batch(rollouts.encode())
    validate_rollout_batch(arrays, token_budget=BUDGET, vocab_size=VOCAB)
    config = SidecarConfig(
        batching=BatchingConfig(token_budget=BUDGET), rollouts=RolloutsConfig(vocab_size=VOCAB)
    )
    scheduler = Scheduler(config)
    scheduler.register_tasks(list(known))
    scheduler.ingest_batch(batch_meta(arrays), arrays.columns)


def _set_token(field: str, value):
    def change(r: SyntheticRollouts) -> None:
        array = getattr(r, field)[4].copy()
        array[-1] = value
        getattr(r, field)[4] = array

    return change


def _grow(field: str):
    def change(r: SyntheticRollouts) -> None:
        getattr(r, field)[4] = np.r_[getattr(r, field)[4], 0].astype(getattr(r, field)[4].dtype)

    return change


def _too_long(r: SyntheticRollouts) -> None:
    length = BUDGET + 1
    r.token_ids[4] = np.zeros(length, np.int32)
    r.action_mask[4] = np.r_[0, np.ones(length - 1)].astype(np.uint8)
    r.sampler_logprobs[4] = np.zeros(length, np.float32)


def _first_is_policy(r: SyntheticRollouts) -> None:
    r.action_mask[4] = np.ones_like(r.action_mask[4])


BROKEN = {
    "action_mask longer than token_ids": (_grow("action_mask"), "action_mask"),
    "log-probs longer than token_ids": (_grow("sampler_logprobs"), "sampler_logprobs"),
    "longer than the token budget": (_too_long, "token_ids"),
    "negative policy version": (
        lambda r: r.policy_versions.__setitem__(4, -1),
        "policy_version",
    ),
    "NaN reward": (lambda r: r.rewards.__setitem__(4, float("nan")), "reward"),
    "infinite reward": (lambda r: r.rewards.__setitem__(4, float("inf")), "reward"),
    "NaN log-prob": (_set_token("sampler_logprobs", np.nan), "sampler_logprobs"),
    "-inf log-prob": (_set_token("sampler_logprobs", -np.inf), "sampler_logprobs"),
    "log-prob +3.0": (_set_token("sampler_logprobs", 3.0), "sampler_logprobs"),
    "log-prob just above 0": (_set_token("sampler_logprobs", 1e-5), "sampler_logprobs"),
    "token id = vocab size": (_set_token("token_ids", VOCAB), "token_ids"),
    "negative token id": (_set_token("token_ids", -1), "token_ids"),
    "mask value 2": (_set_token("action_mask", 2), "action_mask"),
    "action_mask[0] == 1": (_first_is_policy, "action_mask"),
    "unknown task": (lambda r: r.task_ids.__setitem__(4, "task-99"), "task_id"),
    "duplicate id in the batch": (lambda r: r.rollout_ids.__setitem__(4, "g0-r0"), "rollout_id"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_rollout_is_named_with_its_field(case: str) -> None:
    rollouts = _rollouts()
    change, field = BROKEN[case]
    change(rollouts)
    with pytest.raises(InvalidBatchError) as error:
        _validate(rollouts)
    assert f"rollout '{rollouts.rollout_ids[4]}': field {field}:" in str(error.value)


def test_a_sequence_exactly_at_the_budget_is_fine() -> None:
    rollouts = _rollouts()
    _too_long(rollouts)
    for name in ("token_ids", "action_mask", "sampler_logprobs"):
        getattr(rollouts, name)[4] = getattr(rollouts, name)[4][:BUDGET]
    _validate(rollouts)


def test_a_positive_log_prob_is_refused_naming_rollout_field_and_token() -> None:
    rollouts = _rollouts()
    logprobs = rollouts.sampler_logprobs[4].copy()
    logprobs[2] = 3.0
    rollouts.sampler_logprobs[4] = logprobs
    with pytest.raises(InvalidBatchError) as error:
        _validate(rollouts)
    assert str(error.value) == (
        f"rollout '{rollouts.rollout_ids[4]}': field sampler_logprobs: 3.0 at token 2 is "
        "above 0; a log-probability is <= 0 (tolerance 1e-06)"
    )
    assert error.value.reason is RejectReason.POSITIVE_LOGPROB


def test_log_probs_of_zero_and_float_rounding_above_it_are_accepted() -> None:
    """A certain token's log-prob is 0, and float32 arithmetic may land a few ulps above."""
    rollouts = _rollouts()
    for row in range(len(rollouts.sampler_logprobs)):
        logprobs = rollouts.sampler_logprobs[row].copy()
        logprobs[-1] = 0.0
        logprobs[0] = np.float32(LOGPROB_TOLERANCE * 0.5)
        rollouts.sampler_logprobs[row] = logprobs
    _validate(rollouts)


def test_the_first_offending_rollout_is_reported() -> None:
    rollouts = _rollouts()
    rollouts.rewards[2] = float("nan")
    rollouts.rewards[6] = float("nan")
    with pytest.raises(InvalidBatchError, match="rollout 'g0-r2': field reward"):
        _validate(rollouts)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_well_formed_batches_pass(seed: int) -> None:
    _validate(_rollouts(seed))


@pytest.mark.parametrize("vocab_size", [0, VOCAB])
def test_a_front_end_warns_at_start_up_when_token_ids_are_unchecked(vocab_size, caplog) -> None:
    """vocab_size 0 (the default: rlfeed cannot know the tokenizer) lets any id >= 0 through;
    each front-end says so once, naming the setting, when its ingest handler is built."""
    config = SidecarConfig(rollouts=RolloutsConfig(vocab_size=vocab_size))
    frontend = SimpleNamespace(config=config, scheduler=SimpleNamespace(ingest=None))
    with caplog.at_level(logging.WARNING, logger="rlfeed.service.frontend.ingest"):
        RolloutIngest(frontend, assembler=None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if vocab_size:
        assert warnings == []
    else:
        (warning,) = warnings
        assert warning.startswith("rlfeed: [rollouts] vocab_size = 0: token ids are only checked")
        assert "set it to the tokenizer's vocabulary size" in warning
