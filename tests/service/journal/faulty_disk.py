"""`FaultyDisk`: a fault-injecting layer under the journal's writes and fsyncs, in this
process. Disk full (ENOSPC) and I/O errors (EIO) on write or fsync, and slow fsyncs, as a
real disk gives them: a failing write first lands part of its bytes (a short write).

Loaded by path (`importlib`) by the integration tests, as `exactly_once.py` is.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence

from rlfeed.service.journal import appender as appender_module
from rlfeed.service.journal import files as files_module
from rlfeed.service.journal import journal as journal_module

_real_write_all = files_module.write_all
_real_write_direct = files_module.write_direct
_real_sync_fd = files_module.sync_fd


class FaultyDisk:
    """Patches the journal's `write_all`, `write_direct` (O_DIRECT appends) and `sync_fd`
    (and segment creation's writes) for the test's duration (`monkeypatch`). Set
    `write_error` / `sync_error` to an errno to make every write / fsync fail with it, None
    to let them through; `sync_delay_s` delays every fsync."""

    def __init__(self, monkeypatch) -> None:
        self.write_error: int | None = None
        self.sync_error: int | None = None
        self.sync_delay_s = 0.0
        self.failures = 0  # writes and fsyncs failed
        self.syncs = 0  # fsyncs done
        self.direct_writes = 0  # O_DIRECT writes tried
        self._lock = threading.Lock()
        for module in (appender_module, files_module):
            monkeypatch.setattr(module, "write_all", self._write_all)
        monkeypatch.setattr(appender_module, "write_direct", self._write_direct)
        monkeypatch.setattr(journal_module, "sync_fd", self._sync_fd)

    def fail(self, code: int = errno.ENOSPC, *, on: str = "write") -> None:
        if on == "write":
            self.write_error = code
        else:
            self.sync_error = code

    def heal(self) -> None:
        self.write_error = self.sync_error = None

    def _raise(self, code: int) -> None:
        with self._lock:
            self.failures += 1
        raise OSError(code, os.strerror(code))

    def _write_all(self, fd: int, chunks: Sequence[bytes]) -> None:
        code = self.write_error
        if code is None:
            _real_write_all(fd, chunks)
            return
        data = b"".join(bytes(c) for c in chunks)
        if len(data) > 1:
            os.write(fd, data[: len(data) // 2])  # what fit before the disk said no
        self._raise(code)

    def _write_direct(self, fd: int, buffer, nbytes: int, offset: int) -> None:
        with self._lock:
            self.direct_writes += 1
        code = self.write_error
        if code is None:
            _real_write_direct(fd, buffer, nbytes, offset)
            return
        blocks = nbytes // 2 // files_module.BLOCK_BYTES * files_module.BLOCK_BYTES
        if blocks:
            _real_write_direct(fd, buffer, blocks, offset)  # what fit before the disk said no
        self._raise(code)

    def _sync_fd(self, fd: int) -> None:
        if self.sync_delay_s:
            time.sleep(self.sync_delay_s)
        code = self.sync_error
        if code is not None:
            self._raise(code)
        _real_sync_fd(fd)
        with self._lock:
            self.syncs += 1


errno_names = {errno.ENOSPC: "ENOSPC", errno.EIO: "EIO"}
