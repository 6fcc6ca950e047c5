"""A scheduler process killed (SIGKILL) at any point of a snapshot write comes back from its
journal as the scheduler that never stopped: whatever the kill left (a half-written temp
file, a whole one never renamed, a snapshot whose directory entry was not synced, the
journal's old records not deleted yet, the older snapshots not pruned yet).

The run is `test_journaled_scheduler`'s workload in a forked child whose snapshot path is
armed to kill it at one point of its second snapshot; the parent rebuilds from the
directory and compares with a plain `Scheduler` given the calls the child committed.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
from rlfeed.service.journal import journal as journal_module
from rlfeed.service.journal import snapshot as snapshot_module
from rlfeed.service.journal.files import write_all
from rlfeed.service.scheduler.journaled import SCHEDULER_SLOT, JournaledScheduler
from rlfeed.service.scheduler.state import Scheduler

_spec = importlib.util.spec_from_file_location(
    "journaled_workload", Path(__file__).with_name("test_journaled_scheduler.py")
)
workload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workload)

TASKS = [f"t{i}" for i in range(5)]
SNAPSHOT_EVERY = 40
KILL_AFTER_CALLS = 120  # the first snapshot after these many calls; older ones are whole
SEED = 7


def _die(calls_file: Path, calls: int) -> None:
    calls_file.write_text(str(calls))
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, calls_file: Path, counter: list[int]) -> None:
    """Patch the child's snapshot path to kill it at `point` of its first snapshot after
    KILL_AFTER_CALLS calls. `counter[0]`: the calls committed so far."""
    snapshots = [0]  # the armed snapshot's number, once chosen
    real_create = snapshot_module.create_file_atomically
    real_prune = snapshot_module.SnapshotStore._prune
    real_delete = journal_module.Journal.delete_before

    def armed() -> bool:
        return snapshots[0] == 1

    def create(path: Path, chunks) -> None:
        if counter[0] >= KILL_AFTER_CALLS:
            snapshots[0] += 1
        if not armed() or point in ("renamed", "old records kept", "older snapshot kept"):
            real_create(path, chunks)
            if armed() and point == "renamed":
                _die(calls_file, counter[0])  # before the directory's fsync and the prune
            return
        data = b"".join(chunks)
        fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT, 0o600)
        write_all(fd, [data[: len(data) // 2] if point == "half written" else data])
        if point == "written, not renamed":
            os.fsync(fd)
        _die(calls_file, counter[0])

    def prune(self) -> None:
        if armed() and point == "older snapshot kept":
            _die(calls_file, counter[0])
        real_prune(self)

    def delete_before(self, position: int):
        if armed() and point == "old records kept" and self.directory.name == SCHEDULER_SLOT:
            _die(calls_file, counter[0])
        return real_delete(self, position)

    snapshot_module.create_file_atomically = create
    snapshot_module.SnapshotStore._prune = prune
    journal_module.Journal.delete_before = delete_before


def _child(directory: Path, point: str, calls_file: Path) -> None:
    counter = [0]  # calls committed (or being committed: the kill comes after its sync)
    _arm(point, calls_file, counter)
    journaled = JournaledScheduler(_config(directory), directory, workload._ref_of)
    journaled.register_tasks(TASKS)
    journaled.commit()
    commit = journaled.commit

    def counted_commit() -> None:
        counter[0] += 1
        commit()

    journaled.commit = counted_commit
    workload._drive([journaled], SEED, calls=400)
    os._exit(3)  # the kill never came: the parent fails


def _config(directory: Path):
    return workload._config(directory, snapshot_every=SNAPSHOT_EVERY)


POINTS = [
    "half written",
    "written, not renamed",
    "renamed",
    "older snapshot kept",
    "old records kept",
]


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_during_a_snapshot_write_loses_nothing(tmp_path, point) -> None:
    calls_file = tmp_path / "calls"
    directory = tmp_path / "journal"
    directory.mkdir()
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(directory, point, calls_file)
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, f"the child was not killed ({child.exitcode})"
    calls = int(calls_file.read_text())
    leftovers = sorted(p.name for p in (directory / SCHEDULER_SLOT).iterdir())
    if point in ("half written", "written, not renamed"):
        assert any(name.endswith(".msgpack.tmp") for name in leftovers), leftovers

    plain = Scheduler(_config(directory), track_releases=True)
    plain.register_tasks(TASKS)
    workload._drive([plain], SEED, calls=calls)  # the same first `calls` calls
    assert plain.next_step >= 2, "the workload stored steps before the kill"
    rebuilt = JournaledScheduler(_config(directory), directory, workload._ref_of)
    try:
        assert workload._comparable(rebuilt) == workload._comparable(plain)
        assert not list((directory / SCHEDULER_SLOT).glob("*.tmp"))  # cleaned up
        # Going on, both answer the same.
        after_rebuilt = workload._drive([rebuilt], 500, calls=40, first_key=100_000)
        after_plain = workload._drive([plain], 500, calls=40, first_key=100_000)
        assert repr(after_rebuilt) == repr(after_plain)
    finally:
        rebuilt.close()
