"""Large records reach the disk with O_DIRECT (`journal.appender`), from an aligned buffer,
rewriting the partial last block each time. What the journal holds must not depend on it:
the files are byte-identical to a journal written through the page cache, readers see
every record while appends go on, and a crash's zero padding is cut on reopen without
losing a record. (tmp_path is on ext4 here, which takes O_DIRECT; a file system that
refuses it is imitated by refusing the flag at open.)"""

from __future__ import annotations

import errno
import logging
import os
import random
from pathlib import Path

import pytest
from rlfeed.service.journal import Journal, JournalConfig
from rlfeed.service.journal import appender as appender_module
from rlfeed.service.journal.appender import BUFFER_BYTES, DIRECT_MIN_BYTES
from rlfeed.service.journal.files import BLOCK_BYTES

# Around every boundary the appender handles: a block, the direct threshold, its buffer.
SIZES = [
    1,
    27,
    BLOCK_BYTES - 1,
    BLOCK_BYTES,
    DIRECT_MIN_BYTES - 1,
    DIRECT_MIN_BYTES,
    300_001,
    5,
    BUFFER_BYTES,
    BUFFER_BYTES + 1,
    2 * BUFFER_BYTES + 123,
    BLOCK_BYTES + 1,
    DIRECT_MIN_BYTES + 3,
]


def _payloads(seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for size in SIZES]


def _config(direct_io: bool) -> JournalConfig:
    # Segments of 12 MiB: several records each, and rolls between them.
    return JournalConfig(segment_bytes=12 << 20, max_record_bytes=16 << 20, direct_io=direct_io)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.glob("*.seg"))}


@pytest.fixture
def direct_writes(monkeypatch) -> list[int]:
    """The sizes of the O_DIRECT writes made during the test."""
    sizes: list[int] = []
    real = appender_module.write_direct

    def counted(fd: int, buffer, nbytes: int, offset: int) -> None:
        sizes.append(nbytes)
        real(fd, buffer, nbytes, offset)

    monkeypatch.setattr(appender_module, "write_direct", counted)
    return sizes


def test_a_journal_written_with_o_direct_is_byte_identical_to_one_through_the_page_cache(
    tmp_path, direct_writes
) -> None:
    payloads = _payloads()
    for direct_io in (False, True):
        with Journal.open(tmp_path / str(direct_io), _config(direct_io)) as journal:
            for kind, payload in enumerate(payloads, start=1):
                journal.append(kind, payload)
        if not direct_io:
            assert direct_writes == []
    assert len(direct_writes) >= sum(size >= DIRECT_MIN_BYTES for size in SIZES)
    assert all(size % BLOCK_BYTES == 0 for size in direct_writes)
    buffered, direct = _files(tmp_path / "False"), _files(tmp_path / "True")
    assert len(buffered) > 1  # it rolled
    assert direct == buffered


def test_every_record_reads_back_while_appends_go_on(tmp_path, direct_writes) -> None:
    """Each direct write rewrites the block the previous append ended in, which a reader
    may have in its page cache: what it reads is still exactly what was appended."""
    payloads = _payloads(seed=1)
    with Journal.open(tmp_path, _config(direct_io=True)) as journal:
        for count, payload in enumerate(payloads, start=1):
            journal.append(7, payload)
            assert [r.payload for r in journal.records_after(0)] == payloads[:count]
    assert direct_writes


def test_a_crash_leaves_zeros_past_the_end_and_a_reopen_keeps_every_record(
    tmp_path, caplog
) -> None:
    payloads = _payloads(seed=2)
    payloads.append(os.urandom(DIRECT_MIN_BYTES + 5))  # the last append leaves padding
    child = os.fork()
    if child == 0:  # the writer dies without closing: no trim, no final fsync of ours
        try:
            journal = Journal.open(tmp_path, _config(direct_io=True))
            for payload in payloads:
                journal.append(1, payload)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    newest = sorted(tmp_path.glob("*.seg"))[-1]
    assert newest.stat().st_size % BLOCK_BYTES == 0  # whole blocks: the zeros are there
    caplog.set_level(logging.INFO, logger="rlfeed.service.journal")
    with Journal.open(tmp_path, _config(direct_io=True)) as journal:
        assert [r.payload for r in journal.records_after(0)] == payloads
        journal.append(1, b"after")
    assert [r.levelno for r in caplog.records if "O_DIRECT" in r.message] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with Journal.open(tmp_path, _config(direct_io=True)) as journal:
        assert [r.payload for r in journal.records_after(0)] == [*payloads, b"after"]


def test_where_o_direct_is_refused_records_go_through_the_page_cache_with_a_warning(
    tmp_path, monkeypatch, direct_writes, caplog
) -> None:
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    payloads = _payloads(seed=3)
    caplog.set_level(logging.WARNING, logger="rlfeed.service.journal")
    with Journal.open(tmp_path, _config(direct_io=True)) as journal:
        for payload in payloads:
            journal.append(1, payload)
        assert [r.payload for r in journal.records_after(0)] == payloads
    assert direct_writes == []
    refused = [r.message for r in caplog.records if "refuses O_DIRECT" in r.message]
    assert len(refused) == 1 and "Invalid argument" in refused[0]  # one, for every segment
    assert len(_files(tmp_path)) > 1
