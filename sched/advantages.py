"""Group-relative advantages and the zero-advantage share (chapters 9 and 14.5/14.7).

Every rollout belongs to a group: the G attempts at one prompt. Its advantage is its reward
minus the group's mean reward, optionally divided by a scale:

- ``mean``:     A = r - mean_g                       (plain mean baseline)
- ``mean_std``: A = (r - mean_g) / (std_g + eps)     (GRPO)
- ``constant``: A = (r - mean_g) / scale             ("Dr. GRPO": no per-group std scaling;
  pair it with a constant loss normalizer, see `rlfeed.sched.normalization`)

std_g is the population standard deviation (ddof=0), so a group of one is well defined
(its advantage is 0). A group whose rewards are all equal has zero advantage under every
baseline: such a group costs G full rollouts and contributes no gradient, which is what
the pass-rate curriculum (`rlfeed.sched.curriculum`) avoids sampling. Its advantages are
returned as exact zeros, not as rounding noise divided by eps.

Group ids are arbitrary integers (not necessarily dense or sorted); everything is
vectorized with one `np.unique(return_inverse=True)` and `np.bincount`, no loop per group.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

AdvantageMode = Literal["mean", "mean_std", "constant"]

_MODES = ("mean", "mean_std", "constant")


def _as_rewards_and_groups(rewards: ArrayLike, group_ids: ArrayLike) -> tuple[np.ndarray, ...]:
    """Validated float64 rewards [n] and int64 group ids [n]."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {rewards.shape}")
    if group_ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {group_ids.shape}")
    if rewards.size != group_ids.size:
        raise ValueError(
            f"rewards has {rewards.size} entries but group_ids has {group_ids.size}; "
            "they must have one entry per rollout"
        )
    if group_ids.size and not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        index = int(bad[0])
        raise ValueError(
            f"rewards[{index}] is {rewards[index]!r}; every reward must be finite "
            f"({bad.size} non-finite reward(s))"
        )
    return rewards, group_ids.astype(np.int64, copy=False)


def _group_stats(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """(inverse [n], count [g], mean [g], std [g], constant [g]) per distinct group id.

    `constant[g]` is True when every reward of group g is exactly equal (min == max); it is
    decided on the rewards themselves, not on a rounded variance.
    """
    _, inverse = np.unique(group_ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    num_groups = int(inverse.max()) + 1 if inverse.size else 0
    count = np.bincount(inverse, minlength=num_groups).astype(np.float64)
    mean = np.bincount(inverse, weights=rewards, minlength=num_groups) / np.maximum(count, 1)
    # Two-pass variance: mean first, then squared deviations; stable for large rewards.
    deviation = rewards - mean[inverse]
    variance = np.bincount(inverse, weights=deviation * deviation, minlength=num_groups)
    std = np.sqrt(variance / np.maximum(count, 1))
    order = np.argsort(inverse, kind="stable")
    starts = np.zeros(num_groups, dtype=np.int64)
    np.cumsum(count[:-1].astype(np.int64), out=starts[1:])
    if num_groups:
        sorted_rewards = rewards[order]
        constant = np.minimum.reduceat(sorted_rewards, starts) == np.maximum.reduceat(
            sorted_rewards, starts
        )
    else:
        constant = np.zeros(0, dtype=bool)
    return inverse, count, mean, std, constant


def group_advantages(
    rewards: ArrayLike,
    group_ids: ArrayLike,
    *,
    mode: AdvantageMode = "mean_std",
    scale: float = 1.0,
    eps: float = 1e-6,
) -> np.ndarray:
    """Group-relative advantage of every rollout; float32 [n].

    rewards:   [n] finite floats, one per rollout.
    group_ids: [n] integers; rollouts with the same id form a group (any order, any values).
    mode:      "mean", "mean_std" (divide by group std + eps) or "constant" (divide by
               `scale`); see the module docstring.
    scale:     the constant divisor of mode="constant" (> 0); ignored otherwise.
    eps:       added to the group std in mode="mean_std" (>= 0); ignored otherwise.

    Guarantees: within each group the advantages sum to 0 (up to rounding); a group whose
    rewards are all equal gets exactly 0.0 for every rollout, in every mode.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "constant" and not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0 for mode='constant', got {scale!r}")
    if mode == "mean_std" and not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    rewards, group_ids = _as_rewards_and_groups(rewards, group_ids)
    if rewards.size == 0:
        return np.zeros(0, dtype=np.float32)
    inverse, _, mean, std, constant = _group_stats(rewards, group_ids)
    advantages = rewards - mean[inverse]
    if mode == "mean_std":
        denominator = std + eps
        # A constant group has std 0; with eps = 0 it would be 0/0. It is zeroed below.
        denominator[constant] = 1.0
        advantages /= denominator[inverse]
    elif mode == "constant":
        advantages /= scale
    advantages[constant[inverse]] = 0.0
    return advantages.astype(np.float32)


def zero_advantage_groups(rewards: ArrayLike, group_ids: ArrayLike) -> np.ndarray:
    """bool [n]: True for every rollout whose group's rewards are all equal.

    Such a group (all-pass, all-fail, or any other tie) has zero advantage under every
    baseline, so its rollouts contribute no policy gradient.
    """
    rewards, group_ids = _as_rewards_and_groups(rewards, group_ids)
    if rewards.size == 0:
        return np.zeros(0, dtype=bool)
    inverse, _, _, _, constant = _group_stats(rewards, group_ids)
    return constant[inverse]


def zero_advantage_group_share(rewards: ArrayLike, group_ids: ArrayLike) -> float:
    """Share of GROUPS (not rollouts) whose rewards are all equal; 0.0 for no rollouts."""
    rewards, group_ids = _as_rewards_and_groups(rewards, group_ids)
    if rewards.size == 0:
        return 0.0
    _, _, _, _, constant = _group_stats(rewards, group_ids)
    return float(constant.mean())
