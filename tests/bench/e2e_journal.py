"""What the journal costs in an end-to-end run: the bytes and syncs the journals wrote
(in the front-end and in the scheduler actor) and the rate the journal's disk takes.

`_process_journal_io` reaches the actor by reference to this module: Ray puts the driver
script's folder (tests/bench) on its workers' `sys.path`."""

from __future__ import annotations

import os
import time


def disk_write_rate(directory: str, nbytes: int = 64 << 20) -> float:
    """Bytes/s of one sequential write of `nbytes` into `directory`, fdatasync'd: what the
    journal's disk takes right now (a shared VM's disk varies several-fold from minute to
    minute, so each run measures its own). The ingest bytes / this rate is the floor a
    journal that syncs before each ack puts under the end-to-end time."""
    path = os.path.join(directory, "disk-probe")
    chunk = os.urandom(8 << 20)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / (time.perf_counter() - started)


def _process_journal_io(_actor=None) -> tuple[int, int]:
    """(bytes, syncs) this process's journals wrote; an rlfeed older than that count (the
    bench run against an old commit) gives the bytes the process wrote to disk at all
    (/proc/self/io write_bytes: its journals, and little else) and syncs -1."""
    try:
        from rlfeed.service.journal.files import JOURNAL_IO
    except ImportError:
        with open("/proc/self/io") as io:
            fields = dict(line.split(": ") for line in io.read().splitlines())
        return int(fields["write_bytes"]), -1
    return JOURNAL_IO.bytes_written, JOURNAL_IO.syncs


def journal_io(actor) -> tuple[int, int]:
    """(bytes written, syncs) so far by the journals of this process (the front-end) and
    of the scheduler actor's (the replicas' processes, with --replicas, are not counted)."""
    import ray

    here = _process_journal_io()
    there = ray.get(actor.__ray_call__.remote(_process_journal_io))
    syncs = -1 if min(here[1], there[1]) < 0 else here[1] + there[1]
    return here[0] + there[0], syncs
