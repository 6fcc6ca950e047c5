"""Disk faults under the journal (`faulty_disk.FaultyDisk`, a fault-injecting layer: disk
full and I/O errors on write or fsync, slow fsyncs). A record whose write or fsync failed
is never acknowledged (its append raises the retryable `JournalWriteError` naming the
cause); reads work throughout; once the disk takes writes again the journal heals on its
own and goes on gap-free, and a reopen finds exactly the acknowledged records."""

from __future__ import annotations

import errno
import importlib.util
import threading
import time
from pathlib import Path

import pytest
from rlfeed.service.journal import Journal, JournalConfig, JournalWriteError

_spec = importlib.util.spec_from_file_location(
    "faulty_disk", Path(__file__).with_name("faulty_disk.py")
)
faulty_disk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faulty_disk)


@pytest.fixture
def disk(monkeypatch):
    return faulty_disk.FaultyDisk(monkeypatch)


def _config(sync: str, segment_bytes: int = 4096) -> JournalConfig:
    return JournalConfig(segment_bytes=segment_bytes, max_record_bytes=1 << 20, sync=sync)


def _records(journal: Journal) -> list[bytes]:
    return [record.payload for record in journal.records_after(0)]


@pytest.mark.parametrize("size", [100, 300_001], ids=["page-cache", "o-direct"])
@pytest.mark.parametrize("sync", ["always", "group", "none"])
@pytest.mark.parametrize(("code", "on"), [(errno.ENOSPC, "write"), (errno.EIO, "write")])
def test_a_failed_write_is_never_acknowledged_and_the_journal_heals_once_writes_work(
    tmp_path, disk, sync, code, on, size
) -> None:
    """Small records go through the page cache, large ones (>= 256 KiB) straight to the
    device (O_DIRECT, `journal.appender`); a failed write of either kind lands part of its
    bytes, and the heal cuts them."""
    journal = Journal.open(tmp_path, _config(sync))
    journal.retry_after_s = 0.05
    acknowledged = [b"a" * size, b"b" * size]
    assert [journal.append(1, p) for p in acknowledged] == [1, 2]
    assert (disk.direct_writes > 0) == (size > 256 << 10)
    disk.fail(code, on=on)
    with pytest.raises(JournalWriteError) as raised:
        journal.append(1, b"lost" * (size // 2))
    name = faulty_disk.errno_names[code]
    assert name in str(raised.value) and "retry in 0.05 s" in str(raised.value)
    assert journal.fault is not None and raised.value.cause.errno == code
    assert _records(journal) == acknowledged  # reads work while writes fail
    failures = disk.failures
    with pytest.raises(JournalWriteError):  # within retry_after_s: not even tried
        journal.append(1, b"x")
    assert disk.failures == failures
    time.sleep(0.06)
    with pytest.raises(JournalWriteError):  # tried again: the disk still fails
        journal.append(1, b"x")
    assert disk.failures == failures + 1

    disk.heal()
    time.sleep(0.06)
    assert journal.append(1, b"c" * size) == 3  # gap-free after the last acknowledged
    assert journal.fault is None
    acknowledged.append(b"c" * size)
    assert _records(journal) == acknowledged
    journal.close()
    with Journal.open(tmp_path, _config(sync)) as again:
        assert _records(again) == acknowledged


def test_a_failed_fsync_fails_every_append_it_covered_and_cuts_them(tmp_path, disk) -> None:
    """Group commit: records written but not durable when the fsync fails are not
    acknowledged to any of their appenders, and the heal cuts them from the file (the
    page cache may no longer hold them after a failed fsync), reusing their positions."""
    journal = Journal.open(tmp_path, _config("group"))
    journal.retry_after_s = 0.05
    assert journal.append(1, b"kept") == 1
    disk.fail(errno.EIO, on="sync")
    outcomes: list[object] = []

    def append(payload: bytes) -> None:
        try:
            outcomes.append(journal.append(1, payload))
        except JournalWriteError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=append, args=(b"p%d" % i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(outcomes) == 4 and all(isinstance(o, JournalWriteError) for o in outcomes)
    assert "EIO" in str(outcomes[0])
    disk.heal()
    time.sleep(0.06)
    assert journal.append(1, b"next") == 2
    journal.close()
    with Journal.open(tmp_path, _config("group")) as again:
        assert _records(again) == [b"kept", b"next"]


def test_a_segment_that_cannot_be_created_leaves_no_stray_file(tmp_path, disk) -> None:
    """Disk full when a segment is full and the next one is created: no new segment file
    is left whose first number the healed journal gives to another record."""
    journal = Journal.open(tmp_path, _config("group"))
    journal.retry_after_s = 0.05
    payload = b"r" * 1500
    written = [journal.append(1, payload) for _ in range(2)]  # the next one rolls
    disk.fail(errno.ENOSPC)
    with pytest.raises(JournalWriteError, match="ENOSPC"):
        journal.append(1, payload)
    assert sorted(p.name for p in tmp_path.glob("*.seg")) == [f"{1:020d}.seg"]
    disk.heal()
    time.sleep(0.06)
    written += [journal.append(1, payload) for _ in range(3)]
    assert written == [1, 2, 3, 4, 5]
    journal.close()
    with Journal.open(tmp_path, _config("group")) as again:
        assert _records(again) == [payload] * 5


def test_a_slow_fsync_slows_each_append_and_concurrent_appends_share_it(tmp_path, disk) -> None:
    journal = Journal.open(tmp_path, _config("group", segment_bytes=1 << 20))
    disk.sync_delay_s = 0.2
    started = time.monotonic()
    journal.append(1, b"one")
    assert time.monotonic() - started >= 0.2  # acknowledged only once durable
    syncs = disk.syncs
    threads = [threading.Thread(target=journal.append, args=(1, b"x" * 10)) for _ in range(16)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    took = time.monotonic() - started
    assert took >= 0.2
    assert disk.syncs - syncs <= 3 and took < 16 * 0.2 / 2, (disk.syncs - syncs, took)
    journal.close()
