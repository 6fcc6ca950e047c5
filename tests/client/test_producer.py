"""RolloutWriter: what is written arrives column for column; backpressure; server errors."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.client.arrow_codec import RolloutColumns, encode_rollouts
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.retry import FullSidecar
from rlfeed.client.transport import (
    BufferFullError,
    InvalidRolloutsError,
    SidecarError,
)
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.config import config_from_dict
from rlfeed.service.inprocess import InProcessTransport


def make_transport(**rollouts) -> InProcessTransport:
    return InProcessTransport(
        config_from_dict(
            {
                "batching": {"token_budget": 256},
                "rollouts": {"prompts_per_step": 2, "group_size": 2, "vocab_size": 100, **rollouts},
            }
        )
    )


class Recording:
    """Wraps a transport; keeps every submitted batch, can hold or refuse submissions."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches = []
        self.gate = threading.Event()
        self.gate.set()
        self.refuse = 0  # answer RESOURCE_EXHAUSTED this many times first
        self.retry_after_s = None  # the hint those answers carry
        self.attempts: list[float] = []  # when each submission came (monotonic)

    def submit(self, batch):
        self.gate.wait()
        self.attempts.append(time.monotonic())
        if self.refuse:
            self.refuse -= 1
            raise BufferFullError(
                "buffer full: max_buffered_bytes = 1.0 MiB", retry_after_s=self.retry_after_s
            )
        ack = self.inner.submit(batch)
        self.batches.append(batch)
        return ack

    def __getattr__(self, name):
        return getattr(self.inner, name)


def rollout(i: int, length: int = 5, task: str = "t0", group: str | None = None, **overrides):
    rng = np.random.default_rng(i)
    mask = np.zeros(length, np.uint8)
    mask[length // 2 :] = 1
    row = {
        "rollout_id": f"r{i}",
        "task_id": task,
        "group_id": group if group is not None else f"g{i // 2}",
        "policy_version": i % 3,
        "reward": float(i % 2),
        "token_ids": rng.integers(0, 100, length).astype(np.int32),
        "action_mask": mask,
        "sampler_logprobs": np.where(mask > 0, -rng.random(length), 0.0).astype(np.float32),
    }
    row.update(overrides)
    return row


@pytest.fixture
def recording():
    transport = Recording(make_transport())
    transport.register_tasks(["t0", "t1"])
    return transport


def test_written_rollouts_arrive_column_for_column(recording):
    rows = [rollout(i, length=3 + i) for i in range(10)]
    with RolloutWriter(recording, max_batch_rollouts=4) as writer:
        for row in rows:
            writer.write(**row)
    assert [len(decode_rollout_batch(b.arrow_ipc)) for b in recording.batches] == [4, 4, 2]
    received = [decode_rollout_batch(b.arrow_ipc) for b in recording.batches]
    i = 0
    for batch in received:
        for j in range(len(batch)):
            row = rows[i]
            a, b = batch.offsets[j], batch.offsets[j + 1]
            assert batch.rollout_ids[j] == row["rollout_id"]
            assert batch.task_ids[j] == row["task_id"]
            assert batch.group_ids[j] == row["group_id"]
            assert batch.policy_versions[j] == row["policy_version"]
            assert batch.rewards[j] == row["reward"]
            np.testing.assert_array_equal(batch.token_ids[a:b], row["token_ids"])
            np.testing.assert_array_equal(batch.action_mask[a:b], row["action_mask"])
            np.testing.assert_array_equal(batch.sampler_logprobs[a:b], row["sampler_logprobs"])
            i += 1
    assert i == len(rows)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=12), st.integers(0, 99)
)
def test_encoded_batches_decode_to_the_same_arrays_for_any_lengths(lengths, seed):
    rows = [rollout(seed * 100 + i, length=n) for i, n in enumerate(lengths)]
    columns = RolloutColumns.empty()
    for row in rows:
        columns.append(**row)
    batch = decode_rollout_batch(encode_rollouts(columns))
    np.testing.assert_array_equal(batch.offsets, np.concatenate(([0], np.cumsum(lengths))))
    assert batch.rollout_ids == [row["rollout_id"] for row in rows]
    for name in ("token_ids", "action_mask", "sampler_logprobs"):
        expected = [row[name] for row in rows]
        flat = np.concatenate(expected) if expected else np.zeros(0)
        np.testing.assert_array_equal(getattr(batch, name), flat)


def test_flush_returns_one_ack_per_batch_in_order(recording):
    writer = RolloutWriter(recording, max_batch_rollouts=3)
    for i in range(8):
        writer.write(**rollout(i))
    acks = writer.flush()
    assert [a.sequence for a in acks] == [0, 1, 2]
    assert [a.accepted for a in acks] == [3, 3, 2]
    assert writer.flush() == []
    writer.close()
    assert recording.status().counters.rollouts_accepted == 8


def test_plain_lists_are_accepted(recording):
    with RolloutWriter(recording) as writer:
        writer.write(
            rollout_id="a",
            task_id="t0",
            group_id="g",
            policy_version=0,
            reward=1,
            token_ids=[5, 6, 7],
            action_mask=[0, 1, 1],
            sampler_logprobs=[0.0, -0.5, -0.25],
        )
    batch = decode_rollout_batch(recording.batches[0].arrow_ipc)
    assert batch.token_ids.tolist() == [5, 6, 7]
    assert batch.sampler_logprobs.tolist() == [0.0, -0.5, -0.25]


def test_mismatched_lengths_fail_at_the_write_call(recording):
    writer = RolloutWriter(recording)
    with pytest.raises(ValueError, match=r"rollout 'r0': action_mask has 4 entries but token_ids"):
        writer.write(**rollout(0, length=5, action_mask=np.zeros(4, np.uint8)))
    writer.close()


def test_invalid_batch_raises_the_server_message_and_the_writer_keeps_working(recording):
    writer = RolloutWriter(recording, max_batch_rollouts=2)
    bad_mask = np.ones(5, np.uint8)  # action_mask[0] = 1: nothing predicts the first token
    writer.write(**rollout(0))
    writer.write(**rollout(1, action_mask=bad_mask))
    with pytest.raises(InvalidRolloutsError, match=r"'r1'.*action_mask") as caught:
        writer.flush()
    assert caught.value.rollout_ids == ("r0", "r1")  # the batch is rejected as a whole
    writer.write(**rollout(2))
    writer.write(**rollout(3))
    assert [a.accepted for a in writer.flush()] == [2]
    writer.close()
    assert recording.status().counters.rollouts_accepted == 2


def test_unknown_task_is_named_in_the_error(recording):
    writer = RolloutWriter(recording)
    writer.write(**rollout(0, task="nope"))
    with pytest.raises(InvalidRolloutsError, match="unknown task 'nope'"):
        writer.close()


def test_full_writer_raises_when_asked_to(recording):
    recording.gate.clear()  # the sidecar does not answer
    writer = RolloutWriter(
        recording, max_batch_rollouts=2, max_buffered_rollouts=4, on_full="raise"
    )
    for i in range(4):
        writer.write(**rollout(i))
    with pytest.raises(BufferFullError, match="4 unacknowledged rollouts"):
        writer.write(**rollout(4))
    recording.gate.set()
    writer.flush()
    writer.write(**rollout(4))
    writer.close()
    assert recording.status().counters.rollouts_accepted == 5


def test_full_writer_blocks_until_the_sidecar_catches_up(recording):
    recording.gate.clear()
    writer = RolloutWriter(recording, max_batch_rollouts=2, max_buffered_rollouts=4)
    for i in range(4):
        writer.write(**rollout(i))
    done = threading.Event()

    def fifth() -> None:
        writer.write(**rollout(4))
        done.set()

    thread = threading.Thread(target=fifth)
    thread.start()
    assert not done.wait(0.3)  # blocked: four rollouts unacknowledged
    recording.gate.set()
    assert done.wait(5)
    thread.join()
    writer.close()
    assert recording.status().counters.rollouts_accepted == 5


def test_blocking_write_gives_up_after_block_timeout(recording):
    recording.gate.clear()
    writer = RolloutWriter(
        recording, max_batch_rollouts=1, max_buffered_rollouts=1, block_timeout_s=0.2
    )
    writer.write(**rollout(0))
    started = time.monotonic()
    with pytest.raises(BufferFullError, match=r"no room after 0\.2 s"):
        writer.write(**rollout(1))
    assert time.monotonic() - started < 2
    recording.gate.set()
    writer.close()


class Flaky(Recording):
    """Answers UNAVAILABLE `outages` times, after delivering the batch once (the ack was lost)."""

    def __init__(self, inner, outages: int) -> None:
        super().__init__(inner)
        self.outages = outages
        inner.register_tasks(["t0"])

    def submit(self, batch):
        if self.outages:
            self.outages -= 1
            self.inner.submit(batch)  # delivered, but the answer never came back
            raise SidecarError("UNAVAILABLE", "connection reset")
        return super().submit(batch)


def test_an_unavailable_sidecar_is_retried_and_nothing_counts_twice():
    flaky = Flaky(make_transport(), outages=3)
    with RolloutWriter(flaky, max_batch_rollouts=4, retry_backoff_s=0.001) as writer:
        for i in range(4):
            writer.write(**rollout(i))
    status = flaky.status()
    assert flaky.outages == 0
    assert status.counters.rollouts_accepted == 4  # the re-sent batch was a duplicate


def test_a_lasting_outage_surfaces_with_the_rollout_ids_to_resend():
    flaky = Flaky(make_transport(), outages=10**6)
    writer = RolloutWriter(flaky, max_batch_rollouts=2, connect_timeout_s=0.05)
    writer.write(**rollout(0))
    writer.write(**rollout(1))
    with pytest.raises(SidecarError) as error:
        writer.flush(timeout_s=10)
    assert error.value.code == "UNAVAILABLE"
    assert error.value.rollout_ids == ("r0", "r1")


class Restarting(Recording):
    """A sidecar that is gone for `outages` calls and comes back without what it held (a
    restart without a journal)."""

    def restart(self, outages: int) -> None:
        self.outages = outages
        self.inner = make_transport()

    def sample_tasks(self, n):
        if getattr(self, "outages", 0):
            self.outages -= 1
            raise SidecarError("UNAVAILABLE", "restarting")
        return self.inner.sample_tasks(n)


def test_after_an_outage_a_writer_samples_from_the_pool_it_had_registered(caplog):
    sidecar = Restarting(make_transport())
    writer = RolloutWriter(sidecar, max_batch_rollouts=2)
    assert writer.register_tasks(["t0", "t1"]) == 2
    sidecar.restart(outages=2)
    with caplog.at_level(logging.WARNING):
        sampled = writer.sample_tasks(2)
    assert len(sampled) == 2 and set(sampled) <= {"t0", "t1"}
    assert "had lost 2 of the 2 tasks this writer registered" in caplog.text
    assert sidecar.status().tasks_total == 2
    writer.close()


def test_resource_exhausted_is_retried_until_accepted(recording):
    recording.refuse = 3
    with RolloutWriter(recording, max_batch_rollouts=2, retry_backoff_s=0.001) as writer:
        for i in range(4):
            writer.write(**rollout(i))
    assert recording.refuse == 0
    assert recording.status().counters.rollouts_accepted == 4
    assert len(recording.batches) == 2


def test_a_full_sidecar_is_retried_at_its_hinted_pace_with_a_warning_naming_it(recording, caplog):
    recording.refuse, recording.retry_after_s = 3, 0.05
    writer = RolloutWriter(recording, max_batch_rollouts=2, retry_backoff_s=0.001)
    with caplog.at_level("WARNING", logger="rlfeed.client.retry"), writer:
        writer.write(**rollout(0))
        writer.write(**rollout(1))
    gaps = np.diff(recording.attempts)
    assert len(gaps) == 3 and gaps.min() >= 0.05  # the hint, not the 1 ms backoff
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once, then every 10 s
    assert "sidecar at <Recording> is full" in warnings[0]
    assert "max_buffered_bytes = 1.0 MiB" in warnings[0]


def test_the_full_sidecar_warning_repeats_every_10_s_with_how_long_it_lasted(monkeypatch, caplog):
    import rlfeed.client.retry as retry_module

    now = [100.0]
    monkeypatch.setattr(retry_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    full = FullSidecar("host:1", backoff_s=0.01)
    refusal = BufferFullError("max_buffered_bytes = 4096.0 MiB")
    with caplog.at_level("WARNING", logger="rlfeed.client.retry"):
        pauses = []
        for _ in range(25):
            pauses.append(full.pause_s(refusal))
            now[0] += 1.0
    assert pauses[:8] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0]  # no hint: backoff
    warnings = [r.getMessage() for r in caplog.records]
    assert [w.split(" for ")[1].split(" s ")[0] for w in warnings] == ["0", "10", "20"]
    assert all("host:1" in w and "max_buffered_bytes = 4096.0 MiB" in w for w in warnings)


def test_sidecar_buffer_limit_reaches_the_producer_as_backpressure():
    transport = make_transport(max_buffered_rollouts=4)
    transport.register_tasks(["t0"])
    writer = RolloutWriter(
        transport,
        max_batch_rollouts=2,
        max_buffered_rollouts=2,
        retry_backoff_s=0.001,
        on_full="raise",
    )
    for i in range(4):
        writer.write(**rollout(i))  # one step (2 groups of 2), unfetched: the sidecar is full
        writer.flush()
    writer.write(**rollout(4))
    writer.write(**rollout(5))  # sealed, refused by the sidecar, retried in the background
    with pytest.raises(BufferFullError):
        writer.write(**rollout(6))
    assert transport.get_batch(0, 0, 0).ready  # a trainer takes step 0 ...
    writer.flush(timeout_s=5)  # ... which frees room: the retried batch goes in
    writer.close()
    assert transport.status().counters.rollouts_accepted == 6


def test_tasks_are_registered_and_sampled(recording):
    writer = RolloutWriter(recording)
    assert writer.register_tasks(["t1", "t2", "t3"]) == 2  # t1 was known
    tasks = writer.sample_tasks(2)
    assert len(tasks) == 2
    assert set(tasks) <= {"t0", "t1", "t2", "t3"}
    writer.close()


def test_closed_writer_refuses_writes(recording):
    writer = RolloutWriter(recording)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(**rollout(0))


# ---------------------------------------------------------------------------------------
# Over real gRPC and a real Ray-hosted scheduler


def grpc_sidecar(make_sidecar, **rollouts):
    return make_sidecar(
        batching={"token_budget": 256},
        rollouts={"prompts_per_step": 2, "group_size": 2, "vocab_size": 100, **rollouts},
    )


def test_writer_over_grpc_gets_acks_and_the_server_message(make_sidecar):
    sidecar = grpc_sidecar(make_sidecar)
    with RolloutWriter(sidecar.address, max_batch_rollouts=2) as writer:
        assert writer.register_tasks(["t0", "t1"]) == 2
        assert set(writer.sample_tasks(2)) <= {"t0", "t1"}
        for i in range(4):
            writer.write(**rollout(i))
        acks = writer.flush()
        assert [(a.sequence, a.accepted) for a in acks] == [(0, 2), (1, 2)]
        writer.write(**rollout(4, token_ids=np.full(5, 100, np.int32)))  # vocab_size is 100
        with pytest.raises(InvalidRolloutsError, match=r"rollout 'r4'.*token_ids") as caught:
            writer.flush()
        assert caught.value.code == "INVALID_ARGUMENT"
        writer.write(**rollout(5))
        writer.write(**rollout(6, group="g2b"))
    from rlfeed.client.transport import GrpcTransport

    transport = GrpcTransport(sidecar.address)
    counters = transport.status().counters
    transport.close()
    assert (counters.rollouts_accepted, counters.batches_rejected) == (6, 1)


def test_sidecar_backpressure_over_grpc_blocks_until_a_trainer_fetches(make_sidecar):
    sidecar = grpc_sidecar(make_sidecar, max_buffered_rollouts=4)
    from rlfeed.client.transport import GrpcTransport

    transport = GrpcTransport(sidecar.address)
    writer = RolloutWriter(transport, max_batch_rollouts=2, retry_backoff_s=0.005)
    writer.register_tasks(["t0"])
    for i in range(4):
        writer.write(**rollout(i))  # one full step, not fetched: the sidecar's buffer is full
    writer.flush()
    columns = RolloutColumns.empty()
    for row in (rollout(4), rollout(5)):
        columns.append(**row)
    with pytest.raises(BufferFullError, match="max_buffered_rollouts = 4") as refused:
        transport.submit(pb.RolloutBatch(arrow_ipc=encode_rollouts(columns)))
    assert refused.value.retry_after_s == 0.5  # the rlfeed-retry-after-ms trailing metadata
    writer.write(**rollout(4))
    writer.write(**rollout(5))
    with pytest.raises(TimeoutError):
        writer.flush(timeout_s=0.5)  # RESOURCE_EXHAUSTED, retried
    assert transport.get_batch(0, 0, 1.0).ready
    writer.flush(timeout_s=10)
    writer.close()
    assert transport.status().counters.rollouts_accepted == 6
    transport.close()


def test_batches_in_flight_together_are_acknowledged_in_batch_order(recording):
    lock, inside, most = threading.Lock(), [0], [0]
    plain_submit = recording.submit

    def slow_submit(batch):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05 if batch.sequence % 2 == 0 else 0.01)  # later batches may finish first
        try:
            return plain_submit(batch)
        finally:
            with lock:
                inside[0] -= 1

    recording.submit = slow_submit
    writer = RolloutWriter(recording, max_batch_rollouts=2, max_in_flight=3)
    for i in range(12):
        writer.write(**rollout(i))
    acks = writer.flush()
    writer.close()
    assert [a.sequence for a in acks] == list(range(6))
    assert all(a.accepted == 2 for a in acks)
    assert most[0] > 1, "batches were never submitted concurrently"
    assert recording.status().counters.rollouts_accepted == 12


def test_a_transport_that_overrides_submit_is_never_bypassed():
    from rlfeed.client.transport import GrpcTransport, fast_variant

    class Intercepting(GrpcTransport):
        def submit(self, batch):
            return super().submit(batch)

    plain = GrpcTransport("127.0.0.1:1")
    intercepting = Intercepting("127.0.0.1:1")
    try:
        assert fast_variant(plain, "submit", "submit_serialized") == plain.submit_serialized
        assert fast_variant(intercepting, "submit", "submit_serialized") is None
        assert fast_variant(make_transport(), "submit", "submit_serialized") is None
    finally:
        plain.close()
        intercepting.close()


def _reference_rollout_stream(rows) -> bytes:
    """The straightforward encoding: concatenate each token column, let pyarrow write."""
    import pyarrow as pa
    from rlfeed.proto.arrow_schemas import ROLLOUT_SCHEMA

    lengths = [a.size for a in rows.token_ids]
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))

    def values(name, dtype):
        arrays = getattr(rows, name)
        return pa.array(np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype))

    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(rows.rollout_id, pa.string()),
            pa.array(rows.task_id, pa.string()),
            pa.array(rows.group_id, pa.string()),
            pa.array(rows.policy_version, pa.int64()),
            pa.array(rows.reward, pa.float64()),
            pa.ListArray.from_arrays(offsets, values("token_ids", np.int32)),
            pa.ListArray.from_arrays(offsets, values("action_mask", np.uint8)),
            pa.ListArray.from_arrays(offsets, values("sampler_logprobs", np.float32)),
        ],
        schema=ROLLOUT_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 3000), max_size=12),
    strided=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_rollouts_encode_to_the_bytes_of_concatenated_columns(lengths, strided, seed) -> None:
    """The writer joins the rows' own arrays into the stream (one copy); the bytes equal
    pyarrow writing the concatenated columns, whatever the lengths (odd, empty, none) and
    whether a row's arrays can be joined as they are (strided ones take the fallback)."""
    from rlfeed.client.arrow_codec import RolloutColumns, encode_rollouts

    rng = np.random.default_rng(seed)
    rows = RolloutColumns.empty()
    for i, length in enumerate(lengths):
        tokens = rng.integers(0, 50_000, 2 * length if strided else length).astype(np.int32)
        rows.append(
            rollout_id=f"r{i}", task_id=f"t{i % 3}", group_id=f"g{i // 2}", policy_version=i,
            reward=float(i % 2), token_ids=tokens[::2] if strided else tokens,
            action_mask=(np.arange(length) > length // 3).astype(np.uint8),
            sampler_logprobs=-rng.random(length).astype(np.float32),
        )  # fmt: skip
    assert encode_rollouts(rows) == _reference_rollout_stream(rows)


def test_the_token_values_are_joined_from_the_rows_own_arrays() -> None:
    """The fast path is taken: the stream's pieces are the rows' arrays, not copies."""
    from rlfeed.client.arrow_codec import _rollout_stream_pieces

    rows = RolloutColumns.empty()
    for i in range(3):
        rows.append(
            rollout_id=f"r{i}", task_id="t", group_id="g", policy_version=0, reward=1.0,
            token_ids=np.arange(100, dtype=np.int32), action_mask=np.ones(100, np.uint8),
            sampler_logprobs=np.zeros(100, np.float32),
        )  # fmt: skip
    pieces, _ = _rollout_stream_pieces(rows)
    for name in ("token_ids", "action_mask", "sampler_logprobs"):
        assert all(any(piece is array for piece in pieces) for array in getattr(rows, name))


# ---------------------------------------------------------------------------------------
# Values are range-checked before they are narrowed to their wire types


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "token_ids",
            np.array([1, 2**32 + 7, 3, 4, 5]),
            r"token_ids: 4294967303 at token 1 is not an int32",
        ),
        (
            "token_ids",
            [1, 2, -(2**31) - 1, 4, 5],
            r"token_ids: -2147483649 at token 2 is not an int32",
        ),
        ("token_ids", [1.0, 2.5, 3.0, 4.0, 5.0], r"token_ids: 2.5 at token 1 is not an int32"),
        ("action_mask", np.array([0, 0, 256, 1, 1]), r"action_mask: 256 at token 2 is not 0 or 1"),
        ("action_mask", [0, 0, -1, 1, 1], r"action_mask: -1 at token 2 is not 0 or 1"),
        (
            "sampler_logprobs",
            [0.0, 0.0, -1e39, -1.0, -1.0],
            r"sampler_logprobs: -1e\+39 at token 2 is not a finite",
        ),
    ],
)
def test_a_value_that_does_not_fit_its_wire_type_is_refused_not_wrapped(
    recording, field, value, message
):
    """`astype(int32)` turns a token id of 2**32 + 7 into 7; the writer must not send it."""
    writer = RolloutWriter(recording, max_batch_rollouts=1)
    with pytest.raises(ValueError, match=rf"rollout 'r0': field {message}"):
        writer.write(**rollout(0, **{field: value}))
    assert writer.unacknowledged == 0
    writer.close()
    assert recording.batches == []  # nothing was sent


def test_a_policy_version_beyond_int64_is_refused(recording):
    writer = RolloutWriter(recording)
    with pytest.raises(ValueError, match=r"rollout 'r0': policy_version 9223372036854775808"):
        writer.write(**rollout(0, policy_version=2**63))
    writer.close()


def test_values_that_fit_are_narrowed_exactly(recording):
    wide = rollout(0, length=4)
    wide.update(
        token_ids=np.array([0, 99, 2, 3], np.int64),
        action_mask=[False, True, True, True],
        sampler_logprobs=np.array([0.0, -0.25, -1.5, -2.0], np.float64),
    )
    with RolloutWriter(recording, max_batch_rollouts=1) as writer:
        writer.write(**wide)
    (batch,) = recording.batches
    sent = decode_rollout_batch(batch.arrow_ipc)
    assert sent.token_ids.tolist() == [0, 99, 2, 3]
    assert sent.sampler_logprobs.tolist() == [0.0, -0.25, -1.5, -2.0]
