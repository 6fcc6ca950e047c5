"""Virtual environments made by tests, with exactly the packages a test names: the floor
versions of a producer-only install, the grpcio-tools that generates the committed gencode.

Each is kept in pytest's cache (`.pytest_cache/d/scratch-venvs/`), keyed by its
requirements and this Python, and reused while its "ready" marker is there: the first run
downloads (or reads pip's cache), later runs take seconds. Loaded by path
(`importlib.util.spec_from_file_location`), as `tests/` is not a package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

PIP_TIMEOUT_S = 600


def scratch_venv(cache_dir: Path, requirements: list[str]) -> Path:
    """The python of a venv holding `requirements` (pip specifiers) and their dependencies,
    made on first use under `cache_dir`; an install that fails raises with pip's output."""
    key = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:16]
    root = Path(cache_dir) / key
    python = root / "bin" / "python"
    marker = root / "ready"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
        pip(python, "install", "--only-binary=:all:", *requirements)
        marker.write_text("\n".join(requirements) + "\n")
    return python


def pip(python: Path, *args: str) -> str:
    """Run `python -m pip ARGS`; its output, or AssertionError with it on failure."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run = subprocess.run(
        [str(python), "-m", "pip", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        env=env,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"pip {' '.join(args)} failed:\n{output[-4000:]}"
    return output
