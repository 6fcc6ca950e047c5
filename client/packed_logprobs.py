"""`PackedLogProbs`: a causal LM's per-token log-probs on packed rows, as one `nn.Module`.

Wrap this module, not the model inside it, in DDP or FSDP2:

    policy = PackedLogProbs(hf_model)               # finds the body and the output layer
    policy = DistributedDataParallel(policy)        # or fully_shard(policy)
    logprobs = policy(mb.input_ids, mb.position_ids, mb.target_ids)   # [T]

Why a module: DDP all-reduces gradients and FSDP2 gathers sharded parameters only for
computation that runs through the wrapper's `forward`. Calling `ddp.module.model(...)` and
reading `ddp.module.lm_head.weight` (the natural way to avoid the [T, V] logits of
`hf_model(...)`) bypasses both: under DDP every rank silently keeps its own gradient, under
FSDP2 the output weight is still a sharded DTensor. Here the body, the output layer and
`checkpointed_log_probs` all run inside one `forward`, so the wrapper sees all of it.

Packed-row conventions applied inside (see `rlfeed.client.attention`): no attention mask,
position ids restarting at 0 per sequence (as served), `use_cache=False` for Hugging Face
bodies (a cache switches transformers' packed-sequence detection off), ids and positions
widened to int64, a [T] stream run as one [1, T] row. A zero-token (no-op) microbatch runs
one dummy token and returns an empty result, so every parameter still gets its (zero)
gradient and the ranks' collectives stay in step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from rlfeed.client.attention import hf_packed_kwargs
from rlfeed.client.logprobs import DEFAULT_CHUNK_SIZE, LogProbs, checkpointed_log_probs
from torch import nn

__all__ = ["PackedLogProbs"]


def _is_hf_model(module: nn.Module) -> bool:
    """A transformers `PreTrainedModel` (transformers is imported if one exists)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _find(model: nn.Module, getter: str, attribute: str, keyword: str) -> nn.Module:
    """`model.getter()`, else `model.attribute`: the module passed as `keyword=` otherwise."""
    found = getattr(model, getter)() if hasattr(model, getter) else None
    if found is None:
        found = getattr(model, attribute, None)
    if not isinstance(found, nn.Module):
        raise TypeError(
            f"cannot find the {keyword} of {type(model).__name__} (no {getter}() or "
            f".{attribute}); pass it explicitly: PackedLogProbs({keyword}=...)"
        )
    return found


def _shaped(values: torch.Tensor, shape: torch.Size, empty: bool) -> torch.Tensor:
    """[N] results in the inputs' shape, never as a view: FSDP2 warns about a module output
    that is a view (an in-place op on it would skip the pre-backward hook); a copy of [R, L]
    floats costs nothing next to the forward."""
    if empty:
        return values[:0].reshape(shape).clone()
    return values if len(shape) == 1 else values.reshape(shape).clone()


class PackedLogProbs(nn.Module):
    """Per-token log-probs (and entropies) of a causal LM on packed rows, checkpointed.

    `PackedLogProbs(hf_model)` takes a Hugging Face causal LM's body (`get_decoder()`, else
    `.model`) and output layer (`get_output_embeddings()`, else `.lm_head`); `body=` and
    `output=` give them explicitly, for any model. Both are registered as submodules, so
    `parameters()`, DDP and FSDP2 see them (a tied output weight counts once); the model's
    own modules are shared, not copied, so `hf_model.save_pretrained()` saves what trains.

    The body is called as `body(input_ids=[R, L], position_ids=[R, L], **body_kwargs)` and
    returns hidden states [R, L, D] (a tensor, an object with `.last_hidden_state`, or a
    tuple whose first item is it). Hugging Face bodies also get `use_cache=False`. The
    output layer is a module with `.weight` [V, D] and optionally `.bias` [V] (an
    `nn.Linear`, or a tied `nn.Embedding`); its dtype must equal the hidden states'.

    chunk_size: tokens per chunk of the output layer (`checkpointed_log_probs`); default
        1024. temperature: the sampler's temperature (logits are divided by it); default 1.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        body: nn.Module | None = None,
        output: nn.Module | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError(
                "PackedLogProbs got a DistributedDataParallel model; its body would run "
                "outside DDP's forward and gradients would not be synchronized. Wrap the "
                "plain model: DistributedDataParallel(PackedLogProbs(model))"
            )
        if model is None and (body is None or output is None):
            raise TypeError("PackedLogProbs needs a model, or both body= and output=")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.body = body if body is not None else _find(model, "get_decoder", "model", "body")
        self.output = (
            output
            if output is not None
            else _find(model, "get_output_embeddings", "lm_head", "output")
        )
        weight = getattr(self.output, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise TypeError(
                f"the output layer ({type(self.output).__name__}) needs a .weight of shape [V, D]"
            )
        self.chunk_size = int(chunk_size)
        self.temperature = float(temperature)
        self._hf_body = _is_hf_model(self.body)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, temperature={self.temperature}"

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        return_entropy: bool = False,
        **body_kwargs: Any,
    ) -> LogProbs:
        """Log-probs of `target_ids`, shaped like `input_ids` (in at least fp32).

        input_ids, position_ids, target_ids: [T] (one packed stream, what `BatchLoader`
        serves) or [R, L] rows; position ids restart at 0 per sequence; target t is what
        position t predicts (fill any valid id where nothing is predicted and mask it in
        the loss). cu_seqlens: optional int [n + 1] sequence boundaries of a [T] stream;
        Hugging Face bodies get them as FlashAttention's `cu_seq_lens_*`/`max_length_*`
        (sdpa and eager ignore them), other bodies as `cu_seqlens=`. With
        `return_entropy=True` returns `(log_probs, entropy)`. body_kwargs go to the body.
        """
        weight = self.output.weight
        if _is_dtensor(weight):
            raise RuntimeError(
                "the output weight is a sharded DTensor inside PackedLogProbs.forward: apply "
                "fully_shard to the PackedLogProbs module itself (the root; its layers may be "
                "sharded first), not only to the model inside it"
            )
        shape = input_ids.shape
        if input_ids.ndim not in (1, 2) or position_ids.shape != shape or target_ids.shape != shape:
            raise ValueError(
                "input_ids, position_ids and target_ids must share one [T] or [R, L] shape, got "
                f"{tuple(shape)}, {tuple(position_ids.shape)}, {tuple(target_ids.shape)}"
            )
        if cu_seqlens is not None and input_ids.ndim != 1:
            raise ValueError("cu_seqlens describes one [T] stream; got [R, L] rows")
        empty = input_ids.numel() == 0
        if empty:
            # A no-op microbatch: one dummy token keeps every parameter in the graph (zero
            # gradients), so DDP's and FSDP2's per-backward collectives match other ranks'.
            dummy = torch.zeros(1, dtype=torch.int64, device=weight.device)
            input_ids = position_ids = target_ids = dummy
            cu_seqlens = None if cu_seqlens is None else torch.tensor([0, 1])
        if input_ids.ndim == 1:  # one [T] stream is one [1, T] row
            input_ids, position_ids = input_ids[None], position_ids[None]
        hidden = self._hidden(input_ids.long(), position_ids.long(), cu_seqlens, body_kwargs)
        result = checkpointed_log_probs(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            target_ids.reshape(-1),
            chunk_size=self.chunk_size,
            bias=getattr(self.output, "bias", None),
            temperature=self.temperature,
            return_entropy=return_entropy,
        )
        if return_entropy:
            return tuple(_shaped(values, shape, empty) for values in result)
        return _shaped(result, shape, empty)

    def _hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        body_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """[R, L, D] hidden states of the body."""
        if self._hf_body:
            mask = body_kwargs.get("attention_mask")
            if mask is not None and mask.ndim != 4:
                raise ValueError(
                    "a 2-D attention_mask (even all ones) turns transformers' packed-sequence "
                    "masking off; pass none (restarted position_ids suffice) or a 4-D block mask"
                )
            if body_kwargs.get("use_cache"):
                raise ValueError("use_cache=True switches transformers' packed masking off")
            body_kwargs = {**body_kwargs, "use_cache": False}
            if cu_seqlens is not None:  # FlashAttention's boundaries; the served positions stay
                flash = hf_packed_kwargs(cu_seqlens, input_ids.shape[-1], input_ids.device)
                del flash["position_ids"]
                body_kwargs.update(flash)
        elif cu_seqlens is not None:
            body_kwargs = {**body_kwargs, "cu_seqlens": cu_seqlens}
        out = self.body(input_ids=input_ids, position_ids=position_ids, **body_kwargs)
        if isinstance(out, torch.Tensor):
            return out
        if hasattr(out, "last_hidden_state"):
            return out.last_hidden_state
        return out[0]
