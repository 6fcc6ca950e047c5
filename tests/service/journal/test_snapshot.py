"""Snapshots: the newest one that verifies wins; a crash mid-write never beats a good one."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.service.journal import Journal, JournalConfig, SnapshotStore

CONFIG = JournalConfig()

# What the scheduler will snapshot: int-keyed maps, nested lists, bytes ids, floats.
state_strategy = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.integers(0, 1000) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=25, deadline=None)
@given(state=state_strategy, position=st.integers(0, 2**63), version=st.integers(0, 1000))
def test_round_trip(tmp_path_factory, state, position, version):
    store = SnapshotStore(tmp_path_factory.mktemp("snap"), CONFIG)
    store.write(position, version, state)
    loaded = store.load_latest()
    assert (loaded.position, loaded.version, loaded.state) == (position, version, state)


def test_the_newest_snapshot_wins_and_only_snapshots_kept_stay(tmp_path):
    store = SnapshotStore(tmp_path, JournalConfig(snapshots_kept=3))
    for position in (5, 9, 12, 40):
        store.write(position, 1, {"step": position})
    assert store.load_latest().state == {"step": 40}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"snapshot-{p:020d}.msgpack" for p in (9, 12, 40)
    ]
    assert store.oldest_position() == 9


def test_no_snapshot_means_replay_from_the_start(tmp_path):
    assert SnapshotStore(tmp_path, CONFIG).load_latest() is None
    assert SnapshotStore(tmp_path, CONFIG).oldest_position() is None


def test_a_leftover_temp_file_never_wins_and_is_deleted(tmp_path, caplog):
    store = SnapshotStore(tmp_path, CONFIG)
    store.write(10, 1, {"good": True})
    newer = tmp_path / f"snapshot-{20:020d}.msgpack"
    store.write(20, 1, {"crashed": "before the rename"})
    newer.rename(newer.with_name(newer.name + ".tmp"))  # the state a crash before rename leaves
    with caplog.at_level(logging.WARNING, logger="rlfeed.service.journal"):
        reopened = SnapshotStore(tmp_path, CONFIG)
    assert reopened.load_latest().state == {"good": True}
    assert not list(tmp_path.glob("*.tmp")) and "cut short" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "bit flipped", "empty", "zeroed header"])
def test_a_damaged_newest_snapshot_falls_back_to_the_previous_good_one(tmp_path, caplog, damage):
    store = SnapshotStore(tmp_path, CONFIG)
    store.write(10, 1, {"good": list(range(100))})
    newest = store.write(20, 1, {"newer": list(range(100))})
    data = bytearray(newest.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "bit flipped":
        data[len(data) - 7] ^= 0x04
    elif damage == "empty":
        data = bytearray()
    else:
        data[:32] = bytes(32)
    newest.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="rlfeed.service.journal"):
        loaded = store.load_latest()
    assert (loaded.position, loaded.state) == (10, {"good": list(range(100))})
    assert f"skipping snapshot {newest}" in caplog.text


def test_every_single_bit_flip_of_a_snapshot_is_detected(tmp_path):
    store = SnapshotStore(tmp_path, CONFIG)
    store.write(3, 2, {7: [b"rollout-a", b"rollout-b"], "pass_rate": {1: 0.25}})
    path = store.write(4, 2, {"step": 4})
    original = path.read_bytes()
    for offset in range(len(original)):
        damaged = bytearray(original)
        damaged[offset] ^= 1 << (offset % 8)
        path.write_bytes(damaged)
        assert store.load_latest().position == 3
    path.write_bytes(original)
    assert store.load_latest().position == 4


def test_a_snapshot_over_max_snapshot_bytes_is_refused_before_writing(tmp_path):
    store = SnapshotStore(tmp_path, JournalConfig(max_snapshot_bytes=100))
    with pytest.raises(ValueError, match="max_snapshot_bytes"):
        store.write(1, 1, {"blob": b"x" * 100})
    assert not list(tmp_path.iterdir())


def test_recovery_is_snapshot_plus_replay_of_later_records(tmp_path):
    """The intended use: state = fold(snapshot.state, records after snapshot.position)."""
    config = JournalConfig(segment_bytes=4096)

    def apply(total: int, payload: bytes) -> int:
        return total + int(payload)

    total = 0
    with Journal.open(tmp_path, config) as journal:
        store = SnapshotStore(tmp_path, config)
        for i in range(1, 200):
            position = journal.append(1, str(i).encode().rjust(300))
            total += i
            if i % 50 == 0:
                journal.sync()
                store.write(position, 1, total)
                journal.delete_before(store.oldest_position() + 1)
    with Journal.open(tmp_path, config) as journal:
        snapshot = SnapshotStore(tmp_path, config).load_latest()
        recovered = snapshot.state
        for record in journal.records_after(snapshot.position):
            recovered = apply(recovered, record.payload)
        assert journal.first_position > 1  # retention did delete segments
    assert recovered == total == sum(range(1, 200))
