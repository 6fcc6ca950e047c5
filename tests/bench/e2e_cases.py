"""The end-to-end benchmark's workloads: its cases, the command line's options, and the
rollouts, writer batches and Arrow payloads every part of the run (producers, raw baseline,
stages) is given, so each part sends exactly the same bytes.

Shared by `bench_e2e_throughput.py` (the entry point) and its sibling modules."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WORLD_SIZE = 2
# The ranks opt in to glibc keeping freed memory (BatchLoader's default is off), as the
# figures in the README were measured; the raw client takes the same setting.
RANK_RETAINED_FREE_MIB = 256
CASES = {
    # name: (tokens per rollout, rollouts, prompts_per_step, group_size, writer batch, budget)
    # A writer batch of None keeps RolloutWriter's defaults (256 rollouts or 8 MiB: 114
    # rollouts of 8k tokens); 256 rollouts of 100 tokens would be only 230 KiB, so the
    # short case's producers raise the count, as such a producer would.
    "long": (8192, 2048, 8, 8, None, 65536),
    "short": (100, 40_960, 64, 8, 2048, 65536),
}


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    rollouts: int
    prompts_per_step: int
    group_size: int
    batch_rollouts: int | None  # None: RolloutWriter's default
    token_budget: int

    @property
    def steps(self) -> int:
        return self.rollouts // (self.prompts_per_step * self.group_size)

    def writer_limits(self) -> dict[str, int]:
        """The RolloutWriter batch limits the producers use: the writer's defaults, or
        exactly `batch_rollouts` rollouts per batch, whatever their bytes."""
        from rlfeed.client.producer import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_BATCH_ROLLOUTS

        if self.batch_rollouts is None:
            return {
                "max_batch_rollouts": DEFAULT_MAX_BATCH_ROLLOUTS,
                "max_batch_bytes": DEFAULT_MAX_BATCH_BYTES,
            }
        return {"max_batch_rollouts": self.batch_rollouts, "max_batch_bytes": 1 << 62}


@dataclass(frozen=True)
class Options:
    """How the end-to-end run is set up (the command line's flags)."""

    producers: int = 2
    in_flight: int = 1  # batches each producer keeps in flight
    cpu: bool = False  # print CPU seconds per process in the window
    replicas: int = 1  # front-ends on the sidecar's port
    client_env: dict[str, str] = field(default_factory=dict)  # every client's environment
    warm_up: bool = True  # producers and ranks run the workload once untimed first
    journal: str | None = None  # [journal] sync policy, journal in a fresh temp dir; None: off
    direct_io: bool = True  # [journal] direct_io: large records written with O_DIRECT

    def first_timed_step(self, case: Case) -> int:
        """The first step in the timed window: the warm-up pass has the steps before it."""
        return case.steps if self.warm_up else 0


def make_rows(case: Case, producer: int, producers: int) -> list[dict]:
    """This producer's share of complete groups, as RolloutWriter.write keyword dicts."""
    rng = np.random.default_rng(producer)
    groups = case.rollouts // case.group_size
    rows = []
    mask = np.ones(case.tokens, np.uint8)
    mask[: case.tokens // 4] = 0  # a prompt, then policy tokens
    for g in range(producer, groups, producers):
        for k in range(case.group_size):
            rows.append(
                {
                    "rollout_id": f"g{g}/{k}",
                    "task_id": f"task-{g % 64}",
                    "group_id": f"g{g}",
                    "policy_version": 0,
                    "reward": float(rng.random() < 0.5),
                    "token_ids": rng.integers(0, 32000, case.tokens, dtype=np.int32),
                    "action_mask": mask,
                    "sampler_logprobs": np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                }
            )
    return rows


def warm_up_rows(rows: list[dict]) -> list[dict]:
    """The same rollouts under other ids (new groups, not duplicates): the untimed pass."""
    return [
        {**row, "rollout_id": f"warm-{row['rollout_id']}", "group_id": f"warm-{row['group_id']}"}
        for row in rows
    ]


def writer_batches(case: Case, rows: list[dict]) -> list[list[dict]]:
    """These rows split as RolloutWriter splits them: a batch is sealed at
    `max_batch_rollouts` rollouts or `max_batch_bytes` bytes (as `append` counts them)."""
    from rlfeed.client.arrow_codec import RolloutColumns

    limits = case.writer_limits()
    batches, batch, batch_bytes = [], [], 0
    for row in rows:
        batch.append(row)
        batch_bytes += RolloutColumns.empty().append(**row)
        if len(batch) >= limits["max_batch_rollouts"] or batch_bytes >= limits["max_batch_bytes"]:
            batches.append(batch)
            batch, batch_bytes = [], 0
    if batch:
        batches.append(batch)
    return batches


def payloads(case: Case, rows: list[dict]) -> list[bytes]:
    """The Arrow payloads RolloutWriter sends for these rows (same batch boundaries)."""
    from rlfeed.client.arrow_codec import RolloutColumns, encode_rollouts

    out = []
    for batch in writer_batches(case, rows):
        columns = RolloutColumns.empty()
        for row in batch:
            columns.append(**row)
        out.append(encode_rollouts(columns))
    return out
