"""The clients of `bench_chaos.py`, one process each, killed (SIGKILL) and restarted by it:
a producer on the real `RolloutWriter`, a trainer rank on the real `BatchLoader`. Each
keeps what it must survive a kill with in files under OUT, as a real one keeps it in its
own state:

    python tests/bench/chaos_clients.py producer ADDRESSES OUT INDEX SEED PACE_S
    python tests/bench/chaos_clients.py trainer ADDRESSES OUT RANK WORLD_SIZE

Producer INDEX writes groups 0, 1, 2, ... (4 rollouts each, ids `p{INDEX}-g{g}-r{k}`, the
same content on every run), two groups at a time, then `flush()`es and appends "FIRST END"
to `producer-INDEX.acked`: those groups are acknowledged. Restarted, it starts again at
the first group not in that file, so it resends what it had not seen acknowledged (the
sidecar answers `duplicate` for what it already has). It stops at a chunk's end once
OUT/stop-producers exists, writing OUT/producer-INDEX.done.

Trainer RANK iterates steps with `auto_ack=False`, appends each step it is served to
`rank-RANK.served` (step, a digest of its tensors, its rollout ids, the time), and every
CHECKPOINT_EVERY steps writes `rank-RANK.ckpt` ({"next_step"}) and then acknowledges the
step (`loader.ack`): the documented checkpoint pattern. Restarted, it resumes at the
checkpoint, so the steps since are served to it again (they must be byte-identical).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

GROUP_SIZE, TASKS = 4, [f"task-{i}" for i in range(8)]  # as `exactly_once.CONFIG` wants
GROUPS_PER_FLUSH = 2
CHECKPOINT_EVERY = 3
OUTAGE_S = 900.0  # how long a client rides through the sidecar not answering


def acked_groups(out: Path, index: int) -> int:
    """The first group producer `index` has not seen acknowledged."""
    path = out / f"producer-{index}.acked"
    numbers = path.read_text().split() if path.exists() else []  # whole lines: one write each
    return int(numbers[-1]) if numbers else 0


def rollout_ids(index: int, group: int) -> list[str]:
    return [f"p{index}-g{group}-r{k}" for k in range(GROUP_SIZE)]


def _write_group(writer, index: int, group: int, seed: int) -> None:
    rng = np.random.default_rng([seed, index, group])
    for k, rollout_id in enumerate(rollout_ids(index, group)):
        length = int(rng.integers(24, 120))
        prompt = int(rng.integers(4, length // 2))
        mask = np.r_[np.zeros(prompt, np.uint8), np.ones(length - prompt, np.uint8)]
        writer.write(
            rollout_id=rollout_id,
            task_id=TASKS[group % len(TASKS)],
            group_id=f"p{index}-g{group}",
            policy_version=0,
            reward=float(rng.integers(0, 2)) + 0.01 * k,  # never a zero-advantage group
            token_ids=rng.integers(0, 1000, length).astype(np.int32),
            action_mask=mask,
            sampler_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        )


def producer(addresses: str, out: Path, index: int, seed: int, pace_s: float) -> None:
    from rlfeed.client.producer import RolloutWriter

    group = acked_groups(out, index)
    writer = RolloutWriter(
        addresses,
        max_batch_rollouts=3,  # a group's rollouts span batches
        connect_timeout_s=OUTAGE_S,
        reconnect_timeout_s=OUTAGE_S,
    )
    writer.register_tasks(TASKS)
    with (out / f"producer-{index}.acked").open("a") as log:
        while not (out / "stop-producers").exists():
            for offset in range(GROUPS_PER_FLUSH):
                _write_group(writer, index, group + offset, seed)
            writer.flush()
            group += GROUPS_PER_FLUSH
            log.write(f"{group - GROUPS_PER_FLUSH} {group}\n")
            log.flush()
            time.sleep(pace_s)
    writer.close()
    (out / f"producer-{index}.done").write_text(str(group))


def step_content(step) -> tuple[str, list[str]]:
    """A digest of everything a rank is served of a step, and its rollout ids."""
    digest, ids = hashlib.sha256(), []
    for mb in step:
        for tensor in (mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.target_ids,
                       mb.loss_mask, mb.sampler_logprobs, mb.advantages):  # fmt: skip
            digest.update(tensor.numpy().tobytes())
        digest.update("\0".join(mb.rollout_ids).encode())
        ids.extend(mb.rollout_ids)
    digest.update(f"{step.policy_token_count} {step.policy_version}".encode())
    return digest.hexdigest(), ids


def trainer(addresses: str, out: Path, rank: int, world_size: int) -> None:
    from rlfeed.client.loader import BatchLoader

    checkpoint = out / f"rank-{rank}.ckpt"
    start = json.loads(checkpoint.read_text())["next_step"] if checkpoint.exists() else 0
    loader = BatchLoader(
        addresses,
        rank,
        world_size,
        start_step=start,
        auto_ack=False,
        timeout_s=4 * OUTAGE_S,
        connect_timeout_s=OUTAGE_S,
        reconnect_timeout_s=OUTAGE_S,
    )
    with (out / f"rank-{rank}.served").open("a") as log:
        for step in loader:
            digest, ids = step_content(step)
            line = {"step": step.step, "digest": digest, "ids": ids, "t": time.time()}
            log.write(json.dumps(line) + "\n")
            log.flush()
            if (step.step + 1) % CHECKPOINT_EVERY == 0:
                temporary = checkpoint.with_suffix(".tmp")
                temporary.write_text(json.dumps({"next_step": step.step + 1}))
                os.replace(temporary, checkpoint)
                loader.ack(step.step)


if __name__ == "__main__":
    role, addresses, out, *rest = sys.argv[1:]
    if role == "producer":
        producer(addresses, Path(out), int(rest[0]), int(rest[1]), float(rest[2]))
    else:
        trainer(addresses, Path(out), int(rest[0]), int(rest[1]))
