"""What other processes import: the producer (inference side), the batch loader and the
torch ops (trainer side).

Names are resolved lazily (PEP 562): `from rlfeed.client import RolloutWriter` on an
inference node does not import torch, and importing the package starts nothing (no
threads, servers or I/O). Type checkers, which do not run `__getattr__`, see the same
names through the `TYPE_CHECKING` imports below (a test keeps the two lists equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # `X as X`: an explicit re-export (PEP 484), since `__all__` is computed.
    from rlfeed.client.arrow_codec import MicrobatchTensors as MicrobatchTensors
    from rlfeed.client.attention import block_causal_mask as block_causal_mask
    from rlfeed.client.attention import concat_rows_cu_seqlens as concat_rows_cu_seqlens
    from rlfeed.client.attention import hf_packed_kwargs as hf_packed_kwargs
    from rlfeed.client.attention import position_ids_from_cu_seqlens as position_ids_from_cu_seqlens
    from rlfeed.client.attention import segment_ids_from_cu_seqlens as segment_ids_from_cu_seqlens
    from rlfeed.client.attention import varlen_inputs as varlen_inputs
    from rlfeed.client.consistency import ratio_outlier_share as ratio_outlier_share
    from rlfeed.client.loader import BatchLoader as BatchLoader
    from rlfeed.client.loader import TrainStep as TrainStep
    from rlfeed.client.logprobs import checkpointed_log_probs as checkpointed_log_probs
    from rlfeed.client.logprobs import chunked_log_probs as chunked_log_probs
    from rlfeed.client.logprobs import full_log_probs as full_log_probs
    from rlfeed.client.loss import LOSS_MODES as LOSS_MODES
    from rlfeed.client.loss import PolicyLossStats as PolicyLossStats
    from rlfeed.client.loss import aggregate_loss as aggregate_loss
    from rlfeed.client.loss import policy_loss as policy_loss
    from rlfeed.client.loss import rank_norm_const as rank_norm_const
    from rlfeed.client.packed_logprobs import PackedLogProbs as PackedLogProbs
    from rlfeed.client.producer import RolloutWriter as RolloutWriter
    from rlfeed.client.transport import AuthenticationError as AuthenticationError
    from rlfeed.client.transport import BufferFullError as BufferFullError
    from rlfeed.client.transport import GrpcTransport as GrpcTransport
    from rlfeed.client.transport import InvalidRequestError as InvalidRequestError
    from rlfeed.client.transport import InvalidRolloutsError as InvalidRolloutsError
    from rlfeed.client.transport import MessageTooLargeError as MessageTooLargeError
    from rlfeed.client.transport import SidecarError as SidecarError
    from rlfeed.client.transport import SidecarUnreachableError as SidecarUnreachableError
    from rlfeed.client.transport import StepReleasedError as StepReleasedError
    from rlfeed.client.transport import TLSHandshakeError as TLSHandshakeError
    from rlfeed.client.transport import Transport as Transport
    from rlfeed.client.transport import WorldSizeMismatchError as WorldSizeMismatchError

# public name -> submodule that defines it. The in-process sidecar for tests is
# `rlfeed.service.inprocess.InProcessTransport`: service code, so not exported here.
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
    "MessageTooLargeError": "transport",
    "GrpcTransport": "transport",
    "InvalidRequestError": "transport",
    "InvalidRolloutsError": "transport",
    "SidecarError": "transport",
    "SidecarUnreachableError": "transport",
    "StepReleasedError": "transport",
    "TLSHandshakeError": "transport",
    "Transport": "transport",
    "WorldSizeMismatchError": "transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlfeed.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlfeed.client.{module}"), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
