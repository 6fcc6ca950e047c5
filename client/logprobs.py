"""Per-token log-probabilities of the targets without materializing the [T, V] logits.

For T tokens and a vocabulary of V, the full logits hold T * V numbers: 0.6 MB per token in
fp32 at Qwen3's V = 151,936, i.e. 20 GB for a 32k-token microbatch, before the log-softmax
and its gradient of the same size (chapter 14.3). Three implementations, same contract:

* `full_log_probs`: the straightforward computation, the reference for tests. Peak memory
  grows like ~12 bytes * T * V in bf16 (matmul output, fp32 copy, fp32 log-softmax).
* `chunked_log_probs`: the token axis in chunks under ordinary autograd. The transient
  full tensor is gone, but autograd keeps every chunk's log-softmax for backward, so the
  peak still grows with T (the chapter's middle option).
* `checkpointed_log_probs`: a custom autograd Function that keeps only the inputs and a
  per-token log-sum-exp, recomputes each chunk's logits in backward and accumulates the
  weight gradient chunk by chunk. Peak memory is one chunk's logits (~6 bytes * chunk * V
  in bf16) plus the weight gradient, independent of T. Cost: one more output-layer matmul
  (about 4/3 of the full computation's FLOPs for the output layer).

Numerics, all three: the matmul runs in the inputs' dtype (bf16 stays bf16, accumulating in
fp32 inside the kernel), then logits are upcast to at least fp32 before the softmax;
log-probs and entropies are returned in that dtype (fp32 for bf16/fp16/fp32 inputs).
`checkpointed_log_probs` accumulates the weight gradient over chunks in fp32 and casts it
to the weight's dtype once (for bf16 weights this costs a V x D fp32 buffer, 4 bytes per
output-layer parameter). On CUDA each chunk's product goes into that buffer inside the matmul,
unrounded, so the result has the full computation's single bf16 rounding; on CPU each chunk's
product is rounded to bf16 first (1.1-1.2x the full computation's error, measured).

Shapes: hidden [..., D]; weight [V, D] (the `lm_head` / tied embedding weight); bias [V] or
None; targets [...] int, in [0, V) (the next-token targets of `rlfeed.sched.layout`, fill 0
where nothing is predicted; mask those positions in the loss, not here). Outputs [...].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "checkpointed_log_probs",
    "chunked_log_probs",
    "full_log_probs",
]

# Tokens per chunk. At V = 151,936 one chunk's fp32 logits are 0.6 GB; the T-independent
# part of the checkpointed peak is a few times that.
DEFAULT_CHUNK_SIZE = 1024

LogProbs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half precision and fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None = None,
) -> None:
    if weight.ndim != 2:
        raise ValueError(f"weight must be [V, D], got shape {tuple(weight.shape)}")
    vocab, width = weight.shape
    if hidden.ndim < 1 or hidden.shape[-1] != width:
        raise ValueError(
            f"hidden must be [..., D] with D = weight.shape[1] = {width}, got {tuple(hidden.shape)}"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} differs from weight dtype {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (vocab,) or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be [V] = [{vocab}] of dtype {weight.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel():
        bad = (targets < 0) | (targets >= vocab)
        if bool(bad.any()):
            index = int(torch.nonzero(bad.reshape(-1))[0])
            raise ValueError(
                f"targets[{index}] (flat index) = {int(targets.reshape(-1)[index])} is outside "
                f"the vocabulary [0, {vocab})"
            )


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """[..., V] logits / temperature in the softmax dtype (a fresh tensor)."""
    logits = F.linear(hidden, weight, bias).to(_softmax_dtype(hidden.dtype))
    # In place is safe under autograd too: neither the cast nor the matmul saves its output.
    return logits.div_(temperature) if temperature != 1.0 else logits


def _log_probs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, return_entropy: bool
) -> LogProbs:
    log_softmax = torch.log_softmax(logits, dim=-1)
    picked = log_softmax.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    if not return_entropy:
        return picked
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return picked, entropy


def full_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> LogProbs:
    """Straightforward reference: materializes the full [..., V] logits and log-softmax."""
    _validate(hidden, weight, targets, bias, temperature)
    return _log_probs_from_logits(
        _logits(hidden, weight, bias, temperature), targets, return_entropy
    )


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> LogProbs:
    """Chunked over tokens without recomputation: forward memory shrinks, backward does not."""
    _validate(hidden, weight, targets, bias, temperature, chunk_size)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    pieces = [
        _log_probs_from_logits(
            _logits(flat_hidden[start : start + chunk_size], weight, bias, temperature),
            flat_targets[start : start + chunk_size],
            return_entropy,
        )
        for start in range(0, flat_targets.numel(), chunk_size)
    ]
    if not pieces:
        empty = flat_hidden.new_zeros(0, dtype=_softmax_dtype(hidden.dtype))
        return (empty, empty.clone()) if return_entropy else empty
    if not return_entropy:
        return torch.cat(pieces).reshape(targets.shape)
    log_probs, entropy = zip(*pieces, strict=True)
    return torch.cat(log_probs).reshape(targets.shape), torch.cat(entropy).reshape(targets.shape)


def _divisor(temperature: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The temperature as a [1] tensor for `_tempered_minus`; None for temperature 1."""
    if temperature == 1.0:
        return None
    return torch.full((1,), temperature, dtype=dtype, device=device)


def _accumulate_weight_grad(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor
) -> None:
    """grad_weight += grad_logits.T @ hidden_chunk; grad_weight is in the softmax dtype."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden_chunk)
    elif grad_weight.is_cuda:
        # cuBLAS adds the half-precision product into the fp32 buffer in its epilogue (read and
        # write 8 bytes per element), with no [V, D] half-precision product rounded in between.
        torch.addmm(
            grad_weight, grad_logits.t(), hidden_chunk, out_dtype=grad_weight.dtype, out=grad_weight
        )
    else:
        # No mixed-dtype matmul on CPU: a [V, D] product in the inputs' dtype, then the add.
        grad_weight += grad_logits.t() @ hidden_chunk


def _tempered_minus(
    logits: torch.Tensor, shift: torch.Tensor, divisor: torch.Tensor | None
) -> torch.Tensor:
    """logits / temperature - shift in the softmax dtype; on CUDA one pass over [chunk, V].

    shift: [chunk, 1]; divisor: the temperature as a [1] tensor, None for temperature 1.
    Logits already in the softmax dtype are overwritten in place. On CUDA, half-precision
    logits are read once and promoted inside the op, which writes the fp32 block: the cast is
    exact, so the values equal those of casting first and subtracting in place, without that
    extra read and write of the fp32 block. The divisor is a one-element tensor rather than a
    Python float so that it promotes as well, and divides each logit exactly as the peak is
    divided (so the peak's row maximum stays exactly 0).
    """
    if not logits.is_cuda:
        # CPU kernels promote through a cast copy (a second fp32 block), and there addcdiv
        # costs more than a division and a subtraction (measured): cast, then in place.
        logits = logits.to(shift.dtype)
        return (logits if divisor is None else logits.div_(divisor)).sub_(shift)
    out = logits if logits.dtype == shift.dtype else None
    if divisor is None:
        return torch.sub(logits, shift, out=out)
    return torch.addcdiv(-shift, logits, divisor, out=out)


class _CheckpointedLogProbs(torch.autograd.Function):
    """Chunked log-probs (and entropy) that recompute each chunk's logits in backward.

    Saved for backward: the inputs and, per token, the log-sum-exp (and entropy): O(T)
    instead of O(T * V).

    Passes over each [chunk, V] block besides the matmuls, in bytes per logit, for bf16 inputs
    on CUDA without entropy: forward 20 (max over bf16 2, subtract into fp32 6, exp 8, sum 4),
    backward 20 (subtract into fp32 6, exp 8, scale and round to bf16 in one op 6) at any
    temperature, and each chunk's weight gradient is added into the fp32 accumulator inside
    its matmul (8 D / chunk). Casting first and working in place cost 30 + 36 (38 + 52 at
    temperature != 1) and 12 D / chunk: the full computation's 48 per logit plus 30. Measured
    on an H200 (16,384 tokens, V = 151,936, chunk 1,024): 1.78x -> 1.49x the full pass's
    time. The bytes are not the whole story: PyTorch's promoting kernels are not vectorized
    and move about 1.4 TB/s against exp's 4.2, so 46 of the pass's 77 ms are still
    elementwise (a fused kernel reading each bf16 logit once would remove most of it). CPU
    kernels promote through a cast copy, so there the logits are cast first (forward 28,
    backward 36; 36 and 44 at temperature != 1).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, return_entropy):
        ctx.set_materialize_grads(False)
        tokens = targets.numel()
        acc_dtype = _softmax_dtype(hidden.dtype)
        divisor = _divisor(temperature, acc_dtype, hidden.device)
        log_probs = torch.empty(tokens, dtype=acc_dtype, device=hidden.device)
        log_sum_exp = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if return_entropy else None
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            with torch.no_grad():
                logits = F.linear(hidden[start:stop], weight, bias)
                picked = logits.gather(-1, targets[start:stop, None].long()).to(acc_dtype)
                # Max before the upcast and the temperature: both are monotone, so the peak of
                # the tempered fp32 logits is the tempered peak.
                peak = logits.amax(dim=-1, keepdim=True).to(acc_dtype)
                if divisor is not None:
                    picked, peak = picked / divisor, peak / divisor
                # A log-sum-exp computed in place: torch.logsumexp would hold a second
                # [chunk, V] buffer.
                shifted = _tempered_minus(logits, peak, divisor)
                del logits
                if entropy is None:
                    total = shifted.exp_().sum(-1)
                else:
                    # H = log S - sum(exp(z') * z') / S with z' = z - max, S = sum(exp(z')).
                    exp_shifted = shifted.exp()
                    total = exp_shifted.sum(-1)
                    weighted = exp_shifted.mul_(shifted).sum(-1)
                    entropy[start:stop] = total.log() - weighted / total
                    del exp_shifted
                chunk_lse = total.log_().add_(peak.squeeze(-1))
                log_probs[start:stop] = picked.squeeze(-1) - chunk_lse
                log_sum_exp[start:stop] = chunk_lse
            del shifted
        ctx.save_for_backward(hidden, weight, bias, targets, log_sum_exp, entropy)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        if entropy is None:
            return log_probs
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy=None):
        hidden, weight, bias, targets, log_sum_exp, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        tokens, chunk_size, temperature = targets.numel(), ctx.chunk_size, ctx.temperature
        acc_dtype = _softmax_dtype(hidden.dtype)
        divisor = _divisor(temperature, acc_dtype, hidden.device)
        # Scaling in fp32 and rounding to bf16 in one op (CUDA casts while storing; CPU kernels
        # would materialize an fp32 result first). The bias gradient needs the fp32 block.
        fused_round = (
            grad_entropy is None and not need_bias and hidden.dtype != acc_dtype and hidden.is_cuda
        )
        # Contiguous, so that each chunk's rows are a valid `out=` of the matmul.
        grad_hidden = (
            torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            if need_hidden
            else None
        )
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device)
            if need_bias
            else None
        )
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            hidden_chunk = hidden[start:stop]
            picked = targets[start:stop, None].long()
            # d objective / dz = p * (a * log p + b) + onehot(y) * w per row, with
            # w = g_logp / T, a = -g_H / T, b = -g_H * H / T - w (d H / dz' = -p (log p + H)).
            tempered = (
                None if grad_log_probs is None else grad_log_probs[start:stop, None] / temperature
            )
            with torch.no_grad():
                logits = F.linear(hidden_chunk, weight, bias)
                log_softmax = _tempered_minus(logits, log_sum_exp[start:stop, None], divisor)
                del logits
                if grad_entropy is not None:
                    probs = log_softmax.exp()
                    slope = grad_entropy[start:stop, None] / -temperature
                    offset = slope * entropy[start:stop, None]
                    if tempered is not None:
                        offset = offset - tempered
                    grad_logits = torch.addcmul(offset, log_softmax, slope, out=log_softmax)
                    grad_logits.mul_(probs)
                    del probs
                    if tempered is not None:
                        grad_logits.scatter_add_(1, picked, tempered)
                else:
                    probs = log_softmax.exp_()
                    # The target's entry in fp32, rounded once: p * -w, then + w.
                    on_target = probs.gather(1, picked).mul_(-tempered).add_(tempered)
                    if fused_round:
                        # Scale in fp32 and round to bf16 in one pass: no fp32 gradient block.
                        grad_logits = torch.mul(
                            probs, -tempered, out=torch.empty_like(probs, dtype=hidden.dtype)
                        )
                    else:
                        grad_logits = probs.mul_(-tempered)
                    del probs
                    grad_logits.scatter_(1, picked, on_target.to(grad_logits.dtype))
                del log_softmax
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, grad_logits, hidden_chunk)
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(weight.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def checkpointed_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> LogProbs:
    """Log-probs of `targets` under softmax((hidden @ weight.T + bias) / temperature).

    Chunks the token axis and recomputes each chunk's logits in backward, so neither the
    forward nor the backward pass ever holds more than one chunk's [chunk_size, V] logits;
    gradients flow to hidden, weight and bias and equal those of `full_log_probs` to
    rounding. With `return_entropy=True` returns `(log_probs, entropy)` (per-token entropy
    of the same tempered distribution, in nats, differentiable) from the same pass.
    """
    _validate(hidden, weight, targets, bias, temperature, chunk_size)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    out = _CheckpointedLogProbs.apply(
        flat_hidden, weight, bias, flat_targets, int(chunk_size), float(temperature), return_entropy
    )
    if targets.ndim == 1:
        # The Function's own outputs, not views of them: FSDP2 warns about a module that
        # returns a view (an in-place op on it would skip the module's pre-backward hook).
        return out
    if not return_entropy:
        return out.reshape(targets.shape)
    return out[0].reshape(targets.shape), out[1].reshape(targets.shape)
