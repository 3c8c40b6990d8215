"""Reading the LevelDB-style table format TensorFlow uses for checkpoint ``.index`` files.

Owns: footer, block handles, block trailers (type byte + masked CRC32C, every
block checked), optional snappy blocks, and prefix-compressed entries with
restart points. ``iter_table(data)`` yields every ``(key, value)`` in order.

Layout (tensorflow/tsl/lib/io/table_format, leveldb doc/table_format.md)::

    [data block 1][trailer] ... [data block N][trailer]
    [metaindex block][trailer] [index block][trailer]
    footer: metaindex handle, index handle (varints), zero padding to 40 bytes,
            8-byte magic 0xdb4775248b80fb57 (little endian)
    trailer: 1 byte compression type (0 none, 1 snappy) + fixed32 masked crc32c
             of block contents + type byte
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from ..errors import CorruptCheckpointError
from ..storage.checksum import crc32c, unmask
from ._protobuf import read_varint

__all__ = ["TABLE_MAGIC", "iter_table"]

TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_TRAILER_SIZE = 5
_MAX_BLOCK = 256 * 1024 * 1024


def _handle(data: bytes, pos: int, what: str) -> tuple[int, int, int]:
    offset, pos = read_varint(data, pos, what=what)
    size, pos = read_varint(data, pos, what=what)
    return offset, size, pos


def _block(data: bytes, offset: int, size: int, what: str) -> bytes:
    end = offset + size
    if offset < 0 or size > _MAX_BLOCK or end + _TRAILER_SIZE > len(data):
        raise CorruptCheckpointError(
            f"{what}: block at offset {offset} of {size} bytes lies outside the "
            f"{len(data)}-byte file."
        )
    contents = data[offset:end]
    kind = data[end]
    (stored,) = struct.unpack_from("<I", data, end + 1)
    actual = crc32c(data[offset : end + 1])
    if unmask(stored) != actual:
        raise CorruptCheckpointError(
            f"{what}: block at offset {offset} fails its checksum "
            f"(stored {unmask(stored):#010x}, computed {actual:#010x})."
        )
    if kind == 0:
        return contents
    if kind == 1:
        from ._snappy import decompress

        return decompress(contents, _MAX_BLOCK)
    raise CorruptCheckpointError(
        f"{what}: block at offset {offset} uses unknown compression type {kind}."
    )


def _entries(block: bytes, what: str) -> Iterator[tuple[bytes, bytes]]:
    if len(block) < 4:
        raise CorruptCheckpointError(f"{what}: block of {len(block)} bytes is too short.")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * num_restarts
    if limit < 0:
        raise CorruptCheckpointError(
            f"{what}: block declares {num_restarts} restart points, more than fit in it."
        )
    pos = 0
    key = b""
    while pos < limit:
        shared, pos = read_varint(block, pos, what=what)
        non_shared, pos = read_varint(block, pos, what=what)
        value_len, pos = read_varint(block, pos, what=what)
        if shared > len(key) or non_shared + value_len > limit - pos:
            raise CorruptCheckpointError(f"{what}: malformed block entry at offset {pos}.")
        key = key[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        yield key, block[pos : pos + value_len]
        pos += value_len


def iter_table(data: bytes, *, what: str = "table") -> Iterator[tuple[bytes, bytes]]:
    """Every ``(key, value)`` of a whole table file held in ``data``, in key order."""
    if len(data) < _FOOTER_SIZE:
        raise CorruptCheckpointError(
            f"{what} is {len(data)} bytes, shorter than a table footer ({_FOOTER_SIZE})."
        )
    footer = data[-_FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, 40)
    if magic != TABLE_MAGIC:
        raise CorruptCheckpointError(
            f"{what} does not end with the table magic number "
            f"(found {magic:#018x}, expected {TABLE_MAGIC:#018x}); truncated or not a table."
        )
    _meta_off, _meta_size, pos = _handle(footer, 0, what)
    index_off, index_size, _ = _handle(footer, pos, what)
    body = len(data) - _FOOTER_SIZE
    if index_off + index_size + _TRAILER_SIZE > body:
        raise CorruptCheckpointError(f"{what}: index block handle points past the end of the file.")
    index = _block(data, index_off, index_size, what)
    previous = None
    for _last_key, handle in _entries(index, what):
        off, size, _ = _handle(handle, 0, what)
        if off + size + _TRAILER_SIZE > body:
            raise CorruptCheckpointError(f"{what}: data block handle points past the index.")
        for key, value in _entries(_block(data, off, size, what), what):
            if previous is not None and key <= previous:
                raise CorruptCheckpointError(f"{what}: keys are not in increasing order.")
            previous = key
            yield key, value
