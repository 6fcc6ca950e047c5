"""Arrow IPC framing of one fixed-width, null-free record batch, for any row count, without
running pyarrow's writer or reader per batch.

A served microbatch is one record batch of `MICROBATCH_SCHEMA` (six fixed-width columns, no
nulls). Its IPC stream is a header (the schema message and the record-batch message, both
flatbuffers), each column's values padded to 8 bytes, and the end-of-stream marker. Only a
few integers of the header depend on the row count T (the batch length, every field node's
length, every buffer's offset and length, the body length); all other bytes are the same
for every T >= 1. Running pyarrow's writer over placeholder arrays costs ~47 us of Python
per microbatch (a batch, six arrays, a writer, a file object); writing those integers into
a copy of the header costs ~8.

`FixedWidthFraming.derive(schema)` takes the bytes from the writer itself: it writes three
probe batches, finds each integer whose bytes change with T by matching them against the
quantities above, and checks the result against the writer at row counts it did not probe
(every padding remainder, larger T). Where anything does not match (a writer that lays
the messages out differently) it returns None, and the caller uses pyarrow instead.

The same knowledge reads such a stream back (`FixedWidthFraming.columns`): a stream whose
header, size and end are byte for byte those written for T rows has its columns at known
offsets, so a trainer rank views them without pyarrow's reader (~50 us per microbatch);
any other stream is left to pyarrow.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

_ALIGNMENT = 8  # Arrow IPC pads every body buffer to a multiple of 8 bytes
_PADDING = tuple(bytes(n) for n in range(_ALIGNMENT))
_INT64 = struct.Struct("<q")

# Row counts whose quantities (T, T * width, padded offsets) differ pairwise, so that each
# changing integer of the message matches one quantity only; and row counts the probes
# miss: every padding remainder, and past 2**16 and 2**20 (bytes that were 0 when probed).
_PROBES = (1, 13, 1003)
_CHECKS = (2, 3, 4, 5, 6, 7, 8, 9, 64, 65_535, 65_536, 65_537, (1 << 20) + 3)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _body_offsets(widths: Sequence[int], rows: int) -> list[int]:
    """Where each column's values start in the body of a batch of `rows` rows, then where
    the body ends (its length): the padded bytes of the columns before."""
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + _padded(rows * width))
    return offsets


@dataclass(frozen=True)
class FixedWidthFraming:
    """The IPC stream of one record batch of a fixed-width, null-free schema, as pieces to
    join around the column values (see the module docstring)."""

    widths: tuple[int, ...]  # bytes per value, per column
    probe_header: bytes  # the header of the first probe's batch
    slots: tuple[tuple[int, int], ...]  # (byte offset, index in `_quantities`) each
    end_of_stream: bytes

    @classmethod
    def derive(cls, schema: pa.Schema) -> FixedWidthFraming | None:
        """The framing of `schema`, or None where it has a variable-width or boolean
        column, or where the writer's messages do not follow the layout described above."""
        if not all(
            pa.types.is_primitive(field.type) and not pa.types.is_boolean(field.type)
            for field in schema
        ):
            return None
        widths = tuple(field.type.byte_width for field in schema)
        probes = [_writer_framing(schema, rows) for rows in _PROBES]
        probe_header, end_of_stream = probes[0]
        if any(len(head) != len(probe_header) or tail != end_of_stream for head, tail in probes):
            return None
        slots = _find_slots([header for header, _ in probes], widths)
        if slots is None:
            return None
        framing = cls(widths, probe_header, slots, end_of_stream)
        for rows in _CHECKS:
            if (framing.header(rows), end_of_stream) != _writer_framing(schema, rows):
                return None
        return framing

    def header(self, num_rows: int) -> bytes:
        """The stream's bytes before the body, for a batch of num_rows >= 1 rows."""
        header = bytearray(self.probe_header)
        values = _quantities(self.widths, num_rows)
        for offset, index in self.slots:
            _INT64.pack_into(header, offset, values[index])
        return bytes(header)

    def pieces(self, num_rows: int, columns: Sequence[Sequence]) -> tuple[list, int]:
        """(the stream of a batch of num_rows >= 1 rows as buffers to join, its size):
        `columns[i]` are buffers whose concatenation is column i's num_rows values. The
        column buffers are referenced, not copied."""
        header = self.header(num_rows)
        out: list = [header]
        size = len(header) + len(self.end_of_stream)
        for width, column in zip(self.widths, columns, strict=True):
            nbytes = num_rows * width
            out += column
            padding = _padded(nbytes) - nbytes
            if padding:
                out.append(_PADDING[padding])
            size += nbytes + padding
        out.append(self.end_of_stream)
        return out, size

    def columns(self, stream, num_rows: int, dtypes: Sequence[np.dtype]) -> list | None:
        """Read-only numpy views of the columns of `stream` (bytes-like), a batch of
        num_rows >= 1 rows framed exactly as `pieces` frames one: its header, size and end
        of stream equal; None for any other stream. `dtypes[i]`: column i's, of width
        `widths[i]`."""
        header = self.header(num_rows)
        view = memoryview(stream)
        *starts, body = (len(header) + offset for offset in _body_offsets(self.widths, num_rows))
        if (
            view.nbytes != body + len(self.end_of_stream)
            or view[: len(header)] != header
            or view[body:] != self.end_of_stream
        ):
            return None
        return [
            np.frombuffer(view, dtype, num_rows, start)
            for start, dtype in zip(starts, dtypes, strict=True)
        ]


def _writer_framing(schema: pa.Schema, rows: int) -> tuple[bytes, bytes]:
    """(header, end of stream) of pyarrow's stream of one zero-filled batch of `rows` rows:
    the bytes before and after its body."""
    arrays = [pa.array(np.zeros(rows, field.type.to_pandas_dtype())) for field in schema]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
        batch_end = sink.tell()
    stream = sink.getvalue().to_pybytes()
    body = _body_offsets([field.type.byte_width for field in schema], rows)[-1]
    return stream[: batch_end - body], stream[batch_end:]


def _quantities(widths: tuple[int, ...], rows: int) -> list[int]:
    """Every integer of a stream's header that depends on the row count T = rows: T itself
    (batch and field-node lengths), each width's column bytes (buffer lengths), and the
    padded bytes of the first k columns for k = 1 .. n (buffer offsets; the body length)."""
    return [rows, *(rows * width for width in widths), *_body_offsets(widths, rows)[1:]]


def _find_slots(
    headers: list[bytes], widths: tuple[int, ...]
) -> tuple[tuple[int, int], ...] | None:
    """The (offset, quantity index) of every 8-byte little-endian integer of the probe
    headers that equals one of `_quantities` at every probe; None unless they cover, without
    overlapping, every byte that differs between the probes."""
    first = headers[0]
    changing = {i for header in headers[1:] for i in range(len(first)) if header[i] != first[i]}
    expected = [_quantities(widths, rows) for rows in _PROBES]
    slots, covered = [], set()
    for offset in range(len(first) - 7):
        values = [_INT64.unpack_from(header, offset)[0] for header in headers]
        if values[0] == values[1]:
            continue
        matches = [
            index
            for index in range(len(expected[0]))
            if all(probe[index] == value for probe, value in zip(expected, values, strict=True))
        ]
        if not matches:
            continue
        span = set(range(offset, offset + 8))
        if span & covered:
            return None
        slots.append((offset, matches[0]))
        covered |= span
    return tuple(slots) if changing <= covered else None
