"""Journal segments and snapshots hold training data: the owner alone may read them, whatever
the umask, and the directories the journal creates are the owner's alone too."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from rlfeed.service.journal import Journal, JournalConfig, SnapshotStore

SMALL = JournalConfig(segment_bytes=4096, max_record_bytes=1 << 16)


@pytest.fixture
def open_umask():
    """The most permissive umask: nothing may rely on it to hide the files."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_segments_snapshots_and_the_lock_are_0600_and_new_directories_0700(tmp_path, open_umask):
    tmp_path.chmod(0o755)  # an existing folder (a mounted volume): left as it is
    journal_dir = tmp_path / "journal" / "scheduler"  # --journal-dir and its slot, both new
    with Journal.open(journal_dir, SMALL) as journal:
        for n in range(40):  # ~40 KB: several segment rolls
            journal.append(1, bytes([n]) * 1000)
    store = SnapshotStore(journal_dir, SMALL)
    store.write(40, 1, {"rollouts": list(range(100))})
    store.write(41, 1, {"rollouts": list(range(101))})

    files = sorted(p for p in journal_dir.iterdir() if p.is_file())
    names = [p.name for p in files]
    assert "LOCK" in names and len(files) >= 5, names  # segments, snapshots, LOCK
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}
    assert _mode(journal_dir) == _mode(journal_dir.parent) == 0o700
    assert _mode(tmp_path) == 0o755


def test_an_existing_journal_directory_keeps_its_mode_and_its_files_are_private(tmp_path):
    tmp_path.chmod(0o750)  # e.g. a volume the operator shares with a backup group
    with Journal.open(tmp_path, SMALL) as journal:
        journal.append(1, b"x")
    assert _mode(tmp_path) == 0o750
    assert all(_mode(p) == 0o600 for p in tmp_path.iterdir())
