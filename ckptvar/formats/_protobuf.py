"""A minimal protocol-buffers wire-format decoder (enough for TensorBundle records).

Owns: ``parse(data) -> {field_number: [values]}`` over the four wire types
protobuf 3 writes (varint, fixed64, length-delimited, fixed32), plus
``signed64``. Nested messages are length-delimited values parsed again by the
caller; unknown fields are kept and ignored. Every malformed input raises
``CorruptCheckpointError`` (never IndexError or an endless loop).

>>> parse(bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x68, 0x69]))
{1: [150], 2: [b'hi']}
"""

from __future__ import annotations

import struct

from ..errors import CorruptCheckpointError

__all__ = ["parse", "read_varint", "signed64"]

_MAX_DEPTH_BYTES = 1 << 30


def read_varint(data: bytes | memoryview, pos: int, *, what: str = "record") -> tuple[int, int]:
    """Decode one base-128 varint at ``pos``; returns ``(value, next_pos)``."""
    result = 0
    shift = 0
    n = len(data)
    while True:
        if pos >= n:
            raise CorruptCheckpointError(f"Truncated varint in {what}.")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise CorruptCheckpointError(f"Varint longer than 10 bytes in {what}.")


def signed64(value: int) -> int:
    """Reinterpret a decoded varint as a two's-complement int64 (protobuf ``int64``)."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


#: Fixed-width wire types: ``{wire: (bytes, struct format, name)}``.
_FIXED = {1: (8, "<Q", "fixed64"), 5: (4, "<I", "fixed32")}


def parse(data: bytes | memoryview, *, what: str = "record") -> dict[int, list[int | bytes]]:
    """Split one message into ``{field_number: [raw values in order]}``.

    Varints come back as unsigned ints, fixed32/fixed64 as unsigned ints,
    length-delimited fields as ``bytes``.
    """
    if len(data) > _MAX_DEPTH_BYTES:
        raise CorruptCheckpointError(f"{what} is implausibly large ({len(data)} bytes).")
    fields: dict[int, list[int | bytes]] = {}
    pos = 0
    n = len(data)
    while pos < n:
        tag, pos = read_varint(data, pos, what=what)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise CorruptCheckpointError(f"Field number 0 in {what}.")
        value: int | bytes
        if wire == 0:
            value, pos = read_varint(data, pos, what=what)
        elif wire in _FIXED:
            size, fmt, name = _FIXED[wire]
            if pos + size > n:
                raise CorruptCheckpointError(f"Truncated {name} field {number} in {what}.")
            (value,) = struct.unpack_from(fmt, data, pos)
            pos += size
        elif wire == 2:
            length, pos = read_varint(data, pos, what=what)
            if length > n - pos:
                raise CorruptCheckpointError(
                    f"Field {number} in {what} declares {length} bytes; only {n - pos} remain."
                )
            value = bytes(data[pos : pos + length])
            pos += length
        else:
            raise CorruptCheckpointError(
                f"Unsupported wire type {wire} (field {number}) in {what}."
            )
        fields.setdefault(number, []).append(value)
    return fields
