"""A trainer rank of a learning run: the Hugging Face policy under DDP on served steps.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m rlfeed.service.learning.trainer --run-dir DIR

Each rank loads the newest published weights (version `start_step`: the warm start),
wraps the model as `DistributedDataParallel(PackedLogProbs(model))` (gloo), and for each
step served by `BatchLoader` computes the README's loss: `policy_loss` (clipped ratio
against the served sampler log-probs, the sidecar's advantages), `mode="constant"` with
norm N / world_size (N: the step's global policy-token count), so DDP's mean all-reduce
gives the exact step mean. After the optimizer step rank 0 publishes the weights as
version step + 1 (`weights.py`), evaluates the held-out and training pass rates every
`eval_every` steps (`evaluation.py`; before the first step and after the last too), and
writes one record per step to `steps.jsonl` with every rank's rollout ids and times.

The step-0 ratio check, for real: on a step whose rollouts were all sampled with the
weights being trained (min = max served policy version = the trainer's version), the
trainer's log-probs must reproduce the sampler's; each rank records the max |difference|
over its policy tokens there (null on steps with older rollouts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from rlfeed.service.learning.run_spec import STEPS_FILE, WEIGHTS_DIR, RunSpec


def backward_pass(policy, step, *, world_size: int):
    """The README's loss over this rank's microbatches of `step`, gradients accumulated (DDP
    all-reduces at the last microbatch's backward); no optimizer step.

    policy: `DistributedDataParallel(PackedLogProbs(...))`, called as a whole.
    Returns (this rank's loss sum, trainer log-probs [T], sampler log-probs [T], policy-token
    mask [T] bool), T = this rank's positions."""
    from rlfeed.client.loss import policy_loss, rank_norm_const

    norm_const = rank_norm_const(step.policy_token_count, world_size)
    loss_sum, trainer_lp, sampler_lp, masks = 0.0, [], [], []
    for index, mb in enumerate(step):
        last = index == len(step) - 1
        with contextlib.nullcontext() if last else policy.no_sync():
            logprobs = policy(
                mb.input_ids, mb.position_ids, mb.target_ids, cu_seqlens=mb.cu_seqlens
            )
            loss, _ = policy_loss(
                logprobs,
                mb.sampler_logprobs,
                mb.advantages,
                mb.loss_mask,
                mode="constant",
                norm_const=norm_const,
            )
            loss.backward()
        loss_sum += float(loss.detach())
        trainer_lp.append(logprobs.detach())
        sampler_lp.append(mb.sampler_logprobs)
        masks.append(mb.loss_mask != 0)
    lp, slp, mask = (torch.cat(x) if x else torch.zeros(0) for x in (trainer_lp, sampler_lp, masks))
    return loss_sum, lp, slp, mask.bool()


def rl_step(policy, optimizer, step, *, world_size: int, version: int) -> dict:
    """One optimizer update over this rank's microbatches of `step`; this rank's figures.

    policy: `DistributedDataParallel(PackedLogProbs(...))`, called as a whole."""
    from rlfeed.client.consistency import ratio_outlier_share

    optimizer.zero_grad()
    loss_sum, lp, slp, mask = backward_pass(policy, step, world_size=world_size)
    optimizer.step()
    on_policy = step.min_policy_version == step.policy_version == version
    difference = (lp - slp)[mask].abs()
    return {
        "loss_sum": loss_sum,
        "policy_tokens": int(mask.sum()),
        "tokens": step.num_tokens,
        "ratio_outliers": ratio_outlier_share(lp, slp, mask) * int(mask.sum()) if mask.any() else 0,
        "max_abs_logprob_diff": (
            float(difference.max()) if on_policy and difference.numel() else None
        ),
        "rollout_ids": [rid for mb in step for rid in mb.rollout_ids],
        "max_seqlen": max((mb.max_seqlen for mb in step), default=0),
    }


def step_record(per_rank: list[dict], step, version: int, world_size: int) -> dict:
    """The step's record from every rank's figures: global counts (the keys the demo's
    summary reads) plus each rank's rollout ids and times."""
    policy_tokens = sum(r["policy_tokens"] for r in per_rank)
    diffs = [r["max_abs_logprob_diff"] for r in per_rank if r["max_abs_logprob_diff"] is not None]
    longest = max(r["max_seqlen"] for r in per_rank)
    seconds = max(r["t_trained"] - r["t_served"] for r in per_rank)
    return {
        "step": step.step,
        "trainer_version": version,
        "policy_version": step.policy_version,
        "min_policy_version": step.min_policy_version,
        "loss": sum(r["loss_sum"] for r in per_rank) / world_size,
        "rollouts": step.num_rollouts,
        "tokens": sum(r["tokens"] for r in per_rank),
        "policy_tokens": policy_tokens,
        "padded_positions": step.num_rollouts * longest,
        "ratio_outlier_share": (
            sum(r["ratio_outliers"] for r in per_rank) / policy_tokens if policy_tokens else 0.0
        ),
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "seconds": seconds,
        "tokens_per_second": sum(r["tokens"] for r in per_rank) / seconds if seconds else 0.0,
        "ranks": [
            {key: r[key] for key in ("rollout_ids", "t_asked", "t_served", "t_trained")}
            for r in per_rank
        ],
    }


class Evaluator:
    """Rank 0's held-out and training pass rates (`evaluation.pass_rates`)."""

    def __init__(self, policy, spec: RunSpec) -> None:
        from rlfeed.service.gym.splits import make_split

        self.policy = policy  # the PackedLogProbs inside DDP: rank 0 alone calls it
        self.split = make_split(spec.train_tasks, spec.gym_seed)

    def __call__(self) -> dict:
        from rlfeed.service.learning.evaluation import pass_rates

        started = time.perf_counter()
        held_out = pass_rates(self.policy, self.split.held_out)
        train = pass_rates(self.policy, self.split.train)
        return {"held_out": held_out, "train": train, "seconds": time.perf_counter() - started}


def train(spec: RunSpec, run_dir: Path) -> None:
    """This rank's loop over the run's steps (process group already initialised)."""
    import torch.distributed as dist
    from rlfeed.client.loader import BatchLoader
    from rlfeed.client.packed_logprobs import PackedLogProbs
    from rlfeed.service.learning.policy import build_model
    from rlfeed.service.learning.weights import WeightsPublisher, WeightsReader
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(spec.policy)
    update = WeightsReader(run_dir / WEIGHTS_DIR).poll()
    if update is None or update[0] != spec.start_step:
        raise RuntimeError(
            f"rank {rank}: expected weights of version {spec.start_step} in "
            f"{run_dir / WEIGHTS_DIR}, found {None if update is None else update[0]}"
        )
    version, state = update
    model.load_state_dict(state)
    packed = PackedLogProbs(model)
    policy = DistributedDataParallel(packed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    lead = rank == 0
    publisher = WeightsPublisher(run_dir / WEIGHTS_DIR) if lead else None
    evaluator = Evaluator(packed, spec) if lead else None
    records = open(run_dir / STEPS_FILE, "a") if lead else None  # noqa: SIM115
    if records is not None:
        records.write(json.dumps({"eval": evaluator(), "version": version}) + "\n")
        records.flush()
    # prefetch 0: a step is fetched when asked, so the wait for it is measured, not hidden.
    loader = BatchLoader(
        spec.address, start_step=spec.start_step, stop_step=spec.end_step, prefetch=0
    )
    steps = iter(loader)
    try:
        for index in range(spec.steps):
            asked = time.time()
            step = next(steps)
            served = time.time()
            figures = rl_step(policy, optimizer, step, world_size=world_size, version=version)
            figures.update(t_asked=asked, t_served=served, t_trained=time.time())
            version += 1
            if publisher is not None:
                publisher.publish(version, model.state_dict())
            gathered = [None] * world_size if lead else None
            dist.gather_object(figures, gathered, dst=0)
            if records is not None:
                record = step_record(gathered, step, version - 1, world_size)
                last = index == spec.steps - 1
                if last or (index + 1) % spec.eval_every == 0:
                    record["eval"] = evaluator()
                records.write(json.dumps(record) + "\n")
                records.flush()
            loader.report(
                step.step,
                loss=figures["loss_sum"],  # this rank's term: the step loss is their mean
                ratio_outlier_share=figures["ratio_outliers"] / max(figures["policy_tokens"], 1)
                if index == 0
                else None,
                tokens_per_second=figures["tokens"] / max(figures["t_trained"] - served, 1e-9),
                step_seconds=figures["t_trained"] - served,
                # The version just published: the sidecar's max_policy_lag counts from it.
                policy_version=version if lead else None,
            )
    finally:
        loader.close()
        if records is not None:
            records.close()


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m rlfeed.service.learning.trainer")
    parser.add_argument("--run-dir", required=True, help="the run directory (run.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two ranks, producers and the sidecar share a few cores
    run_dir = Path(args.run_dir)
    spec = RunSpec.read(run_dir)
    dist.init_process_group("gloo")
    try:
        train(spec, run_dir)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
