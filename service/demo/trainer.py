"""A trainer rank for `rlfeed demo --synthetic`: a tiny causal transformer trained with GRPO
on served steps.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m rlfeed.service.demo.trainer --address 127.0.0.1:50051 --steps 4

Each rank pulls microbatches with `BatchLoader` and scores packed rows with
`DistributedDataParallel(PackedLogProbs(body=model, output=model.embed))` (varlen
attention, checkpointed log-probs), then divides its loss sum by N / world_size (N: the
step's global policy-token count); DDP's sum / world_size all-reduce, once per step, gives
the exact step mean whatever the split. The step-0 ratio outlier share checks packing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    """The demo's policy: small enough to train on two CPU cores."""

    vocab_size: int = 512  # token ids in [0, vocab_size); default 512
    d_model: int = 64  # residual width; default 64
    n_layers: int = 2  # transformer blocks; default 2
    n_heads: int = 4  # attention heads; default 4
    max_positions: int = 4096  # learned absolute positions (>= the token budget); 4096
    seed: int = 0  # initial weights (the fleet's sampler uses the same); default 0


class Block(nn.Module):
    """Pre-norm attention + MLP block over one packed row."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x_TD: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        t, d = x_TD.shape
        q, k, v = self.qkv(self.norm1(x_TD)).view(t, 3, self.n_heads, d // self.n_heads).unbind(1)
        # Varlen attention on CPU: causal attention inside each sequence of the row, which is
        # what flash_attn_varlen_func computes from cu_seqlens; O(sum L^2), never O(T^2).
        attended = torch.cat(
            [
                F.scaled_dot_product_attention(
                    qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
                ).transpose(0, 1)
                for qs, ks, vs in zip(
                    q.split(lengths), k.split(lengths), v.split(lengths), strict=True
                )
            ]
        )
        x_TD = x_TD + self.proj(attended.reshape(t, d))
        return x_TD + self.mlp(self.norm2(x_TD))


class TinyCausalLM(nn.Module):
    """Embedding + blocks + final norm; the LM head is tied to the embedding."""

    def __init__(self, config: TinyModelConfig) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)  # same weights in every process that builds it
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.max_positions, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        torch.random.set_rng_state(generator_state)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """[1, T, D] hidden states of one packed row [1, T]: the body `PackedLogProbs` calls."""
        return self.hidden_states(input_ids[0], position_ids[0], cu_seqlens)[None]

    def hidden_states(
        self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """[T, D] final hidden states of one packed row; sequences never see each other.

        input_ids_T, position_ids_T: [T]; cu_seqlens: int [n + 1] with cu_seqlens[-1] = T."""
        lengths = torch.diff(cu_seqlens.to(torch.int64)).tolist()
        x_TD = self.embed(input_ids_T) + self.positions(position_ids_T)
        for block in self.blocks:
            x_TD = block(x_TD, lengths)
        return self.norm(x_TD)


def sequence_log_probs(model: TinyCausalLM, token_ids: list) -> list:
    """Log-prob of each token given its prefix (0 for the first), each sequence scored on
    its own: what a sampler running this model would report. Returns float32 arrays."""
    import numpy as np
    from rlfeed.client.logprobs import checkpointed_log_probs

    out = []
    with torch.no_grad():
        for tokens in token_ids:
            ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
            n = ids.numel()
            hidden = model.hidden_states(ids, torch.arange(n), torch.tensor([0, n]))
            per_token = np.zeros(n, dtype=np.float32)
            # Position t predicts token t + 1.
            per_token[1:] = checkpointed_log_probs(
                hidden[:-1], model.lm_head_weight, ids[1:]
            ).numpy()
            out.append(per_token)
    return out


def grpo_step(policy, optimizer, step, *, world_size: int, lr_clip: float = 1.0) -> dict:
    """One optimizer update over this rank's microbatches of `step`; returns figures.

    policy: `DistributedDataParallel(PackedLogProbs(...))`, called as a whole."""
    import torch.distributed as dist
    from rlfeed.client.consistency import ratio_outlier_share
    from rlfeed.service.learning.trainer import backward_pass

    started = time.perf_counter()
    optimizer.zero_grad()
    loss_sum, lp, slp, mask = backward_pass(policy, step, world_size=world_size)
    torch.nn.utils.clip_grad_norm_(policy.parameters(), lr_clip)
    optimizer.step()
    seconds = time.perf_counter() - started

    outliers = ratio_outlier_share(lp, slp, mask) if int(mask.sum()) else 0.0
    local_max = max((mb.max_seqlen for mb in step), default=0)
    # Step-wide figures: loss (each rank's sum / (N / W), so the mean over ranks is the
    # step loss), outlier count, positions, longest sequence.
    totals = torch.tensor(
        [loss_sum / world_size, outliers * int(mask.sum()), float(mask.sum()), step.num_tokens],
        dtype=torch.float64,
    )
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    longest = torch.tensor([local_max], dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return {
        "step": step.step,
        "loss": float(totals[0]),
        "ratio_outlier_share": float(totals[1] / totals[2]) if totals[2] else 0.0,
        "local_ratio_outlier_share": outliers,
        "policy_tokens": int(totals[2]),
        "tokens": int(totals[3]),
        "rollouts": step.num_rollouts,
        "padded_positions": step.num_rollouts * int(longest[0]),
        "seconds": seconds,
        "tokens_per_second": step.num_tokens / seconds if seconds > 0 else 0.0,
        "policy_version": step.policy_version,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="sidecar HOST:PORT")
    parser.add_argument("--steps", type=int, required=True, help="steps to train")
    parser.add_argument("--start-step", type=int, default=0, help="first step to fetch")
    parser.add_argument("--vocab-size", type=int, default=TinyModelConfig.vocab_size)
    parser.add_argument("--seed", type=int, default=0, help="initial weights")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--summary-file", help="rank 0 writes per-step figures here (JSON lines)")
    parser.add_argument("--timeout", type=float, default=120.0, help="max wait per step, s")


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist
    from rlfeed.client.loader import BatchLoader
    from rlfeed.client.packed_logprobs import PackedLogProbs
    from torch.nn.parallel import DistributedDataParallel

    parser = argparse.ArgumentParser(prog="python -m rlfeed.service.demo.trainer")
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two ranks, the sidecar and the fleet share a few cores
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = TinyCausalLM(TinyModelConfig(vocab_size=args.vocab_size, seed=args.seed))
    # The LM head is the tied embedding; all compute runs in the wrapper's forward.
    policy = DistributedDataParallel(PackedLogProbs(body=model, output=model.embed))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    summary = open(args.summary_file, "a") if (rank == 0 and args.summary_file) else None  # noqa: SIM115
    loader = BatchLoader(
        args.address,
        start_step=args.start_step,
        stop_step=args.start_step + args.steps,
        timeout_s=args.timeout,
    )
    try:
        for step in loader:
            figures = grpo_step(policy, optimizer, step, world_size=world_size)
            loader.report(
                step.step,
                loss=figures["loss"],
                ratio_outlier_share=(
                    figures["local_ratio_outlier_share"]
                    if step.step == args.start_step
                    else math.nan
                ),
                tokens_per_second=figures["tokens_per_second"],
                step_seconds=figures["seconds"],
                policy_version=step.step + 1,  # the fleet samples as of the steps trained
            )
            if rank == 0:
                print(
                    f"step {step.step:>3}  loss {figures['loss']:+.4f}  "
                    f"rollouts {figures['rollouts']:>4}  tokens {figures['tokens']:>6}  "
                    f"policy tokens {figures['policy_tokens']:>6}  "
                    f"ratio outliers {figures['ratio_outlier_share']:.3f}  "
                    f"{figures['tokens_per_second'] * world_size:,.0f} tok/s",
                    flush=True,
                )
                if summary is not None:
                    summary.write(json.dumps(figures) + "\n")
                    summary.flush()
    finally:
        loader.close()
        if summary is not None:
            summary.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
