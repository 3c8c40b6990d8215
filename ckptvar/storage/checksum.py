"""Checksums of stored values: CRC-32C bound to the value's key, dtype and shape.

A value's checksum is CRC-32C continued over the value's little-endian C-order
bytes, seeded with the CRC-32C of a header that names the value::

    crc32c(key_utf8 + b"\\0" + dtype_name + b"\\0" + b",".join(dims) + b"\\0")

so the same bytes stored under another key, dtype or shape do not verify
(swapped or relabelled arrays are caught, not only flipped bits).

>>> import numpy as np
>>> a = np.arange(3, dtype="<i4")
>>> value_checksum("w", "int32", (3,), a) == finish(header_crc("w", "int32", (3,)), [a])
True
>>> value_checksum("w", "int32", (3,), a) != value_checksum("v", "int32", (3,), a)
True

It is also the one home of CRC-32C for the formats ckptvar reads: :func:`crc32c`,
:func:`extend`, and LevelDB/TensorFlow's :func:`mask`/:func:`unmask`.

>>> hex(crc32c(b"123456789")), extend(crc32c(b"1234"), b"56789") == crc32c(b"123456789")
('0xe3069283', True)
>>> unmask(mask(0xE3069283)) == 0xE3069283
True
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c
import numpy as np

__all__ = [
    "combine",
    "crc",
    "crc32c",
    "extend",
    "finish",
    "header",
    "header_crc",
    "header_tail",
    "mask",
    "shift_tables",
    "unmask",
    "value_checksum",
]

#: Buffers at least this large are hashed with the GIL released, so a second
#: thread can hash while the first reads or writes.
_RELEASE_GIL_FROM = 1 << 15


def crc(data: Any, value: int = 0) -> int:
    """CRC-32C of a bytes-like ``data`` (any C-contiguous buffer), continued from ``value``."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    mode = 1 if mv.nbytes >= _RELEASE_GIL_FROM else 0
    return _crc32c.crc32c(mv, value, gil_release_mode=mode)


def crc32c(data: Any) -> int:
    """The CRC-32C of a bytes-like ``data``."""
    return crc(data)


def extend(value: int, data: Any) -> int:
    """Continue the CRC-32C ``value`` over more ``data``."""
    return crc(data, value)


_MASK_DELTA = 0xA282EAD8


def mask(value: int) -> int:
    """Rotate right by 15 bits and add a constant (LevelDB ``crc32c::Mask``)."""
    return ((((value >> 15) | (value << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """Inverse of :func:`mask`."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# CRC-32C (Castagnoli), reflected: what lets pieces hashed apart be joined (combine).
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)  # [v, b]: bit b of v


def _tables(basis: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The byte tables of a linear map on CRCs given by its values on the 32 single bits:
    ``t0[c & 255] ^ t1[c >> 8 & 255] ^ t2[c >> 16 & 255] ^ t3[c >> 24]``."""
    b = np.array(basis, np.uint32)
    t0, t1, t2, t3 = (np.bitwise_xor.reduce(np.where(_BITS, b[8 * k : 8 * k + 8], 0), axis=1)
                      .astype(np.uint32).tolist() for k in range(4))
    return t0, t1, t2, t3


def _apply(t: tuple[list[int], list[int], list[int], list[int]], c: int) -> int:
    return t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]


_POW2: list[tuple[list[int], list[int], list[int], list[int]]] = []
_POW2_LOCK = threading.Lock()


def _pow2_shift(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The tables of the shift past ``2**k`` bytes (multiplying by ``x^(8 * 2^k)`` modulo the
    polynomial), each the square of the one before (built on first use, kept)."""
    with _POW2_LOCK:
        return _grow(k)


def _grow(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    while len(_POW2) <= k:
        if not _POW2:  # one byte: x^8
            basis = [_multmodp(1 << 23, 1 << j) for j in range(32)]
        else:  # the shift past 2^k bytes is the one past 2^(k-1), twice
            basis = [_apply(_POW2[-1], _apply(_POW2[-1], 1 << j)) for j in range(32)]
        _POW2.append(_tables(basis))
    return _POW2[k]


def shift_tables(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The four byte tables of ``crc -> combine(crc, 0, n)``, the shift past ``n`` bytes:
    ``t0[c & 255] ^ t1[c >> 8 & 255] ^ t2[c >> 16 & 255] ^ t3[c >> 24]``.

    >>> t0, t1, t2, t3 = shift_tables(5)
    >>> c = crc(b"abc")
    >>> t0[c & 255] ^ t1[c >> 8 & 255] ^ t2[c >> 16 & 255] ^ t3[c >> 24] == combine(c, 0, 5)
    True
    """
    if n > 0 and n & (n - 1) == 0:
        return _pow2_shift(n.bit_length() - 1)
    return _tables([combine(1 << j, 0, n) for j in range(32)])


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's method).

    Lets the pieces of one value be hashed on several threads at once.

    >>> a, b = b"hello, ", b"world"
    >>> combine(crc(a), crc(b), len(b)) == crc(a + b) == crc(b, crc(a))
    True

    The shift past ``len(B)`` bytes is applied by table look-ups, four per set bit of
    ``len(B)`` (a few microseconds; the tables of each power of two are built once).
    """
    c, k = crc1, 0
    while len2:
        if len2 & 1:
            t0, t1, t2, t3 = _POW2[k] if k < len(_POW2) else _pow2_shift(k)
            c = t0[c & 255] ^ t1[(c >> 8) & 255] ^ t2[(c >> 16) & 255] ^ t3[c >> 24]
        len2 >>= 1
        k += 1
    return c ^ crc2


def header(key: str, dtype_name: str, shape: Iterable[int]) -> bytes:
    """The bytes that bind a checksum to ``key``, ``dtype_name`` and ``shape``."""
    dims = ",".join(str(int(d)) for d in shape)
    return f"{key}\0{dtype_name}\0{dims}\0".encode()


_TAILS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def _new_tail(dtype_name: str, dims: tuple[int, ...]) -> bytes:
    if len(_TAILS) > 4096:
        _TAILS.clear()
    tail = f"\0{dtype_name}\0{','.join(str(int(d)) for d in dims)}\0".encode()
    _TAILS[(dtype_name, dims)] = tail
    return tail


def header_tail(dtype_name: str, shape: Iterable[int]) -> bytes:
    """The part of :func:`header` after the key: ``header_crc(key, dtype_name, shape) ==
    crc(header_tail(dtype_name, shape), crc(key.encode()))`` (cached, as there)."""
    dims = shape if type(shape) is tuple else tuple(shape)
    return _TAILS.get((dtype_name, dims)) or _new_tail(dtype_name, dims)


def header_crc(key: str, dtype_name: str, shape: Iterable[int]) -> int:
    """The CRC-32C of :func:`header`, the seed the data bytes are hashed onto.

    The dtype-and-shape part of the header is cached (a model repeats a few shapes many
    times, and a restore asks once per value).
    """
    dims = shape if type(shape) is tuple else tuple(shape)
    tail = _TAILS.get((dtype_name, dims)) or _new_tail(dtype_name, dims)
    return _crc32c.crc32c(tail, _crc32c.crc32c(key.encode("utf-8")))


def finish(seed: int, pieces: Iterable[Any]) -> int:
    """Continue ``seed`` over byte pieces (arrays are taken as their raw bytes)."""
    value = seed
    for piece in pieces:
        value = crc(_as_bytes(piece), value)
    return value


def value_checksum(key: str, dtype_name: str, shape: Iterable[int], data: Any) -> int:
    """The stored checksum of a whole value whose raw bytes are ``data``."""
    return finish(header_crc(key, dtype_name, shape), [data])


def _as_bytes(piece: Any) -> Any:
    if isinstance(piece, np.ndarray):
        if piece.size == 0:
            return b""
        return piece.reshape(-1).view(np.uint8)
    return piece
