"""A durable, CRC-checked journal and snapshot store for the sidecar (no Ray, gRPC or torch).

See README.md in this folder for the on-disk format and how recovery works.
"""

from rlfeed.service.config.journal import JournalConfig
from rlfeed.service.journal.errors import (
    JournalClosedError,
    JournalCorruptError,
    JournalError,
    JournalLockedError,
    JournalRangeError,
    JournalVersionError,
    JournalWriteError,
)
from rlfeed.service.journal.journal import Journal
from rlfeed.service.journal.records import Record
from rlfeed.service.journal.snapshot import Snapshot, SnapshotStore

__all__ = [
    "Journal",
    "JournalClosedError",
    "JournalConfig",
    "JournalCorruptError",
    "JournalError",
    "JournalLockedError",
    "JournalRangeError",
    "JournalVersionError",
    "JournalWriteError",
    "Record",
    "Snapshot",
    "SnapshotStore",
]
