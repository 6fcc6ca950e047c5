"""Loss aggregation modes and exact gradient accumulation (14.4, 14.7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.client.logprobs import checkpointed_log_probs
from rlfeed.client.loss import aggregate_loss, policy_loss, rank_norm_const
from rlfeed.sched.layout import row_layout

# ---------------------------------------------------------------------------------------
# Modes against their definitions


def sequences_strategy():
    return st.lists(st.integers(1, 9), min_size=1, max_size=6).flatmap(
        lambda lengths: st.tuples(
            st.just(lengths),
            st.lists(st.booleans(), min_size=sum(lengths), max_size=sum(lengths)),
            st.lists(
                st.floats(-3, 3, allow_nan=False), min_size=sum(lengths), max_size=sum(lengths)
            ),
        )
    )


def by_definition(lengths, selected, losses, mode):
    """Plain-Python loss over a list of sequences."""
    per_sequence, start = [], 0
    for length in lengths:
        chosen = [losses[t] for t in range(start, start + length) if selected[t]]
        start += length
        if chosen:
            per_sequence.append(chosen)
    if not per_sequence:
        return 0.0
    if mode == "token_mean":
        tokens = [value for sequence in per_sequence for value in sequence]
        return sum(tokens) / len(tokens)
    if mode == "seq_mean_token_sum":
        return sum(sum(sequence) for sequence in per_sequence) / len(per_sequence)
    return sum(sum(sequence) / len(sequence) for sequence in per_sequence) / len(per_sequence)


@settings(max_examples=60, deadline=None)
@given(data=sequences_strategy(), padding=st.integers(0, 4))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_modes_match_definition_in_packed_and_padded_layouts(mode, data, padding):
    lengths, selected, losses = data
    expected = by_definition(lengths, selected, losses, mode)
    total = sum(lengths)
    layout = row_layout(lengths, total + padding)
    packed_loss = torch.zeros(total + padding, dtype=torch.float64)
    packed_loss[:total] = torch.tensor(losses, dtype=torch.float64)
    packed_mask = torch.zeros(total + padding, dtype=torch.bool)
    packed_mask[:total] = torch.tensor(selected)
    # Padding values must not matter.
    packed_loss[total:] = float("nan")
    via_segments = aggregate_loss(
        packed_loss, packed_mask, mode, segment_ids=torch.from_numpy(layout.segment_ids)
    )
    via_cu = aggregate_loss(packed_loss, packed_mask, mode, cu_seqlens=layout.cu_seqlens)
    width = max(lengths) + padding
    rows_loss = torch.full((len(lengths), width), float("nan"), dtype=torch.float64)
    rows_mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, (start, length) in enumerate(zip(layout.cu_seqlens[:-1], lengths, strict=True)):
        rows_loss[row, :length] = packed_loss[start : start + length]
        rows_mask[row, :length] = packed_mask[start : start + length]
    via_rows = aggregate_loss(rows_loss, rows_mask, mode)
    for value in (via_segments, via_cu, via_rows):
        assert math.isclose(float(value), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_constant_divides_the_masked_sum_by_norm_const():
    losses = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, float("inf")]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert float(aggregate_loss(losses, mask, "constant", norm_const=10.0)) == pytest.approx(2.9)


def test_seq_modes_with_norm_const_divide_by_the_given_sequence_count():
    losses = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    summed = aggregate_loss(losses, mask, "seq_mean_token_sum", norm_const=4)
    averaged = aggregate_loss(losses, mask, "seq_mean_token_mean", norm_const=4)
    assert float(summed) == pytest.approx((4.0 + 5.0) / 4)
    assert float(averaged) == pytest.approx((2.0 + 5.0) / 4)


def test_packed_rows_with_segment_ids_count_each_row_segment_separately():
    # Two packed rows; segment 0 of row 0 and segment 0 of row 1 are different sequences.
    losses = torch.tensor([[1.0, 1.0, 3.0, 0.0], [5.0, 7.0, 7.0, 7.0]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[0, 3] = False
    segment_ids = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1]])
    loss = aggregate_loss(losses, mask, "seq_mean_token_mean", segment_ids=segment_ids)
    assert float(loss) == pytest.approx((1.0 + 3.0 + 5.0 + 7.0) / 4)


def test_empty_mask_gives_zero_not_nan():
    losses = torch.randn(5, requires_grad=True)
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        loss = aggregate_loss(losses, torch.zeros(5), mode)
        assert float(loss.detach()) == 0.0
        assert not torch.autograd.grad(loss, losses)[0].any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "token_sum"}, "unknown loss mode"),
        ({"mode": "constant"}, "needs norm_const"),
        ({"mode": "constant", "norm_const": 0}, "norm_const must be > 0"),
        ({"mode": "seq_mean_token_sum", "segment_ids": torch.tensor([0, -1])}, "selects padding"),
        ({"mode": "seq_mean_token_sum", "segment_ids": torch.tensor([0])}, "segment_ids shape"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        aggregate_loss(torch.ones(2), torch.ones(2), **kwargs)


def test_rank_norm_const_accounts_for_the_mean_all_reduce():
    assert rank_norm_const(1000, 4) == 250.0
    assert rank_norm_const(1000, 4, grad_reduction="sum") == 1000.0
    with pytest.raises(ValueError, match="policy_token_count"):
        rank_norm_const(-1, 2)


def test_a_step_without_policy_tokens_trains_with_zero_loss_instead_of_failing():
    norm = rank_norm_const(0, 2)
    per_token = torch.randn(6, requires_grad=True)
    loss = aggregate_loss(per_token, torch.zeros(6), "constant", norm_const=norm)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(per_token.grad) == 0


# ---------------------------------------------------------------------------------------
# The clipped policy loss


def test_policy_loss_matches_the_ppo_formula_token_by_token():
    generator = torch.Generator().manual_seed(1)
    logprobs = (torch.randn(40, generator=generator) * 0.3 - 2).requires_grad_(True)
    sampler = logprobs.detach() + torch.randn(40, generator=generator) * 0.3
    advantages = torch.randn(40, generator=generator)
    mask = torch.rand(40, generator=generator) > 0.3
    loss, stats = policy_loss(
        logprobs, sampler, advantages, mask, clip_low=0.2, clip_high=0.28, norm_const=50.0
    )
    expected, clipped = 0.0, 0
    for t in range(40):
        if not mask[t]:
            continue
        ratio = math.exp(float(logprobs.detach()[t]) - float(sampler[t]))
        bounded = min(max(ratio, 0.8), 1.28)
        a = float(advantages[t])
        expected += -min(ratio * a, bounded * a)
        clipped += bounded * a < ratio * a
    assert float(loss.detach()) == pytest.approx(expected / 50.0, rel=1e-5)
    assert float(stats.clip_fraction) == pytest.approx(clipped / int(mask.sum()))
    assert 0 < clipped < int(mask.sum())
    assert float(stats.policy_tokens) == int(mask.sum())


def test_policy_gradient_at_ratio_one_is_minus_advantage_over_n():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 0.5, 4.0])
    mask = torch.tensor([1, 1, 0, 1])
    loss, stats = policy_loss(logprobs, logprobs.detach(), advantages, mask, norm_const=8.0)
    grad = torch.autograd.grad(loss, logprobs)[0]
    torch.testing.assert_close(grad, -advantages * mask / 8.0)
    assert float(stats.ratio_mean) == 1.0
    assert float(stats.clip_fraction) == 0.0
    assert float(stats.approx_kl) == 0.0


def test_unselected_positions_with_infinite_logprobs_do_not_poison_the_loss():
    logprobs = torch.tensor([-1.0, -float("inf")], requires_grad=True)
    sampler = torch.tensor([-1.2, 0.0])
    loss, _ = policy_loss(logprobs, sampler, torch.ones(2), torch.tensor([1, 0]), norm_const=1.0)
    grad = torch.autograd.grad(loss, logprobs)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_policy_loss_default_mode_requires_the_global_count():
    with pytest.raises(ValueError, match="needs norm_const"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))


# ---------------------------------------------------------------------------------------
# Gradient accumulation: accumulated microbatches and ranks vs the one-pass gradient

VOCAB, WIDTH = 31, 12


class TinyPolicy(torch.nn.Module):
    """Per-token policy (no attention needed: the loss is per token either way)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=generator))
        self.mix = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=generator) / 4)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=generator) / 4)

    def forward(self, input_ids, targets):
        hidden = torch.tanh(self.embed[input_ids] @ self.mix)
        return checkpointed_log_probs(hidden, self.head, targets, chunk_size=64)


def make_episodes(count=64, seed=3):
    """Long-tailed episode lengths; the policy tokens are each episode's tail."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(18), 0.8, count), 10, 149).astype(int)
    episodes = []
    for length in lengths:
        tokens = torch.from_numpy(rng.integers(0, VOCAB, length + 1))
        mask = torch.zeros(length, dtype=torch.bool)
        mask[int(rng.integers(3, 8)) :] = True
        episodes.append(
            {
                "input_ids": tokens[:-1],
                "targets": tokens[1:],
                "mask": mask,
                "advantages": torch.full((length,), float(rng.normal())),
                "noise": torch.from_numpy(rng.normal(0, 0.2, length)).float(),
            }
        )
    return episodes


def microbatch_loss(model, episodes, mode, norm_const=None):
    batch = {key: torch.cat([e[key] for e in episodes]) for key in episodes[0]}
    logprobs = model(batch["input_ids"], batch["targets"])
    sampler = logprobs.detach() + batch["noise"]  # some ratios away from 1, some clipped
    loss, _ = policy_loss(
        logprobs, sampler, batch["advantages"], batch["mask"], mode=mode, norm_const=norm_const
    )
    return loss


def flat_grad(model, losses):
    model.zero_grad()
    for loss in losses:
        loss.backward()  # accumulate: gradients add, as in a microbatch loop
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def split(episodes, parts, order):
    ordered = [episodes[i] for i in order]
    size = math.ceil(len(ordered) / parts)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def compare(name, accumulated, reference):
    relative = float((accumulated - reference).norm() / reference.norm())
    cosine = float(torch.nn.functional.cosine_similarity(accumulated, reference, dim=0))
    print(f"{name}: relative error {relative:.2e}, cosine {cosine:.4f}")
    return relative


@pytest.fixture(scope="module")
def setting():
    model, episodes = TinyPolicy(), make_episodes()
    total = int(sum(int(e["mask"].sum()) for e in episodes))
    reference = flat_grad(model, [microbatch_loss(model, episodes, "token_mean")])
    rng = np.random.default_rng(7)
    orders = {
        "random": rng.permutation(len(episodes)),
        "length-sorted": np.argsort([e["mask"].numel() for e in episodes], kind="stable"),
    }
    return model, episodes, total, reference, orders


@pytest.mark.parametrize("order_name", ["random", "length-sorted"])
def test_constant_mode_with_global_count_reproduces_the_full_batch_gradient(setting, order_name):
    model, episodes, total, reference, orders = setting
    microbatches = split(episodes, 4, orders[order_name])
    losses = [microbatch_loss(model, mb, "constant", norm_const=total) for mb in microbatches]
    assert compare(f"constant N, {order_name}", flat_grad(model, losses), reference) < 1e-6


@pytest.mark.parametrize("order_name", ["random", "length-sorted"])
def test_per_microbatch_token_mean_changes_the_gradient(setting, order_name):
    model, episodes, _, reference, orders = setting
    microbatches = split(episodes, 4, orders[order_name])
    counts = [int(sum(int(e["mask"].sum()) for e in mb)) for mb in microbatches]
    losses = [microbatch_loss(model, mb, "token_mean") / len(microbatches) for mb in microbatches]
    error = compare(
        f"token_mean per microbatch {counts}, {order_name}", flat_grad(model, losses), reference
    )
    assert error > 1e-2


def test_data_parallel_ranks_with_n_over_world_size_reproduce_the_full_batch_gradient(setting):
    model, episodes, total, reference, orders = setting
    world_size, per_rank = 2, 2
    microbatches = split(episodes, world_size * per_rank, orders["length-sorted"])
    ranks = [microbatches[r::world_size] for r in range(world_size)]
    norm_const = rank_norm_const(total, world_size)
    rank_grads = [
        flat_grad(model, [microbatch_loss(model, mb, "constant", norm_const) for mb in rank])
        for rank in ranks
    ]
    # DDP's all-reduce averages the ranks' gradients.
    averaged = torch.stack(rank_grads).mean(0)
    assert compare("2 ranks x 2 microbatches, N / world_size", averaged, reference) < 1e-6
    # Each rank normalizing by its own token count (token_mean over its microbatches) drifts.
    local = []
    for rank in ranks:
        rank_episodes = [e for mb in rank for e in mb]
        count = int(sum(int(e["mask"].sum()) for e in rank_episodes))
        losses = [microbatch_loss(model, mb, "constant", count) for mb in rank]
        local.append(flat_grad(model, losses))
    assert compare("2 ranks, per-rank token count", torch.stack(local).mean(0), reference) > 1e-2
