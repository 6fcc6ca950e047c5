"""A `JournaledScheduler` rebuilt from its journal is the scheduler that wrote it: the same
status, pass rates, dedup memory, random draws, sampling rounds and step plans as a plain
`Scheduler` that received the same calls and never stopped (no Ray, no gRPC)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.journal import Journal, JournalConfig, SnapshotStore
from rlfeed.service.scheduler.journaled import SCHEDULER_SLOT, STATE_VERSION, JournaledScheduler
from rlfeed.service.scheduler.records import BatchHandle, HeldBy, JournalRef
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import synthetic_groups

SLOT = "frontend-0"


def _config(journal_dir, snapshot_every: int = 20_000, step_groups: str = "fixed") -> SidecarConfig:
    return with_overrides(
        SidecarConfig(),
        rollouts={"prompts_per_step": 2, "group_size": 4, "step_groups": step_groups},
        batching={"world_size": 2, "token_budget": 256},
        journal={
            "dir": str(journal_dir),
            "sync": "none",
            "segment_bytes": 4096,
            "snapshot_every_records": snapshot_every,
        },
    )


def _ref_of(handle):
    return JournalRef(SLOT, handle.key) if isinstance(handle, BatchHandle) else handle


def _ingest_and_store(scheduler: Scheduler, meta, key: int) -> tuple:
    """Ingest a batch, plan the steps it made ready and store them as a front-end would."""
    result = scheduler.ingest_batch(meta, BatchHandle("fe", key))
    works = scheduler.plan_ready_steps()
    for work in works:
        args = (work.step, [HeldBy("fe")] * 2, 100)
        if isinstance(scheduler, JournaledScheduler):
            refs = [JournalRef(SLOT, 10_000 + work.step * 2 + rank) for rank in range(2)]
            scheduler.store_step(*args, refs=refs)
        else:
            scheduler.store_step(*args)
    return result, [work.plan for work in works]


def _drive(schedulers: list[Scheduler], seed: int, calls: int, first_key: int = 0) -> list:
    """The same random workload on every scheduler; returns what the first one answered."""
    rng = np.random.default_rng(seed)
    rollouts = synthetic_groups(
        num_groups=40, group_size=4, rng=rng, tasks=[f"t{i}" for i in range(5)], prefix=f"{seed}-"
    )
    order = rng.permutation(len(rollouts))  # groups arrive interleaved, partly resent
    answers, position, key = [], 0, first_key
    for _ in range(calls):
        action = rng.choice(["ingest", "ingest", "sample", "fetch", "ack", "report"])
        if action == "ingest" and position < len(order):
            rows = order[position : position + int(rng.integers(1, 7))].tolist()
            if rng.random() < 0.2 and position:  # a resend of rows already taken
                rows = order[max(0, position - 3) : position].tolist()
            else:
                position += len(rows)
            meta = batch_meta(decode_rollout_batch(rollouts.encode(rows)))
            key += 1
            results = [_ingest_and_store(scheduler, meta, key) for scheduler in schedulers]
            answers.append(results[0])
        elif action == "sample":
            draws = [scheduler.sample_tasks(3) for scheduler in schedulers]
            answers.append(draws[0])
        elif action == "fetch" and schedulers[0].next_step:
            step, rank = int(rng.integers(0, schedulers[0].next_step)), int(rng.integers(0, 2))
            for scheduler in schedulers:
                scheduler.fetch_batch(step, rank)
        elif action == "ack" and schedulers[0].next_step:
            rank, step = int(rng.integers(0, 2)), int(rng.integers(0, schedulers[0].next_step))
            acked = [scheduler.ack_steps(rank, step) for scheduler in schedulers]
            answers.append(acked[0])
        elif action == "report":
            for scheduler in schedulers:
                scheduler.record_report(int(rng.integers(0, 2)), {"step": 1.0, "loss": 0.5})
        for scheduler in schedulers:  # as the actor does after each call
            scheduler.take_releases()
            if isinstance(scheduler, JournaledScheduler):
                scheduler.commit()
    return answers


def _comparable(scheduler: Scheduler) -> tuple:
    status = dataclasses.asdict(scheduler.status())
    return status, scheduler.pass_rate_estimates().tolist(), scheduler.step_rounds()


@pytest.mark.parametrize("step_groups", ["fixed", "sampled"])
@pytest.mark.parametrize("snapshot_every", [20_000, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_rebuilds_the_scheduler_that_never_stopped(
    tmp_path, seed: int, snapshot_every: int, step_groups: str
) -> None:
    """Replayed from the first call, or from a snapshot taken mid-run plus the calls after
    it (old segments deleted): the same scheduler either way, its sampling rounds too."""
    config = _config(tmp_path, snapshot_every, step_groups)
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    plain = Scheduler(config, track_releases=True)
    for scheduler in (journaled, plain):
        scheduler.register_tasks([f"t{i}" for i in range(5)])
    _drive([journaled, plain], seed, calls=200)
    assert plain.next_step >= 3  # the workload planned, stored and fetched steps
    assert (step_groups == "sampled") == bool(plain.step_rounds())  # rounds still open
    journaled.close()
    segments = sorted((tmp_path / SCHEDULER_SLOT).glob("*.seg"))
    if snapshot_every < 20_000:
        assert list((tmp_path / SCHEDULER_SLOT).glob("snapshot-*.msgpack"))
        assert int(segments[0].stem) > 1  # the first records' segments are gone

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    assert _comparable(rebuilt) == _comparable(plain)
    # Going on, both answer the same: draws, dedup verdicts, acceptances and step plans.
    after_rebuilt = _drive([rebuilt], seed + 100, calls=80, first_key=1000)
    after_plain = _drive([plain], seed + 100, calls=80, first_key=1000)
    assert repr(after_rebuilt) == repr(after_plain)
    assert _comparable(rebuilt) == _comparable(plain)
    rebuilt.close()


def test_recovery_names_stored_steps_and_buffered_batches_by_journal_position(tmp_path) -> None:
    config = _config(tmp_path)
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    journaled.register_tasks([f"t{i}" for i in range(5)])
    _drive([journaled], 7, calls=60)
    held = journaled.status()
    stored = journaled.held_steps(list(range(journaled.next_step)))
    journaled.close()

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    batches, steps = rebuilt.claim_journaled(SLOT, "new-front-end")
    assert stored and set(steps) == set(stored)  # every step still held, and no other
    positions = {step: [ref.position for ref in refs] for step, refs in steps.items()}
    assert all(p == [10_000 + s * 2, 10_000 + s * 2 + 1] for s, p in positions.items())
    assert batches == sorted(batches) and (batches or held.buffered_rollouts == 0)
    assert rebuilt.claim_journaled(SLOT, "new-front-end") == ([], {})  # claimed once
    rebuilt.close()


def test_a_journal_from_a_newer_format_is_refused_not_misread(tmp_path) -> None:
    journal = Journal.open(tmp_path / SCHEDULER_SLOT, JournalConfig())
    journal.append(1, msgpack.packb([99, "sample_tasks", 3]))
    journal.close()
    with pytest.raises(ValueError, match="format version 99"):
        JournaledScheduler(_config(tmp_path), tmp_path, _ref_of)


def test_store_step_without_journal_references_is_refused(tmp_path) -> None:
    journaled = JournaledScheduler(_config(tmp_path), tmp_path, _ref_of)
    with pytest.raises(ValueError, match="journal reference"):
        journaled.store_step(0, [HeldBy("fe")] * 2, 10)
    journaled.close()


def test_a_dead_front_end_leaves_the_claim_a_recovery_would(tmp_path) -> None:
    """`orphan_frontend` (one replica died, the actor lives on) turns its handles back into
    journal references: the next front-end of the slot claims exactly what a restart of
    the whole sidecar on the same journal would hand it."""
    config = _config(tmp_path)
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    journaled.register_tasks([f"t{i}" for i in range(5)])
    _drive([journaled], 7, calls=60)
    before = _comparable(journaled)
    journaled.orphan_frontend("fe", SLOT, journaled.step_refs())
    assert _comparable(journaled) == before  # where the bytes are, not what is held
    assert not any(isinstance(h, BatchHandle) for h in journaled.payload_handles())
    claimed = journaled.claim_journaled(SLOT, "next-front-end")
    journaled.close()

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    assert claimed == rebuilt.claim_journaled(SLOT, "next-front-end")
    assert claimed[1]  # held steps were claimed, not only batches
    rebuilt.close()


def test_a_planned_step_reads_the_journal_of_a_dead_front_end_until_claimed(tmp_path) -> None:
    """The work of a step planned but not stored names its batches' handles as they were;
    `step_payloads` gives them as they are now: a journal reference once their front-end
    died, the next front-end's memory once it claimed the slot, nothing once stored."""
    journaled = JournaledScheduler(_config(tmp_path), tmp_path, _ref_of)
    rollouts = synthetic_groups(
        num_groups=2, group_size=4, rng=np.random.default_rng(0), tasks=["t0"], prefix="p-"
    )
    journaled.register_tasks(["t0"])
    meta = batch_meta(decode_rollout_batch(rollouts.encode(list(range(8)))))
    assert journaled.ingest_batch(meta, BatchHandle("fe", 3)).steps_ready
    (work,) = journaled.plan_ready_steps()
    (key,) = work.payloads
    assert journaled.step_payloads(work.step) == {key: BatchHandle("fe", 3)}
    journaled.orphan_frontend("fe", SLOT, journaled.step_refs())
    assert journaled.step_payloads(work.step) == {key: JournalRef(SLOT, 3)}
    assert journaled.claim_journaled(SLOT, "next") == ([3], {})
    assert journaled.step_payloads(work.step) == {key: BatchHandle("next", 3)}
    journaled.store_step(work.step, [HeldBy("next")] * 2, 10, [JournalRef(SLOT, 4)] * 2)
    assert journaled.step_payloads(work.step) == {}
    journaled.close()


def _groups_meta(tasks: list[str], prefix: str, rows: range):
    rollouts = synthetic_groups(
        num_groups=len(tasks),
        group_size=4,
        rng=np.random.default_rng(0),
        tasks=tasks,
        prefix=prefix,
    )
    return batch_meta(decode_rollout_batch(rollouts.encode(list(rows))))


@pytest.mark.parametrize("from_snapshot", [False, True])
def test_a_sidecar_restarted_mid_round_still_makes_the_round_s_step(
    tmp_path, from_snapshot: bool
) -> None:
    """step_groups "sampled": a round of 3 (prompts_per_step is 2), 2 of its groups in,
    restart; the third group after it makes a step of 3, from replay or a snapshot."""
    config = _config(tmp_path, step_groups="sampled")
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    journaled.register_tasks([f"t{i}" for i in range(5)])
    tasks = journaled.sample_tasks(3).task_ids
    assert _ingest_and_store(journaled, _groups_meta(tasks, "m-", range(8)), 1)[1] == []
    journaled.commit()
    if from_snapshot:
        assert journaled.snapshot()
    before = _comparable(journaled)
    journaled.close()

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    assert _comparable(rebuilt) == before
    assert rebuilt.step_rounds() == [[3, 1]] and rebuilt.status().complete_groups == 2
    _, plans = _ingest_and_store(rebuilt, _groups_meta(tasks, "m-", range(8, 12)), 2)
    assert [plan.num_groups for plan in plans] == [3]
    rebuilt.close()


def test_a_snapshot_from_before_rounds_is_read_its_groups_stepping_as_fallback(
    tmp_path,
) -> None:
    """State version 1 had no "rounds": its complete groups go prompts_per_step to a step.
    A version this rlfeed does not know is refused, not misread."""
    config = _config(tmp_path, step_groups="sampled")
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    journaled.register_tasks([f"t{i}" for i in range(5)])
    _ingest_and_store(journaled, _groups_meta(["t0", "t1"], "v1-", range(6)), 1)
    assert journaled.snapshot()
    before = _comparable(journaled)
    journaled.close()
    store = SnapshotStore(tmp_path / SCHEDULER_SLOT, config.journal)
    snapshot = store.load_latest()
    assert snapshot.version == STATE_VERSION == 3 and snapshot.state["rounds"] == [[2, 0]]
    del snapshot.state["rounds"]
    store.write(snapshot.position, 1, snapshot.state)

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    assert _comparable(rebuilt) == before  # the one complete group: a fallback step of 2
    _, plans = _ingest_and_store(rebuilt, _groups_meta(["t0", "t1"], "v1-", range(6, 8)), 2)
    assert [plan.num_groups for plan in plans] == [2]
    rebuilt.close()
    store.write(snapshot.position, 99, snapshot.state)
    with pytest.raises(ValueError, match="state version 99"):
        JournaledScheduler(config, tmp_path, _ref_of)


@pytest.mark.parametrize("snapshot_every", [20_000, 3])
def test_the_trainers_published_version_survives_a_restart(tmp_path, snapshot_every) -> None:
    """Replayed (or read from a snapshot): the trainer's version, the groups it made stale
    and what it keeps holding rollouts to after the restart."""
    config = with_overrides(
        _config(tmp_path, snapshot_every), rollouts={"max_policy_lag": 1, "prompts_per_step": 2}
    )
    journaled = JournaledScheduler(config, tmp_path, _ref_of)
    journaled.register_tasks([f"t{i}" for i in range(5)])
    rng = np.random.default_rng(9)
    tasks = [f"t{i}" for i in range(5)]
    old = synthetic_groups(num_groups=2, group_size=4, rng=rng, tasks=tasks, prefix="old")
    meta = batch_meta(decode_rollout_batch(old.encode(range(6))))
    _ingest_and_store(journaled, meta, key=1)
    journaled.record_report(0, {"step": 3, "loss": 0.5, "policy_version": 4})
    journaled.commit()
    before = journaled.status()
    assert before.trainer_policy_version == 4 and before.counters.rollouts_stale == 6
    journaled.close()
    snapshots = list((tmp_path / SCHEDULER_SLOT).glob("snapshot-*.msgpack"))
    assert bool(snapshots) == (snapshot_every == 3)

    rebuilt = JournaledScheduler(config, tmp_path, _ref_of)
    assert dataclasses.asdict(rebuilt.status()) == dataclasses.asdict(before)
    assert rebuilt.last_reports[0] == {"step": 3, "loss": 0.5, "policy_version": 4}
    lagging = synthetic_groups(
        num_groups=1, group_size=4, rng=rng, tasks=tasks, prefix="new", policy_version=2
    )
    result, _ = _ingest_and_store(
        rebuilt, batch_meta(decode_rollout_batch(lagging.encode())), key=2
    )
    assert (result.accepted, result.stale) == (0, 4)  # 2 < 4 - max_policy_lag
    rebuilt.close()


def test_a_record_that_cannot_be_written_stops_the_scheduler_for_a_restart_from_it(
    tmp_path, monkeypatch
) -> None:
    """Disk full under the scheduler's journal: the call changed the state in memory but
    its record failed, so this scheduler never goes on (the actor exits, and Ray restarts
    it from the journal): `on_write_failure` gets the error naming the cause, and every
    later call fails even once the disk takes writes again. A scheduler rebuilt from the
    journal has what was journaled, and writes on."""
    import errno
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "faulty_disk", Path(__file__).parents[1] / "journal" / "faulty_disk.py"
    )
    faulty_disk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faulty_disk)
    disk = faulty_disk.FaultyDisk(monkeypatch)
    config = with_overrides(_config(tmp_path), journal={"sync": "group"})
    failures: list[Exception] = []
    scheduler = JournaledScheduler(config, tmp_path, _ref_of, on_write_failure=failures.append)
    assert scheduler.register_tasks(["a"]) == (1, 1)
    scheduler.commit()
    disk.fail(errno.ENOSPC)
    with pytest.raises(Exception, match="ENOSPC"):
        scheduler.register_tasks(["b"])
    assert len(failures) == 1 and "ENOSPC" in str(failures[0])
    disk.heal()
    with pytest.raises(Exception, match="ENOSPC"):  # not healed in place: the state diverged
        scheduler.register_tasks(["c"])
    scheduler.close()
    again = JournaledScheduler(config, tmp_path, _ref_of)
    assert again.status().tasks_total == 1  # "a": what was journaled, not "b"
    assert again.register_tasks(["b"]) == (1, 2)
    again.commit()
    again.close()
