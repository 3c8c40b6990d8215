"""Values a writer takes a piece at a time: the :class:`Chunked` input and its helpers.

A :class:`Chunked` value hands its bytes (C order, little-endian) to the writer in
consecutive pieces instead of as one host array: a GPU tensor staged through a bounded
pinned host buffer (``ckptvar._staging``), or a strided host array copied a slab at a
time. ckptvar's own containers (HDF5, Zarr) write each piece as it comes and hash it on
the way (:class:`BlockHasher`), so no full host copy of the value is ever made; so do
the writers of other tools' formats (safetensors, ``.npz``) and compressed Zarr, which
regroup the pieces into their own chunks (:class:`Regroup`). :func:`materialize` makes
a value whole, for what needs it at once (a small packed value).

>>> import numpy as np
>>> class Pieces:
...     def __init__(self, a): self.a, self.shape, self.dtype, self.nbytes = a, a.shape, a.dtype, a.nbytes
...     def byte_chunks(self):
...         flat = self.a.reshape(-1).view(np.uint8)
...         yield from (memoryview(flat[i:i + 5]) for i in range(0, flat.size, 5))
>>> v = Pieces(np.arange(6, dtype=np.int32))
>>> isinstance(v, Chunked), materialize(v).tolist()
(True, [0, 1, 2, 3, 4, 5])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "PIECE", "Chunked", "HostPieces", "Regroup", "as_host", "is_chunked", "materialize",
    "piece_bytes",
]

#: The default size of the pieces a chunked value is copied through (64 MiB; the pinned
#: staging buffer's halves have this size too). ``CKPTVAR_STAGING_BYTES`` sets another.
PIECE = 64 << 20
_ENV = "CKPTVAR_STAGING_BYTES"
_GRAIN = 64 << 10


def piece_bytes() -> int:
    """The size of a piece (``CKPTVAR_STAGING_BYTES``, else :data:`PIECE`), rounded down
    to a multiple of 64 KiB, at least 64 KiB."""
    text = os.environ.get(_ENV, "").strip()
    try:
        n = int(text) if text else PIECE
    except ValueError:
        raise ValueError(f"{_ENV} must be a number of bytes, got {text!r}.") from None
    return max(_GRAIN, n - n % _GRAIN)


@runtime_checkable
class Chunked(Protocol):
    """A value whose bytes come a piece at a time, in C order and little-endian.

    ``byte_chunks()`` yields consecutive memoryviews that together are the value's ``nbytes``
    bytes; each view is valid only until the next one is asked for (its buffer is
    reused). It may be called more than once (an incremental save hashes, then writes).
    """

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def nbytes(self) -> int: ...

    def byte_chunks(self) -> Iterator[memoryview]: ...


class HostPieces:
    """A host array that is not one C-ordered little-endian run (a transposed view, a
    big-endian array), copied a slab of whole leading rows at a time (at least one row,
    about ``piece`` bytes) into one reused buffer, never into a full C-ordered copy.

    >>> import numpy as np
    >>> a = np.arange(12, dtype=">i4").reshape(3, 4).T  # strided and big-endian
    >>> v = HostPieces(a, piece=8)
    >>> [len(p) for p in v.byte_chunks()], materialize(v).tolist() == a.tolist()
    ([12, 12, 12, 12], True)
    """

    def __init__(self, array: np.ndarray, piece: int | None = None) -> None:
        if array.ndim == 0:
            raise ValueError("HostPieces needs an array of at least one dimension.")
        self.array = array
        self.piece = piece_bytes() if piece is None else int(piece)
        dt = array.dtype
        if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
            dt = dt.newbyteorder("<")
        self.dtype: np.dtype = dt
        self.shape: tuple[int, ...] = tuple(array.shape)
        self.nbytes: int = int(array.nbytes)

    def byte_chunks(self) -> Iterator[memoryview]:
        a = self.array
        n = a.shape[0]
        row = max(1, a[0].nbytes) if n else 1
        rows = max(1, min(n, self.piece // row))
        buf = np.empty((rows, *a.shape[1:]), self.dtype)
        for i in range(0, n, rows):
            k = min(rows, n - i)
            dst = buf[:k]
            np.copyto(dst, a[i : i + k], casting="no" if a.dtype == self.dtype else "equiv")
            if dst.nbytes:
                yield dst.reshape(-1).view(np.uint8).data


class Regroup:
    """Pieces of any sizes in, consecutive runs of exactly ``size`` bytes out (the last
    may be shorter): ``push(piece)`` calls ``emit(run, index)`` for each run it completes,
    ``finish()`` for the rest. A run inside one piece is a view of it; one that spans
    pieces is gathered into one reused buffer of ``size`` bytes (allocated only then).
    ``run`` is valid only during the call.

    >>> out = []
    >>> r = Regroup(4, lambda run, i: out.append((i, bytes(run))))
    >>> for p in (b"abcdef", b"gh", b"ijklm"):
    ...     r.push(memoryview(p))
    >>> r.finish(), out
    (13, [(0, b'abcd'), (1, b'efgh'), (2, b'ijkl'), (3, b'm')])
    """

    def __init__(self, size: int, emit: Callable[[memoryview, int], None]) -> None:
        if size < 1:
            raise ValueError(f"A run must be at least one byte, got {size}.")
        self.size = size
        self.emit = emit
        self.index = 0  # of the next run
        self.total = 0  # bytes pushed
        self._buf: np.ndarray | None = None
        self._fill = 0

    def push(self, piece: Any) -> None:
        mv = memoryview(piece).cast("B")
        self.total += len(mv)
        size = self.size
        while len(mv):
            if not self._fill and len(mv) >= size:  # a whole run in the piece: no copy
                self._run(mv[:size])
                mv = mv[size:]
                continue
            if self._buf is None:
                self._buf = np.empty(size, np.uint8)
            take = min(size - self._fill, len(mv))
            self._buf[self._fill : self._fill + take] = np.frombuffer(mv[:take], np.uint8)
            self._fill += take
            mv = mv[take:]
            if self._fill == size:
                self._fill = 0
                self._run(self._buf.data)

    def finish(self) -> int:
        """Emit the last, shorter run (if any); returns the bytes pushed in all."""
        if self._fill:
            assert self._buf is not None
            n, self._fill = self._fill, 0
            self._run(self._buf[:n].data)
        return self.total

    def _run(self, run: memoryview) -> None:
        i, self.index = self.index, self.index + 1
        self.emit(run, i)


def materialize(value: Chunked) -> np.ndarray:
    """The whole value as one new host array (for writers that need it at once)."""
    out = np.empty(value.shape, value.dtype)
    flat = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
    pos = 0
    for piece in value.byte_chunks():
        n = len(piece)
        if pos + n > flat.size:
            raise ValueError(f"A chunked value of {value.nbytes} bytes gave more bytes.")
        flat[pos : pos + n] = np.frombuffer(piece, np.uint8)
        pos += n
    if pos != flat.size:
        raise ValueError(f"A chunked value of {value.nbytes} bytes gave {pos} bytes.")
    return out


def is_chunked(value: Any) -> bool:
    """Whether ``value`` is :class:`Chunked` (its type defines ``byte_chunks``; no other
    attribute of an unrelated value, such as a sparse tensor's ``nbytes``, is touched)."""
    return callable(getattr(type(value), "byte_chunks", None)) and isinstance(value, Chunked)


def as_host(value: Any) -> Any:
    """``value`` itself, or a :class:`Chunked` value made whole on the host."""
    return materialize(value) if is_chunked(value) else value
