"""Write a golden journal set: what `rlfeed serve --journal-dir` leaves after a short run,
made deterministically by today's code, for later versions to read (`test_golden.py`).

    .venv/bin/python tests/service/journal/golden/make_golden.py  # segment1-...-call1/
    .venv/bin/python tests/service/journal/golden/make_golden.py --out /tmp/x

The run goes through the pieces a sidecar is made of, in one process and in a fixed order
(no Ray, no gRPC, no threads, so the bytes are the same every time): a `SchedulerActor`
body with its `JournaledScheduler`, and one front-end's part done by the front-end's own
functions: decode and validate a batch, journal it (kind 1) in `frontend-0/`, hand the
actor its metadata, materialize the steps it plans, journal what the step's store note
needs (`journal_step`: each rank's digest; call format 1 journaled the responses, kind 2)
and note the step stored, note first fetches, delete the segments nothing needs
(`SlotRetention`). Tasks are registered and sampled, both ranks fetch, ack and report a
policy version, one batch is resent and one refused; a snapshot is written mid-run and
records follow it; one complete group and half a group stay buffered.

Next to the journal, `expected.json` holds what a user sees of the state it leaves: the
GetStatus answer (less the fields named in "status_ignores", which describe the process,
not the state), the sha256 of every servable (step, rank)'s GetBatchResponse bytes, the
steps released, and two requests to make after resuming with their answers: a resent
batch (all duplicates) and `continuation.arrow` (the rest of the half group: one more
step). The folder is named for the formats' versions (`folder_name`); paths in it are
relative. Run it when a format changes, and keep the older sets (README of the journal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from google.protobuf.json_format import MessageToDict
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.messages import status_to_proto
from rlfeed.service.codec.rollout_batch import batch_meta, decode_batch, validate_batch
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.frontend.journaling import KIND_BATCH, SlotRetention, journal_step
from rlfeed.service.journal import Journal
from rlfeed.service.journal.records import FORMAT_VERSION
from rlfeed.service.journal.snapshot import SNAPSHOT_FORMAT_VERSION
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.journaled import CALL_FORMAT_VERSION
from rlfeed.service.scheduler.records import (
    BatchHandle,
    FetchNote,
    HeldBy,
    IngestKind,
    StoreStepNote,
)
from rlfeed.service.scheduler.snapshot import STATE_VERSION
from rlfeed.service.testing import SyntheticRollouts, synthetic_groups

SLOT = "frontend-0"
FRONTEND_ID = "golden-frontend"
TASKS = ["task-a", "task-b", "task-c"]
# The run's config (the journal's dir is where it is read); the reader uses the same.
SECTIONS = {
    "rollouts": {"prompts_per_step": 2, "group_size": 4},
    "batching": {"world_size": 2, "token_budget": 256, "retained_steps": 1},
    "journal": {"segment_bytes": 4096, "snapshot_every_records": 24},
}
# GetStatus fields about the process answering, not the journaled state.
STATUS_IGNORES = ["version", "front_ends", "front_end_list"]


def versions() -> dict[str, int]:
    """The version of every format in a journal directory."""
    return {
        "segment": FORMAT_VERSION,
        "snapshot": SNAPSHOT_FORMAT_VERSION,
        "state": STATE_VERSION,
        "call": CALL_FORMAT_VERSION,
    }


def folder_name() -> str:
    """The set's folder, named for the version of each format it holds, e.g.
    "segment1-snapshot1-state2-call1": a new version of any format makes a new set."""
    return "-".join(f"{name}{number}" for name, number in versions().items())


def user_view(status) -> dict:
    """A GetStatus answer as JSON, less the fields that describe the answering process."""
    view = MessageToDict(status, preserving_proto_field_name=True)
    for name in STATUS_IGNORES:
        view.pop(name, None)
    return view


class GoldenRun:
    """One scheduler and one front-end slot journaling into `directory`, driven in order."""

    def __init__(self, directory: Path) -> None:
        self.config = with_overrides(
            SidecarConfig(),
            **{**SECTIONS, "journal": {**SECTIONS["journal"], "dir": str(directory)}},
        )
        self.actor = SchedulerActor(self.config)
        self.actor.register_frontend(FRONTEND_ID, "", slot=SLOT)
        self.journal = Journal.open(directory / SLOT, self.config.journal)
        self.retention = SlotRetention(self.journal, SLOT)
        self.columns: dict[int, object] = {}  # the front-end's memory: position -> columns
        self.responses: dict[int, list[bytes]] = {}
        self.notes: list = []  # StoreStepNote / FetchNote riding on the next call

    def submit(self, payload: bytes):
        """A batch as `RolloutIngest.SubmitRolloutBatch` takes it; returns the result."""
        arrays = decode_batch(payload)
        validate_batch(arrays, self.config)
        with self.retention.appending():
            key = self.journal.append(KIND_BATCH, payload)
            self.columns[key] = arrays.columns
            notes, self.notes = self.notes, []
            meta = batch_meta(arrays)
            (reply,) = self.actor.ingest(
                FRONTEND_ID, notes, [(meta, BatchHandle(FRONTEND_ID, key))]
            )
        assert reply.kind is IngestKind.OK, reply.message
        for work in reply.work:  # the assembler's part
            responses = materialize_work(work, resolve=lambda handle: self.columns[handle.key])
            with self.retention.appending():
                positions, digests = journal_step(self.journal, work, responses)
                size = sum(map(len, responses))
                handles = [HeldBy(FRONTEND_ID)] * 2
                self.notes.append(StoreStepNote(work.step, handles, size, positions, digests))
            self.responses[work.step] = responses
        return reply.result

    def fetch(self, step: int, rank: int) -> bytes:
        """A first fetch served from the front-end's memory: noted for the actor."""
        self.notes.append(FetchNote(step, rank))
        return self.responses[step][rank]

    def sync(self) -> None:
        """The assembler's idle call: send the notes, then trim the slot's journal."""
        notes, self.notes = self.notes, []
        self.actor.sync(FRONTEND_ID, notes)
        self.retention.trim(self.actor)  # the actor answers journal_floor(slot) directly

    def close(self) -> None:
        self.actor.close()
        self.journal.close()


def _groups(seed: int, num_groups: int, policy_version: int, prefix: str) -> SyntheticRollouts:
    rng = np.random.default_rng(seed)
    return synthetic_groups(
        num_groups=num_groups,
        group_size=4,
        rng=rng,
        tasks=TASKS,
        prefix=prefix,
        max_length=40,
        policy_version=policy_version,
        pass_rate=0.5,
    )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make(directory: Path) -> dict:
    """Run the short run into `directory` (empty or absent); returns expected.json's body."""
    run = GoldenRun(directory)
    run.actor.register_tasks(TASKS)
    run.actor.sample_tasks(3)
    first = _groups(seed=7, num_groups=9, policy_version=0, prefix="p0-")
    # Interleaved, 3 rollouts a batch: groups complete out of order, steps plan as they do.
    order = np.random.default_rng(8).permutation(len(first)).tolist()
    resent = None
    for start in range(0, len(order), 3):
        rows = order[start : start + 3]
        run.submit(first.encode(rows))
        if start == 9:
            resent = first.encode(rows)
            run.submit(resent)  # a producer's retry of a batch already acknowledged
        if start % 6 == 0:
            run.sync()
    run.actor.record_rejection(FRONTEND_ID, [])  # a batch the front-end refused
    stored = sorted(run.responses)
    for step in stored[:2]:
        for rank in (0, 1):
            run.fetch(step, rank)
    run.sync()
    for rank in (0, 1):
        run.actor.ack_steps(rank, stored[1])
        run.actor.record_report(rank, {"step": 2.0, "loss": 0.5 + rank, "policy_version": 1.0})
    run.actor.sample_tasks(2)
    second = _groups(seed=9, num_groups=5, policy_version=1, prefix="p1-")
    half = [*range(16), 16, 17]  # four groups and half of the fifth
    for start in range(0, len(half), 4):
        run.submit(second.encode(half[start : start + 4]))
    run.fetch(stored[2], 0)
    run.sync()
    status = run.actor.status()
    held = sorted(run.actor.held_steps(list(run.responses)))
    expected = {
        "made_by": "tests/service/journal/golden/make_golden.py",
        "versions": versions(),
        "config": SECTIONS,
        "slot": SLOT,
        "status_ignores": STATUS_IGNORES,
        "status": user_view(status_to_proto(status, run.config)),
        "served": {
            f"{step},{rank}": _digest(run.responses[step][rank]) for step in held for rank in (0, 1)
        },
        "released_steps": sorted(set(run.responses) - set(held)),
        "resend": {"file": "resend.arrow", "accepted": 0, "duplicate": 3},
        "continuation": {
            "file": "continuation.arrow",
            "accepted": 2,
            "next_step": status.next_step + 1,
        },
    }
    (directory / "continuation.arrow").write_bytes(second.encode([18, 19]))
    (directory / "resend.arrow").write_bytes(resent)
    run.close()
    for lock in directory.rglob("LOCK"):
        lock.unlink()
    return expected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write (default: next to this file)")
    args = parser.parse_args(argv)
    directory = args.out or Path(__file__).resolve().parent / folder_name()
    if directory.exists():
        shutil.rmtree(directory)
    expected = make(directory)
    text = json.dumps(expected, indent=1, sort_keys=True) + "\n"
    (directory / "expected.json").write_text(text)
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    print(f"wrote {directory} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
