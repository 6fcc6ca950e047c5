"""The Arrow schemas of the two bulk payloads in `rlfeed.proto`, defined once.

`rlfeed.proto` documents them for clients in any language; the Python producer, the
server's codec and the batch loader all take them from here so the three cannot drift.
"""

import numpy as np
import pyarrow as pa

ROLLOUT_SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("policy_version", pa.int64()),
        ("reward", pa.float64()),
        ("token_ids", pa.list_(pa.int32())),
        ("action_mask", pa.list_(pa.uint8())),
        ("sampler_logprobs", pa.list_(pa.float32())),
    ]
)
"""`RolloutBatch.arrow_ipc`: one row per rollout; `token_ids` offsets are its cu_seqlens."""

# Bytes of one token across the per-token rollout columns (int32 id + uint8 mask + float32
# log-prob), read off the schema; `sched.assembly.TOKEN_BYTES` must agree (a test checks).
TOKEN_BYTES = sum(
    field.type.value_type.bit_width // 8 for field in ROLLOUT_SCHEMA if pa.types.is_list(field.type)
)

MICROBATCH_SCHEMA = pa.schema(
    [
        ("input_ids", pa.int32()),
        ("position_ids", pa.int32()),
        ("target_ids", pa.int32()),
        ("loss_mask", pa.uint8()),
        ("sampler_logprobs", pa.float32()),
        ("advantages", pa.float32()),
    ]
)
"""`Microbatch.arrow_ipc`: one row per token of a packed row (next-token layout)."""


def numpy_dtype(arrow_type: pa.DataType) -> np.dtype:
    """The numpy dtype of a fixed-width Arrow type. `DataType.to_pandas_dtype()` gives the
    same, but pyarrow before 16 imports pandas for it, which a producer-only install lacks."""
    return pa.array([], arrow_type).to_numpy(zero_copy_only=False).dtype
