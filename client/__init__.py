"""Trainer-side client: torch ops for packed microbatches (and, later, producer and loader).

Importing this package imports torch but starts nothing: no threads, servers or I/O.
"""

from rlfeed.client.attention import (
    block_causal_mask,
    concat_rows_cu_seqlens,
    hf_packed_kwargs,
    position_ids_from_cu_seqlens,
    segment_ids_from_cu_seqlens,
    varlen_inputs,
)
from rlfeed.client.consistency import ratio_outlier_share
from rlfeed.client.logprobs import checkpointed_log_probs, chunked_log_probs, full_log_probs
from rlfeed.client.loss import (
    LOSS_MODES,
    PolicyLossStats,
    aggregate_loss,
    policy_loss,
    rank_norm_const,
)

__all__ = [
    "LOSS_MODES",
    "PolicyLossStats",
    "aggregate_loss",
    "block_causal_mask",
    "checkpointed_log_probs",
    "chunked_log_probs",
    "concat_rows_cu_seqlens",
    "full_log_probs",
    "hf_packed_kwargs",
    "policy_loss",
    "position_ids_from_cu_seqlens",
    "rank_norm_const",
    "ratio_outlier_share",
    "segment_ids_from_cu_seqlens",
    "varlen_inputs",
]
