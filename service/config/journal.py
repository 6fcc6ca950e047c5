"""The journal's settings: one frozen dataclass, every field with its meaning, unit and default.

The defaults are the safe ones: an append returns only once its record is on stable storage
(`sync = "group"`: one fsync shared by the appends that arrive together), so the sidecar may
ack a producer as soon as `append` returns. The field docs live in `doc` metadata, the same
convention as `rlfeed.service.config`, so the sidecar's `[journal]` section can embed this
class and print it with the rest of the resolved config.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfeed.service.config.fields import documented

SYNC_POLICIES: tuple[str, ...] = ("always", "group", "none")

MiB = 1 << 20
# The record header's length field is a u32; keep well clear of it.
MAX_RECORD_BYTES_LIMIT = (1 << 32) - 1


@dataclass(kw_only=True, frozen=True)
class JournalConfig:
    """Durability: where the sidecar journals what it acknowledges, and how it syncs it."""

    dir: str = documented(
        "",
        "folder of the sidecar's journal, on local disk or shared storage; empty = off: "
        "a crash then loses every buffered rollout and the curriculum (production runs set "
        "it). Inside: scheduler/ (the scheduler's calls and snapshots) and frontend-N/ (each "
        "front-end's ingest payloads and step responses)",
    )
    snapshot_every_records: int = documented(
        20_000,
        "the scheduler snapshots its state after this many journaled calls, count; the "
        "journal before the older kept snapshot is then deleted, so a restart replays at "
        "most about twice this many calls",
    )

    segment_bytes: int = documented(
        256 * MiB,
        "a segment file is closed and a new one started once the next record would take it "
        "past this many bytes (a segment holds at least one record), bytes; retention "
        "deletes whole segments, so this is also its granularity",
    )
    max_record_bytes: int = documented(
        512 * MiB,
        "largest payload one record may carry, bytes; appends above it are refused and a "
        "reader never reads more than this for one record (the sidecar's largest ingest "
        "message, i.e. `[server] max_message_bytes`)",
    )
    sync: str = documented(
        "group",
        'when an append is made durable before it returns: "always" = one fsync per record; '
        '"group" = concurrent appends share one fsync (durable before return, at most '
        'group_commit_window_seconds later); "none" = the OS writes back when it likes: '
        "survives a killed process, not a power loss or kernel crash",
    )
    direct_io: bool = documented(
        True,
        "append records of 256 KiB or more (a front-end's ingest batches) with O_DIRECT: "
        "the device reads them from an aligned buffer instead of the kernel copying them "
        "into the page cache first, several times less CPU per journaled byte; fsyncs and "
        'what survives a crash are the same (with sync = "none" such an append waits for '
        "its write to reach the device, not for an fsync). Where the file system refuses "
        "O_DIRECT, records go through the page cache (one warning)",
    )
    group_commit_window_seconds: float = documented(
        0.0,
        'with sync = "group": how long the thread that leads an fsync waits for other '
        "appends to join it, seconds; it bounds the latency added to an append. 0 still "
        "batches the appends that arrive while the previous fsync runs",
    )
    snapshots_kept: int = documented(
        2,
        "newest valid snapshots kept on disk, count (>= 2, so a damaged newest snapshot "
        "falls back to the previous one; retention must keep the records after the oldest)",
    )
    max_snapshot_bytes: int = documented(
        4096 * MiB,
        "largest snapshot written or read, bytes; a bigger one is refused, never half-read",
    )

    def __post_init__(self) -> None:
        if self.snapshot_every_records < 1:
            raise ValueError(
                f"[journal] snapshot_every_records: must be >= 1, got {self.snapshot_every_records}"
            )
        if self.sync not in SYNC_POLICIES:
            raise ValueError(f"[journal] sync: must be one of {SYNC_POLICIES}, got {self.sync!r}")
        if not 0 < self.max_record_bytes <= MAX_RECORD_BYTES_LIMIT:
            raise ValueError(
                f"[journal] max_record_bytes: must be in [1, {MAX_RECORD_BYTES_LIMIT}], "
                f"got {self.max_record_bytes}"
            )
        if self.segment_bytes < 4096:
            raise ValueError(f"[journal] segment_bytes: must be >= 4096, got {self.segment_bytes}")
        if not 0.0 <= self.group_commit_window_seconds <= 1.0:
            raise ValueError(
                "[journal] group_commit_window_seconds: must be in [0, 1], "
                f"got {self.group_commit_window_seconds}"
            )
        if self.snapshots_kept < 2:
            raise ValueError(f"[journal] snapshots_kept: must be >= 2, got {self.snapshots_kept}")
        if self.max_snapshot_bytes < 1:
            raise ValueError("[journal] max_snapshot_bytes: must be >= 1")
