"""What other processes import: the producer (inference side), the batch loader and the
torch ops (trainer side).

Names are resolved lazily (PEP 562): `from rlfeed.client import RolloutWriter` on an
inference node does not import torch, and importing the package starts nothing (no
threads, servers or I/O).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it (a dotted name: a module outside rlfeed.client)
_EXPORTS: dict[str, str] = {
    # trainer-side torch ops
    "block_causal_mask": "attention",
    "concat_rows_cu_seqlens": "attention",
    "hf_packed_kwargs": "attention",
    "position_ids_from_cu_seqlens": "attention",
    "segment_ids_from_cu_seqlens": "attention",
    "varlen_inputs": "attention",
    "ratio_outlier_share": "consistency",
    "checkpointed_log_probs": "logprobs",
    "chunked_log_probs": "logprobs",
    "full_log_probs": "logprobs",
    "PackedLogProbs": "packed_logprobs",
    "LOSS_MODES": "loss",
    "PolicyLossStats": "loss",
    "aggregate_loss": "loss",
    "policy_loss": "loss",
    "rank_norm_const": "loss",
    # transport, producer and loader
    "MicrobatchTensors": "arrow_codec",
    "BatchLoader": "loader",
    "TrainStep": "loader",
    "RolloutWriter": "producer",
    "AuthenticationError": "transport",
    "BufferFullError": "transport",
    "GrpcTransport": "transport",
    "InProcessTransport": "rlfeed.service.inprocess",  # service side; resolved on use only
    "InvalidRolloutsError": "transport",
    "SidecarError": "transport",
    "StepReleasedError": "transport",
    "Transport": "transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlfeed.client' has no attribute {name!r}")
    path = module if "." in module else f"rlfeed.client.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
