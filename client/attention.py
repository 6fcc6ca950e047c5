"""Attention inputs for packed rows: block-diagonal masks, varlen boundaries, HF keywords.

A packed row holds several sequences back to back. It is computed correctly only if every
token attends to earlier tokens of its own sequence and its position id restarts at 0 at
each sequence start (chapter 14.1); a plain causal mask leaks attention across sequences
and running position ids shift every later sequence. Nothing fails loudly either way.

Which path when:

* **Explicit mask (CPU, reference, any SDPA model).** `block_causal_mask` builds the
  block-diagonal causal mask from `segment_ids`. It costs O(L^2) memory per row, so it is
  the reference path and the CPU path, not the long-context GPU path.
* **Variable-length kernels (GPU).** FlashAttention's `flash_attn_varlen_func` takes the
  row flattened to [total_tokens, heads, head_dim] plus `cu_seqlens` and `max_seqlen`
  instead of a mask; `varlen_inputs` returns exactly those keywords. The computation is the
  same as the masked one.
* **Hugging Face transformers (checked on 5.24.0).** `hf_packed_kwargs` returns the keywords
  a model's forward takes for a packed [1, total_tokens] stream: `position_ids` plus
  `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q`, `max_length_k` (the
  `FlashAttentionKwargs` names in `transformers/modeling_flash_attention_utils.py`) and
  `use_cache=False`. What transformers does with them:

  - flash_attention_2/3 (read in `_flash_attention_forward`, not run here: no GPU): uses
    the four `cu_seq_lens_*`/`max_length_*` keywords directly when all four are given;
    otherwise it infers the boundaries from `position_ids`, but only for batch size 1.
  - sdpa, eager (run in the tests; flex by reading the code): the attention functions
    ignore the `cu_seq_lens_*` keywords.
    The mask is built in `masking_utils.create_causal_mask`, which derives a block-diagonal
    causal mask from `position_ids` (a new sequence wherever the position does not grow by
    exactly 1, `find_packed_sequence_indices`) **only if `attention_mask is None` and no
    cache is in use**. Two traps follow, both verified in `tests/client/test_hf_packed.py`:
    (1) any 2-D `attention_mask`, even all ones, switches the detection off and the row
    gets a plain causal mask; (2) `use_cache` defaults to `config.use_cache` (True in the
    Qwen3 and GPT-2 configs; `utils.generic.merge_with_config_defaults` applies it in train
    mode too unless gradient checkpointing is on), and the resulting DynamicCache switches
    the detection off too. Hence `use_cache=False` in the
    returned keywords. With both avoided, position-ids-only packing is exact on CPU with
    sdpa and eager, for [R, L] rows as well as [1, T].
  - Any model also accepts a prepared 4-D float mask as `attention_mask` (returned as-is
    by `create_causal_mask`): `block_causal_mask(segment_ids)` of shape [R, 1, L, L].

Which bug shows where: with learned absolute position embeddings, running position ids
change every later sequence even under a correct block mask. With rotary embeddings (Qwen3,
Llama) attention inside a block depends only on position differences, so running ids under
a correct mask are harmless up to rounding; but transformers' sdpa/eager path derives the
mask *from* the position ids, so there running ids turn into a plain causal mask: a leak.

Conventions: `cu_seqlens` is int32 [n + 1] from 0 (as `rlfeed.sched.layout.row_layout`
produces); `segment_ids` is int [L] or [R, L] with -1 on padding; `position_ids` int64,
0 on padding. Padding sits after the last sequence of a row.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "block_causal_mask",
    "concat_rows_cu_seqlens",
    "hf_packed_kwargs",
    "position_ids_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "varlen_inputs",
]


def _as_cu_seqlens(cu_seqlens: Any) -> torch.Tensor:
    """Validated int64 CPU copy of `cu_seqlens`: 1-D, starts at 0, non-decreasing."""
    cu = torch.as_tensor(cu_seqlens).detach().to(device="cpu", dtype=torch.int64)
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with n + 1 >= 1 entries, got shape {tuple(cu.shape)}"
        )
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    steps = torch.diff(cu)
    if steps.numel() and int(steps.min()) < 0:
        index = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing; cu_seqlens[{index + 1}] < cu_seqlens[{index}]"
        )
    return cu


def _total_tokens(cu: torch.Tensor, total_tokens: int | None) -> int:
    real = int(cu[-1])
    if total_tokens is None:
        return real
    if total_tokens < real:
        raise ValueError(f"total_tokens={total_tokens} is smaller than cu_seqlens[-1]={real}")
    return int(total_tokens)


def segment_ids_from_cu_seqlens(
    cu_seqlens: Any, total_tokens: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """[total_tokens] int32: index of each token's sequence, -1 on trailing padding."""
    cu = _as_cu_seqlens(cu_seqlens)
    total = _total_tokens(cu, total_tokens)
    segment_ids = torch.full((total,), -1, dtype=torch.int32)
    lengths = torch.diff(cu)
    segment_ids[: int(cu[-1])] = torch.repeat_interleave(
        torch.arange(lengths.numel(), dtype=torch.int32), lengths
    )
    return segment_ids.to(device) if device is not None else segment_ids


def position_ids_from_cu_seqlens(
    cu_seqlens: Any, total_tokens: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """[total_tokens] int64 position ids restarting at 0 per sequence, 0 on padding."""
    cu = _as_cu_seqlens(cu_seqlens)
    total = _total_tokens(cu, total_tokens)
    real = int(cu[-1])
    position_ids = torch.zeros(total, dtype=torch.int64)
    starts = torch.repeat_interleave(cu[:-1], torch.diff(cu))
    position_ids[:real] = torch.arange(real, dtype=torch.int64) - starts
    return position_ids.to(device) if device is not None else position_ids


def block_causal_mask(
    segment_ids: Any, n_heads: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Block-diagonal causal attention mask of packed rows.

    segment_ids: [L] or [R, L] integer, the sequence index of each token, -1 on padding.
    Query i may attend key j iff j <= i and both are in the same (non-padding) segment;
    a padding query attends to itself only, so no softmax row is empty.

    Returns, for a floating `dtype`, 0 where allowed and -inf where forbidden (an additive
    mask); for `dtype=torch.bool`, True where allowed (SDPA's boolean convention). Shape:

    * `n_heads=None`: [R, 1, L, L], broadcast over heads by
      `torch.nn.functional.scaled_dot_product_attention` and accepted as a prepared 4-D
      `attention_mask` by Hugging Face models.
    * `n_heads=H`: [R * H, L, L] (row-major: row r's copy for head h is r * H + h), the
      per-row-and-head `attn_mask` layout of `torch.nn.MultiheadAttention`.
    """
    segment = torch.as_tensor(segment_ids)
    if segment.ndim == 1:
        segment = segment[None]
    if segment.ndim != 2:
        raise ValueError(f"segment_ids must be [L] or [R, L], got shape {tuple(segment.shape)}")
    if segment.dtype.is_floating_point or segment.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor, got {segment.dtype}")
    _, length = segment.shape
    index = torch.arange(length, device=segment.device)
    causal = index[None, :] <= index[:, None]  # [query, key]
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    allowed = (same & causal) | torch.eye(length, dtype=torch.bool, device=segment.device)
    if n_heads is None:
        allowed = allowed[:, None]
    else:
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        allowed = allowed.repeat_interleave(n_heads, dim=0)
    if dtype == torch.bool:
        return allowed
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be floating point or torch.bool, got {dtype}")
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def concat_rows_cu_seqlens(rows_cu_seqlens: list[Any], row_length: int) -> torch.Tensor:
    """cu_seqlens of R packed rows of `row_length` flattened into one [R * row_length] stream.

    Each row's padding becomes one extra sequence, so every token belongs to exactly one
    sequence and varlen kernels write (finite) output for padding too.
    """
    pieces = [torch.zeros(1, dtype=torch.int64)]
    for row, cu_seqlens in enumerate(rows_cu_seqlens):
        cu = _as_cu_seqlens(cu_seqlens)
        if int(cu[-1]) > row_length:
            raise ValueError(
                f"row {row} holds {int(cu[-1])} tokens, more than row_length={row_length}"
            )
        bounds = cu[1:]
        if int(cu[-1]) < row_length:
            bounds = torch.cat([bounds, torch.tensor([row_length])])
        pieces.append(bounds + row * row_length)
    return torch.cat(pieces).to(torch.int32)


def _padded_cu_seqlens(cu_seqlens: Any, total_tokens: int | None) -> tuple[torch.Tensor, int]:
    cu = _as_cu_seqlens(cu_seqlens)
    total = _total_tokens(cu, total_tokens)
    if total > int(cu[-1]):
        # Trailing padding as one more sequence: varlen kernels leave tokens outside every
        # sequence unwritten (possibly NaN), which a masked loss would still multiply by 0.
        cu = torch.cat([cu, torch.tensor([total])])
    max_seqlen = int(torch.diff(cu).max()) if cu.numel() > 1 else 0
    return cu.to(torch.int32), max_seqlen


def varlen_inputs(
    cu_seqlens: Any, total_tokens: int | None = None, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Keywords of `flash_attn_varlen_func(q, k, v, **varlen_inputs(cu), causal=True)`.

    Returns `cu_seqlens_q`/`cu_seqlens_k` (int32 [n + 1], or [n + 2] when `total_tokens`
    exceeds `cu_seqlens[-1]` and the padding becomes its own sequence) and
    `max_seqlen_q`/`max_seqlen_k` (Python ints: the kernels size their grid from them).
    For several rows, flatten them and pass `concat_rows_cu_seqlens(...)`.
    """
    cu, max_seqlen = _padded_cu_seqlens(cu_seqlens, total_tokens)
    if device is not None:
        cu = cu.to(device)
    return {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen,
    }


def hf_packed_kwargs(
    cu_seqlens: Any, total_tokens: int | None = None, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Keywords for a Hugging Face causal LM's forward on one packed [1, total_tokens] stream.

    `model(input_ids=ids[None], **hf_packed_kwargs(cu_seqlens))` is exact with
    flash_attention_2/3 (through `cu_seq_lens_*`/`max_length_*`) and with sdpa/eager (which
    derive the block mask from the restarted `position_ids`, [1, total_tokens] int64, only
    without an attention mask and without a cache, hence `use_cache=False`). Do not also
    pass `attention_mask`. See the module docstring for what transformers does.
    """
    cu, max_seqlen = _padded_cu_seqlens(cu_seqlens, total_tokens)
    position_ids = position_ids_from_cu_seqlens(cu_seqlens, total_tokens)[None]
    if device is not None:
        cu, position_ids = cu.to(device), position_ids.to(device)
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
        "use_cache": False,
    }
