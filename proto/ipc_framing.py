"""Arrow IPC stream framing that producer, server and trainer share, without copying values.

`ipc_stream_pieces` collects pyarrow's writer output as buffers to join (body buffers are
views of the arrays); `swap_placeholder_bodies` puts real values where a writer framed
placeholders (framing depends on buffer sizes, never on values). `FixedWidthFraming` goes
further for a fixed-width, null-free batch (a served microbatch): probing the writer once,
it finds the header integers that change with the row count, then writes (~8 us) or reads
(`columns`) such a stream at known offsets instead of running pyarrow per batch (~47 and
~50 us). Where the writer lays messages out otherwise, `derive` returns None and callers
use pyarrow.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from rlfeed.proto.arrow_schemas import MICROBATCH_SCHEMA, numpy_dtype

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
    arrays = [pa.array(np.zeros(rows, numpy_dtype(field.type))) for field in schema]
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


class _PiecesSink:
    """A write-only file that keeps what it is given: an Arrow IPC writer hands a Python
    file its metadata as small bytes and each body buffer as a `pa.Buffer` over the array
    itself, so a stream is collected without copying the columns."""

    def __init__(self) -> None:
        self.pieces: list = []
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.pieces.append(data)
        self.size += size
        return size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def ipc_stream_pieces(batch: pa.RecordBatch) -> tuple[list, int]:
    """(the Arrow IPC stream of one record batch as buffers to join, its size in bytes);
    the body buffers are views of the batch's arrays, so joining them is the only copy."""
    sink = _PiecesSink()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), batch.schema) as writer:
        writer.write_batch(batch)
    return sink.pieces, sink.size


def swap_placeholder_bodies(pieces: list, swaps: dict[int, list[tuple[int, list]]]) -> list | None:
    """`pieces` of `ipc_stream_pieces` with the body buffers of placeholder arrays replaced
    by the real values' pieces. An Arrow IPC stream's framing depends on the buffers' sizes,
    never on their values, so a writer run over placeholders frames the real values too.

    swaps[address] = [(size in bytes, replacement pieces), ...], in the order the writer
    hands over the placeholder buffer at `address` (several columns may share one). None
    unless every swap meets its buffer at its size: then encode the values directly."""
    queues = {address: entries[::-1] for address, entries in swaps.items()}
    out: list = []
    for piece in pieces:
        queue = queues.get(piece.address) if isinstance(piece, pa.Buffer) else None
        if queue is None:
            out.append(piece)
            continue
        if not queue:
            return None
        size, replacement = queue.pop()
        if piece.size != size:
            return None
        out += replacement
    return None if any(queues.values()) else out


@functools.cache
def microbatch_framing() -> FixedWidthFraming | None:
    """How a served microbatch's Arrow stream is framed (`FixedWidthFraming`), derived from
    pyarrow's writer once per process, at first use; None where it lays it out otherwise."""
    return FixedWidthFraming.derive(MICROBATCH_SCHEMA)
