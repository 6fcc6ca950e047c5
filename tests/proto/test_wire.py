"""Messages read in place (client/wire.py) equal what the generated classes parse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.client.arrow_codec import decode_step, parse_get_batch_response
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.wire import read_varint, split_field
from rlfeed.sched.assembly import StepConfig, StepRollouts, assemble_step
from rlfeed.service.codec.materialize import materialize_step
from rlfeed.service.codec.messages import decode_rollout_batch, parse_rollout_batch
from rlfeed.service.testing import synthetic_groups


@settings(max_examples=50, deadline=None)
@given(value=st.integers(0, 2**64 - 1))
def test_varints_read_back_what_protobuf_writes(value: int) -> None:
    wire = pb.RolloutBatch(sequence=value).SerializeToString()  # tag 0x10, then the varint
    if value == 0:
        assert wire == b""  # proto3 leaves a default value out
    else:
        assert read_varint(memoryview(wire), 1) == (value, len(wire))


@settings(max_examples=50, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), min_size=0, max_size=3),
    sequence=st.integers(0, 2**64 - 1),
    unknown=st.booleans(),
)
def test_rollout_batch_view_equals_the_generated_parse(payloads, sequence, unknown) -> None:
    # Several arrow_ipc occurrences (the last wins) and fields this version does not know.
    wire = b"".join(pb.RolloutBatch(arrow_ipc=p).SerializeToString() for p in payloads)
    wire += pb.RolloutBatch(sequence=sequence).SerializeToString()
    if unknown:
        wire += b"\x1a\x03abc" + b"\x25\x01\x02\x03\x04" + b"\x29" + bytes(8)  # 3, 4, 5
    view = parse_rollout_batch(wire)
    message = pb.RolloutBatch.FromString(wire)
    assert bytes(view.arrow_ipc) == message.arrow_ipc and view.sequence == message.sequence


def test_rollout_batch_view_aliases_the_request_bytes() -> None:
    payload = synthetic_groups(num_groups=2, group_size=3, rng=np.random.default_rng(0)).encode()
    wire = pb.RolloutBatch(arrow_ipc=payload, sequence=4).SerializeToString()
    view = parse_rollout_batch(wire)
    assert view.arrow_ipc.obj is wire
    arrays = decode_rollout_batch(view.arrow_ipc)
    np.testing.assert_array_equal(arrays.token_ids, decode_rollout_batch(payload).token_ids)


@pytest.mark.parametrize("wire", [b"\x0a\x05ab", b"\x0a", b"\x80", b"\x0b\x00"])
def test_malformed_bytes_raise_what_the_generated_parse_raises(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.RolloutBatch.FromString(wire)
    with pytest.raises(DecodeError):
        parse_rollout_batch(wire)
    with pytest.raises(DecodeError):
        parse_get_batch_response(wire)


def test_truncated_fields_are_refused_by_the_walk() -> None:
    with pytest.raises(ValueError, match="truncated"):
        split_field(memoryview(b"\x0a\x05ab"), 1)


def served_step(world_size: int = 2) -> list[bytes]:
    rollouts = synthetic_groups(num_groups=3, group_size=4, rng=np.random.default_rng(3))
    columns = decode_rollout_batch(rollouts.encode()).columns
    plan = assemble_step(
        StepRollouts(
            lengths=columns.lengths,
            policy_tokens=np.add.reduceat(
                columns.action_mask.astype(np.int64), columns.offsets[:-1]
            ),
            rewards=np.asarray(rollouts.rewards, np.float64),
            group_ids=np.repeat(np.arange(3), 4),
        ),
        StepConfig(token_budget=1024, world_size=world_size),
    )
    return materialize_step(
        step=5,
        plan=plan,
        rows=[(0, i) for i in range(len(rollouts))],
        rollout_ids=rollouts.rollout_ids,
        policy_versions=np.zeros(len(rollouts), np.int64),
        columns={0: columns},
    )


def test_served_response_view_decodes_to_the_same_tensors_as_the_message() -> None:
    for wire in served_step():
        view, message = parse_get_batch_response(wire), pb.GetBatchResponse.FromString(wire)
        assert view.step == message.step and view.rank == message.rank
        assert view.policy_token_count == message.policy_token_count
        assert len(view.microbatches) == len(message.microbatches) > 0
        for got, want in zip(decode_step(view), decode_step(message), strict=True):
            for name in ("input_ids", "position_ids", "cu_seqlens", "target_ids", "loss_mask"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert torch.equal(got.advantages, want.advantages)
            assert got.rollout_ids == want.rollout_ids and got.max_seqlen == want.max_seqlen


def test_served_tensors_alias_the_received_bytes() -> None:
    wire = served_step()[0]
    start = np.frombuffer(wire, np.uint8).ctypes.data
    (first, *_) = decode_step(parse_get_batch_response(wire))
    for name in ("input_ids", "target_ids", "loss_mask", "sampler_logprobs", "advantages"):
        assert start <= getattr(first, name).data_ptr() < start + len(wire), f"{name} copied"


def test_a_not_ready_answer_reads_as_not_ready() -> None:
    view = parse_get_batch_response(pb.GetBatchResponse(step=3).SerializeToString())
    assert not view.ready and view.step == 3 and view.microbatches == []


@pytest.mark.parametrize("sequence", [0, 1, 300, 2**63])
def test_serialized_rollout_batch_is_byte_identical_to_the_generated_one(sequence: int) -> None:
    from rlfeed.client.arrow_codec import RolloutColumns, encode_rollout_batch, encode_rollouts

    rows = RolloutColumns.empty()
    rng = np.random.default_rng(sequence % 7)
    for i in range(5):
        length = int(rng.integers(2, 50))
        mask = (np.arange(length) >= length // 2).astype(np.uint8)
        rows.append(
            rollout_id=f"r{i}", task_id="t", group_id="g", policy_version=i, reward=0.5,
            token_ids=rng.integers(0, 1000, length), action_mask=mask,
            sampler_logprobs=np.where(mask > 0, -0.25, 0.0),
        )  # fmt: skip
    generated = pb.RolloutBatch(arrow_ipc=encode_rollouts(rows), sequence=sequence)
    assert encode_rollout_batch(rows, sequence) == generated.SerializeToString()


@settings(max_examples=40, deadline=None)
@given(
    arrow=st.lists(st.binary(max_size=400), max_size=3),
    ids=st.lists(st.text(max_size=200), max_size=40),
    cu_seqlens=st.lists(st.integers(0, 2**31 - 1), max_size=30),
    max_seqlen=st.integers(-(2**31), 2**31 - 1),
    num_tokens=st.integers(0, 2**32 - 1),
)
def test_splitting_out_a_field_leaves_the_rest_of_the_message(
    arrow, ids, cu_seqlens, max_seqlen, num_tokens
) -> None:
    rest = pb.Microbatch(
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, rollout_ids=ids, num_tokens=num_tokens
    ).SerializeToString()
    # arrow_ipc before, between (several occurrences: the last wins) and after the rest
    pieces = [pb.Microbatch(arrow_ipc=a).SerializeToString() for a in arrow]
    wire = b"".join([*pieces[:1], rest, *pieces[1:]])
    values, others = split_field(memoryview(wire), 1)
    message = pb.Microbatch.FromString(wire)
    assert (bytes(values[-1]) if values else b"") == message.arrow_ipc
    message.ClearField("arrow_ipc")
    assert pb.Microbatch.FromString(others) == message


def test_token_bytes_agree_between_the_schema_and_the_scheduler():
    """The scheduler counts buffered bytes without pyarrow; its constant is the schema's."""
    from rlfeed.proto.arrow_schemas import TOKEN_BYTES as SCHEMA_TOKEN_BYTES
    from rlfeed.sched.assembly import TOKEN_BYTES

    assert TOKEN_BYTES == SCHEMA_TOKEN_BYTES == 9
