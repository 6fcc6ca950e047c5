"""Chunked and checkpointed log-probs against the full computation they replace (14.3)."""

from __future__ import annotations

import pytest
import torch
from rlfeed.client.logprobs import (
    _tempered_minus,
    checkpointed_log_probs,
    chunked_log_probs,
    full_log_probs,
)

TOKENS, WIDTH, VOCAB = 37, 16, 53
# CUDA runs other kernels (promoting elementwise ops, a mixed-dtype weight-gradient matmul).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def make_inputs(dtype=torch.float32, with_bias=True, seed=0, tokens=TOKENS):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, WIDTH, generator=generator)
    weight = torch.randn(VOCAB, WIDTH, generator=generator) / WIDTH**0.5
    bias = torch.randn(VOCAB, generator=generator) if with_bias else None
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    # Non-uniform upstream gradients, as a masked, advantage-weighted loss would send.
    upstream = torch.randn(2, tokens, generator=generator)
    leaves = [hidden.to(dtype), weight.to(dtype)] + ([bias.to(dtype)] if with_bias else [])
    for leaf in leaves:
        leaf.requires_grad_(True)
    return leaves, targets, upstream


def values_and_grads(fn, leaves, targets, upstream, **kwargs):
    hidden, weight, *rest = leaves
    bias = rest[0] if rest else None
    log_probs, entropy = fn(hidden, weight, targets, bias=bias, return_entropy=True, **kwargs)
    objective = (log_probs * upstream[0]).sum() + (entropy * upstream[1]).sum()
    grads = torch.autograd.grad(objective, leaves)
    return [log_probs.detach(), entropy.detach(), *grads]


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 37, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_checkpointed_matches_full_values_and_grads(chunk_size, with_bias, temperature):
    leaves, targets, upstream = make_inputs(with_bias=with_bias)
    expected = values_and_grads(full_log_probs, leaves, targets, upstream, temperature=temperature)
    actual = values_and_grads(
        checkpointed_log_probs,
        leaves,
        targets,
        upstream,
        chunk_size=chunk_size,
        temperature=temperature,
    )
    names = ["log_probs", "entropy", "grad_hidden", "grad_weight", "grad_bias"]
    for name, got, want in zip(names, actual, expected, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("chunk_size", [4, 37])
def test_chunked_matches_full(chunk_size):
    leaves, targets, upstream = make_inputs()
    expected = values_and_grads(full_log_probs, leaves, targets, upstream, temperature=0.9)
    actual = values_and_grads(
        chunked_log_probs, leaves, targets, upstream, chunk_size=chunk_size, temperature=0.9
    )
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_log_probs_without_entropy_match_and_are_log_softmax_of_logits():
    leaves, targets, upstream = make_inputs()
    hidden, weight, bias = leaves
    log_probs = checkpointed_log_probs(hidden, weight, targets, bias=bias, chunk_size=6)
    logits = hidden.double() @ weight.double().T + bias.double()
    straightforward = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs.double(), straightforward, rtol=1e-5, atol=1e-5)
    grad = torch.autograd.grad((log_probs * upstream[0]).sum(), weight)[0]
    expected = torch.autograd.grad(
        (full_log_probs(hidden, weight, targets, bias=bias) * upstream[0]).sum(), weight
    )[0]
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_leading_dims_are_kept_and_frozen_weight_gets_no_grad():
    leaves, targets, _ = make_inputs(with_bias=False, tokens=36)
    hidden, weight = leaves
    rows_hidden = hidden.detach().reshape(4, 9, WIDTH).requires_grad_(True)
    frozen = weight.detach()
    log_probs = checkpointed_log_probs(rows_hidden, frozen, targets.reshape(4, 9), chunk_size=7)
    assert log_probs.shape == (4, 9)
    reference = full_log_probs(rows_hidden, frozen, targets.reshape(4, 9))
    grad = torch.autograd.grad(log_probs.sum(), rows_hidden)[0]
    expected = torch.autograd.grad(reference.sum(), rows_hidden)[0]
    torch.testing.assert_close(log_probs, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_entropy_only_objective_gets_the_entropy_gradient():
    leaves, targets, upstream = make_inputs(with_bias=False)
    hidden, weight = leaves
    _, entropy = checkpointed_log_probs(hidden, weight, targets, chunk_size=5, return_entropy=True)
    _, reference = full_log_probs(hidden, weight, targets, return_entropy=True)
    grads = torch.autograd.grad((entropy * upstream[1]).sum(), leaves)
    expected = torch.autograd.grad((reference * upstream[1]).sum(), leaves)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_inputs_stay_close_to_the_fp32_reference(device, temperature):
    leaves32, targets, upstream = make_inputs(with_bias=True)
    leaves32 = [leaf.detach().to(device).requires_grad_(True) for leaf in leaves32]
    targets, upstream = targets.to(device), upstream.to(device)
    leaves16 = [leaf.detach().bfloat16().requires_grad_(True) for leaf in leaves32]
    # Reference: the bf16-rounded inputs computed entirely in fp32.
    rounded = [leaf.detach().float().requires_grad_(True) for leaf in leaves16]
    kwargs = {"temperature": temperature}
    expected = values_and_grads(full_log_probs, rounded, targets, upstream, **kwargs)
    actual = values_and_grads(
        checkpointed_log_probs, leaves16, targets, upstream, chunk_size=8, **kwargs
    )
    assert actual[0].dtype == actual[1].dtype == torch.float32
    assert [grad.dtype for grad in actual[2:]] == [torch.bfloat16] * 3
    names = ["log_probs", "entropy", "grad_hidden", "grad_weight", "grad_bias"]
    for name, got, want in zip(names, actual, expected, strict=True):
        # The bf16 matmul outputs carry ~2**-8 relative rounding, scaled by their magnitude.
        scale = want.abs().max()
        error = (got.float() - want).abs().max()
        assert error <= 2e-2 * scale, f"{name}: error {error:.3g} vs scale {scale:.3g}"
    bf16_full = values_and_grads(full_log_probs, leaves16, targets, upstream, **kwargs)
    for got, want in zip(actual[:2], bf16_full[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_log_probs_and_grads_are_as_accurate_as_the_full_computation(device, temperature):
    # A training loss's case: no bias, log-probs only (on CUDA the gradient block is scaled
    # and rounded to bf16 in one op). Errors against the bf16-rounded inputs computed in fp32.
    tokens, width, vocab = 300, 64, 2000
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, width, generator=generator).bfloat16().to(device)
    weight = (torch.randn(vocab, width, generator=generator) * 2 / width**0.5).bfloat16()
    weight = weight.to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    upstream = torch.randn(tokens, generator=generator).to(device)

    def values_and_grads_of(fn, dtype, **kwargs):
        leaves = [hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)]
        log_probs = fn(*leaves, targets, temperature=temperature, **kwargs)
        grads = torch.autograd.grad((log_probs * upstream).sum(), leaves)
        return [log_probs.detach().float(), *(grad.float() for grad in grads)]

    reference = values_and_grads_of(full_log_probs, torch.float32)
    full = values_and_grads_of(full_log_probs, torch.bfloat16)
    checkpointed = values_and_grads_of(checkpointed_log_probs, torch.bfloat16, chunk_size=32)
    torch.testing.assert_close(checkpointed[0], full[0], rtol=1e-5, atol=1e-5)
    for name, got, baseline, want in zip(
        ["log_probs", "grad_hidden", "grad_weight"], checkpointed, full, reference, strict=True
    ):
        error = float((got - want).norm() / want.norm())
        full_error = float((baseline - want).norm() / want.norm())
        # The weight gradient sums per-chunk bf16 products on CPU (measured 1.1-1.2x there).
        assert error <= 1.5 * full_error + 1e-6, f"{name}: {error:.3g} vs full {full_error:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tempered_minus_equals_casting_dividing_then_subtracting(device, temperature, dtype):
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 301, generator=generator) * 8).to(dtype).to(device)
    divisor = None if temperature == 1.0 else torch.full((1,), temperature, device=device)
    upcast = logits.float()
    tempered = upcast if divisor is None else upcast / divisor
    peak = logits.amax(-1, keepdim=True).float()
    peak = peak if divisor is None else peak / divisor
    shifted = _tempered_minus(logits.clone(), peak, divisor)
    assert shifted.dtype == torch.float32
    assert torch.equal(shifted, tempered - peak)
    # The tempered peak of the raw logits is the peak of the tempered logits.
    assert torch.equal(shifted.amax(-1), torch.zeros(9, device=device))


def saved_bytes(fn, tokens, **kwargs):
    """Bytes autograd keeps for backward (the part of the peak that grows with T)."""
    leaves, targets, _ = make_inputs(with_bias=True, tokens=tokens)
    hidden, weight, bias = leaves
    # Inputs are alive anyway; count only what autograd adds on top of them.
    seen = {leaf.untyped_storage().data_ptr() for leaf in (*leaves, targets)}
    total = 0

    def pack(tensor):
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(hidden, weight, targets, bias=bias, **kwargs)
    return total


def test_checkpointed_saves_o_of_t_while_full_and_chunked_save_o_of_t_times_v():
    per_token_logits = VOCAB * 4
    for tokens in (64, 256):
        checkpointed = saved_bytes(checkpointed_log_probs, tokens, chunk_size=16)
        chunked = saved_bytes(chunked_log_probs, tokens, chunk_size=16)
        full = saved_bytes(full_log_probs, tokens)
        assert checkpointed <= 8 * tokens  # one fp32 log-sum-exp per token
        assert chunked >= tokens * per_token_logits
        assert full >= tokens * per_token_logits


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"targets": torch.tensor([0, VOCAB])}, "targets\\[1\\]"),
        ({"targets": torch.tensor([0, -1])}, "targets\\[1\\]"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "targets shape"),
        ({"weight": torch.randn(VOCAB, WIDTH + 1)}, "hidden must be"),
        ({"weight": torch.randn(VOCAB, WIDTH, dtype=torch.float64)}, "dtype"),
        ({"bias": torch.randn(VOCAB + 1)}, "bias must be"),
        ({"temperature": 0.0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_inputs_are_rejected(change, message):
    arguments = {
        "hidden": torch.randn(2, WIDTH),
        "weight": torch.randn(VOCAB, WIDTH),
        "targets": torch.tensor([0, 1]),
        "bias": None,
        "temperature": 1.0,
        "chunk_size": 4,
    } | change
    hidden, weight, targets = (arguments.pop(name) for name in ("hidden", "weight", "targets"))
    with pytest.raises(ValueError, match=message):
        checkpointed_log_probs(hidden, weight, targets, **arguments)


def test_no_tokens_gives_empty_output():
    hidden = torch.zeros(0, WIDTH, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)
    log_probs = checkpointed_log_probs(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert log_probs.shape == (0,)
    log_probs.sum().backward()
    assert weight.grad is not None and not weight.grad.any()


def test_non_contiguous_hidden_gets_the_same_grads():
    base = torch.randn(WIDTH, 23, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)
    targets = torch.randint(0, VOCAB, (23,))
    log_probs = checkpointed_log_probs(base.t(), weight, targets, chunk_size=5)
    reference = full_log_probs(base.t(), weight, targets)
    grads = torch.autograd.grad(log_probs.sum(), (base, weight))
    expected = torch.autograd.grad(reference.sum(), (base, weight))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
