"""The ``.index`` entries of a TensorFlow checkpoint, decoded: dtypes, shapes, slice keys.

Owns: the TensorFlow ``DataType`` numbers NumPy can hold (:data:`TF_DTYPES`) and the
names of those it cannot, :class:`BundleEntry` (one ``BundleEntryProto``:
:func:`parse_entry`) and :func:`decode_slice_key` (the OrderedCode key of one slice
of a partitioned variable).

>>> TF_DTYPES[1], TF_DTYPE_NAMES[7]
(dtype('float32'), 'string')
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CorruptCheckpointError
from ._common import check_shape
from ._protobuf import parse, signed64

__all__ = ["TF_DTYPES", "TF_DTYPE_NAMES", "BundleEntry", "decode_slice_key", "parse_entry"]

#: TensorFlow ``DataType`` enum values NumPy / ml_dtypes can hold.
TF_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("float32"),
    2: np.dtype("float64"),
    3: np.dtype("int32"),
    4: np.dtype("uint8"),
    5: np.dtype("int16"),
    6: np.dtype("int8"),
    8: np.dtype("complex64"),
    9: np.dtype("int64"),
    10: np.dtype("bool"),
    11: np.dtype("int8"),  # qint8, stored as plain int8
    12: np.dtype("uint8"),  # quint8
    13: np.dtype("int32"),  # qint32
    14: np.dtype(ml_dtypes.bfloat16),
    15: np.dtype("int16"),  # qint16
    16: np.dtype("uint16"),  # quint16
    17: np.dtype("uint16"),
    18: np.dtype("complex128"),
    19: np.dtype("float16"),
    22: np.dtype("uint32"),
    23: np.dtype("uint64"),
    24: np.dtype(ml_dtypes.float8_e5m2),
    25: np.dtype(ml_dtypes.float8_e4m3fn),
    # the ml_dtypes types TensorFlow names (one byte per element, as tf.experimental holds them)
    26: np.dtype(ml_dtypes.float8_e4m3fnuz),
    27: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    28: np.dtype(ml_dtypes.float8_e5m2fnuz),
    29: np.dtype(ml_dtypes.int4),
    30: np.dtype(ml_dtypes.uint4),
    31: np.dtype(ml_dtypes.int2),
    32: np.dtype(ml_dtypes.uint2),
    33: np.dtype(ml_dtypes.float4_e2m1fn),
}
TF_DTYPE_NAMES = {
    7: "string",
    20: "resource",
    21: "variant",
}


@dataclass
class BundleEntry:
    key: str
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    crc: int | None
    slices: list[tuple[tuple[int, int], ...]]


def parse_shape(data: bytes, what: str) -> tuple[int, ...] | None:
    fields = parse(data, what=what)
    if fields.get(3, [0])[-1]:  # unknown_rank
        return None
    dims = []
    for dim in fields.get(2, []):
        if not isinstance(dim, bytes):
            raise CorruptCheckpointError(f"{what}: malformed shape dimension.")
        size = signed64(int(parse(dim, what=what).get(1, [0])[-1]))
        dims.append(size)
    return tuple(dims)


def parse_slice(data: bytes, what: str) -> tuple[tuple[int, int], ...]:
    extents = []
    for ext in parse(data, what=what).get(1, []):
        if not isinstance(ext, bytes):
            raise CorruptCheckpointError(f"{what}: malformed slice extent.")
        f = parse(ext, what=what)
        start = signed64(int(f.get(1, [0])[-1]))
        length = signed64(int(f[2][-1])) if 2 in f else -1
        extents.append((start, length))
    return tuple(extents)


def parse_entry(key: str, data: bytes, path: Path) -> BundleEntry:
    what = f"index entry {key!r} of {str(path)!r}"
    f = parse(data, what=what)

    def num(field: int, default: int = 0) -> int:
        value = f.get(field, [default])[-1]
        if not isinstance(value, int):
            raise CorruptCheckpointError(f"{what}: field {field} has the wrong wire type.")
        return value

    shape_raw = f.get(2, [b""])[-1]
    if not isinstance(shape_raw, bytes):
        raise CorruptCheckpointError(f"{what}: shape has the wrong wire type.")
    shape = parse_shape(shape_raw, what)
    if shape is None:
        raise CorruptCheckpointError(f"{what}: a stored tensor cannot have unknown rank.")
    slices = []
    for s in f.get(7, []):
        if not isinstance(s, bytes):
            raise CorruptCheckpointError(f"{what}: slice has the wrong wire type.")
        slices.append(parse_slice(s, what))
    return BundleEntry(
        key=key,
        dtype=num(1),
        shape=check_shape(list(shape), what=f"Tensor {key!r}", path=path),
        shard=signed64(num(3)),
        offset=signed64(num(4)),
        size=signed64(num(5)),
        crc=num(6) if 6 in f else None,
        slices=slices,
    )


# ----------------------------------------------------------------- OrderedCode slice keys


def _read_num_increasing(data: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(data):
        raise CorruptCheckpointError("Truncated slice key.")
    n = data[pos]
    if n > 8 or pos + 1 + n > len(data):
        raise CorruptCheckpointError("Malformed number in a slice key.")
    return int.from_bytes(data[pos + 1 : pos + 1 + n], "big"), pos + 1 + n


def _read_string(data: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    n = len(data)
    while pos < n:
        b = data[pos]
        if b == 0x00:
            if pos + 1 >= n:
                break
            nxt = data[pos + 1]
            if nxt == 0x01:
                return bytes(out), pos + 2
            if nxt == 0xFF:
                out.append(0x00)
                pos += 2
                continue
            break
        if b == 0xFF:
            if pos + 1 < n and data[pos + 1] == 0x00:
                out.append(0xFF)
                pos += 2
                continue
            break
        out.append(b)
        pos += 1
    raise CorruptCheckpointError("Malformed string in a slice key.")


def _read_signed_num_increasing(data: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(data):
        raise CorruptCheckpointError("Truncated signed number in a slice key.")
    negative = not data[pos] & 0x80
    xor = 0xFF if negative else 0x00
    first = data[pos] ^ xor
    # Count the header's leading one bits (they may continue into the second byte).
    length = 0
    bits = first
    while length < 8 and bits & 0x80:
        length += 1
        bits = (bits << 1) & 0xFF
    if length == 8:
        if pos + 1 >= len(data):
            raise CorruptCheckpointError("Truncated signed number in a slice key.")
        second = data[pos + 1] ^ xor
        extra = 0
        bits = second
        while extra < 2 and bits & 0x80:
            extra += 1
            bits = (bits << 1) & 0xFF
        length += extra
    if length == 0 or length > 10 or pos + length > len(data):
        raise CorruptCheckpointError("Malformed signed number in a slice key.")
    raw = bytearray(b ^ xor for b in data[pos : pos + length])
    # Clear the header bits: `length` leading one bits followed by a zero bit.
    header_bits = length + 1
    for i in range(min(len(raw), (header_bits + 7) // 8)):
        clear = min(8, header_bits - 8 * i)
        if clear > 0:
            raw[i] &= (0xFF >> clear) if clear < 8 else 0
    value = int.from_bytes(raw, "big")
    return (~value if negative else value), pos + length


def decode_slice_key(key: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``(full tensor name, ((start, length), ...))`` of a partitioned-variable slice key."""
    zero, pos = _read_num_increasing(key, 0)
    if zero != 0:
        raise CorruptCheckpointError(f"Slice key {key!r} does not start with 0.")
    name, pos = _read_string(key, pos)
    rank, pos = _read_num_increasing(key, pos)
    if rank > 64:
        raise CorruptCheckpointError(f"Slice key {key!r} declares rank {rank}.")
    extents = []
    for _ in range(rank):
        start, pos = _read_signed_num_increasing(key, pos)
        length, pos = _read_signed_num_increasing(key, pos)
        extents.append((start, length))
    if pos != len(key):
        raise CorruptCheckpointError(f"Slice key {key!r} has trailing bytes.")
    return name.decode("utf-8", "surrogateescape"), tuple(extents)
