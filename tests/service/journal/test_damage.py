"""Damaged journals: every change is detected, a torn tail is cut, anything else refuses.

Each test damages a closed journal's files in place, opens it, and checks the outcome
against an oracle computed from the undamaged layout (parsed here with plain struct
reads, not the journal's reader): damage confined to the newest segment with no intact
record after it is a torn tail (warning, every record before it kept, appends resume at
its position); any other damage raises `JournalCorruptError` naming the file and the
offset of the first record that fails. Never a silent misread.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
from rlfeed.service.journal import Journal, JournalConfig, JournalCorruptError

CONFIG = JournalConfig(segment_bytes=4096, max_record_bytes=1 << 16)
FILE_HEADER, RECORD_HEADER = 24, 28


@dataclass(frozen=True)
class Extent:
    seq: int
    start: int
    end: int


@dataclass
class Layout:
    payloads: dict[int, bytes]  # seq -> payload
    files: list[Path]  # oldest first
    extents: dict[Path, list[Extent]]


def build(directory: Path, count: int = 40) -> Layout:
    """A closed journal of `count` records of varied sizes over three or more segments."""
    payloads = {}
    with Journal.open(directory, CONFIG) as journal:
        for i in range(count):
            payload = bytes((i * 31 + j) % 251 for j in range((i * 97) % 401))
            payloads[journal.append(1 + i % 3, payload)] = payload
    files = sorted(directory.glob("*.seg"))
    extents = {}
    for path in files:
        data, offset, found = path.read_bytes(), FILE_HEADER, []
        while offset < len(data):
            (length,) = struct.unpack_from("<I", data, offset + 8)
            (seq,) = struct.unpack_from("<Q", data, offset + 16)
            found.append(Extent(seq, offset, offset + RECORD_HEADER + length))
            offset = found[-1].end
        extents[path] = found
    assert len(files) >= 3
    return Layout(payloads, files, extents)


def expect(layout: Layout, path: Path, first: int, last: int, size: int):
    """The outcome of bytes [first, last] of `path` changed (file now `size` bytes long).

    Returns ("refuse", offset) or ("torn", first lost seq) or ("clean", None).
    """
    if first < FILE_HEADER:
        return "refuse", 0
    extents = layout.extents[path]
    damaged = next(e for e in extents if e.start <= first < e.end)
    intact_after = any(e.start > last and e.end <= size for e in extents)
    if path != layout.files[-1] or intact_after:
        return "refuse", damaged.start
    return "torn", damaged.seq


def check_open(directory: Path, layout: Layout, outcome, path: Path, caplog) -> None:
    kind, value = outcome
    caplog.clear()
    if kind == "refuse":
        with pytest.raises(JournalCorruptError) as error:
            Journal.open(directory, CONFIG)
        assert (error.value.file, error.value.offset) == (str(path), value), error.value
        assert str(path) in str(error.value) and f"offset {value}" in str(error.value)
        return
    with caplog.at_level(logging.WARNING, logger="rlfeed.service.journal"):
        journal = Journal.open(directory, CONFIG)
    with journal:
        kept = list(journal.records_after(0))
        lost_from = value if kind == "torn" else len(layout.payloads) + 1
        assert [r.seq for r in kept] == list(range(1, lost_from))
        assert all(r.payload == layout.payloads[r.seq] for r in kept)
        assert ("torn tail" in caplog.text and str(path) in caplog.text) == (kind == "torn")
        assert journal.last_position == lost_from - 1


def test_truncation_at_every_offset_of_the_newest_segment_keeps_the_intact_prefix(
    scratch_dir, caplog
):
    layout = build(scratch_dir)
    newest = layout.files[-1]
    original = newest.read_bytes()
    boundaries = {e.end for e in layout.extents[newest]} | {FILE_HEADER}
    cases = 0
    for size in range(len(original)):
        _restore(newest, original)
        os.truncate(newest, size)
        if size < FILE_HEADER:
            outcome = ("refuse", 0)
        elif size in boundaries:
            outcome = ("clean", None)
            layout_now = Layout(
                {s: p for s, p in layout.payloads.items() if s < _first_seq_at(layout, size)},
                layout.files,
                layout.extents,
            )
            check_open(scratch_dir, layout_now, outcome, newest, caplog)
            cases += 1
            continue
        else:
            outcome = expect(layout, newest, size, len(original) - 1, size)
        check_open(scratch_dir, layout, outcome, newest, caplog)
        cases += 1
    newest.write_bytes(original)
    assert cases == len(original)


def _restore(path: Path, original: bytes) -> None:
    """Put back what a truncation cut, in place (rewriting whole files is slower on ext4)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size)
        f.write(original[size:])


def _first_seq_at(layout: Layout, size: int) -> int:
    """The first record of the newest segment that does not fit in `size` bytes."""
    extents = layout.extents[layout.files[-1]]
    return next((e.seq for e in extents if e.end > size), extents[-1].seq + 1)


def test_a_flipped_bit_anywhere_is_detected(scratch_dir, caplog):
    """Every byte of the newest segment (where torn tails are possible), every third byte
    (a different bit each time) of the older ones, where any damage must refuse."""
    layout = build(scratch_dir)
    cases = 0
    for path in layout.files:
        original = path.read_bytes()
        stride = 1 if path == layout.files[-1] else 3
        for offset in range(0, len(original), stride):
            mask = 1 << (offset * 5 % 8)
            _flip(path, offset, mask)
            outcome = expect(layout, path, offset, offset, len(original))
            check_open(scratch_dir, layout, outcome, path, caplog)
            if outcome[0] == "torn":  # the open cut the tail off
                path.write_bytes(original)
            else:
                _flip(path, offset, mask)
            cases += 1
        assert path.read_bytes() == original
    assert cases > 3500


def _flip(path: Path, offset: int, mask: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


@pytest.mark.parametrize("length", [1, 4, 28, 100, 512, 4096])
def test_a_zeroed_block_is_detected(scratch_dir, caplog, length):
    layout = build(scratch_dir)
    cases = 0
    for path in layout.files:
        original = path.read_bytes()
        for start in range(0, len(original), 23):
            damaged = bytearray(original)
            damaged[start : start + length] = bytes(len(damaged[start : start + length]))
            changed = [
                i for i in range(start, start + length) if damaged[i : i + 1] != original[i : i + 1]
            ]
            path.write_bytes(damaged)
            if changed:
                outcome = expect(layout, path, changed[0], changed[-1], len(original))
            else:
                outcome = ("clean", None)
            check_open(scratch_dir, layout, outcome, path, caplog)
            cases += 1
        path.write_bytes(original)
    assert cases > 300


def test_reopen_and_append_after_a_torn_tail(tmp_path, caplog):
    layout = build(tmp_path)
    newest = layout.files[-1]
    last = layout.extents[newest][-1]
    with open(newest, "r+b") as f:
        f.truncate(last.end - 3)
    with (
        caplog.at_level(logging.WARNING, logger="rlfeed.service.journal"),
        Journal.open(tmp_path, CONFIG) as journal,
    ):
        assert journal.append(9, b"after the tear") == last.seq
    assert "torn tail" in caplog.text
    with Journal.open(tmp_path, CONFIG) as journal:
        records = list(journal.records_after(0))
    assert [r.seq for r in records] == list(range(1, last.seq + 1))
    assert records[-1].payload == b"after the tear" and records[-1].kind == 9
    assert all(r.payload == layout.payloads[r.seq] for r in records[:-1])


def test_a_damaged_tail_longer_than_one_record_refuses(tmp_path):
    config = JournalConfig(segment_bytes=1 << 20, max_record_bytes=64)
    with Journal.open(tmp_path, config) as journal:
        journal.append(1, b"x" * 64)
    (segment,) = tmp_path.glob("*.seg")
    with open(segment, "ab") as f:
        f.write(b"\xff" * (RECORD_HEADER + 65))  # garbage no single record could explain
    with pytest.raises(JournalCorruptError) as error:
        Journal.open(tmp_path, config)
    assert error.value.offset == FILE_HEADER + RECORD_HEADER + 64


def test_damage_found_while_reading_after_open_raises_with_file_and_offset(tmp_path):
    layout = build(tmp_path)
    oldest = layout.files[0]
    with Journal.open(tmp_path, CONFIG) as journal:
        target = layout.extents[oldest][2]
        with open(oldest, "r+b") as f:
            f.seek(target.end - 1)
            byte = f.read(1)
            f.seek(target.end - 1)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(JournalCorruptError) as error:
            list(journal.records_after(0))
    assert (error.value.file, error.value.offset) == (str(oldest), target.start)


def test_a_segment_missing_from_the_middle_refuses(tmp_path):
    layout = build(tmp_path)
    layout.files[1].unlink()
    with pytest.raises(JournalCorruptError) as error:
        Journal.open(tmp_path, CONFIG)
    assert error.value.file == str(layout.files[2]) and error.value.offset == 0
