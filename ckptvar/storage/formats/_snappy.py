"""Snappy block decompression in pure Python (for compressed SSTable blocks).

Owns: ``decompress(data, max_size)``. TensorFlow writes checkpoint index blocks
uncompressed, so this path is rare; it is bounded (the declared size is checked
against ``max_size`` before any allocation) and rejects every malformed copy.

>>> decompress(bytes([5, 0x10]) + b"hello", max_size=100)
b'hello'
"""

from __future__ import annotations

from ...errors import CorruptCheckpointError

__all__ = ["decompress"]


def decompress(data: bytes, max_size: int) -> bytes:
    """Decode one raw snappy block; raises ``CorruptCheckpointError`` on any inconsistency."""
    from ._protobuf import read_varint

    size, pos = read_varint(data, 0, what="snappy block header")
    if size > max_size:
        raise CorruptCheckpointError(
            f"Snappy block declares {size} bytes uncompressed; the limit is {max_size}."
        )
    out = bytearray()
    n = len(data)
    while pos < n:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
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
            out += data[pos : pos + length]
            pos += length
        else:
            if kind == 1:
                if pos + 1 > n:
                    raise CorruptCheckpointError("Truncated snappy copy.")
                length = ((tag >> 2) & 7) + 4
                offset = ((tag >> 5) << 8) | data[pos]
                pos += 1
            else:
                width = 2 if kind == 2 else 4
                if pos + width > n:
                    raise CorruptCheckpointError("Truncated snappy copy.")
                length = (tag >> 2) + 1
                offset = int.from_bytes(data[pos : pos + width], "little")
                pos += width
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
