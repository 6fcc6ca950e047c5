"""Protobuf wire format read in place, for the messages whose bulk field is Arrow bytes.

Parsing a `RolloutBatch` or a `GetBatchResponse` with the generated classes copies every
bytes field twice (into the parsed message, then out into a new `bytes` on access). The
Arrow payloads are the whole size of those messages, so the two hot paths walk the fields
here instead and keep the payloads as views of the received buffer; every other field
still goes through the generated classes. Standard library only.
"""

from __future__ import annotations

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


def split_field(data: memoryview, field_number: int) -> tuple[list[memoryview], bytes]:
    """(the values of every occurrence of length-delimited field `field_number`, as views,
    in order; every other field re-serialized in order, which parses to the same message
    minus that field). ValueError on truncated input, group wire types, or the field with
    another wire type. Written for speed: it runs once per field of every served microbatch
    (hundreds of rollout ids each)."""
    values, others = [], []
    kept_from = position = 0  # others gets data[kept_from:start] at each occurrence
    size = len(data)
    while position < size:
        start = position
        tag = data[position]
        if tag < 0x80:  # the common one-byte tag, without a call
            position += 1
        else:
            tag, position = read_varint(data, position)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == LENGTH_DELIMITED:
            if position < size and data[position] < 0x80:
                length, position = data[position], position + 1
            else:
                length, position = read_varint(data, position)
            if position + length > size:
                raise ValueError("truncated length-delimited field")
            if field == field_number:
                others.append(data[kept_from:start])
                values.append(data[position : position + length])
                kept_from = position + length
            position += length
        elif field == field_number:
            raise ValueError(f"field {field_number} with wire type {wire_type}")
        elif wire_type == VARINT:
            _, position = read_varint(data, position)
        elif wire_type in (FIXED64, FIXED32):
            position += 8 if wire_type == FIXED64 else 4
            if position > size:
                raise ValueError("truncated fixed-width field")
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    others.append(data[kept_from:])
    return values, b"".join(others)
