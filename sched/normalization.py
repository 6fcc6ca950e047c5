"""Loss-normalization weights under gradient accumulation and data parallelism (chapter 14.4).

The gradient of a token_mean loss over a batch gives every policy token the weight 1/N,
where N = `policy_token_count` is the number of policy (action-mask) tokens over all
microbatches and all ranks. Splitting the batch changes that unless the normalizer does:

- ``microbatch_token_mean``: each microbatch divides its token sum by its own count n_k and
  the K accumulated microbatches are averaged (divided by K); with data parallelism each
  rank does this and the all-reduce averages over the R ranks. A token's weight becomes
  1 / (R K n_k): `weight_distortion` = N / (R K n_k) times the weight the full-batch loss
  gives it. Length-sorted microbatches, which a token-budget scheduler produces, make n_k
  vary the most, and the short microbatch (short episodes) is up-weighted.
- ``global_token_mean``: every microbatch divides its token sum by the global N (one
  all-reduce of the count before the backward pass). Every token gets exactly 1/N. With a
  mean all-reduce of gradients (DDP/FSDP) each rank must also multiply by R; the weights
  returned here are the effective ones in the final, reduced gradient.

This module computes the weights only, in numpy, so the schedule can be checked and the
distortion reported; the torch loss applies them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

NormalizationMode = Literal["microbatch_token_mean", "global_token_mean"]

_MODES = ("microbatch_token_mean", "global_token_mean")


def policy_token_count(*action_masks: ArrayLike) -> int:
    """N: the number of policy tokens (action mask 1) over all masks given.

    Pass one mask per microbatch (any shape, bool or 0/1 integers), from every rank; the
    count is what the global normalizer divides by. Entries other than 0/1 are an error,
    since a weighted mask here would silently change the loss scale.
    """
    total = 0
    for index, mask in enumerate(action_masks):
        array = np.asarray(mask)
        if array.dtype != bool:
            bad = np.flatnonzero((array != 0) & (array != 1))
            if bad.size:
                raise ValueError(
                    f"action_masks[{index}] has value {array.reshape(-1)[bad[0]]!r} at flat "
                    f"position {int(bad[0])}; an action mask holds only 0 and 1"
                )
        total += int(np.count_nonzero(array))
    return total


def _as_ids(values: ArrayLike, name: str, size: int | None) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if size is not None and array.size != size:
        raise ValueError(f"{name} has {array.size} entries, expected {size} (one per token)")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size and array.min() < 0:
        index = int(np.argmin(array))
        raise ValueError(f"{name}[{index}] is {int(array[index])}; ids must be >= 0")
    return array


def _check_below(ids: np.ndarray, limit: int | None, name: str, limit_name: str) -> None:
    if limit is None:
        return
    if int(limit) != limit or limit < 1:
        raise ValueError(f"{limit_name} must be a whole number >= 1, got {limit!r}")
    if ids.size and ids.max() >= limit:
        index = int(np.argmax(ids))
        raise ValueError(f"{name}[{index}] is {int(ids[index])}, not below {limit_name}={limit}")


def per_token_weights(
    microbatch_of_token: ArrayLike,
    *,
    mode: NormalizationMode,
    rank_of_token: ArrayLike | None = None,
    num_microbatches: int | None = None,
    num_ranks: int | None = None,
) -> np.ndarray:
    """Weight of every policy token in the accumulated, all-reduced gradient; float64 [n].

    microbatch_of_token: [n] ints >= 0, the microbatch of each policy token. Ids are local to
        a rank: microbatch 0 of rank 0 and microbatch 0 of rank 1 are different microbatches.
    mode: "microbatch_token_mean" (weight 1 / (R K_r n_k)) or "global_token_mean" (1 / N).
    rank_of_token: [n] ints >= 0, the data-parallel rank of each token; None = one rank.
    num_microbatches: K, the accumulation steps per rank (the divisor of the microbatch
        loop). None = the number of distinct microbatch ids seen on each rank. Give it when
        a microbatch may hold no policy token: it still counts in K.
    num_ranks: R, the world size the all-reduce averages over. None = distinct ranks seen.

    Guarantees: in global mode every weight is exactly 1/N; in either mode the weights sum
    to 1 when every microbatch on every rank holds at least one policy token.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    microbatch = _as_ids(microbatch_of_token, "microbatch_of_token", None)
    n = microbatch.size
    if rank_of_token is None:
        rank = np.zeros(n, dtype=np.int64)
    else:
        rank = _as_ids(rank_of_token, "rank_of_token", n)
    _check_below(microbatch, num_microbatches, "microbatch_of_token", "num_microbatches")
    _check_below(rank, num_ranks, "rank_of_token", "num_ranks")
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    if mode == "global_token_mean":
        return np.full(n, 1.0 / n)

    # Tokens per (rank, microbatch): one combined key, one unique.
    key = rank * (int(microbatch.max()) + 1) + microbatch
    pair_keys, pair_of_token, tokens_per_pair = np.unique(
        key, return_inverse=True, return_counts=True
    )
    pair_of_token = pair_of_token.reshape(-1)
    ranks, rank_index = np.unique(rank, return_inverse=True)
    rank_index = rank_index.reshape(-1)
    if num_microbatches is None:
        pair_rank = np.searchsorted(ranks, pair_keys // (int(microbatch.max()) + 1))
        microbatches_per_rank = np.bincount(pair_rank, minlength=ranks.size)[rank_index]
    else:
        microbatches_per_rank = np.full(n, num_microbatches, dtype=np.int64)
    world_size = ranks.size if num_ranks is None else num_ranks
    denominator = world_size * microbatches_per_rank * tokens_per_pair[pair_of_token]
    return 1.0 / denominator.astype(np.float64)


def weight_distortion(microbatch_token_counts: ArrayLike) -> np.ndarray:
    """Closed form N / (R K n_k): per-microbatch token_mean weight over the global 1/N.

    microbatch_token_counts: [K] policy-token counts of one rank's microbatches, or
        [R, K] for R data-parallel ranks with K microbatches each.
    Returns an array of the same shape; > 1 means that microbatch's tokens are up-weighted.
    A microbatch with no policy token has no token to distort: its entry is NaN.
    """
    counts = np.asarray(microbatch_token_counts, dtype=np.float64)
    if counts.ndim not in (1, 2) or counts.size == 0:
        raise ValueError(
            f"microbatch_token_counts must be a non-empty [K] or [R, K] array, "
            f"got shape {counts.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(counts.reshape(-1)) | (counts.reshape(-1) < 0))
    if bad.size:
        raise ValueError(
            f"microbatch_token_counts has {counts.reshape(-1)[bad[0]]!r} at flat position "
            f"{int(bad[0])}; counts must be finite and >= 0"
        )
    grid = counts.reshape(1, -1) if counts.ndim == 1 else counts
    num_ranks, num_microbatches = grid.shape
    total = grid.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        distortion = np.where(grid > 0, total / (num_ranks * num_microbatches * grid), np.nan)
    return distortion.reshape(counts.shape)
