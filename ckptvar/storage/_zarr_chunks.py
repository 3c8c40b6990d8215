"""Compressed Zarr values decoded one chunk of rows at a time, in bounded memory.

Owns :func:`decode_rows`: rows ``[lo, hi)`` of a value stored by zarr-python's codecs
(compressed), its chunks decoded in order, each hashed into the value's running
checksum and dropped once its rows are copied out. The checksum covers the whole
value, so every chunk is decoded (a slice costs the value's reads and decoding), but
host memory holds one chunk and the rows asked for, never the whole value twice. A
value written as one chunk (every compressed value before ckptvar wrote them in
chunks of :data:`._zarr.COMPRESSED_CHUNK`) is that one chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from . import checksum as _checksum

__all__ = ["ChunkMismatch", "decode_rows", "in_row_chunks"]


class ChunkMismatch(ValueError):
    """A chunk decodes to another shape or dtype than its place in the value."""


def in_row_chunks(shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` is chunked along its first axis only (as ckptvar
    writes compressed values), so its chunks, in order, are its C-order bytes."""
    return bool(shape) and len(chunks) == len(shape) and chunks[0] > 0 and all(
        c >= s for c, s in zip(chunks[1:], shape[1:], strict=True))


def decode_rows(
    shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int, *, rows: tuple[int, int],
    seed: int, rows_of: Callable[[int, int, int], np.ndarray], out: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """``rows`` ``(lo, hi)`` of a value of ``shape`` and stored dtype ``dtype`` (into ``out``
    when given) and the checksum of all its bytes continued from ``seed``.

    ``rows_of(i, a, b)`` decodes chunk ``i``, rows ``[a, b)``; it raises for a chunk that
    is gone or does not decode. A chunk of another shape or dtype is a :class:`ChunkMismatch`.
    """
    n, (lo, hi) = shape[0], rows
    if out is None:
        out = np.empty((hi - lo, *shape[1:]), dtype)
    value = seed
    for i in range(math.ceil(n / chunk_rows)):
        a, b = i * chunk_rows, min(n, (i + 1) * chunk_rows)
        block = np.asarray(rows_of(i, a, b), order="C")
        if block.shape != (b - a, *shape[1:]) or block.dtype != dtype:
            raise ChunkMismatch(f"chunk {i} decodes as {block.dtype}{block.shape}, expected "
                             f"{dtype}{(b - a, *shape[1:])}")
        value = _checksum.finish(value, [block])
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out[s - lo: e - lo] = block[s - a: e - a]
    return out, value

