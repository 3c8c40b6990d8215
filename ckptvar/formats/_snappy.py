"""Snappy block decompression in pure Python (for compressed SSTable blocks).

Owns: ``decompress(data, max_size)``. TensorFlow writes checkpoint index blocks
uncompressed, so this path is rare; it is bounded (the declared size is checked
against ``max_size`` before any allocation) and rejects every malformed copy.

>>> decompress(bytes([5, 0x10]) + b"hello", max_size=100)
b'hello'
"""

from __future__ import annotations

from ..errors import CorruptCheckpointError
from ._protobuf import read_varint

__all__ = ["decompress"]


def _literal(data: bytes, tag: int, pos: int) -> tuple[bytes, int]:
    """The literal that starts after ``tag`` at ``pos``, and the position after it."""
    n = len(data)
    length = tag >> 2
    if length >= 60:
        extra = length - 59
        if pos + extra > n:
            raise CorruptCheckpointError("Truncated snappy literal length.")
        length = int.from_bytes(data[pos : pos + extra], "little")
        pos += extra
    length += 1
    if pos + length > n:
        raise CorruptCheckpointError("Truncated snappy literal.")
    return data[pos : pos + length], pos + length


def _copy_op(data: bytes, tag: int, pos: int) -> tuple[int, int, int]:
    """``(length, offset, next position)`` of the copy whose tag is ``tag``."""
    kind = tag & 3
    if kind == 1:
        if pos + 1 > len(data):
            raise CorruptCheckpointError("Truncated snappy copy.")
        return ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[pos], pos + 1
    width = 2 if kind == 2 else 4
    if pos + width > len(data):
        raise CorruptCheckpointError("Truncated snappy copy.")
    return (tag >> 2) + 1, int.from_bytes(data[pos : pos + width], "little"), pos + width


def decompress(data: bytes, max_size: int) -> bytes:
    """Decode one raw snappy block; raises ``CorruptCheckpointError`` on any inconsistency."""
    size, pos = read_varint(data, 0, what="snappy block header")
    if size > max_size:
        raise CorruptCheckpointError(
            f"Snappy block declares {size} bytes uncompressed; the limit is {max_size}."
        )
    out = bytearray()
    n = len(data)
    while pos < n:
        tag = data[pos]
        if tag & 3 == 0:
            literal, pos = _literal(data, tag, pos + 1)
            out += literal
        else:
            length, offset, pos = _copy_op(data, tag, pos + 1)
            if offset == 0 or offset > len(out):
                raise CorruptCheckpointError(f"Snappy copy offset {offset} is out of range.")
            start = len(out) - offset
            if offset >= length:
                out += out[start : start + length]
            else:
                for i in range(length):
                    out.append(out[start + i])
        if len(out) > size:
            raise CorruptCheckpointError("Snappy block decodes to more than it declares.")
    if len(out) != size:
        raise CorruptCheckpointError(
            f"Snappy block decodes to {len(out)} bytes; its header says {size}."
        )
    return bytes(out)
