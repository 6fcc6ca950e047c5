"""The append API the sidecar uses: one writer per directory, durable per `JournalConfig.sync`.

    journal = Journal.open(directory, JournalConfig())
    position = journal.append(KIND_INGEST, arrow_ipc_bytes)  # durable when it returns
    ...                                                      # ... so ack the producer now
    for record in journal.records_after(snapshot.position):  # recovery: replay the rest
        ...

A position is a record's sequence number: 1 for the first record ever appended, one more
for each after it, never reused (deleting segments does not renumber). Position 0 means
"before every record". Thread-safe: appends from many threads are written one at a time,
and with `sync = "group"` the threads whose records are waiting share one fsync.

A write or fsync that fails (disk full, I/O error) fails every append not yet durable with
`JournalWriteError` (retryable; nothing it covers was acknowledged). An append at least
`retry_after_s` later first heals the journal: the file is cut back to its last durable
record (with sync "none", its last whole one), synced, and appending goes on from there,
so positions stay gap-free and nothing acknowledged is lost. Reads work throughout.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rlfeed.service.config.journal import JournalConfig
from rlfeed.service.journal.appender import SegmentAppender
from rlfeed.service.journal.durability import Durability
from rlfeed.service.journal.errors import JournalRangeError
from rlfeed.service.journal.files import (
    DirectoryLock,
    make_private_directory,
    sync_fd,
)
from rlfeed.service.journal.records import (
    FILE_HEADER_BYTES,
    RECORD_HEADER_BYTES,
    Record,
    crc32c,
    encode_record_header,
    warn_if_slow_crc,
)
from rlfeed.service.journal.segments import (
    Segment,
    create_segment,
    delete_segments,
    read_segments,
    recover,
    segment_path,
)


class Journal:
    """An append-only, CRC-checked, segmented record log in one directory.

    Open it with `Journal.open`; it recovers (verifies everything, cuts a torn tail,
    refuses corruption) before it accepts an append.
    """

    def __init__(
        self,
        directory: Path,
        config: JournalConfig,
        lock: DirectoryLock,
        segments: list[Segment],
        next_seq: int,
        tail_bytes: int,
    ) -> None:
        self.directory = directory
        self.config = config
        self._lock_file = lock
        self._segments = segments
        self._next_seq = next_seq
        self._segment_bytes = tail_bytes
        self._file = SegmentAppender(segments[-1].path, tail_bytes, direct=config.direct_io)
        self._write_lock = threading.Lock()  # the file, its size, the segment list, next_seq
        self._durability = Durability(directory, next_seq - 1)  # what appenders wait on
        self._durable_bytes = tail_bytes  # end of the durable records of the newest segment

    @classmethod
    def open(cls, directory: str | os.PathLike[str], config: JournalConfig) -> Journal:
        """Open (creating it if needed) and recover the journal in `directory`.

        Raises `JournalLockedError` if another writer holds it and `JournalCorruptError`
        if any file fails a check other than a torn tail (which is cut, with a warning).
        """
        path = Path(directory)
        make_private_directory(path)
        warn_if_slow_crc()
        lock = DirectoryLock(path)
        try:
            found = recover(path, config.max_record_bytes)
            segments, tail_bytes = found.segments, found.tail_bytes
            if not segments:
                segments, tail_bytes = [create_segment(path, found.next_seq)], FILE_HEADER_BYTES
            return cls(path, config, lock, segments, found.next_seq, tail_bytes)
        except BaseException:
            lock.release()
            raise

    @property
    def last_position(self) -> int:
        """Position of the newest record written (0 if none ever was)."""
        return self._next_seq - 1

    @property
    def first_position(self) -> int:
        """Position of the oldest record retention has kept (it may not be written yet)."""
        return self._segments[0].base_seq

    @property
    def fault(self) -> OSError | None:
        """The failed write or fsync that appends now wait out (None: appends work)."""
        return self._durability.fault

    @property
    def durable_position(self) -> int:
        """Every record up to this position is on stable storage."""
        return self._durability.position

    @property
    def retry_after_s(self) -> float:
        """An append heals a faulted journal at most this often (seconds; 0.5)."""
        return self._durability.retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, seconds: float) -> None:
        self._durability.retry_after_s = seconds

    def append(self, kind: int, payload: bytes | memoryview) -> int:
        """Append one record of `kind` (1..255); return its position once durable per policy.

        With sync "always" or "group" the record is on stable storage when this returns,
        so the caller may acknowledge it. Raises `ValueError` for a payload over
        `max_record_bytes` (nothing is written) and `JournalClosedError` once closed or
        after a failed write or fsync (the journal stops rather than guess what is on disk).
        """
        return self.append_all(kind, [payload])[0]

    def append_all(self, kind: int, payloads: list[bytes | memoryview]) -> list[int]:
        """`append` for several records that need one wait, not one each (a step's
        responses, one per rank): their positions, consecutive unless other threads append
        meanwhile. A `ValueError` for an oversized one writes none of them. A memoryview
        (an ingest payload inside its request) is written and checksummed in place."""
        payloads = [p if type(p) is bytes else memoryview(p).cast("B") for p in payloads]
        for payload in payloads:
            if len(payload) > self.config.max_record_bytes:
                raise ValueError(
                    f"record of {len(payload)} bytes exceeds max_record_bytes "
                    f"({self.config.max_record_bytes})"
                )
        written = [self._write(kind, payload, crc32c(payload)) for payload in payloads]
        if self.config.sync == "group" and written:
            self._wait_durable(*written[-1])
        if len({epoch for _, epoch in written}) > 1:  # healed in between: the first ones went
            raise self._durability.write_error()
        return [position for position, _ in written]

    def _write(self, kind: int, payload: bytes | memoryview, payload_crc: int) -> tuple[int, int]:
        """Write one record (fsynced with sync "always"); its position and epoch."""
        with self._write_lock:
            self._check_writable()
            record_bytes = RECORD_HEADER_BYTES + len(payload)
            has_records = self._segment_bytes > FILE_HEADER_BYTES
            seq = self._next_seq
            header = encode_record_header(seq, kind, len(payload), payload_crc)
            try:
                if has_records and self._segment_bytes + record_bytes > self.config.segment_bytes:
                    self._roll()
                self._file.write([header, payload])
                if self.config.sync == "always":
                    sync_fd(self._file.fd)
            except OSError as error:
                raise self._durability.faulted(error) from error
            self._segment_bytes += record_bytes
            self._next_seq = seq + 1
            if self.config.sync == "always":
                self._durable_bytes = self._segment_bytes
                self._durability.mark(seq)
            return seq, self._durability.epoch

    def sync(self) -> int:
        """Make every record written so far durable, whatever the policy; return its position."""
        with self._write_lock:
            self._check_writable()
            target, epoch = self._next_seq - 1, self._durability.epoch
        self._wait_durable(target, epoch)
        return target

    def records_after(self, position: int) -> Iterator[Record]:
        """The records after `position`, oldest first, up to the newest written at this call.

        Raises `JournalRangeError` if retention deleted some of them or `position` is past
        the end (a snapshot that covers records the journal lost), `JournalCorruptError` if
        a record fails its checks: what it yields is always gap-free and verified.
        """
        with self._write_lock:
            self._durability.check_open()
            segments = list(self._segments)
            last = self._next_seq - 1
        if position < segments[0].base_seq - 1:
            raise JournalRangeError(
                f"records {position + 1}..{segments[0].base_seq - 1} were deleted by retention"
            )
        if position > last:
            raise JournalRangeError(f"position {position} is past the journal's end ({last})")
        return read_segments(segments, position, last, self.config.max_record_bytes)

    def delete_before(self, position: int) -> list[Path]:
        """Delete every whole segment whose records all have positions below `position`.

        The segment being written is never deleted. Returns the paths deleted. Call it with
        the oldest kept snapshot's position + 1, never more.
        """
        with self._write_lock:
            self._durability.check_open()
            victims: list[Segment] = []
            for segment, following in zip(self._segments, self._segments[1:], strict=False):
                if following.base_seq - 1 >= position:
                    break
                victims.append(segment)
            self._segments = self._segments[len(victims) :]
            delete_segments(self.directory, victims)
        return [segment.path for segment in victims]

    def close(self) -> None:
        """Sync what was written, close the file and release the directory. Idempotent."""
        with self._write_lock:
            if self._file.fd < 0:
                return
            durability = self._durability
            try:
                if durability.failure is None and durability.fault is None:
                    self._file.trim()
                    sync_fd(self._file.fd)
                    durability.mark(self._next_seq - 1)
                elif durability.fault is not None:  # best effort: leave only what is durable
                    with contextlib.suppress(OSError):
                        self._cut_to_durable()
            finally:
                self._file.close()
                self._lock_file.release()
                durability.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals (called with _write_lock held unless said otherwise) ---

    def _check_writable(self) -> None:
        """Open, and not faulted: with a fault, heal if `retry_after_s` passed, else raise it."""
        durability = self._durability
        durability.check_open()
        if durability.fault is None:
            return
        durability.check_retry_due()
        try:
            self._cut_to_durable()
            sync_fd(self._file.fd)
        except OSError as error:
            raise durability.faulted(error) from error
        durability.healed()

    def _cut_to_durable(self) -> None:
        """Cut what a failure left unacknowledged: after the last durable record (sync
        "none": after the last whole one, which its appends acknowledged); a new epoch."""
        if self.config.sync != "none":
            self._segment_bytes = self._durable_bytes
            self._next_seq = self._durability.position + 1
        self._file.truncate(self._segment_bytes)
        self._durability.epoch += 1

    def _roll(self) -> None:
        """Close the full segment (synced: only the newest may hold a torn write), start one."""
        self._file.trim()
        sync_fd(self._file.fd)
        self._durable_bytes = self._segment_bytes
        self._durability.mark(self._next_seq - 1)
        path = segment_path(self.directory, self._next_seq)
        try:
            segment = create_segment(self.directory, self._next_seq)
            direct = self.config.direct_io
            appender = SegmentAppender(segment.path, FILE_HEADER_BYTES, direct=direct)
        except OSError:  # no stray segment: a heal may give its first number to another
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._file.close()
        self._file, self._segment_bytes = appender, FILE_HEADER_BYTES
        self._durable_bytes = FILE_HEADER_BYTES
        self._segments.append(segment)

    def _wait_durable(self, seq: int, epoch: int) -> None:
        """Return once record `seq`, written in `epoch`, is durable (called without
        _write_lock); JournalWriteError if a failure came first.

        Group commit: the first waiter becomes the leader, lets the configured window pass
        so more appends can join, then fsyncs everything written so far; the others wait
        for it. One fsync thus covers every record written before it started.
        """
        durability = self._durability
        if not durability.lead_or_wait(seq, epoch):
            return
        try:
            if self.config.group_commit_window_seconds > 0:
                time.sleep(self.config.group_commit_window_seconds)
            with self._write_lock:
                if durability.position >= seq:  # close() synced it meanwhile
                    return
                durability.check_open()
                if durability.fault is not None or epoch != durability.epoch:
                    raise durability.write_error()
                target, size, segments = (
                    self._next_seq - 1,
                    self._segment_bytes,
                    len(self._segments),
                )
                fd = os.dup(self._file.fd)  # a roll may close the file while this one syncs
            try:
                sync_fd(fd)
            except OSError as error:
                raise durability.faulted(error) from error
            finally:
                os.close(fd)
            with self._write_lock:
                if epoch == durability.epoch:  # what the fsync covered is durable, fault or not
                    if segments == len(self._segments):  # else a roll synced it all
                        self._durable_bytes = max(self._durable_bytes, size)
                    durability.mark(target)
        finally:
            durability.done_leading()
