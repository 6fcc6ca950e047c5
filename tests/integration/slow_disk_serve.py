"""`rlfeed serve ARGS` with its journal's fsyncs slowed by `faulty_disk.py`: a slow disk
under the front-end of a real sidecar process, for tests that measure that process.

    python tests/integration/slow_disk_serve.py DELAY_FILE serve --journal-dir DIR ...

DELAY_FILE holds the delay of every fsync in seconds ("0.2"), read at each fsync, so a
test slows the disk and heals it while the sidecar runs. Only this process's
journal (the front-end's) is slowed: the scheduler actor's runs in a Ray worker.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest


def _faulty_disk():
    path = Path(__file__).parents[1] / "service" / "journal" / "faulty_disk.py"
    spec = importlib.util.spec_from_file_location("faulty_disk", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    delay_file = Path(sys.argv[1])

    class FileDelayedDisk(_faulty_disk().FaultyDisk):
        """Reads the delay from DELAY_FILE at each fsync (no thread of its own: `rlfeed
        serve` sets up glibc's heaps before any thread starts)."""

        def _sync_fd(self, fd: int) -> None:
            with contextlib.suppress(OSError, ValueError):  # being rewritten: kept as was
                self.sync_delay_s = float(delay_file.read_text() or 0)
            super()._sync_fd(fd)

    FileDelayedDisk(pytest.MonkeyPatch())  # patched for the process's life
    from rlfeed.service.cli import main as rlfeed

    return rlfeed(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
