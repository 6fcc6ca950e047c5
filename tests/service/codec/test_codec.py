"""Arrow IPC <-> numpy on the server: exact round trips, zero-copy, clear errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import ROLLOUT_SCHEMA
from rlfeed.sched.assembly import materialize_microbatch
from rlfeed.service.codec.messages import (
    RolloutBatchArrays,
    decode_microbatch,
    decode_rollout_batch,
    encode_microbatch,
    encode_microbatch_parts,
    join_rank_response,
)
from rlfeed.service.testing import synthetic_groups


def _ipc(table: pa.Table | pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    return sink.getvalue().to_pybytes()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), num_groups=st.integers(0, 5), group_size=st.integers(1, 4))
def test_decoded_batch_equals_the_submitted_arrays(seed, num_groups, group_size) -> None:
    rollouts = synthetic_groups(
        num_groups=num_groups, group_size=group_size, rng=np.random.default_rng(seed)
    )
    batch = decode_rollout_batch(rollouts.encode())
    assert batch.rollout_ids == rollouts.rollout_ids
    assert batch.task_ids == rollouts.task_ids and batch.group_ids == rollouts.group_ids
    np.testing.assert_array_equal(batch.policy_versions, rollouts.policy_versions)
    np.testing.assert_array_equal(batch.rewards, rollouts.rewards)
    columns = batch.columns
    for i in range(len(rollouts)):
        span = slice(int(columns.offsets[i]), int(columns.offsets[i + 1]))
        np.testing.assert_array_equal(columns.token_ids[span], rollouts.token_ids[i])
        np.testing.assert_array_equal(columns.action_mask[span], rollouts.action_mask[i])
        np.testing.assert_array_equal(columns.sampler_logprobs[span], rollouts.sampler_logprobs[i])
    # Segment sums against the per-rollout sums they replace.
    expected = [int(m.sum()) for m in rollouts.action_mask]
    assert batch.policy_tokens.tolist() == expected
    assert batch.token_bytes == 9 * sum(t.size for t in rollouts.token_ids)


def test_documented_dtypes_decode_without_copying_the_payload() -> None:
    rollouts = synthetic_groups(num_groups=2, group_size=3, rng=np.random.default_rng(0))
    payload = rollouts.encode()
    batch = decode_rollout_batch(payload)
    wire = np.frombuffer(payload, dtype=np.uint8)
    for name in ("token_ids", "action_mask", "sampler_logprobs"):
        assert np.shares_memory(getattr(batch, name), wire), f"{name} was copied"


def test_wider_integer_and_float_columns_are_cast_once() -> None:
    rollouts = synthetic_groups(num_groups=1, group_size=2, rng=np.random.default_rng(1))
    table = pa.table(
        {
            "rollout_id": pa.array(rollouts.rollout_ids, pa.large_string()),
            "task_id": rollouts.task_ids,
            "group_id": rollouts.group_ids,
            "policy_version": pa.array(rollouts.policy_versions, pa.int32()),
            "reward": pa.array(rollouts.rewards, pa.float32()),
            "token_ids": pa.array([t.astype(np.int64) for t in rollouts.token_ids]),
            "action_mask": pa.array(rollouts.action_mask, pa.large_list(pa.uint8())),
            "sampler_logprobs": pa.array(
                [lp.astype(np.float64) for lp in rollouts.sampler_logprobs]
            ),
        }
    )
    batch = decode_rollout_batch(_ipc(table))
    assert batch.token_ids.dtype == np.int32 and batch.sampler_logprobs.dtype == np.float32
    np.testing.assert_array_equal(batch.token_ids, np.concatenate(rollouts.token_ids))


def test_several_record_batches_in_one_stream_are_one_batch() -> None:
    rollouts = synthetic_groups(num_groups=2, group_size=2, rng=np.random.default_rng(2))
    whole = decode_rollout_batch(rollouts.encode())
    table = pa.ipc.open_stream(rollouts.encode()).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ROLLOUT_SCHEMA) as writer:
        for start in range(0, 4, 2):
            writer.write_batch(table.slice(start, 2).to_batches()[0])
    split = decode_rollout_batch(sink.getvalue().to_pybytes())
    assert split.rollout_ids == whole.rollout_ids
    np.testing.assert_array_equal(split.offsets, whole.offsets)
    np.testing.assert_array_equal(split.token_ids, whole.token_ids)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.drop_columns(["reward"]), r"missing column 'reward'"),
        (
            lambda t: t.set_column(5, "token_ids", pa.array([["a"]] * t.num_rows)),
            r"column 'token_ids' values must be int32",
        ),
        (
            lambda t: t.set_column(3, "policy_version", pa.array(["1"] * t.num_rows)),
            r"column 'policy_version' must be integer",
        ),
        (
            lambda t: t.set_column(4, "reward", pa.array([None] * t.num_rows, pa.float64())),
            r"rollout 'g0-r0': field reward is null",
        ),
    ],
)
def test_malformed_columns_are_value_errors_naming_the_column(change, message) -> None:
    rollouts = synthetic_groups(num_groups=1, group_size=2, rng=np.random.default_rng(3))
    table = pa.ipc.open_stream(rollouts.encode()).read_all()
    with pytest.raises(ValueError, match=message):
        decode_rollout_batch(_ipc(change(table)))


def test_bytes_that_are_not_arrow_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a readable Arrow IPC stream"):
        decode_rollout_batch(b"\x00\x01 certainly not arrow")


def test_microbatch_round_trips_through_its_wire_message() -> None:
    rollouts = synthetic_groups(num_groups=2, group_size=3, rng=np.random.default_rng(4))
    columns = decode_rollout_batch(rollouts.encode()).columns
    members = np.array([4, 0, 2])
    advantages = np.linspace(-1, 1, len(rollouts)).astype(np.float32)
    microbatch = materialize_microbatch(columns, members, advantages)
    message = encode_microbatch(microbatch, [rollouts.rollout_ids[i] for i in members])
    arrays = decode_microbatch(message)
    for name in ("input_ids", "position_ids", "target_ids", "loss_mask", "sampler_logprobs"):
        np.testing.assert_array_equal(arrays[name], getattr(microbatch, name))
    np.testing.assert_array_equal(arrays["advantages"], microbatch.advantages)
    np.testing.assert_array_equal(arrays["cu_seqlens"], microbatch.cu_seqlens)
    assert message.rollout_ids == ["g1-r1", "g0-r0", "g0-r2"]
    assert message.policy_tokens == int(microbatch.loss_mask.sum())
    assert message.max_seqlen == max(rollouts.token_ids[i].size for i in members)


def test_hand_joined_rank_response_is_byte_identical_to_protobuf_serialization() -> None:
    rollouts = synthetic_groups(num_groups=3, group_size=4, rng=np.random.default_rng(5))
    columns = decode_rollout_batch(rollouts.encode()).columns
    advantages = np.linspace(-1, 1, len(rollouts)).astype(np.float32)
    members = [np.array([3, 1, 7]), np.array([], dtype=np.int64), np.array([11, 0])]
    microbatches = [materialize_microbatch(columns, m, advantages) for m in members]
    names = [[rollouts.rollout_ids[i] for i in m] for m in members]
    header = pb.GetBatchResponse(
        ready=True, step=300, rank=1, world_size=2, policy_token_count=2**40,
        microbatches_per_rank=3, policy_version=7, min_policy_version=5, num_rollouts=5,
    )  # fmt: skip
    parts = [encode_microbatch_parts(mb, ids) for mb, ids in zip(microbatches, names, strict=True)]
    straightforward = pb.GetBatchResponse()
    straightforward.CopyFrom(header)
    straightforward.microbatches.extend(
        encode_microbatch(mb, ids) for mb, ids in zip(microbatches, names, strict=True)
    )
    joined = join_rank_response(header, parts)
    assert joined == straightforward.SerializeToString(deterministic=True)
    assert pb.GetBatchResponse.FromString(joined) == straightforward


@pytest.mark.parametrize("value", [1, 127, 128, 300, 2**14, 2**21 + 5, 2**35, 2**64 - 1])
def test_hand_written_varints_match_protobuf(value: int) -> None:
    from rlfeed.proto.wire import encode_varint as _varint

    # RolloutBatch.sequence is field 2, varint wire type: tag byte 0x10, then the varint.
    assert b"\x10" + _varint(value) == pb.RolloutBatch(sequence=value).SerializeToString()


def _batch_with_rollout_id_column(rollout_id_column, n: int) -> bytes:
    columns = dict(
        rollout_id=rollout_id_column,
        task_id=pa.array(["t"] * n),
        group_id=pa.array(["g"] * n),
        policy_version=pa.array([0] * n, pa.int64()),
        reward=pa.array([1.0] * n),
        token_ids=pa.array([[0, 1]] * n, pa.list_(pa.int32())),
        action_mask=pa.array([[0, 1]] * n, pa.list_(pa.uint8())),
        sampler_logprobs=pa.array([[0, -1]] * n, pa.list_(pa.float32())),
    )
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_crafted_string_offsets_are_a_value_error_not_an_out_of_bounds_read():
    # Offsets that jump far past the data but end in range pass Arrow's cheap checks.
    offsets = np.array([0, 2_000_000_000, 4], dtype=np.int32)
    ids = pa.StringArray.from_buffers(2, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"r0r1"))
    with pytest.raises(ValueError, match="arrow_ipc"):
        decode_rollout_batch(_batch_with_rollout_id_column(ids, 2))


def test_a_duplicated_column_is_a_value_error_naming_it():
    payload = _batch_with_rollout_id_column(pa.array(["a", "b"]), 2)
    table = pa.ipc.open_stream(payload).read_all()
    doubled = table.append_column("reward", pa.array([0.0, 1.0]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, doubled.schema) as writer:
        writer.write_table(doubled)
    with pytest.raises(ValueError, match="'reward'"):
        decode_rollout_batch(sink.getvalue().to_pybytes())


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(0, 6), st.integers(500, 1500)), max_size=8),
    mask_values=st.sampled_from([2, 2, 4]),
    seed=st.integers(0, 2**31),
)
def test_policy_tokens_are_per_rollout_mask_sums_even_for_empty_rollouts(
    lengths, mask_values, seed
) -> None:
    """Short and long rollouts (counted rollout by rollout), and masks with values above 1
    (not validated yet, so not countable as nonzeros): always the plain sums."""
    rng = np.random.default_rng(seed)
    masks = [rng.integers(0, mask_values, size, dtype=np.uint8) for size in lengths]
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    total = int(offsets[-1])
    batch = RolloutBatchArrays(
        rollout_ids=[f"r{i}" for i in range(len(lengths))],
        task_ids=["t"] * len(lengths),
        group_ids=["g"] * len(lengths),
        policy_versions=np.zeros(len(lengths), np.int64),
        rewards=np.zeros(len(lengths)),
        token_ids=np.zeros(total, np.int32),
        action_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
        sampler_logprobs=np.zeros(total, np.float32),
        offsets=offsets,
        mask_offsets=offsets,
        logprob_offsets=offsets,
    )
    assert batch.policy_tokens.tolist() == [int(m.sum()) for m in masks]
