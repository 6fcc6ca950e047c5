"""The step-0 ratio check: do the trainer's log-probs reproduce the sampler's?

Before any update, the trainer's policy is the sampler's policy, so every policy token's
ratio exp(trainer - sampler) should be 1 up to numerics (bf16, kernel differences). A
packing bug (plain causal mask over a packed row, running position ids) scores tokens
under contexts the sampler never saw and pushes many ratios far from 1 without any error
(chapter 14.7: 5.8% of policy tokens beyond 20% with leaky packing, none with correct
packing). The sampler's log-probs, served with every microbatch, make this a free check on
the first minibatch of a run; a mismatch correction (importance weights, truncation) would
hide the bug, so look before correcting.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ratio_outlier_share"]


def ratio_outlier_share(
    trainer_logprobs: Any, sampler_logprobs: Any, mask: Any, threshold: float = 0.2
) -> float:
    """Share of policy tokens with |exp(trainer - sampler) - 1| > threshold.

    All three inputs share one shape ([T] or [R, L], target-aligned); `mask` selects the
    policy tokens (nonzero = selected). Tensors or arrays; no gradient flows. Returns NaN
    when the mask selects no token (the share of nothing is undefined).
    """
    trainer = torch.as_tensor(trainer_logprobs).detach().double()
    sampler = torch.as_tensor(sampler_logprobs).detach().double().to(trainer.device)
    selected = torch.as_tensor(mask).to(trainer.device) != 0
    if trainer.shape != sampler.shape or trainer.shape != selected.shape:
        raise ValueError(
            f"shapes differ: trainer_logprobs {tuple(trainer.shape)}, sampler_logprobs "
            f"{tuple(sampler.shape)}, mask {tuple(selected.shape)}"
        )
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    count = int(selected.sum())
    if count == 0:
        return float("nan")
    ratio = torch.exp(trainer[selected] - sampler[selected])
    return int(((ratio - 1.0).abs() > threshold).sum()) / count
