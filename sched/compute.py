"""What a sequence costs the trainer in FLOPs, from the model being trained.

A token costs 2N FLOPs in the linear layers (forward pass, N = `param_count`), whatever
sequence it belongs to. Attention adds, per layer and query head, a score (q·k) and a
weighted value (p·v) for every (query, key) pair the causal mask allows: 2 x 2 x head_dim
FLOPs per pair, so `attention_flops_per_pair` = 4 x layers x heads x head_dim. A sequence of
L tokens has L(L + 1) / 2 causal pairs, so its forward cost is

    flops(L) = 2N L + attention_flops_per_pair x L (L + 1) / 2
             = unit_flops x (L + attention_weight x L^2)

with unit_flops = 2N + attention_flops_per_pair / 2 (a token that attends only to itself)
and attention_weight = (attention_flops_per_pair / 2) / unit_flops. The second line is the
cost `rlfeed.sched.balance` already balances (tokens + attention_weight x sum L^2), so a
plan's cost times `unit_flops` is its exact forward FLOP count. The backward pass costs
about twice the forward in both terms, so the ratio, which is all balancing needs, holds for
training too. Padded rows compute count x max(L) positions and the same formula per row.

Qwen3-0.6B: attention_weight ~ 9.6e-5, so at 8k tokens attention is ~0.8x the linear cost
and at 64k ~6x; Llama-3-70B: ~9.3e-6 (0.08x and 0.6x). verl's fixed 24576·L + L^2 is
1/24576 ~ 4.1e-5 for every model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from rlfeed.sched.models import MODELS, ModelArch, param_count


@dataclass(frozen=True)
class SequenceCost:
    """Forward FLOPs of a sequence as a linear and a causal-attention term."""

    linear_flops_per_token: int
    """2N: every token goes through every weight once."""
    attention_flops_per_pair: int
    """4 x layers x heads x head_dim: q·k and p·v for one causal (query, key) pair."""

    @property
    def unit_flops(self) -> float:
        """FLOPs of one unit of balancing cost: a token attending only to itself."""
        return self.linear_flops_per_token + self.attention_flops_per_pair / 2

    @property
    def attention_weight(self) -> float:
        """Weight of sum(L^2) against tokens, in the units `balance_ranks` uses."""
        return self.attention_flops_per_pair / 2 / self.unit_flops


def sequence_cost(arch: ModelArch) -> SequenceCost:
    """The linear and attention FLOP rates of `arch` (see the module docstring)."""
    return SequenceCost(
        linear_flops_per_token=2 * param_count(arch),
        attention_flops_per_pair=4 * arch.num_layers * arch.num_attention_heads * arch.head_dim,
    )


def model_attention_weight(model: str | ModelArch) -> float:
    """The `attention_weight` that makes balancing cost proportional to `model`'s FLOPs.

    `model` is a preset name from `rlfeed.sched.models.MODELS` or an architecture.
    """
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
        model = MODELS[model]
    return sequence_cost(model).attention_weight


def sequence_flops(arch: ModelArch, lengths: ArrayLike) -> np.ndarray:
    """[n] float64 forward FLOPs of each sequence run alone: 2N L + a L (L + 1) / 2."""
    rates = sequence_cost(arch)
    sizes = np.asarray(lengths, dtype=np.float64)
    pairs = sizes * (sizes + 1) / 2
    return rates.linear_flops_per_token * sizes + rates.attention_flops_per_pair * pairs
