"""Served responses written from views of the ingest columns equal the straightforward ones.

`materialize_step` joins each rank's response from pieces (views of the source columns,
constants, a reused scratch). Checked here byte for byte against two references: the
gather-then-encode route it replaced (`materialize_sequences` + `encode_microbatch_parts` +
`join_rank_response`), and plain protobuf serialization of `assembly.materialize_microbatch`
over the concatenated columns; and, decoded by the client, against the reference arrays.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.client.arrow_codec import decode_step, parse_get_batch_response
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import MICROBATCH_SCHEMA
from rlfeed.sched.assembly import (
    StepConfig,
    StepRollouts,
    TokenColumns,
    assemble_step,
    materialize_microbatch,
)
from rlfeed.sched.gather import COLUMN_DTYPES, TokenScratch, materialize_sequences
from rlfeed.service.codec import response_pieces
from rlfeed.service.codec.materialize import materialize_step
from rlfeed.service.codec.messages import (
    _ipc_bytes,
    encode_microbatch,
    encode_microbatch_parts,
    join_rank_response,
)
from rlfeed.service.codec.response_pieces import arrow_stream_pieces, rank_header, thread_scratch

COLUMNS = ("input_ids", "target_ids", "loss_mask", "sampler_logprobs", "advantages")


def make_batch(rng: np.random.Generator, lengths: list[int]) -> TokenColumns:
    """Rollouts of `lengths`: a prompt (mask 0, at least the first token), then a mix of
    policy and observation tokens."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    total = int(offsets[-1])
    action_mask = (rng.random(total) < 0.7).astype(np.uint8)
    action_mask[offsets[:-1]] = 0
    logprobs = np.where(action_mask > 0, -rng.random(total), 0.0).astype(np.float32)
    token_ids = rng.integers(0, 50_000, total).astype(np.int32)
    return TokenColumns(offsets, token_ids, action_mask, logprobs)


class Step:
    """A random step: rollouts drawn from several ingest batches, keyed like the server."""

    def __init__(self, rng, batch_lengths, group_size, world_size, drop_zero_advantage):
        keys = sorted(rng.choice(100, len(batch_lengths), replace=False).tolist())
        self.columns = {
            key: make_batch(rng, lengths) for key, lengths in zip(keys, batch_lengths, strict=True)
        }
        pairs = [(key, row) for key in keys for row in range(len(self.columns[key].lengths))]
        order = rng.permutation(len(pairs))  # arrival order differs from batch order
        self.rows = [pairs[i] for i in order]
        n = len(self.rows)
        self.rollout_ids = [f"r{key}-{row}" for key, row in self.rows]
        self.policy_versions = rng.integers(0, 5, n).astype(np.int64)
        lengths = np.array([self.columns[k].lengths[r] for k, r in self.rows], np.int64)
        policy_tokens = np.array(
            [self._mask(k, r).sum(dtype=np.int64) for k, r in self.rows], np.int64
        )
        self.plan = assemble_step(
            StepRollouts(
                lengths=lengths,
                policy_tokens=policy_tokens,
                rewards=rng.integers(0, 2, n).astype(np.float64),  # all-equal groups happen
                group_ids=np.arange(n) // group_size,
            ),
            StepConfig(
                token_budget=int(max(lengths.max(), rng.integers(1, 3000))),
                world_size=world_size,
                drop_zero_advantage=drop_zero_advantage,
            ),
        )

    def _mask(self, key: int, row: int) -> np.ndarray:
        columns = self.columns[key]
        return columns.action_mask[columns.offsets[row] : columns.offsets[row + 1]]

    def served(self, **kwargs) -> list[bytes]:
        return materialize_step(
            step=7,
            plan=self.plan,
            rows=self.rows,
            rollout_ids=self.rollout_ids,
            policy_versions=self.policy_versions,
            columns=self.columns,
            **kwargs,
        )

    def gather_then_encode(self) -> list[bytes]:
        """The route `materialize_step` replaced: fresh arrays per microbatch, then encode."""
        keys = sorted(self.columns)
        sources = [self.columns[key] for key in keys]
        source_of = np.searchsorted(keys, [key for key, _ in self.rows]).astype(np.int64)
        row_of = np.array([row for _, row in self.rows], np.int64)
        wire = [
            encode_microbatch_parts(
                materialize_sequences(sources, source_of[m], row_of[m], self.plan.advantages[m], m),
                [self.rollout_ids[i] for i in m],
            )
            for m in self.plan.microbatches
        ]
        return [
            join_rank_response(
                rank_header(
                    step=7, plan=self.plan, rank=rank, policy_versions=self.policy_versions
                ),
                [wire[i] for i in indices],
            )
            for rank, indices in enumerate(self.plan.ranks)
        ]

    def reference_microbatches(self) -> list:
        """`materialize_microbatch` of every microbatch, over the concatenated columns."""
        keys = sorted(self.columns)
        row_counts = [self.columns[k].lengths.size for k in keys]
        bases = dict(zip(keys, np.cumsum([0, *row_counts])[:-1], strict=True))
        token_counts = [int(self.columns[k].offsets[-1]) for k in keys]
        token_bases = np.cumsum([0, *token_counts])[:-1]
        offsets = [self.columns[k].offsets[1:] + b for k, b in zip(keys, token_bases, strict=True)]
        concatenated = TokenColumns(
            offsets=np.concatenate([[0], *offsets]).astype(np.int64),
            token_ids=np.concatenate([self.columns[k].token_ids for k in keys]),
            action_mask=np.concatenate([self.columns[k].action_mask for k in keys]),
            sampler_logprobs=np.concatenate([self.columns[k].sampler_logprobs for k in keys]),
        )
        global_rows = np.array([bases[key] + row for key, row in self.rows], np.int64)
        advantages = np.zeros(concatenated.offsets.size - 1, np.float32)
        advantages[global_rows] = self.plan.advantages
        return [
            materialize_microbatch(concatenated, global_rows[m], advantages)
            for m in self.plan.microbatches
        ]

    def protobuf_responses(self) -> list[bytes]:
        """Plain protobuf serialization of the reference microbatches, header by hand."""
        microbatches = self.reference_microbatches()
        # A step whose rollouts were all dropped reports the versions of all of them.
        kept = self.policy_versions[self.plan.kept] if self.plan.kept.size else self.policy_versions
        out = []
        for rank, indices in enumerate(self.plan.ranks):
            message = pb.GetBatchResponse(
                ready=True,
                step=7,
                rank=rank,
                world_size=len(self.plan.ranks),
                policy_token_count=self.plan.policy_token_count,
                microbatches_per_rank=len(indices),
                policy_version=int(kept.max()) if kept.size else 0,
                min_policy_version=int(kept.min()) if kept.size else 0,
                num_rollouts=int(self.plan.kept.size),
            )
            for i in indices:
                ids = [self.rollout_ids[j] for j in self.plan.microbatches[i]]
                message.microbatches.append(encode_microbatch(microbatches[i], ids))
            out.append(message.SerializeToString(deterministic=True))
        return out


# Lengths mix runs of 1-3 tokens (gathered by index), a few hundred (either way) and long
# ones (served as views of the sources).
lengths_strategy = st.one_of(st.integers(1, 3), st.integers(4, 120), st.integers(300, 1500))


@settings(max_examples=40, deadline=None)
@given(
    batch_lengths=st.lists(
        st.lists(lengths_strategy, min_size=1, max_size=10), min_size=1, max_size=4
    ),
    group_size=st.integers(1, 4),
    world_size=st.integers(1, 4),
    drop_zero_advantage=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_served_responses_are_byte_identical_to_both_references(
    batch_lengths, group_size, world_size, drop_zero_advantage, seed
):
    step = Step(
        np.random.default_rng(seed), batch_lengths, group_size, world_size, drop_zero_advantage
    )
    served = step.served()
    assert served == step.gather_then_encode()
    assert served == step.protobuf_responses()
    for rank, (wire, indices) in enumerate(zip(served, step.plan.ranks, strict=True)):
        decoded = decode_step(parse_get_batch_response(wire))
        assert len(decoded) == len(indices)
        for got, i in zip(decoded, indices, strict=True):
            want = step.reference_microbatches()[i]
            for name in COLUMNS:
                assert getattr(got, name).numpy().tobytes() == getattr(want, name).tobytes()
            np.testing.assert_array_equal(got.position_ids.numpy(), want.position_ids)
            np.testing.assert_array_equal(got.cu_seqlens.numpy(), want.cu_seqlens)
            assert got.rollout_ids == tuple(step.rollout_ids[j] for j in step.plan.microbatches[i])
            assert (got.step, got.index) == (7, indices.index(i)), rank


@pytest.mark.parametrize(("seed", "kept"), [(2, 2), (0, 0)])
def test_steps_with_no_op_microbatches_and_dropped_groups_are_byte_identical(seed, kept):
    # Four ranks, two-rollout groups, all-equal groups dropped: some ranks run only no-op
    # microbatches (seed 2), or every rollout is dropped (seed 0).
    step = Step(np.random.default_rng(seed), [[1, 700], [2, 5, 1200]], 2, 4, True)
    assert step.plan.kept.size == kept and step.plan.zero_advantage_groups > 0
    assert any(m.size == 0 for m in step.plan.microbatches) or kept == 0
    assert step.served() == step.gather_then_encode() == step.protobuf_responses()


def test_zero_advantage_groups_kept_in_the_step_serve_zero_advantages():
    rng = np.random.default_rng(2)
    step = Step(rng, [[800, 900, 1000, 40]], 4, 1, drop_zero_advantage=False)
    step.plan.advantages[:] = 0.0  # every group all-equal: advantages are exactly +0.0
    served = step.served()
    assert served == step.gather_then_encode() == step.protobuf_responses()
    (microbatches,) = [decode_step(parse_get_batch_response(wire)) for wire in served]
    assert all(not mb.advantages.numpy().view(np.uint32).any() for mb in microbatches)


def test_a_mask_with_other_values_than_0_and_1_is_served_as_the_reference_serves_it():
    # Validation refuses such masks at ingest; the served bytes must not depend on that.
    step = Step(np.random.default_rng(12), [[900, 40], [3, 1000]], 1, 2, False)
    for columns in step.columns.values():
        columns.action_mask[columns.action_mask > 0] = 3
    assert step.served() == step.gather_then_encode() == step.protobuf_responses()


def test_long_sequences_are_served_from_views_of_the_source_columns():
    rng = np.random.default_rng(4)
    step = Step(rng, [[3000, 2500], [4000]], 1, 1, drop_zero_advantage=False)
    spans = response_pieces.step_spans(
        [step.columns[k] for k in sorted(step.columns)],
        step.plan,
        np.searchsorted(sorted(step.columns), [k for k, _ in step.rows]),
        np.array([r for _, r in step.rows]),
    )
    scratch = TokenScratch()
    parts, size = response_pieces.encode_spans(
        [step.columns[k] for k in sorted(step.columns)], spans[0], ["a", "b", "c"], scratch
    )
    assert size == sum(memoryview(part).nbytes for part in parts)
    viewing = [
        part
        for part in parts
        if isinstance(part, np.ndarray)
        and any(np.shares_memory(part, c.token_ids) for c in step.columns.values())
    ]
    assert len(viewing) == 2 * len(spans[0].lengths)  # input_ids and target_ids, per sequence


@pytest.mark.parametrize("num_tokens", [65_537, 1, 2, 7, 8, 9, 1000])
def test_the_arrow_stream_of_pieces_equals_the_writers_stream_of_the_arrays(num_tokens):
    # The fast path relies on the writer handing over one body buffer per column; should a
    # pyarrow release stop doing so, the fallback keeps the bytes right (slowly) and this
    # test says so.
    rng = np.random.default_rng(num_tokens)
    arrays = {
        field.name: rng.integers(0, 200, num_tokens).astype(field.type.to_pandas_dtype())
        for field in MICROBATCH_SCHEMA
    }
    cut = num_tokens // 3
    pieces = {name: [array[:cut], array[cut:]] for name, array in arrays.items()}
    stream = arrow_stream_pieces(pieces, num_tokens)
    assert stream is not None
    record_batch = pa.RecordBatch.from_arrays(list(arrays.values()), schema=MICROBATCH_SCHEMA)
    parts, size = stream
    assert b"".join(parts) == _ipc_bytes(record_batch)
    assert size == len(_ipc_bytes(record_batch))


def test_only_no_op_microbatches_take_the_straightforward_route(monkeypatch):
    straightforward = []
    real = response_pieces.encode_microbatch_parts

    def recording(microbatch, rollout_ids):
        straightforward.append(microbatch.num_tokens)
        return real(microbatch, rollout_ids)

    monkeypatch.setattr(response_pieces, "encode_microbatch_parts", recording)
    rng = np.random.default_rng(6)
    steps = [
        Step(rng, [[1, 2, 3], [5, 900]], 1, 3, False),
        Step(rng, [[333], [1201, 7]], 1, 2, False),
    ]
    steps.append(Step(np.random.default_rng(2), [[1, 700], [2, 5, 1200]], 2, 4, True))  # no-ops
    for step in steps:
        assert step.served() == step.gather_then_encode()
    assert straightforward and set(straightforward) == {0}


def test_the_straightforward_fallback_gives_the_same_bytes(monkeypatch):
    step = Step(np.random.default_rng(5), [[900, 3, 1], [2000, 60]], 2, 2, False)
    fast = step.served()
    monkeypatch.setattr(response_pieces, "arrow_stream_pieces", lambda columns, n: None)
    assert step.served() == fast == step.gather_then_encode()


def test_one_scratch_serves_many_steps_and_every_rank():
    rng = np.random.default_rng(8)
    scratch = TokenScratch()
    for world_size in (1, 3, 2):
        step = Step(rng, [[500, 20, 3000], [1, 1, 700]], 2, world_size, False)
        assert step.served(scratch=scratch) == step.gather_then_encode()


def test_pieces_come_in_the_order_and_dtypes_of_the_wire_schema():
    assert list(COLUMN_DTYPES) == MICROBATCH_SCHEMA.names
    for field in MICROBATCH_SCHEMA:
        assert COLUMN_DTYPES[field.name] == np.dtype(field.type.to_pandas_dtype()), field.name


def test_each_thread_has_its_own_scratch():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(thread_scratch()))
    thread.start()
    thread.join()
    assert thread_scratch() is thread_scratch()
    assert seen[0] is not thread_scratch()


def test_a_policy_token_in_first_position_is_refused_naming_the_rollout():
    rng = np.random.default_rng(9)
    step = Step(rng, [[5, 6, 7]], 1, 1, False)
    key, row = step.rows[1]
    step.columns[key].action_mask[step.columns[key].offsets[row]] = 1
    with pytest.raises(ValueError, match="rollout 1: action_mask"):
        step.served()
