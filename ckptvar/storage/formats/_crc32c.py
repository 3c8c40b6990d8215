"""CRC32C (Castagnoli) with LevelDB/TensorFlow masking.

Owns: ``crc32c(data)`` (the ``crc32c`` package, a runtime dependency) and
``mask``/``unmask`` as TensorFlow writes them in ``.index`` blocks and
``BundleEntryProto.crc32c``.

>>> hex(crc32c(b"123456789"))
'0xe3069283'
>>> unmask(mask(0xE3069283)) == 0xE3069283
True
"""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["crc32c", "extend", "mask", "unmask"]

_MASK_DELTA = 0xA282EAD8


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of ``data``."""
    return _crc32c.crc32c(data)


def extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """Continue ``crc`` over more ``data``."""
    return _crc32c.crc32c(data, crc)


def mask(crc: int) -> int:
    """Rotate right by 15 bits and add a constant (LevelDB ``crc32c::Mask``)."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """Inverse of :func:`mask`."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF
