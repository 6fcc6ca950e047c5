"""Weight hand-off from trainer rank 0 to the producers: atomically renamed, versioned files.

    publisher = WeightsPublisher(directory)         # trainer rank 0
    publisher.publish(version, model.state_dict())  # after every optimizer step
    reader = WeightsReader(directory)                # each producer
    update = reader.poll()                           # (version, state_dict) or None

The writer saves `{"version", "state_dict"}` to a temporary file in the directory, fsyncs
it, and `os.replace`s it onto `weights-<version>.pt` (then fsyncs the directory): a rename
is atomic, so a name only ever points at a complete file, never a torn or half-written one,
and the version inside is the version in the name. An open file keeps its content even if
it is deleted during the read (POSIX keeps the unlinked inode alive), so the writer can
delete versions older than the newest `keep` while readers load. A reader lists the
directory (a few names), takes the newest version, and loads it only when it is newer than
what it holds: polling costs a `listdir`, not a load. This is prime-rl's filesystem weight
transport.

Why files and not Ray's object store: producers and trainer ranks are plain processes
(the demo can drive a sidecar on another cluster, whose Ray is not ours to use); a file
needs nothing running, costs the writer nothing per reader, lets a restarted producer pick
up the newest weights by itself, and works on a shared filesystem across hosts. Versioned
names rather than one replaced `latest` file: a reader then never has to tell two
same-sized replacements apart by inode and mtime (an inode is reused, mtime is coarse).
The price is a serialize + write per step, about a millisecond for this 75k-parameter model.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

PATTERN = re.compile(r"weights-(\d+)\.pt")


def versioned_name(version: int) -> str:
    return f"weights-{int(version):08d}.pt"


def write_atomically(path: Path, version: int, state_dict: dict[str, torch.Tensor]) -> None:
    """Write `{"version", "state_dict"}` to `path` so that no reader sees a partial file."""
    path = Path(path)
    state = {name: tensor.detach().cpu() for name, tensor in state_dict.items()}
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".weights-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save({"version": int(version), "state_dict": state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def read_weights(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, state_dict) of a file `write_atomically` wrote."""
    with open(path, "rb") as handle:
        loaded = torch.load(handle, map_location="cpu", weights_only=True)
    return int(loaded["version"]), loaded["state_dict"]


def newest_version(directory: Path) -> int | None:
    """The newest version published in `directory`, None if none."""
    versions = [int(m.group(1)) for name in os.listdir(directory) if (m := PATTERN.fullmatch(name))]
    return max(versions, default=None)


class WeightsPublisher:
    """Trainer rank 0's side: `publish(version, state_dict)` adds `weights-<version>.pt` and
    deletes all but the newest `keep` versions."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> Path:
        path = self.directory / versioned_name(version)
        write_atomically(path, version, state_dict)
        for name in os.listdir(self.directory):
            match = PATTERN.fullmatch(name)
            if match and int(match.group(1)) <= version - self.keep:
                (self.directory / name).unlink(missing_ok=True)
        return path


class WeightsReader:
    """A producer's side: `poll()` loads the newest version when it is newer than the one
    it holds (`version`, None before the first load)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.version: int | None = None

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, state_dict) of the newest published version if newer than the last
        one loaded, else None (also while nothing was published yet)."""
        while True:
            newest = newest_version(self.directory) if self.directory.exists() else None
            if newest is None or (self.version is not None and newest <= self.version):
                return None
            try:
                version, state = read_weights(self.directory / versioned_name(newest))
            except FileNotFoundError:  # deleted for a newer one since the listing: again
                continue
            if version != newest:
                raise ValueError(
                    f"{versioned_name(newest)} in {self.directory} holds version {version}"
                )
            self.version = version
            return version, state
