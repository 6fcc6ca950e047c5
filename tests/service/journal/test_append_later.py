"""`Journal.append_later`: the journal's writer thread writes a record while the caller
goes on (a front-end validating the batch it journals); calling the result waits until the
record is durable and gives its position, exactly as `append` would have."""

from __future__ import annotations

import errno
import importlib.util
import threading
import time
from pathlib import Path

import pytest
from rlfeed.service.journal import Journal, JournalConfig, JournalWriteError
from rlfeed.service.journal import appender as appender_module

_spec = importlib.util.spec_from_file_location(
    "faulty_disk", Path(__file__).with_name("faulty_disk.py")
)
faulty_disk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faulty_disk)


def _records(journal: Journal) -> list[tuple[int, bytes]]:
    return [(record.seq, record.payload) for record in journal.records_after(0)]


@pytest.mark.parametrize("sync", ["always", "group", "none"])
def test_records_handed_over_get_the_positions_and_bytes_append_would_give(
    tmp_path, sync
) -> None:
    """In the order handed over; an `append` from another thread meanwhile takes its own
    place among them (positions are given as records are written)."""
    payloads = [bytes([i]) * (300_000 if i % 2 else 100) for i in range(8)]
    with Journal.open(tmp_path, JournalConfig(sync=sync)) as journal:
        waits = [journal.append_later(1, memoryview(p)) for p in payloads[:4]]
        plain = journal.append(1, payloads[4])
        waits += [journal.append_later(1, p) for p in payloads[5:]]
        positions = [wait() for wait in waits]
        assert positions == sorted(positions)
        assert sorted([*positions, plain]) == list(range(1, 9))
        assert journal.durable_position == 8 or sync == "none"
        by_position = dict(zip([*positions[:4], plain, *positions[4:]], payloads, strict=True))
        assert _records(journal) == sorted(by_position.items())


def test_the_caller_goes_on_while_the_record_is_written(tmp_path, monkeypatch) -> None:
    """The write takes 0.3 s (a slow disk): handing it over returns at once; the wait
    returns once it is written and synced."""
    real_write = appender_module.SegmentAppender.write
    started = threading.Event()

    def slow_write(self, chunks) -> None:
        started.set()
        time.sleep(0.3)
        real_write(self, chunks)

    monkeypatch.setattr(appender_module.SegmentAppender, "write", slow_write)
    with Journal.open(tmp_path, JournalConfig()) as journal:
        began = time.monotonic()
        durable = journal.append_later(1, b"batch" * 100)
        assert time.monotonic() - began < 0.1
        assert started.wait(5)
        assert journal.durable_position == 0  # not yet: the write is still on its way
        assert durable() == 1
        assert time.monotonic() - began >= 0.3
        assert journal.durable_position == 1


def test_a_failed_write_raises_from_the_wait_and_the_journal_heals(tmp_path, monkeypatch) -> None:
    disk = faulty_disk.FaultyDisk(monkeypatch)
    journal = Journal.open(tmp_path, JournalConfig())
    journal.retry_after_s = 0.05
    assert journal.append_later(1, b"kept")() == 1
    disk.fail(errno.ENOSPC)
    durable = journal.append_later(1, b"lost" * 100_000)
    with pytest.raises(JournalWriteError, match="ENOSPC"):
        durable()
    disk.heal()
    time.sleep(0.06)
    assert journal.append_later(1, b"after")() == 2  # gap-free after the last durable one
    assert _records(journal) == [(1, b"kept"), (2, b"after")]
    journal.close()


def test_close_writes_what_was_handed_over_before_it(tmp_path) -> None:
    journal = Journal.open(tmp_path, JournalConfig())
    waits = [journal.append_later(1, bytes([i]) * 50_000) for i in range(20)]
    journal.close()
    assert [wait() for wait in waits] == list(range(1, 21))
    with Journal.open(tmp_path, JournalConfig()) as again:
        assert _records(again) == [(i + 1, bytes([i]) * 50_000) for i in range(20)]


def test_an_oversized_record_is_refused_at_once_and_nothing_is_written(tmp_path) -> None:
    with Journal.open(tmp_path, JournalConfig(max_record_bytes=1000)) as journal:
        with pytest.raises(ValueError, match="exceeds max_record_bytes"):
            journal.append_later(1, b"x" * 1001)
        assert journal.append_later(1, b"y")() == 1
