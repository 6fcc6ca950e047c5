"""A walk over an Arrow IPC stream's message envelopes that reads no body: what a payload
declares, checked before pyarrow decompresses or reads anything.

`check_one_plain_stream(payload)` raises ValueError unless the bytes are exactly one Arrow
IPC stream (schema, record and dictionary batches, then the end-of-stream marker or the
end of the bytes, nothing after it) whose batch bodies are not compressed. Why both:

- pyarrow's reader stops at the first end-of-stream marker and silently ignores what
  follows, so a second stream appended to the first would be dropped without a word;
- a compressed body (IPC `BodyCompression`, LZ4 or ZSTD) inflates to whatever size its
  buffers declare: 38 KiB of zstd became 1,152 MiB before any check could run. rlfeed's
  writers never compress (gRPC's own channel compression is bounded by the server's
  `max_message_bytes` after inflating), so compression is refused outright instead of
  trusting declared sizes. The check reads a few header bytes per message: microseconds.

The envelope is `0xFFFFFFFF`, an int32 metadata length, a `Message` flatbuffer (Arrow's
`format/Message.fbs`), then `bodyLength` body bytes; a length of 0 is the end of the
stream (pre-1.0 writers omit the 0xFFFFFFFF). Every read is bounds-checked: garbage is a
ValueError, never an exception of another type.
"""

from __future__ import annotations

import struct

_CONTINUATION = -1
# MessageHeader union tags (Message.fbs): NONE 0, Schema 1, DictionaryBatch 2, RecordBatch 3.
_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH = 1, 2, 3
# Field slots of the tables read here.
_MESSAGE_HEADER_TYPE, _MESSAGE_HEADER, _MESSAGE_BODY_LENGTH = 1, 2, 3
_DICTIONARY_BATCH_DATA = 1
_RECORD_BATCH_COMPRESSION = 3


def _unreadable(detail: str) -> ValueError:
    return ValueError(f"arrow_ipc: not a readable Arrow IPC stream ({detail})")


class _Flatbuffer:
    """Bounds-checked reads of one flatbuffer (`ValueError` for any read outside it)."""

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def read(self, fmt: str, position: int) -> int:
        size = struct.calcsize(fmt)
        if position < 0 or position + size > len(self.data):
            raise _unreadable("malformed message metadata: a read past its end")
        return struct.unpack_from(fmt, self.data, position)[0]

    def root(self) -> int:
        return self.read("<I", 0)

    def field(self, table: int, slot: int) -> int | None:
        """Position of field `slot` of the table at `table`, or None when it is absent."""
        vtable = table - self.read("<i", table)
        vtable_size = self.read("<H", vtable)
        entry = 4 + 2 * slot
        if entry + 2 > vtable_size:
            return None
        offset = self.read("<H", vtable + entry)
        return table + offset if offset else None

    def table(self, table: int, slot: int) -> int | None:
        """The table that field `slot` refers to, or None."""
        position = self.field(table, slot)
        return None if position is None else position + self.read("<I", position)


def _record_batch_is_compressed(metadata: _Flatbuffer, header_type: int, header: int) -> bool:
    batch = header
    if header_type == _DICTIONARY_BATCH:
        batch = metadata.table(header, _DICTIONARY_BATCH_DATA)
    return batch is not None and metadata.field(batch, _RECORD_BATCH_COMPRESSION) is not None


def _message(metadata: _Flatbuffer) -> tuple[int, int]:
    """(header type, body length) of one message; ValueError for a compressed batch or a
    message of a kind a rollout stream has no use for (tensors)."""
    message = metadata.root()
    type_position = metadata.field(message, _MESSAGE_HEADER_TYPE)
    header_type = 0 if type_position is None else metadata.read("<B", type_position)
    if header_type not in (_SCHEMA, _DICTIONARY_BATCH, _RECORD_BATCH):
        raise _unreadable(
            f"a message of type {header_type}, not a schema, record batch or dictionary batch"
        )
    length_position = metadata.field(message, _MESSAGE_BODY_LENGTH)
    body_length = 0 if length_position is None else metadata.read("<q", length_position)
    header = metadata.table(message, _MESSAGE_HEADER)
    if header is None:
        raise _unreadable("malformed message metadata: no header")
    if header_type != _SCHEMA and _record_batch_is_compressed(metadata, header_type, header):
        raise ValueError(
            "arrow_ipc: compressed record batch bodies (IPC body compression) are not "
            "accepted: send the Arrow stream uncompressed (gRPC channel compression is "
            "fine, and bounded by the server's message size limit)"
        )
    return header_type, body_length


def check_one_plain_stream(payload: bytes | memoryview) -> None:
    """ValueError unless `payload` is one uncompressed Arrow IPC stream (module docstring)."""
    view = memoryview(payload).cast("B")
    size, position, messages = len(view), 0, 0
    while position < size:
        if position + 4 > size:
            raise _unreadable(f"truncated message header at byte {position}")
        length = int.from_bytes(view[position : position + 4], "little", signed=True)
        position += 4
        if length == _CONTINUATION:
            if position + 4 > size:
                raise _unreadable(f"truncated message header at byte {position}")
            length = int.from_bytes(view[position : position + 4], "little", signed=True)
            position += 4
        if length == 0:  # end of stream: nothing may follow it
            if position != size:
                raise ValueError(
                    f"arrow_ipc: {size - position} bytes follow the end-of-stream marker at "
                    f"byte {position}: the payload must be exactly one Arrow IPC stream"
                )
            return
        if length < 0 or position + length > size:
            raise _unreadable(f"message {messages} declares {length} metadata bytes")
        header_type, body_length = _message(_Flatbuffer(view[position : position + length]))
        if messages == 0 and header_type != _SCHEMA:
            raise _unreadable("the stream does not start with a schema message")
        if messages > 0 and header_type == _SCHEMA:
            raise ValueError(
                "arrow_ipc: a second schema message: the payload must be exactly one Arrow "
                "IPC stream"
            )
        position += length
        if body_length < 0 or position + body_length > size:
            raise _unreadable(
                f"message {messages} declares a body of {body_length} bytes; "
                f"{size - position} remain"
            )
        position += body_length
        messages += 1
