"""The few POSIX file operations durability rests on, each done the one right way.

Journal segments and snapshots are training data (token ids, rewards of every rollout):
files are created 0600 and the directories the journal creates 0700, owner only (the
umask can only narrow them). A directory that already exists, such as a mounted volume,
keeps its mode: an operator's, not ours to change.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from rlfeed.service.journal.errors import JournalLockedError

# O_DIRECT's alignment of offsets, lengths and memory: a multiple of every common logical
# block size.
BLOCK_BYTES = 4096
# fdatasync flushes the data and the size (what a reader needs), not the timestamps.
_datasync = getattr(os, "fdatasync", os.fsync)
FILE_MODE = 0o600  # segments, snapshots, LOCK: the owner reads and writes, nobody else
DIRECTORY_MODE = 0o700


class JournalIo:
    """What this process's journals and snapshots wrote: bytes and syncs (the end-to-end
    benchmark reports them per acknowledged ingest byte and per second)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_written = 0
        self.syncs = 0

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes

    def synced(self) -> None:
        with self._lock:
            self.syncs += 1


JOURNAL_IO = JournalIo()


def sync_fd(fd: int) -> None:
    """fdatasync (fsync where there is none): the data and the size, what a reader needs."""
    _datasync(fd)
    JOURNAL_IO.synced()


def make_private_directory(directory: Path) -> None:
    """Create `directory` and its missing parents, each DIRECTORY_MODE; existing ones are
    left as they are. Safe against another process creating them at the same time."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            if not path.is_dir():
                raise


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (files created, renamed, deleted) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
        JOURNAL_IO.synced()
    finally:
        os.close(fd)


def write_all(fd: int, chunks: Sequence[bytes]) -> None:
    """Write every byte of `chunks` at the fd's position, resuming after short writes."""
    views = [memoryview(c) for c in chunks if len(c)]
    JOURNAL_IO.wrote(sum(map(len, views)))
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def write_direct(fd: int, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
    """Write `buffer[:nbytes]` at `offset` of an O_DIRECT descriptor (all three aligned to
    the device's block), resuming after a short write of whole blocks."""
    JOURNAL_IO.wrote(nbytes)
    done = 0
    with memoryview(buffer) as view:
        while done < nbytes:
            with view[done:nbytes] as rest:
                written = os.pwrite(fd, rest, offset + done)
            if written <= 0 or (written < nbytes - done and written % BLOCK_BYTES):
                raise OSError(errno.EIO, f"short direct write: {written} of {nbytes - done} bytes")
            done += written


def create_file_atomically(path: Path, chunks: Sequence[bytes]) -> None:
    """Create (or replace) `path` holding `chunks`, all or nothing, even across a crash.

    Write a temporary file beside it, fsync it, rename it into place, fsync the directory:
    after a crash the name either does not exist or has the whole content. A leftover
    `*.tmp` file is the caller's to delete on start-up.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        write_all(fd, chunks)
        os.fsync(fd)
        JOURNAL_IO.synced()
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_directory(path.parent)


class DirectoryLock:
    """An exclusive `flock` on `DIR/LOCK`: one writer per journal directory.

    Held until `release`; the kernel drops it when the process dies, so a crashed writer
    never blocks its replacement.
    """

    def __init__(self, directory: Path) -> None:
        self._fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise JournalLockedError(
                f"journal directory {directory} is in use by another writer (LOCK is held)"
            ) from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1
