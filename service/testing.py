"""Synthetic rollouts, a test-only encoder and an independent checker of served steps.

`synthetic_groups` makes complete groups of random rollouts (long-tailed lengths, a prompt,
then policy tokens); `encode_rollout_arrays` turns per-rollout arrays into a RolloutBatch
Arrow payload (each list column with its own offsets, so malformed batches are expressible).
`check_served_step` verifies every rank's GetBatchResponse of a step against the submitted
arrays by the straightforward computation, one sequence at a time. `fetch_served_bytes`
asks a sidecar for one (step, rank); `step_record` is a plausible StepRecord.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pyarrow as pa
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import ROLLOUT_SCHEMA
from rlfeed.service.codec.messages import decode_microbatch
from rlfeed.service.scheduler.records import StepRecord


@dataclass
class SyntheticRollouts:
    """n rollouts as per-rollout Python lists / arrays (row i = rollout i)."""

    rollout_ids: list[str]
    task_ids: list[str]
    group_ids: list[str]
    policy_versions: list[int]
    rewards: list[float]
    token_ids: list[np.ndarray]  # int32 [L_i]
    action_mask: list[np.ndarray]  # uint8 [L_i]
    sampler_logprobs: list[np.ndarray]  # float32 [L_i]

    def __len__(self) -> int:
        return len(self.rollout_ids)

    def subset(self, rows: Sequence[int]) -> SyntheticRollouts:
        rows = list(rows)
        return SyntheticRollouts(
            **{name: [getattr(self, name)[i] for i in rows] for name in _FIELDS}
        )

    def encode(self, rows: Sequence[int] | None = None) -> bytes:
        """Arrow IPC payload of a RolloutBatch holding `rows` (default all)."""
        part = self if rows is None else self.subset(rows)
        return encode_rollout_arrays(**{name: getattr(part, name) for name in _FIELDS})

    def row_of(self) -> dict[str, int]:
        return {rollout_id: i for i, rollout_id in enumerate(self.rollout_ids)}


_FIELDS = (
    "rollout_ids",
    "task_ids",
    "group_ids",
    "policy_versions",
    "rewards",
    "token_ids",
    "action_mask",
    "sampler_logprobs",
)


def encode_rollout_arrays(
    *,
    rollout_ids: Sequence[str],
    task_ids: Sequence[str],
    group_ids: Sequence[str],
    policy_versions: Sequence[int],
    rewards: Sequence[float],
    token_ids: Sequence[np.ndarray],
    action_mask: Sequence[np.ndarray],
    sampler_logprobs: Sequence[np.ndarray],
) -> bytes:
    """Per-rollout arrays -> Arrow IPC stream bytes in ROLLOUT_SCHEMA (tests and tools).

    Each list column gets its own offsets, so a length mismatch is representable (and is
    then rejected by validation, which is what the tests want to exercise).
    """

    def list_array(arrays: Sequence[np.ndarray], dtype: type) -> pa.ListArray:
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        values = (
            np.concatenate([np.asarray(a, dtype=dtype) for a in arrays])
            if len(arrays)
            else np.zeros(0, dtype)
        )
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(list(rollout_ids), pa.string()),
            pa.array(list(task_ids), pa.string()),
            pa.array(list(group_ids), pa.string()),
            pa.array(np.asarray(policy_versions, dtype=np.int64)),
            pa.array(np.asarray(rewards, dtype=np.float64)),
            list_array(token_ids, np.int32),
            list_array(action_mask, np.uint8),
            list_array(sampler_logprobs, np.float32),
        ],
        schema=ROLLOUT_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def synthetic_groups(
    *,
    num_groups: int,
    group_size: int,
    rng: np.random.Generator,
    tasks: Sequence[str] | None = None,
    prefix: str = "",
    max_length: int = 200,
    vocab_size: int = 1000,
    policy_version: int = 0,
    pass_rate: float = 0.5,
) -> SyntheticRollouts:
    """Complete groups: group g is task tasks[g % len(tasks)] (default "task-g"), rollout
    ids f"{prefix}g{g}-r{i}", binary rewards with probability `pass_rate`, lengths
    log-normal in [2, max_length], prompt tokens masked 0 then policy tokens masked 1."""
    rows: dict[str, list] = {name: [] for name in _FIELDS}
    for g in range(num_groups):
        task = tasks[g % len(tasks)] if tasks else f"task-{g}"
        for i in range(group_size):
            length = int(np.clip(rng.lognormal(np.log(max_length / 4), 0.8), 2, max_length))
            prompt = int(rng.integers(1, length))
            mask = np.zeros(length, dtype=np.uint8)
            mask[prompt:] = 1
            rows["rollout_ids"].append(f"{prefix}g{g}-r{i}")
            rows["task_ids"].append(task)
            rows["group_ids"].append(f"{prefix}g{g}")
            rows["policy_versions"].append(policy_version)
            rows["rewards"].append(float(rng.random() < pass_rate))
            rows["token_ids"].append(rng.integers(0, vocab_size, length).astype(np.int32))
            rows["action_mask"].append(mask)
            rows["sampler_logprobs"].append(
                np.where(mask == 1, -rng.exponential(1.0, length), 0.0).astype(np.float32)
            )
    return SyntheticRollouts(**rows)


def expected_advantages(
    rewards: np.ndarray, group_of: np.ndarray, mode: str, scale: float = 1.0
) -> np.ndarray:
    """Group-relative advantages computed one group at a time (the straightforward way)."""
    advantages = np.zeros(rewards.size, dtype=np.float64)
    for group in np.unique(group_of):
        members = group_of == group
        r = rewards[members]
        if r.min() == r.max():
            continue
        centered = r - r.mean()
        if mode == "mean_std":
            centered = centered / (r.std() + 1e-6)
        elif mode == "constant":
            centered = centered / scale
        advantages[members] = centered
    return advantages


def _as_response(response: bytes | pb.GetBatchResponse) -> pb.GetBatchResponse:
    return pb.GetBatchResponse.FromString(response) if isinstance(response, bytes) else response


def check_served_step(
    responses: Sequence[bytes | pb.GetBatchResponse],
    submitted: SyntheticRollouts,
    *,
    advantage_mode: str = "mean_std",
    advantage_scale: float = 1.0,
) -> list[str]:
    """Assert every rank's response of one step matches `submitted`; returns the served
    rollout ids (each exactly once). `responses[r]` must be rank r's response."""
    responses = [_as_response(r) for r in responses]
    row_of = submitted.row_of()
    first = responses[0]
    served: list[str] = []
    served_advantage: dict[str, float] = {}
    total_policy_tokens = 0
    for rank, response in enumerate(responses):
        assert response.ready and response.rank == rank and response.step == first.step
        assert response.world_size == len(responses)
        assert response.policy_token_count == first.policy_token_count
        assert len(response.microbatches) == response.microbatches_per_rank
        assert response.microbatches_per_rank == first.microbatches_per_rank
        for microbatch in response.microbatches:
            arrays = decode_microbatch(microbatch)
            cu = arrays["cu_seqlens"]
            lengths = np.diff(cu)
            assert cu[0] == 0 and cu[-1] == microbatch.num_tokens == arrays["input_ids"].size
            assert microbatch.max_seqlen == (int(lengths.max()) if lengths.size else 0)
            assert int(arrays["loss_mask"].sum()) == microbatch.policy_tokens
            assert len(microbatch.rollout_ids) == lengths.size
            for k, rollout_id in enumerate(microbatch.rollout_ids):
                row = row_of[rollout_id]
                seg = slice(int(cu[k]), int(cu[k + 1]))
                tokens = submitted.token_ids[row]
                mask = submitted.action_mask[row]
                logprobs = submitted.sampler_logprobs[row]
                assert lengths[k] == tokens.size, f"{rollout_id}: length"
                np.testing.assert_array_equal(arrays["input_ids"][seg], tokens)
                np.testing.assert_array_equal(arrays["position_ids"][seg], np.arange(tokens.size))
                np.testing.assert_array_equal(arrays["target_ids"][seg], np.r_[tokens[1:], 0])
                np.testing.assert_array_equal(arrays["loss_mask"][seg], np.r_[mask[1:], 0])
                np.testing.assert_array_equal(
                    arrays["sampler_logprobs"][seg], np.r_[logprobs[1:], 0.0].astype(np.float32)
                )
                advantage = arrays["advantages"][seg]
                on_policy = arrays["loss_mask"][seg] == 1
                assert np.all(advantage[~on_policy] == 0), f"{rollout_id}: advantage off policy"
                value = float(advantage[on_policy][0]) if on_policy.any() else 0.0
                assert np.all(advantage[on_policy] == np.float32(value))
                served_advantage[rollout_id] = value
                total_policy_tokens += int(mask.sum())
                served.append(rollout_id)
    assert len(served) == len(set(served)), "a rollout was served twice in one step"
    assert total_policy_tokens == first.policy_token_count
    assert len(served) == first.num_rollouts
    # Advantages of the served groups, recomputed group by group from the submitted rewards.
    rows = np.array([row_of[r] for r in served])
    group_names = np.array([submitted.group_ids[i] for i in rows])
    _, group_of = np.unique(group_names, return_inverse=True)
    expected = expected_advantages(
        np.array([submitted.rewards[i] for i in rows], dtype=np.float64),
        group_of,
        advantage_mode,
        advantage_scale,
    )
    for rollout_id, value, mask_sum in zip(
        served, expected, (int(submitted.action_mask[i].sum()) for i in rows), strict=True
    ):
        if mask_sum:
            assert abs(served_advantage[rollout_id] - value) <= 1e-5 * max(1.0, abs(value))
    return served


def fetch_served_bytes(channel: grpc.Channel, step: int, rank: int) -> bytes:
    """GetBatch(step, rank) with no deserializer: the exact response bytes served."""
    get = channel.unary_unary(
        "/rlfeed.v1.BatchServing/GetBatch",
        request_serializer=pb.GetBatchRequest.SerializeToString,
        response_deserializer=None,
    )
    return get(pb.GetBatchRequest(step=step, rank=rank, timeout_ms=10_000), timeout=30)


def step_record(**fields) -> StepRecord:
    """A StepRecord with plausible figures, `fields` overriding them."""
    values = dict(
        step=0, num_rollouts=8, num_groups=2, zero_advantage_groups=1,
        zero_advantage_groups_dropped=0, policy_token_count=100, real_tokens=400,
        computed_positions=400, padded_positions=640, largest_microbatch_positions=300,
        rank_imbalance=1.5, lockstep_efficiency=0.66, microbatches_per_rank=1,
        policy_version=0, min_policy_version=0, response_bytes=0,
        compute_rank_imbalance=1.8, compute_lockstep_efficiency=0.55,
    )  # fmt: skip
    return StepRecord(**{**values, **fields})
