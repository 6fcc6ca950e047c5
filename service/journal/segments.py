"""A directory of numbered segment files: naming, creation, recovery, reading, retention.

Segment `N` is the file `DIR/{N:020d}.seg` whose first record has sequence number N (the
Kafka convention: names sort in record order and say where each file starts). Segments
are created atomically (temp file, fsync, rename, fsync of the directory), so a segment
file always has a whole, valid header. Only the newest segment is ever appended to, so a
torn write can only be at the end of the newest segment; damage anywhere else is
corruption. `Journal` (journal.py) is the one writer on top of this.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rlfeed.service.journal.errors import JournalCorruptError, JournalRangeError
from rlfeed.service.journal.files import BLOCK_BYTES, create_file_atomically, fsync_directory
from rlfeed.service.journal.records import (
    FILE_HEADER_BYTES,
    RECORD_HEADER_BYTES,
    Damage,
    Record,
    decode_file_header,
    encode_file_header,
    intact_record_after,
    read_records,
)

_log = logging.getLogger("rlfeed.service.journal")
_SEGMENT_NAME = re.compile(r"^(\d{20})\.seg$")
_SEGMENT_TMP = re.compile(r"^\d{20}\.seg\.tmp$")


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment file and the sequence number of its first record."""

    path: Path
    base_seq: int


def segment_path(directory: Path, base_seq: int) -> Path:
    return directory / f"{base_seq:020d}.seg"


def create_segment(directory: Path, base_seq: int) -> Segment:
    """A new, empty segment whose first record will be `base_seq` (crash-atomic)."""
    path = segment_path(directory, base_seq)
    create_file_atomically(path, [encode_file_header(base_seq)])
    return Segment(path, base_seq)


def list_segments(directory: Path, *, writer: bool = True) -> list[Segment]:
    """The directory's segments in record order; its `writer` deletes the leftover temp
    files of a crash (a reader must not: the writer may be creating one)."""
    segments = []
    for entry in os.scandir(directory):
        match = _SEGMENT_NAME.match(entry.name)
        if match:
            segments.append(Segment(Path(entry.path), int(match.group(1))))
        elif writer and _SEGMENT_TMP.match(entry.name):
            _log.warning("journal: deleting %s, a segment whose creation a crash cut", entry.path)
            os.unlink(entry.path)
    return sorted(segments, key=lambda s: s.base_seq)


@dataclass(frozen=True)
class Recovered:
    """What `recover` found: the segments in order and the number the next record gets."""

    segments: list[Segment]
    next_seq: int
    tail_bytes: int  # size of the newest segment file after any torn tail was cut


def recover(directory: Path, max_record_bytes: int) -> Recovered:
    """Verify every segment, record by record, and cut a torn tail; else refuse.

    A torn tail is damage in the newest segment that reaches its end with no intact record
    after it, within one record's bound (`RECORD_HEADER_BYTES + max_record_bytes`): what a
    write cut by a crash leaves. It is truncated away with a warning. Anything else that
    fails a check raises `JournalCorruptError` naming the file and byte offset. Reads the
    whole journal once (sequentially, at most one record at a time).
    """
    segments = list_segments(directory)
    if not segments:
        return Recovered([], 1, 0)
    next_seq = segments[0].base_seq
    tail_bytes = 0
    for index, segment in enumerate(segments):
        is_newest = index == len(segments) - 1
        with open(segment.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            base_seq = decode_file_header(segment.path, f.read(FILE_HEADER_BYTES))
            if base_seq != segment.base_seq:
                raise JournalCorruptError(
                    segment.path, 0, f"header says first record {base_seq}, name {segment.base_seq}"
                )
            if base_seq != next_seq:
                raise JournalCorruptError(
                    segment.path, 0, f"starts at record {base_seq}, expected {next_seq}"
                )
            end = FILE_HEADER_BYTES
            try:
                for record_end, record in read_records(f, end, next_seq, max_record_bytes):
                    end, next_seq = record_end, record.seq + 1
            except Damage as damage:
                _classify_damage(f, segment.path, damage, size, is_newest, max_record_bytes)
                _cut_torn_tail(segment.path, damage, size)
                end = damage.offset
            tail_bytes = end
    return Recovered(segments, next_seq, tail_bytes)


def _classify_damage(
    f: BinaryIO, path: Path, damage: Damage, size: int, is_newest: bool, max_record_bytes: int
) -> None:
    """Return if `damage` is a torn tail; raise `JournalCorruptError` if it is not."""
    reason = damage.reason
    if not is_newest:
        raise JournalCorruptError(
            path, damage.offset, f"{reason}, in a segment that a newer one follows"
        )
    if size - damage.offset > RECORD_HEADER_BYTES + max_record_bytes:
        raise JournalCorruptError(
            path, damage.offset, f"{reason}, {size - damage.offset} bytes before the end"
        )
    intact = intact_record_after(f, damage.offset, size)
    if intact is not None:
        raise JournalCorruptError(
            path, damage.offset, f"{reason}, and an intact record follows at offset {intact}"
        )


def _cut_torn_tail(path: Path, damage: Damage, size: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        if size - damage.offset < BLOCK_BYTES and not os.pread(
            fd, size - damage.offset, damage.offset
        ).strip(b"\0"):
            _log.info("journal: cutting the zeros an O_DIRECT write left after %s's end", path)
        else:
            _log.warning(
                "journal: torn tail in %s at byte offset %d (%s): cutting %d bytes that a "
                "crash left half-written",
                path,
                damage.offset,
                damage.reason,
                size - damage.offset,
            )
        os.ftruncate(fd, damage.offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_segments(
    segments: list[Segment], after: int, through: int, max_record_bytes: int
) -> Iterator[Record]:
    """Records `after + 1` .. `through`, in order, from `segments` (which must hold them).

    Raises `JournalRangeError` if retention deleted some of them, `JournalCorruptError` if
    one fails its checks or is missing: the sequence yielded is gap-free or an error.
    """
    expected = after + 1
    for index, segment in enumerate(segments):
        if expected > through:
            return
        following = segments[index + 1].base_seq if index + 1 < len(segments) else None
        if following is not None and following <= expected:
            continue  # every record of this segment is at or before `after`
        try:
            f = open(segment.path, "rb")  # noqa: SIM115 (closed by the `with` below)
        except FileNotFoundError:
            raise JournalRangeError(f"segment {segment.path} was deleted while read") from None
        with f:
            decode_file_header(segment.path, f.read(FILE_HEADER_BYTES))
            records = read_records(
                f, FILE_HEADER_BYTES, segment.base_seq, max_record_bytes, skip_below=expected
            )
            try:
                for end, record in records:
                    if record.seq != expected:
                        start = end - RECORD_HEADER_BYTES - len(record.payload)
                        raise JournalCorruptError(
                            segment.path, start, f"record {record.seq} where {expected} belongs"
                        )
                    yield record
                    expected = record.seq + 1
                    if expected > through:
                        return
            except Damage as damage:
                raise JournalCorruptError(segment.path, damage.offset, damage.reason) from None
    if expected <= through:
        raise JournalCorruptError(
            segments[-1].path if segments else "(no segments)",
            -1,
            f"records {expected}..{through} are missing",
        )


def delete_segments(directory: Path, segments: list[Segment]) -> None:
    """Delete `segments` oldest first (a crash leaves a gap-free suffix), then fsync the dir."""
    for segment in segments:
        os.unlink(segment.path)
    if segments:
        fsync_directory(directory)


def read_positions(directory: Path, positions: set[int], max_record_bytes: int) -> dict[int, bytes]:
    """Position -> payload of records `positions` of the journal in `directory`, read
    without its lock: its writer may be appending (past them) meanwhile, as long as it
    keeps them (a front-end reading another slot's batches, which the scheduler's
    `journal_floor` protects from retention). One sequential read from the lowest.
    Raises like `read_segments` if one is gone or damaged."""
    if not positions:
        return {}
    segments = list_segments(directory, writer=False)
    records = read_segments(segments, min(positions) - 1, max(positions), max_record_bytes)
    return {record.seq: record.payload for record in records if record.seq in positions}
