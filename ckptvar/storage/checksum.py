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

import functools
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


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


# x^(2^k) modulo the polynomial, k = 0..63. zlib takes k modulo 32, as x^(2^32) is x for
# its polynomial; it is not for CRC-32C's, whose shifts past 512 MiB or more need k >= 32.
_X2N = _x2n_table()


@functools.lru_cache(maxsize=64)
def _x8nmodp(n: int) -> int:
    """``x^(8 n)`` modulo the polynomial: the operator that moves a CRC past n bytes."""
    p, k = 1 << 31, 3  # x^0; 8 n = n * 2^3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's method).

    Lets the pieces of one value be hashed on several threads at once.

    >>> a, b = b"hello, ", b"world"
    >>> combine(crc(a), crc(b), len(b)) == crc(a + b) == crc(b, crc(a))
    True
    >>> _x8nmodp(1 << 29) == _multmodp(_x8nmodp(1 << 28), _x8nmodp(1 << 28))  # 512 MiB
    True
    """
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


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
