"""`SegmentAppender`: how bytes reach the newest segment file, through the page cache or,
for large records, straight to the device (O_DIRECT).

Why: a front-end journals every ingest byte it acknowledges, 8 MiB records at hundreds of
MiB/s. Through the page cache every byte is first copied into freshly allocated kernel
pages; on the 2-core dev VM those writes took 0.27-0.37 CPU-s per 144 MiB in the
end-to-end benchmark (a third of the front-end's CPU with the journal on; 0.05 when the
kernel had freed pages at hand), while O_DIRECT writes of the same bytes from an aligned
buffer took 0.004-0.007 CPU-s, plus ~0.015 s to copy them into it: the device reads them by
DMA. The fsync that makes them durable is the same either way, and so is what a reader
sees (the kernel drops cached pages a direct write replaces).

O_DIRECT wants offsets, lengths and memory aligned to the device's block. The appender
keeps the segment's partial last block in memory and writes it again, followed by the new
bytes and zeros up to a whole block, from one reused page-aligned buffer. The rewritten
prefix holds the same bytes as before, so a crash mid-write cannot change a durable
record. The zeros past the logical end are cut when the segment is closed or rolled; a
crash leaves them as a torn tail of zeros, which recovery cuts like any torn tail.

Small records (under `DIRECT_MIN_BYTES`: the scheduler's calls, small ingest batches) go
through the page cache: a synchronous device write per small append would cost more than
the copy it saves. Where the file system refuses O_DIRECT (EINVAL: tmpfs on older kernels,
some network file systems) every write goes through the page cache, with one warning.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from rlfeed.service.journal.files import BLOCK_BYTES, write_all, write_direct

_log = logging.getLogger("rlfeed.service.journal")

DIRECT_MIN_BYTES = 256 << 10  # smaller appends go through the page cache
BUFFER_BYTES = 4 << 20  # the aligned buffer a direct write is staged in, reused
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: not Linux; every write is buffered
_warned: set[Path] = set()  # directories whose refusal was logged (once, not per segment)


class SegmentAppender:
    """Appends to one segment file at its logical end (`size`); `direct` allows O_DIRECT
    for large appends. `fd` is the descriptor to fsync (one per file: it covers both)."""

    def __init__(self, path: Path, size: int, *, direct: bool) -> None:
        self.path = path
        self.size = size
        self.fd = os.open(path, os.O_WRONLY)
        os.lseek(self.fd, size, os.SEEK_SET)
        self._direct_fd = -1
        self._tail = b""  # the bytes of the partial last block, [size - size % BLOCK, size)
        self._buffer: mmap.mmap | None = None  # page-aligned, made at the first direct write
        self._padded = False  # zeros past `size` on disk, to cut before closing
        if direct and _O_DIRECT:
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | _O_DIRECT)
            except OSError as error:
                if error.errno not in _REFUSED:
                    os.close(self.fd)
                    raise
                self._refused(error)
            else:
                self._tail = self._read_tail()

    def write(self, chunks: Sequence[bytes | memoryview]) -> None:
        """Append `chunks` at the logical end. An OSError leaves `size` as it was (the file
        may hold part of them: `truncate` cuts it back)."""
        nbytes = sum(len(chunk) for chunk in chunks)
        if self._direct_fd >= 0 and nbytes >= DIRECT_MIN_BYTES:
            try:
                self._write_direct(chunks)
            except OSError as error:
                if error.errno not in _REFUSED or self._padded:
                    raise
                self._stop_direct(error)  # refused before anything was written
                write_all(self.fd, chunks)
        else:
            write_all(self.fd, chunks)
            if self._direct_fd >= 0:
                self._tail = _last_bytes([self._tail, *chunks], (self.size + nbytes) % BLOCK_BYTES)
        self.size += nbytes

    def truncate(self, size: int) -> None:
        """Cut the file back to `size` bytes (what is durable) and append from there."""
        os.ftruncate(self.fd, size)
        os.lseek(self.fd, size, os.SEEK_SET)
        self.size, self._padded = size, False
        if self._direct_fd >= 0:
            self._tail = self._read_tail()

    def trim(self) -> None:
        """Cut the zeros a direct write left past the logical end (before the last fsync of
        a segment: a closed segment ends at its last record)."""
        if self._padded:
            os.ftruncate(self.fd, self.size)
            self._padded = False

    def close(self) -> None:
        for fd in (self.fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._direct_fd = -1
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    # --- internals ---

    def _write_direct(self, chunks: Sequence[bytes | memoryview]) -> None:
        """Stage the tail block and `chunks` in the aligned buffer, a buffer at a time, and
        write each at its aligned offset; the last one padded with zeros to a block."""
        if self._buffer is None:
            self._buffer = mmap.mmap(-1, BUFFER_BYTES)
        buffer, offset, filled = self._buffer, self.size - len(self._tail), 0
        for chunk in [self._tail, *chunks]:
            view, taken = memoryview(chunk).cast("B"), 0
            while taken < len(view):
                step = min(len(view) - taken, BUFFER_BYTES - filled)
                buffer[filled : filled + step] = view[taken : taken + step]
                filled, taken = filled + step, taken + step
                if filled == BUFFER_BYTES:
                    write_direct(self._direct_fd, buffer, BUFFER_BYTES, offset)
                    self._padded = True
                    offset, filled = offset + BUFFER_BYTES, 0
        tail = buffer[filled - filled % BLOCK_BYTES : filled]
        if filled:
            padded = -(-filled // BLOCK_BYTES) * BLOCK_BYTES
            buffer[filled:padded] = bytes(padded - filled)
            write_direct(self._direct_fd, buffer, padded, offset)
            self._padded = True
        self._tail = tail
        os.lseek(self.fd, offset + filled, os.SEEK_SET)  # the buffered writes' position

    def _read_tail(self) -> bytes:
        start = self.size - self.size % BLOCK_BYTES
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(self.size - start)

    def _stop_direct(self, error: OSError) -> None:
        os.close(self._direct_fd)
        self._direct_fd = -1
        self._refused(error)

    def _refused(self, error: OSError) -> None:
        if self.path.parent in _warned:
            return
        _warned.add(self.path.parent)
        _log.warning(
            "journal: %s refuses O_DIRECT (%s); its records go through the page cache, "
            "which costs more CPU per byte",
            self.path.parent,
            os.strerror(error.errno or 0),
        )


def _last_bytes(chunks: Sequence[bytes | memoryview], count: int) -> bytes:
    """The last `count` bytes of `chunks` joined (count <= their total length)."""
    out: list[bytes] = []
    for chunk in reversed(chunks):
        if count <= 0:
            break
        view = memoryview(chunk).cast("B")
        piece = view[max(0, len(view) - count) :]
        out.append(bytes(piece))
        count -= len(piece)
    return b"".join(reversed(out))
