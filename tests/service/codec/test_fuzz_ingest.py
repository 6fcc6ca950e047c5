"""Fuzzing the ingest path (decode + validate, what every batch goes through before the
scheduler sees it): byte mutations and truncations of valid payloads, and crafted Arrow
schemas (integers of any width, declared widths of 4, 12 or 128 bits, wrong types,
dictionaries, nulls). Every input either is refused with InvalidBatchError (the
handler's INVALID_ARGUMENT) or decodes to arrays that an independent, rollout-by-rollout
check finds valid: nothing else is ever raised, nothing invalid ever accepted.

The default run tries 2,000 inputs (about 10 s); `-m slow` tries 20 times as many.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlfeed.service.codec.messages import RolloutBatchArrays
from rlfeed.service.codec.rollout_batch import decode_batch, validate_batch
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.errors import InvalidBatchError
from rlfeed.service.testing import synthetic_groups

CONFIG = with_overrides(
    SidecarConfig(),
    batching={"token_budget": 256},
    rollouts={"vocab_size": 1000},
    server={"max_ids_per_call": 64, "max_id_bytes": 32},
)
_SEEDS = [
    synthetic_groups(
        num_groups=2, group_size=2, rng=np.random.default_rng(seed), max_length=40
    ).encode()
    for seed in range(4)
]
FAST = settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
SLOW = settings(FAST, max_examples=20000)


def _check_accepted(batch: RolloutBatchArrays) -> None:
    """The contract, checked the straightforward way, one rollout at a time."""
    server = CONFIG.server
    assert 0 < len(batch) <= server.max_ids_per_call
    assert len(set(batch.rollout_ids)) == len(batch)
    for ids in (batch.rollout_ids, batch.task_ids, batch.group_ids):
        assert all(0 < len(i.encode("utf-8", "surrogatepass")) <= server.max_id_bytes for i in ids)
    for row in range(len(batch)):
        start, end = int(batch.offsets[row]), int(batch.offsets[row + 1])
        assert 1 <= end - start <= CONFIG.batching.token_budget
        for offsets in (batch.mask_offsets, batch.logprob_offsets):
            assert int(offsets[row + 1] - offsets[row]) == end - start
        tokens = [int(t) for t in batch.token_ids[start:end]]
        mask = [int(m) for m in batch.action_mask[start:end]]
        assert all(0 <= t < CONFIG.rollouts.vocab_size for t in tokens)
        assert set(mask) <= {0, 1} and mask[0] == 0
        assert all(math.isfinite(float(x)) for x in batch.sampler_logprobs[start:end])
        assert math.isfinite(float(batch.rewards[row])) and batch.policy_versions[row] >= 0


def _ingest_outcome(payload: bytes) -> str:
    """'accepted' (and checked) or 'refused'; anything else raised fails the test."""
    try:
        batch = decode_batch(payload)
        validate_batch(batch, CONFIG)
    except InvalidBatchError:
        return "refused"
    _check_accepted(batch)
    return "accepted"


@st.composite
def mutated_payloads(draw) -> bytes:
    payload = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(0, 6))):
        position = draw(st.integers(0, len(payload) - 1))
        payload[position] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        payload = payload[: draw(st.integers(0, len(payload)))]
    if draw(st.integers(0, 9)) == 0:  # a second stream, or a stray tail
        payload += draw(st.sampled_from([*_SEEDS, b"\xff\xff\xff\xff\x00\x00\x00\x00"]))
    return bytes(payload)


_COLUMN_TYPES = [
    pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64(),
    pa.float16(), pa.float32(), pa.float64(), pa.string(), pa.large_string(), pa.binary(),
    pa.bool_(), pa.null(), pa.list_(pa.int32()), pa.list_(pa.int64()), pa.list_(pa.uint8()),
    pa.list_(pa.float64()), pa.large_list(pa.int32()), pa.list_(pa.string()),
    pa.dictionary(pa.int8(), pa.string()),
]  # fmt: skip
_NAMES = [
    "rollout_id", "task_id", "group_id", "policy_version", "reward", "token_ids",
    "action_mask", "sampler_logprobs",
]  # fmt: skip


def _random_array(kind: pa.DataType, rows: int, rng: np.random.Generator) -> pa.Array:
    if pa.types.is_dictionary(kind):
        return pa.array([f"d{i % 3}" for i in range(rows)]).dictionary_encode()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = rng.integers(0, 6, rows)
        values = _random_array(kind.value_type, int(lengths.sum()), rng)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        make = pa.LargeListArray if pa.types.is_large_list(kind) else pa.ListArray
        return make.from_arrays(
            pa.array(offsets, pa.int64() if make is pa.LargeListArray else pa.int32()), values
        )
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
        texts = [f"v{int(x)}" for x in rng.integers(0, 4, rows)]
        return pa.array(
            texts if not pa.types.is_binary(kind) else [t.encode() for t in texts], kind
        )
    if pa.types.is_null(kind):
        return pa.nulls(rows)
    if pa.types.is_boolean(kind):
        return pa.array(rng.integers(0, 2, rows).astype(bool))
    values = rng.normal(0, 3, rows) if pa.types.is_floating(kind) else rng.integers(-2, 1200, rows)
    if pa.types.is_unsigned_integer(kind):
        values = np.abs(values)
    array = pa.array(values).cast(kind, safe=False)
    if rows and rng.random() < 0.1:  # a null somewhere
        mask = np.zeros(rows, bool)
        mask[rng.integers(0, rows)] = True
        array = pa.array(array.to_pylist(), kind, mask=mask)
    return array


@st.composite
def crafted_payloads(draw) -> bytes:
    """A stream of a random schema: the contract's columns (some missing, repeated or
    extra), each of a random type, with an odd integer width patched in at times."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.integers(0, 5))
    names = [n for n in _NAMES if draw(st.integers(0, 9)) > 0] + draw(
        st.lists(st.sampled_from([*_NAMES, "extra"]), max_size=2)
    )
    types = [draw(st.sampled_from(_COLUMN_TYPES)) for _ in names]
    arrays = [_random_array(kind, rows, rng) for kind in types]
    schema = pa.schema([pa.field(n, a.type) for n, a in zip(names, arrays, strict=True)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    payload = sink.getvalue().to_pybytes()
    widths = [i for i in range(8, len(payload) - 3) if payload[i : i + 4] in _INT_WIDTHS]
    if widths and draw(st.booleans()):
        spot = draw(st.sampled_from(widths))
        bits = struct.pack("<i", draw(st.sampled_from([4, 12, 128, 0, -8])))
        payload = payload[:spot] + bits + payload[spot + 4 :]
    return payload


_INT_WIDTHS = {struct.pack("<i", bits) for bits in (8, 16, 32, 64)}
_seen: dict[str, int] = {}


def _run(payload: bytes) -> None:
    outcome = _ingest_outcome(payload)
    _seen[outcome] = _seen.get(outcome, 0) + 1


@FAST
@given(mutated_payloads())
def test_mutated_payloads_are_refused_or_valid(payload: bytes) -> None:
    _run(payload)


@FAST
@given(crafted_payloads())
def test_crafted_schemas_are_refused_or_valid(payload: bytes) -> None:
    _run(payload)


@pytest.mark.slow
@SLOW
@given(st.one_of(mutated_payloads(), crafted_payloads()))
def test_many_more_payloads_are_refused_or_valid(payload: bytes) -> None:
    _run(payload)


def test_zz_figures() -> None:
    """Prints how many inputs ran (with -s); runs last in this file."""
    print(f"\ningest fuzz: {sum(_seen.values())} inputs, {_seen}")
    assert _seen.get("refused", 0) > 0
