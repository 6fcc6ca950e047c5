"""Protobuf wire format read in place, for the messages whose bulk field is Arrow bytes.

Parsing a `RolloutBatch` or a `GetBatchResponse` with the generated classes copies every
bytes field twice (into the parsed message, then out into a new `bytes` on access). The
Arrow payloads are the whole size of those messages, so the two hot paths walk the fields
here instead and keep the payloads as views of the received buffer; every other field
still goes through the generated classes. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def encode_varint(value: int) -> bytes:
    """A non-negative int as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(field_number: int, size: int) -> bytes:
    """The tag and length that precede `size` bytes of length-delimited field `field_number`
    (write the value after them yourself: that is how a bulk field is joined in, not copied
    into a message first)."""
    return encode_varint(field_number << 3 | LENGTH_DELIMITED) + encode_varint(size)


def read_varint(data: memoryview, position: int) -> tuple[int, int]:
    """(value, position after it); ValueError if truncated or longer than 10 bytes."""
    value = shift = 0
    while True:
        if position >= len(data):
            raise ValueError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def fields(data: memoryview) -> Iterator[tuple[int, int, int, int, int | memoryview]]:
    """(field number, wire type, start, end, value) for every field in order; [start, end)
    spans the field with its tag; value is an int for varint/fixed fields, a view for
    length-delimited ones. ValueError on truncated input and on the group wire types."""
    position = 0
    while position < len(data):
        start = position
        tag, position = read_varint(data, position)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == VARINT:
            value, position = read_varint(data, position)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if position + size > len(data):
                raise ValueError("truncated fixed-width field")
            value = int.from_bytes(data[position : position + size], "little")
            position += size
        elif wire_type == LENGTH_DELIMITED:
            size, position = read_varint(data, position)
            if position + size > len(data):
                raise ValueError("truncated length-delimited field")
            value = data[position : position + size]
            position += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        yield field, wire_type, start, position, value


def split_field(data: memoryview, field_number: int) -> tuple[list[memoryview], bytes]:
    """(the values of every occurrence of length-delimited field `field_number`, as views,
    in order; every other field re-serialized in order, which parses to the same message
    minus that field). ValueError if the field occurs with another wire type."""
    values, others = [], []
    for field, wire_type, start, end, value in fields(data):
        if field != field_number:
            others.append(data[start:end])
        elif wire_type != LENGTH_DELIMITED:
            raise ValueError(f"field {field_number} with wire type {wire_type}")
        else:
            values.append(value)
    return values, b"".join(others)
