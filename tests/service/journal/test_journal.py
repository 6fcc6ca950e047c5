"""The journal's append API: what goes in comes back, in order, across reopen and rolls."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlfeed.service.journal import (
    Journal,
    JournalClosedError,
    JournalConfig,
    JournalLockedError,
    JournalRangeError,
)

SMALL = JournalConfig(segment_bytes=4096, max_record_bytes=1 << 16)

records_strategy = st.lists(
    st.tuples(st.integers(1, 255), st.binary(max_size=1500)), min_size=0, max_size=25
)


@settings(max_examples=25, deadline=None)
@given(records=records_strategy, sync=st.sampled_from(["always", "group", "none"]))
def test_round_trip_across_reopen_and_segment_rolls(tmp_path_factory, records, sync):
    directory = tmp_path_factory.mktemp("journal")
    config = JournalConfig(segment_bytes=4096, max_record_bytes=1 << 16, sync=sync)
    with Journal.open(directory, config) as journal:
        positions = [journal.append(kind, payload) for kind, payload in records]
        assert positions == list(range(1, len(records) + 1))
        assert [(r.kind, r.payload) for r in journal.records_after(0)] == records
    with Journal.open(directory, config) as journal:
        assert journal.last_position == len(records)
        assert [(r.seq, r.kind, r.payload) for r in journal.records_after(0)] == [
            (i + 1, kind, payload) for i, (kind, payload) in enumerate(records)
        ]
        for position in range(len(records) + 1):
            assert [r.seq for r in journal.records_after(position)] == list(
                range(position + 1, len(records) + 1)
            )
        assert journal.append(7, b"next") == len(records) + 1


def test_positions_continue_after_reopen_and_are_never_reused(tmp_path):
    with Journal.open(tmp_path, SMALL) as journal:
        journal.append(1, b"a")
        journal.append(1, b"b")
    with Journal.open(tmp_path, SMALL) as journal:
        assert journal.append(1, b"c") == 3
        assert journal.durable_position == 3


def test_records_after_sees_only_records_written_before_the_call(tmp_path):
    with Journal.open(tmp_path, SMALL) as journal:
        journal.append(1, b"a")
        replay = journal.records_after(0)
        journal.append(1, b"b")
        assert [r.payload for r in replay] == [b"a"]


def test_records_after_refuses_positions_it_cannot_serve_in_full(tmp_path):
    with Journal.open(tmp_path, SMALL) as journal:
        for _ in range(10):
            journal.append(1, b"x" * 1000)
        with pytest.raises(JournalRangeError, match="past the journal's end"):
            journal.records_after(11)
        journal.delete_before(5)
        with pytest.raises(JournalRangeError, match="deleted by retention"):
            journal.records_after(0)


def test_retention_deletes_only_whole_segments_fully_below_the_position(tmp_path):
    with Journal.open(tmp_path, SMALL) as journal:
        for i in range(20):  # 1028 bytes a record: three records a 4096-byte segment
            journal.append(1, bytes([i]) * 1000)
        bases = [1, 4, 7, 10, 13, 16, 19]
        assert sorted(p.name for p in tmp_path.glob("*.seg")) == [f"{b:020d}.seg" for b in bases]
        for position in range(0, 25):
            journal.delete_before(position)
            # The segment holding record `position` (or the newest) is the oldest kept.
            oldest_kept = max(b for b in bases if b <= max(position, 1))
            assert journal.first_position == oldest_kept
            assert sorted(p.name for p in tmp_path.glob("*.seg")) == [
                f"{b:020d}.seg" for b in bases if b >= oldest_kept
            ]
            kept = [r.seq for r in journal.records_after(oldest_kept - 1)]
            assert kept == list(range(oldest_kept, 21))
        assert journal.append(1, b"after") == 21


def test_appends_above_max_record_bytes_are_refused_and_write_nothing(tmp_path):
    config = JournalConfig(segment_bytes=4096, max_record_bytes=100)
    with Journal.open(tmp_path, config) as journal:
        with pytest.raises(ValueError, match="max_record_bytes"):
            journal.append(1, b"x" * 101)
        assert journal.append(1, b"x" * 100) == 1


def test_record_kind_must_fit_a_byte_and_not_be_zero(tmp_path):
    with Journal.open(tmp_path, SMALL) as journal:
        for kind in (0, 256):
            with pytest.raises(ValueError, match="kind"):
                journal.append(kind, b"")


def test_one_writer_per_directory(tmp_path):
    with Journal.open(tmp_path, SMALL), pytest.raises(JournalLockedError, match="in use"):
        Journal.open(tmp_path, SMALL)
    Journal.open(tmp_path, SMALL).close()  # released on close


def test_a_closed_journal_refuses_appends(tmp_path):
    journal = Journal.open(tmp_path, SMALL)
    journal.close()
    journal.close()
    with pytest.raises(JournalClosedError):
        journal.append(1, b"x")


@pytest.mark.parametrize("sync", ["always", "group", "none"])
def test_concurrent_appends_all_land_once_in_order_of_their_positions(tmp_path, sync):
    config = JournalConfig(segment_bytes=8192, sync=sync, group_commit_window_seconds=0.0005)
    journal = Journal.open(tmp_path, config)
    returned: dict[bytes, int] = {}
    lock = threading.Lock()

    def writer(thread: int) -> None:
        for i in range(40):
            payload = f"{thread}:{i}".encode() * 20
            position = journal.append(1, payload)
            assert journal.durable_position >= position or sync == "none"
            with lock:
                returned[payload] = position

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert journal.sync() == 160
    journal.close()
    with Journal.open(tmp_path, config) as reopened:
        on_disk = {r.payload: r.seq for r in reopened.records_after(0)}
    assert on_disk == returned
    assert sorted(on_disk.values()) == list(range(1, 161))


def test_config_rejects_unsafe_or_meaningless_values():
    with pytest.raises(ValueError, match="sync"):
        JournalConfig(sync="sometimes")
    with pytest.raises(ValueError, match="snapshots_kept"):
        JournalConfig(snapshots_kept=1)
    with pytest.raises(ValueError, match="max_record_bytes"):
        JournalConfig(max_record_bytes=1 << 32)
    assert JournalConfig().sync == "group"  # durable before the ack by default


def test_the_journal_package_imports_no_ray_grpc_or_torch():
    code = (
        "import sys, rlfeed.service.journal; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'grpc', 'torch', 'pyarrow', 'numpy')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
