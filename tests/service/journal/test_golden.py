"""Journals written by earlier rlfeed versions: this version reads every golden set under
`golden/` and resumes with the state the writer left, as a user sees it (GetStatus, the
bytes of every servable (step, rank), released steps, the dedup memory, the next step),
or refuses a format it does not read with an error naming both versions.

The sets are made by `golden/make_golden.py` (its docstring says how and what); they are
never regenerated in place: a format change adds a set (service/journal/README.md). The
resume is the one a restarted sidecar does, in-process: a `SchedulerActor` body rebuilds
from `scheduler/`, the front-end of the slot claims what it must load and loads it from
its journal (`load_claim`), then the answers are compared.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import google_crc32c
import msgpack
import pytest
from google.protobuf.json_format import MessageToDict
from rlfeed.service.codec.materialize import materialize_work
from rlfeed.service.codec.messages import status_to_proto
from rlfeed.service.codec.rollout_batch import batch_meta, decode_batch
from rlfeed.service.config import SidecarConfig, with_overrides
from rlfeed.service.frontend.journaling import KIND_BATCH, journal_step, load_claim
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.journal import Journal, JournalVersionError
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.records import (
    BatchHandle,
    FetchKind,
    HeldBy,
    IngestKind,
    StepWork,
    StoreStepNote,
)

GOLDEN = Path(__file__).with_name("golden")
SETS = sorted(path.parent for path in GOLDEN.glob("*/expected.json"))
FRONTEND_ID = "reader"


def _expected(golden: Path) -> dict:
    return json.loads((golden / "expected.json").read_text())


class Resumed:
    """A sidecar resumed from a journal directory, in-process: the scheduler actor's body
    and the memory of the front-end serving the golden slot."""

    def __init__(self, directory: Path, expected: dict) -> None:
        sections = expected["config"]
        journal = {**sections["journal"], "dir": str(directory)}
        self.config = with_overrides(SidecarConfig(), **{**sections, "journal": journal})
        self.actor = SchedulerActor(self.config)  # rebuilds the scheduler from its journal
        self.journal = None
        self.payloads = LocalPayloads()
        self.responses = ResponseCache(self.config.server.max_held_response_bytes)
        slot = expected["slot"]
        try:
            self.actor.register_frontend(FRONTEND_ID, "", slot=slot)
            claim = self.actor.claim_slot(FRONTEND_ID, slot)
            self.journal = Journal.open(directory / slot, self.config.journal)
            load_claim(self.journal, claim, self.payloads, self.responses)
            for work in claim.work:  # planned before the stop, never stored: build them now
                self.store(work)
        except BaseException:
            self.close()
            raise

    def store(self, work: StepWork) -> None:
        """The assembler's part: materialize, journal what the note needs, note it."""
        responses = materialize_work(work, resolve=lambda handle: self.payloads.get(handle.key))
        positions, digests = journal_step(self.journal, work, responses)
        handles = [HeldBy(FRONTEND_ID)] * len(responses)
        size = sum(map(len, responses))
        self.actor.apply_notes([StoreStepNote(work.step, handles, size, positions, digests)])
        self.responses.put(work.step, responses)

    def status(self) -> dict:
        return MessageToDict(
            status_to_proto(self.actor.status(), self.config), preserving_proto_field_name=True
        )

    def served(self, step: int, rank: int) -> bytes:
        """What GetBatch(step, rank) answers: the actor names the holder, memory has it."""
        fetch = self.actor.fetch_batch(step, rank)
        assert fetch.kind is FetchKind.READY, f"step {step} rank {rank}: {fetch}"
        assert fetch.value == HeldBy(FRONTEND_ID)
        return self.responses.get(step)[rank]

    def submit(self, payload: bytes):
        """A batch through the front-end's path: journaled, then buffered by the actor."""
        arrays = decode_batch(payload)
        key = self.journal.append(KIND_BATCH, payload)
        self.payloads.put(key, arrays.columns)
        handle = BatchHandle(FRONTEND_ID, key)
        (reply,) = self.actor.ingest(FRONTEND_ID, [], [(batch_meta(arrays), handle)])
        assert reply.kind is IngestKind.OK, reply.message
        for work in reply.work:
            self.store(work)
        return reply.result

    def close(self) -> None:
        self.actor.close()
        if self.journal is not None:
            self.journal.close()


@pytest.fixture(params=SETS, ids=[path.name for path in SETS])
def golden(request, tmp_path) -> Path:
    """A copy of one golden set (resuming writes to it)."""
    copy = tmp_path / request.param.name
    shutil.copytree(request.param, copy)
    return copy


def test_there_is_a_golden_set_of_todays_formats() -> None:
    from rlfeed.service.journal.records import FORMAT_VERSION
    from rlfeed.service.journal.snapshot import SNAPSHOT_FORMAT_VERSION
    from rlfeed.service.scheduler.journaled import CALL_FORMAT_VERSION
    from rlfeed.service.scheduler.snapshot import STATE_VERSION

    today = {
        "segment": FORMAT_VERSION,
        "snapshot": SNAPSHOT_FORMAT_VERSION,
        "state": STATE_VERSION,
        "call": CALL_FORMAT_VERSION,
    }
    assert today in [_expected(path)["versions"] for path in SETS], (
        f"no golden journal of formats {today}: run tests/service/journal/golden/make_golden.py"
    )


def test_a_golden_set_holds_every_kind_of_file_and_no_absolute_path() -> None:
    for path in SETS:
        names = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
        assert any(n.startswith("scheduler/snapshot-") for n in names), path
        assert any(n.startswith("scheduler/") and n.endswith(".seg") for n in names), path
        assert any(n.startswith("frontend-0/") and n.endswith(".seg") for n in names), path
        for file in path.rglob("*"):
            if file.is_file():
                assert b"/tmp/" not in file.read_bytes(), file
                assert str(Path.home()).encode() not in file.read_bytes(), file


def test_this_version_resumes_a_golden_journal_with_the_state_it_left(golden) -> None:
    expected = _expected(golden)
    resumed = Resumed(golden, expected)
    try:
        status = resumed.status()
        for name in expected["status_ignores"]:
            status.pop(name, None)
        assert status == expected["status"]
        for key, digest in expected["served"].items():
            step, rank = map(int, key.split(","))
            assert hashlib.sha256(resumed.served(step, rank)).hexdigest() == digest, key
        for step in expected["released_steps"]:
            assert resumed.actor.fetch_batch(step, 0).kind is FetchKind.RELEASED, step
        resend = expected["resend"]
        result = resumed.submit((golden / resend["file"]).read_bytes())
        assert (result.accepted, result.duplicate) == (resend["accepted"], resend["duplicate"])
        more = expected["continuation"]
        result = resumed.submit((golden / more["file"]).read_bytes())
        assert result.accepted == more["accepted"]
        assert resumed.actor.status().next_step == more["next_step"]
    finally:
        resumed.close()


# ---- refusals: each format's version bumped in a copy -------------------------------------

_U32 = struct.Struct("<I")


def _crc(*parts: bytes) -> int:
    crc = 0
    for part in parts:
        crc = google_crc32c.extend(crc, part)
    return crc


def _bump_segment_format(segment: Path) -> None:
    """Segment header: magic 8s, version u16, flags u16, first record u64, CRC32C u32."""
    data = bytearray(segment.read_bytes())
    (version,) = struct.unpack_from("<H", data, 8)
    struct.pack_into("<H", data, 8, version + 1)
    _U32.pack_into(data, 20, _crc(bytes(data[:20])))
    segment.write_bytes(bytes(data))


def _bump_snapshot_format(snapshot: Path) -> None:
    """Snapshot header: magic 8s, version u16, flags u16, position u64, body length u64,
    CRC32C u32 of the first 28 bytes and the body."""
    data = bytearray(snapshot.read_bytes())
    (version,) = struct.unpack_from("<H", data, 8)
    struct.pack_into("<H", data, 8, version + 1)
    _U32.pack_into(data, 28, _crc(bytes(data[:28]), bytes(data[32:])))
    snapshot.write_bytes(bytes(data))


def _bump_state_version(snapshot: Path) -> int:
    """The snapshot's state version set to one past the newest this rlfeed reads."""
    from rlfeed.service.scheduler.snapshot import READS_STATE_VERSIONS

    data = bytearray(snapshot.read_bytes())
    body = msgpack.unpackb(bytes(data[32:]), raw=False, strict_map_key=False)
    body["version"] = max(READS_STATE_VERSIONS) + 1
    packed = msgpack.packb(body, use_bin_type=True)
    struct.pack_into("<Q", data, 20, len(packed))
    head = bytes(data[:28])
    snapshot.write_bytes(head + _U32.pack(_crc(head, packed)) + packed)
    return body["version"]


def _bump_call_format(directory: Path, after: int) -> int:
    """The first scheduler record past position `after`: [version, method, ...] with the
    version one past the newest this rlfeed reads (same length), both record CRCs made
    good. Record header: magic 4s, header CRC u32 (of the next 20 bytes), length u32,
    payload CRC u32, seq u64, kind u8, 3x."""
    from rlfeed.service.scheduler.journaled import READS_CALL_FORMATS

    for segment in sorted(directory.glob("*.seg")):
        data = bytearray(segment.read_bytes())
        offset = 24
        while offset < len(data):
            length, _, seq = struct.unpack_from("<IIQ", data, offset + 8)
            start = offset + 28
            if seq > after:
                record = msgpack.unpackb(bytes(data[start : start + length]), raw=False)
                record[0] = max(READS_CALL_FORMATS) + 1
                payload = msgpack.packb(record, use_bin_type=True)
                assert len(payload) == length
                data[start : start + length] = payload
                _U32.pack_into(data, offset + 12, _crc(payload))
                _U32.pack_into(data, offset + 4, _crc(bytes(data[offset + 8 : offset + 28])))
                segment.write_bytes(bytes(data))
                return record[0]
            offset = start + length
    raise AssertionError(f"{directory}: no record after {after}")


def _refusal(golden: Path) -> JournalVersionError:
    with pytest.raises(JournalVersionError) as raised:
        Resumed(golden, _expected(golden)).close()
    return raised.value


def test_a_segment_of_another_format_version_is_refused_naming_both(golden) -> None:
    segment = min((golden / "scheduler").glob("*.seg"))
    _bump_segment_format(segment)
    error = _refusal(golden)
    found = _expected(golden)["versions"]["segment"] + 1
    assert (error.what, error.found) == ("segment format", found)
    assert f"segment format version {found}" in str(error)
    assert f"reads segment format version {found - 1}" in str(error)
    assert error.file == str(segment)


def test_a_front_end_segment_of_another_format_version_is_refused(golden) -> None:
    slot = _expected(golden)["slot"]
    _bump_segment_format(max((golden / slot).glob("*.seg")))
    assert _refusal(golden).what == "segment format"


def test_a_snapshot_of_another_format_version_is_refused_not_skipped(golden) -> None:
    (snapshot,) = (golden / "scheduler").glob("snapshot-*.msgpack")
    _bump_snapshot_format(snapshot)
    error = _refusal(golden)
    found = _expected(golden)["versions"]["snapshot"] + 1
    assert (error.what, error.found, error.file) == ("snapshot format", found, str(snapshot))
    assert f"reads snapshot format version {found - 1}" in str(error)


def test_a_scheduler_state_of_another_version_is_refused_naming_both(golden) -> None:
    (snapshot,) = (golden / "scheduler").glob("snapshot-*.msgpack")
    found = _bump_state_version(snapshot)
    error = _refusal(golden)
    assert (error.what, error.found) == ("scheduler state", found)
    assert f"scheduler state version {found} was written by another rlfeed" in str(error)
    assert str(_expected(golden)["versions"]["state"]) in str(error).split("this rlfeed reads")[1]


def test_a_scheduler_call_of_another_format_version_is_refused_naming_both(golden) -> None:
    (snapshot,) = (golden / "scheduler").glob("snapshot-*.msgpack")
    position = int(snapshot.name.split("-")[1].split(".")[0])
    found = _bump_call_format(golden / "scheduler", after=position)
    error = _refusal(golden)
    assert (error.what, error.found) == ("scheduler call format", found)
    assert str(_expected(golden)["versions"]["call"]) in str(error).split("this rlfeed reads")[1]
