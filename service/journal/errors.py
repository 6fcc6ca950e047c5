"""The journal's errors: each names what a person needs to act on it."""

from __future__ import annotations

import errno
import os


class JournalError(Exception):
    """Base class of every error the journal raises on purpose."""


class JournalCorruptError(JournalError):
    """A file holds bytes the journal did not write, somewhere other than a torn tail.

    Raised instead of ever returning a record that fails its checks: `file` is the damaged
    file, `offset` the byte offset of the first record (or header) that does not verify,
    `reason` what failed. Nothing is repaired; a person decides (restore, or truncate the
    file at `offset` and lose what follows).
    """

    def __init__(self, file: str | os.PathLike[str], offset: int, reason: str) -> None:
        self.file = os.fspath(file)
        self.offset = offset
        self.reason = reason
        super().__init__(f"journal file {self.file} is corrupt at byte offset {offset}: {reason}")


class JournalVersionError(JournalError, ValueError):
    """A journal file holds a format this rlfeed does not read: written by another rlfeed
    version (a newer one, or one older than the oldest this one reads). Raised at once,
    never skipped: recovery must not go on without what that file holds. `what` names the
    format, `found` the version in the file, `reads` the versions this rlfeed reads."""

    def __init__(
        self, file: str | os.PathLike[str], what: str, found: int, reads: tuple[int, ...]
    ) -> None:
        self.file, self.what, self.found, self.reads = os.fspath(file), what, found, reads
        readable = ", ".join(map(str, reads))
        super().__init__(
            f"{self.file}: {what} version {found} was written by another rlfeed version; this "
            f"rlfeed reads {what} version {readable}. Run an rlfeed that reads it, or start on "
            "an empty [journal] dir (service/journal/README.md: compatibility)"
        )


class JournalRangeError(JournalError):
    """Records asked for were deleted by retention (never silently skipped)."""


class JournalLockedError(JournalError):
    """Another writer (process or open `Journal`) holds the journal directory."""


class JournalClosedError(JournalError):
    """The journal was closed, or an earlier write or fsync failed and it stopped accepting."""


class JournalWriteError(JournalClosedError):
    """A write or fsync failed (disk full, I/O error): the record is not acknowledged, nor
    any other not yet durable. Retryable: the journal drops what is not durable and tries
    again on an append at least `retry_after_s` later, so appends succeed again, losing
    nothing acknowledged, once the disk takes writes. `cause` is the OSError."""

    def __init__(self, directory: str | os.PathLike[str], cause: OSError, retry_after_s: float):
        self.cause, self.retry_after_s = cause, retry_after_s
        what = os.strerror(cause.errno) if cause.errno else str(cause)
        name = errno.errorcode.get(cause.errno or 0, "error")
        super().__init__(
            f"journal {os.fspath(directory)} cannot write ({name}: {what}); nothing since its "
            f"last durable record is acknowledged; retry in {retry_after_s:g} s"
        )
