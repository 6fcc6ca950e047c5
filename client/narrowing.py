"""The token columns a producer writes, narrowed to their wire types without wrapping.

`RolloutWriter.write` calls `narrowed_columns` on every rollout: a cast alone would send a
token id of 2**32 + 7 as 7, so each value is checked to survive the narrowing first and a
`ValueError` names the rollout, the field and the first value that does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def narrowed_columns(
    rollout_id: str,
    token_ids: Sequence[int] | np.ndarray,
    action_mask: Sequence[int] | np.ndarray,
    sampler_logprobs: Sequence[float] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three token columns as their wire types (int32, uint8, float32), or a ValueError
    naming the rollout, the field and the first value that does not survive narrowing (a
    cast alone wraps a token id of 2**32 + 7 to 7). Arrays already of the wire type pass
    unchecked and uncopied: the server validates their values."""
    tokens = _narrowed(rollout_id, "token_ids", token_ids, np.int32)
    mask = _narrowed(rollout_id, "action_mask", action_mask, np.uint8)
    logprobs = _narrowed(rollout_id, "sampler_logprobs", sampler_logprobs, np.float32)
    return tokens, mask, logprobs


def _narrowed(rollout_id: str, field: str, values, dtype: type[np.generic]) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == dtype:
        return array
    if array.dtype.kind not in "biuf":
        raise ValueError(f"rollout {rollout_id!r}: field {field}: got {array.dtype}, not numbers")
    floats = array.dtype.kind == "f"
    if dtype is np.float32:
        bad = ~np.isfinite(array) | (np.abs(array) > _FLOAT32_MAX) if floats else None
        rule = "is not a finite float32"
    elif dtype is np.uint8:  # the action mask
        bad = (array != 0) & (array != 1)
        rule = "is not 0 or 1"
    else:
        bad = (array < _INT32_MIN) | (array > _INT32_MAX)
        if floats:
            bad |= ~np.isfinite(array) | (array != np.round(array))
        rule = "is not an int32"
    if bad is not None and bad.any():
        index = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(
            f"rollout {rollout_id!r}: field {field}: {array.ravel()[index].item()} at token "
            f"{index} {rule}"
        )
    return array.astype(dtype)
