"""Snapshots of the scheduler's state: msgpack, CRC-checked, replaced atomically.

A snapshot says "this is the state after applying every journal record up to `position`",
so recovery is: load the newest valid snapshot, then replay `records_after(position)`.

On disk, `DIR/snapshot-{position:020d}.msgpack` is a 32-byte header (little-endian: magic
`b"RLFSNAP\\0"`, format version u16, flags u16, position u64, body length u64, CRC32C u32
of the header's first 28 bytes and the body) followed by the msgpack body
`{"version": state_version, "state": state}`. It is written to `*.tmp`, fsynced, renamed
into place and the directory fsynced, so a crash leaves either the old set of snapshots or
the new one; a leftover temp file is deleted and never read. A snapshot that fails a check
is skipped with a warning in favour of the next older one; one of another format version
(its CRC intact) stops recovery with `JournalVersionError`.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from rlfeed.service.config.journal import JournalConfig
from rlfeed.service.journal.errors import JournalVersionError
from rlfeed.service.journal.files import (
    create_file_atomically,
    fsync_directory,
    make_private_directory,
)
from rlfeed.service.journal.records import crc32c

_log = logging.getLogger("rlfeed.service.journal")

SNAPSHOT_MAGIC = b"RLFSNAP\x00"
SNAPSHOT_FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sHHQQ")  # + u32 CRC
SNAPSHOT_HEADER_BYTES = _HEAD.size + 4
_U32 = struct.Struct("<I")
_NAME = re.compile(r"^snapshot-(\d{20})\.msgpack$")
_TMP = re.compile(r"^snapshot-\d{20}\.msgpack\.tmp$")


@dataclass(frozen=True)
class Snapshot:
    """State as of journal `position`; `version` is the state's schema version (the caller's)."""

    position: int
    version: int
    state: Any


class SnapshotInvalid(Exception):
    """Internal: a snapshot file that fails a check (the loader falls back past it)."""


class SnapshotStore:
    """The snapshots in one directory: write atomically, load the newest that verifies."""

    def __init__(self, directory: str | os.PathLike[str], config: JournalConfig) -> None:
        self.directory = Path(directory)
        self.config = config
        make_private_directory(self.directory)
        for entry in os.scandir(self.directory):
            if _TMP.match(entry.name):
                _log.warning("journal: deleting %s, a snapshot a crash cut short", entry.path)
                os.unlink(entry.path)

    def write(self, position: int, version: int, state: Any) -> Path:
        """Durably store `state` as of journal `position`; prune beyond `snapshots_kept`.

        `state` is what msgpack encodes (dict, list, str, bytes, int, float, bool, None;
        int map keys are fine; tuples come back as lists). The caller must have made the
        journal durable through `position` first (`Journal.sync()`), or a crash could
        leave a snapshot ahead of the journal. Raises `ValueError` above
        `max_snapshot_bytes` (nothing is written).
        """
        body = msgpack.packb({"version": version, "state": state}, use_bin_type=True)
        size = SNAPSHOT_HEADER_BYTES + len(body)
        if size > self.config.max_snapshot_bytes:
            raise ValueError(
                f"snapshot of {size} bytes exceeds max_snapshot_bytes "
                f"({self.config.max_snapshot_bytes})"
            )
        head = _HEAD.pack(SNAPSHOT_MAGIC, SNAPSHOT_FORMAT_VERSION, 0, position, len(body))
        crc = crc32c(body, crc32c(head))
        path = self.directory / f"snapshot-{position:020d}.msgpack"
        create_file_atomically(path, [head, _U32.pack(crc), body])
        self._prune()
        return path

    def load_latest(self) -> Snapshot | None:
        """The newest snapshot that verifies, or None if there is none (replay from 0).

        Damaged or unreadable ones are skipped with a warning; falling back is safe
        because `Journal.records_after` refuses if the records after an older snapshot
        were deleted. An intact one of a format this rlfeed does not read raises
        `JournalVersionError`: another rlfeed version wrote it.
        """
        for position, path in reversed(self._listed()):
            try:
                return self._read(path, position)
            except (SnapshotInvalid, OSError) as error:
                _log.warning("journal: skipping snapshot %s: %s", path, error)
        return None

    def oldest_position(self) -> int | None:
        """Position of the oldest snapshot kept: retention may delete records up to it."""
        listed = self._listed()
        return listed[0][0] if listed else None

    def _listed(self) -> list[tuple[int, Path]]:
        found = []
        for entry in os.scandir(self.directory):
            match = _NAME.match(entry.name)
            if match:
                found.append((int(match.group(1)), Path(entry.path)))
        return sorted(found)

    def _prune(self) -> None:
        stale = self._listed()[: -self.config.snapshots_kept]
        for _, path in stale:  # oldest first
            os.unlink(path)
        if stale:
            fsync_directory(self.directory)

    def _read(self, path: Path, position: int) -> Snapshot:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > self.config.max_snapshot_bytes:
                raise SnapshotInvalid(f"{size} bytes exceeds max_snapshot_bytes")
            header = f.read(SNAPSHOT_HEADER_BYTES)
            if len(header) < SNAPSHOT_HEADER_BYTES:
                raise SnapshotInvalid(f"header is {len(header)} bytes, not 32")
            magic, fmt, flags, header_position, body_bytes = _HEAD.unpack_from(header)
            if magic != SNAPSHOT_MAGIC:
                raise SnapshotInvalid(f"not a snapshot (magic {magic!r})")
            if SNAPSHOT_HEADER_BYTES + body_bytes != size:
                raise SnapshotInvalid(f"header says {body_bytes} body bytes, file has {size}")
            body = f.read(body_bytes)
        (crc,) = _U32.unpack_from(header, _HEAD.size)
        if crc != crc32c(body, crc32c(header[: _HEAD.size])):
            raise SnapshotInvalid("CRC mismatch")
        if fmt != SNAPSHOT_FORMAT_VERSION:  # intact, another rlfeed's: never skipped
            raise JournalVersionError(path, "snapshot format", fmt, (SNAPSHOT_FORMAT_VERSION,))
        if flags != 0:
            raise SnapshotInvalid(f"unknown header flags {flags:#x}")
        if header_position != position:
            raise SnapshotInvalid(f"header says position {header_position}, name {position}")
        try:
            decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
            return Snapshot(position, decoded["version"], decoded["state"])
        except (ValueError, KeyError, TypeError) as error:
            raise SnapshotInvalid(f"msgpack body does not decode: {error}") from error
