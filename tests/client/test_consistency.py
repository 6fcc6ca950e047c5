"""The step-0 trainer/sampler ratio check (14.7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rlfeed.client.consistency import ratio_outlier_share


def test_identical_logprobs_have_no_outliers():
    logprobs = torch.randn(100) - 3
    assert ratio_outlier_share(logprobs, logprobs.clone(), torch.ones(100)) == 0.0


def test_share_counts_ratios_beyond_the_threshold_on_both_sides():
    sampler = torch.zeros(8)
    # ratios: 1, 1.1, 1.25, 0.75, 0.85, 2.0, 0.5, 1.19
    trainer = torch.log(torch.tensor([1.0, 1.1, 1.25, 0.75, 0.85, 2.0, 0.5, 1.19]))
    assert ratio_outlier_share(trainer, sampler, torch.ones(8)) == pytest.approx(4 / 8)
    assert ratio_outlier_share(trainer, sampler, torch.ones(8), threshold=0.05) == 7 / 8


def test_only_policy_tokens_count():
    sampler = torch.zeros(2, 3)
    trainer = torch.tensor([[0.0, 5.0, 0.0], [-5.0, 0.0, 0.01]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    assert ratio_outlier_share(trainer, sampler, mask) == 0.0
    assert ratio_outlier_share(trainer, sampler, torch.ones(2, 3)) == pytest.approx(2 / 6)


def test_accepts_numpy_arrays():
    share = ratio_outlier_share(np.array([0.0, 1.0]), np.array([0.0, 0.0]), np.array([1, 1]))
    assert share == 0.5


def test_empty_mask_gives_nan():
    assert math.isnan(ratio_outlier_share(torch.zeros(3), torch.zeros(3), torch.zeros(3)))


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="shapes differ"):
        ratio_outlier_share(torch.zeros(3), torch.zeros(4), torch.ones(3))
