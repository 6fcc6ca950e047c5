"""Fixtures of the journal tests.

- `scratch_dir` (function): an empty directory on tmpfs (`/dev/shm`) when the machine has
  one, else `tmp_path`. The damage tests open a journal thousands of times and every torn
  tail an open cuts is fsynced; on tmpfs fsync is free, and what they check is the
  classification, not the disk. Removed when the test ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def scratch_dir(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    directory = Path(tempfile.mkdtemp(prefix="rlfeed-journal-test-", dir=shm))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
