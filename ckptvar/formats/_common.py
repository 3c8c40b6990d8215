"""Shared pieces of the foreign-format readers: bounded reads, lazy arrays, a mapping reader.

Owns: :class:`Entry` (where one value's bytes are), :class:`FileArray` (a lazy
array over a contiguous byte range of a file, reading only the rows a slice
needs), :class:`EntryReader` (a ``Reader`` over a dict of lazy arrays with key
aliases), byte order, the size limits every parser applies before
allocating anything, and :func:`new_value`, where a value read by parts is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    MissingKeyError,
    UnsupportedFormatError,
)
from ..storage.base import ArrayInfo, LazyArray, Reader, Writer, verify_each
from ..storage.rawio import pread_exact, pread_into_exact
from ..storage.slicing import element_span

__all__ = [
    "MAX_HEADER_BYTES",
    "CollectingWriter",
    "EntryReader",
    "FileArray",
    "VerifiesItself",
    "bounding_box",
    "check_key_utf8",
    "check_shape",
    "covers_whole",
    "little_endian",
    "new_value",
    "not_regular",
    "overlap_problem",
    "shift_index",
]

#: Largest metadata block (JSON header, pickle, index) a reader accepts before parsing.
MAX_HEADER_BYTES = 256 * 1024 * 1024


#: Boxes of one value compared pairwise for overlap; beyond, counted over a grid.
MAX_PAIRWISE = 1024
#: The most pieces that grid (the value cut at every box edge) may have.
MAX_GRID_CELLS = 1 << 24

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), inside the value's shape


def overlap_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Why ``boxes`` (each inside ``shape``) do not cover ``shape`` without overlap; None.

    Pairs are compared up to :data:`MAX_PAIRWISE` boxes; beyond, the value is cut at
    every box edge and each piece must lie in exactly one box (a count over a grid).
    Empty boxes are ignored; the caller checks that the volumes add up.

    >>> overlap_problem((4,), [((0,), (2,)), ((2,), (2,))]) is None
    True
    >>> overlap_problem((4,), [((0,), (3,)), ((2,), (1,))])
    'at [0] and [2] overlap'
    """
    full = [(o, z) for o, z in boxes if math.prod(z)]
    if len(full) <= MAX_PAIRWISE:
        for i, (ao, az) in enumerate(full):
            for bo, bz in full[i + 1 :]:
                if all(a < b + n and b < a + m for a, m, b, n in zip(ao, az, bo, bz, strict=True)):
                    return f"at {list(ao)} and {list(bo)} overlap"
        return None
    edges = [
        np.unique([0, d, *(o[i] for o, _ in full), *(o[i] + z[i] for o, z in full)])
        for i, d in enumerate(shape)
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_GRID_CELLS:
        return (
            f"({len(full)}) cut it into {cells} pieces, too irregular to check that they "
            f"cover it once (limit {MAX_GRID_CELLS})"
        )
    grid = [
        tuple(
            slice(int(np.searchsorted(e, a)), int(np.searchsorted(e, a + n)))
            for e, a, n in zip(edges, o, z, strict=True)
        )
        for o, z in full
    ]
    # each box covers whole pieces; their counts add up to the grid's unless some overlap
    if sum(math.prod(b.stop - b.start for b in box) for box in grid) == cells:
        count = np.zeros([len(e) - 1 for e in edges], np.uint8)
        for box in grid:
            count[box] += 1
        if bool((count == 1).all()):
            return None
    return f"({len(full)}) overlap or leave part of the shape {list(shape)} uncovered"


def check_key_utf8(key: str, what: str) -> None:
    r"""Refuse a key a UTF-8 file header cannot hold (a lone surrogate: how Python reads
    undecodable bytes), naming it; ``what`` names the format ("npz", "safetensors").

    >>> check_key_utf8("w\udcff", "npz")
    Traceback (most recent call last):
    ...
    ValueError: Invalid npz key 'w\udcff': not valid UTF-8 (surrogates not allowed at 1); rename it (ckpt convert --rename).
    """
    if key.isascii():
        return
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"Invalid {what} key {key!r}: not valid UTF-8 ({exc.reason} at {exc.start}); "
            "rename it (ckpt convert --rename)."
        ) from None


def check_shape(shape: Any, *, what: str, path: Path | str) -> tuple[int, ...]:
    """Validate a declared shape: a sequence of non-negative ints whose product fits int64."""
    if not isinstance(shape, list | tuple):
        raise CorruptCheckpointError(f"{what} in {str(path)!r}: shape {shape!r} is not a list.")
    dims: list[int] = []
    total = 1
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0:
            raise CorruptCheckpointError(
                f"{what} in {str(path)!r}: shape {list(shape)!r} has a dimension that is not "
                "a non-negative integer."
            )
        total *= int(d)
        if total >= 2**62:
            raise CorruptCheckpointError(
                f"{what} in {str(path)!r}: shape {list(shape)!r} declares too many elements."
            )
        dims.append(int(d))
    if len(dims) > 64:
        raise CorruptCheckpointError(f"{what} in {str(path)!r}: {len(dims)} dimensions (max 64).")
    return tuple(dims)


def little_endian(dtype: np.dtype) -> np.dtype:
    """``dtype`` in the machine's byte order (ml_dtypes types have no byte order)."""
    return dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype


def covers_whole(index: Any, shape: tuple[int, ...]) -> bool:
    """True when reading ``full[index]`` touches every element of the value."""
    span = element_span(index, shape)
    return span is None or (span.start == 0 and span.count == math.prod(shape))


def bounding_box(index: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The bounding box ``(lo, hi)`` of a basic index (ints and slices), or ``(None, None)``."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis or i is None for i in idx) or len(idx) > len(shape):
        return None, None
    lo, hi = [], []
    for dim, i in enumerate(idx):
        n = shape[dim]
        if isinstance(i, int | np.integer) and not isinstance(i, bool):
            k = int(i) + n if i < 0 else int(i)
            if not 0 <= k < n:
                return None, None  # numpy raises the IndexError
            lo.append(k)
            hi.append(k + 1)
        elif isinstance(i, slice):
            r = range(*i.indices(n))
            if len(r) == 0:
                lo.append(0)
                hi.append(0)
            else:
                lo.append(min(r[0], r[-1]))
                hi.append(max(r[0], r[-1]) + 1)
        else:
            return None, None
    for dim in range(len(idx), len(shape)):
        lo.append(0)
        hi.append(shape[dim])
    return tuple(lo), tuple(hi)


def shift_index(idx: tuple[Any, ...], lo: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    """``idx`` rewritten for the box starting at ``lo``."""
    out: list[Any] = []
    for dim, i in enumerate(idx):
        if isinstance(i, slice):
            start, stop, step = i.indices(shape[dim])
            r = range(start, stop, step)
            if len(r) == 0:
                out.append(slice(0, 0))
                continue
            first, last = r[0] - lo[dim], r[-1] - lo[dim]
            end = last + (1 if step > 0 else -1)
            out.append(slice(first, end if end >= 0 else None, step))
        else:
            k = int(i) + shape[dim] if i < 0 else int(i)
            out.append(k - lo[dim])
    return tuple(out)


class FileArray(LazyArray):
    """A C-order (or Fortran-order) array stored as raw bytes at ``offset`` in a file.

    ``fetch(offset, size)`` returns the bytes (a file read, or a decompressing
    stream); ``readinto(buf, offset)`` fills a buffer in place when the source allows.
    ``check(raw_bytes)`` verifies a whole value (a CRC), if the format carries one.
    """

    def __init__(
        self,
        info: ArrayInfo,
        *,
        stored_dtype: np.dtype,
        offset: int,
        fetch: Callable[[int, int], bytes],
        readinto: Callable[[memoryview, int], None] | None = None,
        check: Callable[[bytes | memoryview], None] | None = None,
        fortran: bool = False,
    ) -> None:
        self.info = info
        # where the bytes are and how they are laid out
        self._stored, self._offset, self._fortran = stored_dtype, offset, fortran
        # how they are read and verified
        self._fetch, self._readinto, self._check = fetch, readinto, check

    def _decode(self, data: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> np.ndarray:
        arr = np.frombuffer(data, dtype=self._stored)
        arr = arr.reshape(shape, order="F" if self._fortran else "C")
        if self._stored.byteorder not in ("=", "|"):
            arr = arr.astype(little_endian(self._stored))
        if little_endian(self._stored) != self.info.dtype:
            arr = arr.view(self.info.dtype)
        return arr

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        shape = self.info.shape
        nbytes = self.info.size * self._stored.itemsize
        if out is not None and (out.shape != shape or out.dtype != self.info.dtype):
            raise ValueError(
                f"out for {self.info.key!r} must have shape {shape} and dtype "
                f"{self.info.dtype}; got {out.shape} {out.dtype}."
            )
        direct = (
            out is not None
            and self._readinto is not None
            and not self._fortran
            and out.flags.c_contiguous
            and out.flags.writeable
            and self._stored.byteorder in ("=", "|")
        )
        if direct:
            assert out is not None and self._readinto is not None
            buf = out.reshape(-1).view(np.uint8).data if nbytes else memoryview(b"")
            if nbytes:
                self._readinto(buf, self._offset)
            if verify and self._check is not None:
                self._check(buf)
            return out
        raw: bytes | bytearray
        if self._readinto is not None and nbytes:
            raw = bytearray(nbytes)
            self._readinto(memoryview(raw), self._offset)
        else:
            raw = self._fetch(self._offset, nbytes) if nbytes else b""
        if verify and self._check is not None:
            self._check(memoryview(raw) if isinstance(raw, bytearray) else raw)
        arr = self._decode(raw, shape)
        if out is not None:
            out[...] = arr
            return out
        if not arr.flags.writeable:
            arr = arr.copy()
        return arr

    def __getitem__(self, index: Any) -> np.ndarray:
        shape = self.info.shape
        span = None if self._fortran else element_span(index, shape)
        if span is None or (self._check is not None and span.count == math.prod(shape)):
            # Every byte is read anyway: read the whole value and verify its checksum.
            result = self.read()[index]
            return np.array(result, copy=True) if isinstance(result, np.ndarray) else result
        offset, nbytes = span.byte_range(self._stored.itemsize)
        raw = self._fetch(self._offset + offset, nbytes) if nbytes else b""
        result = self._decode(raw, span.shape)[span.index]
        return np.array(result, copy=True) if isinstance(result, np.ndarray) else result


@functools.cache
def _memory() -> int:
    """This machine's physical memory and swap, in bytes (0 where it cannot be told; read
    once: a value assembled from parts asks for each box)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    swap = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo", encoding="ascii") as f:
            line = next((x for x in f if x.startswith("SwapTotal:")), "SwapTotal: 0 kB")
        swap = int(line.split()[1]) * 1024
    return int(physical) + swap


def new_value(info: ArrayInfo, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An empty buffer for the value ``info`` (or for a box of ``shape`` of it): where a
    value assembled from parts (fill values, chunks) is allocated, before any is read.

    More bytes than this machine's memory and swap are refused up front, and an
    allocation that fails is a :class:`CkptError` too, naming the key, its shape and
    dtype and the bytes asked for, never NumPy's bare ``MemoryError``.
    """
    whole = shape is None
    shape = info.shape if shape is None else shape
    nbytes = math.prod(shape) * info.dtype.itemsize
    what = (f"{'' if whole else 'A slice ' + str(shape) + ' of '}{info.key!r} (shape "
            f"{info.shape} {info.dtype}, {nbytes} bytes{'' if whole else ' for the slice'})")
    advice = (f"; read it a slice at a time instead: with cv.open(path) as reader: "
              f"reader[{info.key!r}][i:j]")
    memory = _memory()
    if memory and nbytes > memory:
        raise CkptError(f"{what} is larger than this machine's memory and swap ({memory} "
                        f"bytes): not allocated{advice}.")
    try:
        return np.empty(shape, info.dtype)
    except MemoryError:
        raise CkptError(f"{what} could not be allocated (out of memory){advice}.") from None


class BoxArray(LazyArray):
    """A lazy value assembled box by box: a read or a slice fills only the box it needs.

    Subclasses set ``info`` and implement :meth:`fill` (copy the box ``[lo, hi)`` of the
    value into ``out``, from whatever pieces the format stores: DCP chunks, Zarr chunks).
    """

    def fill(self, out: np.ndarray, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        raise NotImplementedError

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        shape = self.info.shape
        if out is not None and (out.shape != shape or out.dtype != self.info.dtype):
            raise ValueError(
                f"out for {self.info.key!r} must have shape {shape} and dtype {self.info.dtype}."
            )
        result = out if out is not None else new_value(self.info)
        if self.info.size:
            self.fill(result, (0,) * len(shape), shape)
        return result

    def __getitem__(self, index: Any) -> np.ndarray:
        shape = self.info.shape
        lo, hi = bounding_box(index, shape)
        if lo is None or hi is None:
            result = self.read()[index]
        else:  # only the pieces the index's bounding box meets
            box = new_value(self.info, tuple(h - x for x, h in zip(lo, hi, strict=True)))
            if box.size:
                self.fill(box, lo, hi)
            result = box[shift_index(index if isinstance(index, tuple) else (index,), lo, shape)]
        return np.array(result, copy=True) if isinstance(result, np.ndarray) else result


class CollectingWriter(Writer):
    """A ``Writer`` that collects ``(key, array, attrs)`` and writes them all at ``commit``.

    Shared by the safetensors and npz writers: the collection, the metadata, ``abort``,
    and which attributes are worth storing (anything beyond the key as its name). A
    :class:`~ckptvar.storage.Chunked` value (a staged GPU tensor) is kept as it is: the
    writers stream its pieces at ``commit``, never a whole host copy.
    """

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = Path(path)
        self._durable = durable
        self._items: dict[str, tuple[np.ndarray, dict[str, Any]]] = {}
        self._metadata: dict[str, Any] | None = None
        self._done = False

    def _collect(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None) -> None:
        if key in self._items:
            raise ValueError(f"Key {key!r} was already added to {str(self.path)!r}.")
        self._items[key] = (array, dict(attrs or {}))  # a Chunked value stays one

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self._metadata = dict(metadata)

    def abort(self) -> None:
        self._items.clear()
        self._done = True

    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"The writer of {str(self.path)!r} was already closed.")

    def _stored_attrs(self) -> dict[str, dict[str, Any]]:
        """``{key: attrs}`` for the values whose attributes say more than their name."""
        return {k: a for k, (_, a) in self._items.items() if a and a != {"name": k}}


@runtime_checkable
class VerifiesItself(Protocol):
    """A lazy value that checks its stored bytes without building the whole array."""

    def verify(self) -> None:
        """Raise ``CorruptCheckpointError`` if the value's bytes are damaged."""
        ...


class EntryReader(Reader):
    """A ``Reader`` over an ordered dict of lazy arrays, with alternative key spellings."""

    def __init__(
        self,
        path: Path,
        format: str,
        arrays: Mapping[str, LazyArray],
        *,
        aliases: Mapping[str, str] | None = None,
        skipped: Mapping[str, str] | None = None,
        bookkeeping: Mapping[str, str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        on_close: Callable[[], None] | None = None,
        changed: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self.format = format
        self._arrays = dict(arrays)
        self._aliases = dict(aliases or {})
        #: User values present in the file that are not read as arrays: ``{key: reason}``.
        self.skipped: dict[str, str] = dict(skipped or {})
        #: Entries the format keeps for itself (TensorFlow's object graph): ``{key: what}``;
        #: never user values, so never in ``skipped``.
        self.bookkeeping: dict[str, str] = dict(bookkeeping or {})
        #: Values returned in another dtype or shape than stored: ``{key: how}``.
        self.changed: dict[str, str] = dict(changed or {})
        self._metadata = dict(metadata or {})
        self._on_close = on_close

    def _resolve(self, key: str) -> str:
        if key in self._arrays:
            return key
        if isinstance(key, str) and key in self._aliases:
            return self._aliases[key]
        if key in self.skipped or key in self.bookkeeping:
            reason = self.skipped.get(key) or self.bookkeeping[key]
            raise UnsupportedFormatError(f"{key!r} in {str(self.path)!r} cannot be read: {reason}")
        raise MissingKeyError(
            f"No key {key!r} in the {self.format} checkpoint {str(self.path)!r} "
            f"({len(self._arrays)} keys{_sample(self._arrays)})."
        )

    def keys(self) -> Any:
        return self._arrays.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._arrays or key in self._aliases

    def info(self, key: str) -> ArrayInfo:
        return self._arrays[self._resolve(key)].info

    def __getitem__(self, key: str) -> LazyArray:
        return self._arrays[self._resolve(key)]

    def metadata(self) -> dict[str, Any]:
        return dict(self._metadata)

    def verify(self, key: str) -> None:
        lazy = self._arrays[self._resolve(key)]
        if isinstance(lazy, VerifiesItself):
            lazy.verify()  # e.g. a torch view, checked through its storage
        else:
            lazy.read(verify=True)

    def verify_all(self) -> list[tuple[str, str]]:
        """Read and check every value; ``[(key, reason), ...]`` for each damaged one.

        Every key is reported on its own, so several tensors viewing one damaged
        storage are each listed.
        """
        return verify_each(self, self._arrays)

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {str(self.path)!r} ({len(self)} keys)>"


def _sample(arrays: Mapping[str, Any]) -> str:
    names = list(arrays)[:5]
    return ", e.g. " + ", ".join(repr(n) for n in names) if names else ""


def not_regular(mode: int) -> str:
    """What a path that is not a regular file is, as the end of a refusal."""
    what = ("a named pipe" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
    return f"is {what}, not a regular file"


class FileHandle:
    """An ``os.open`` descriptor shared by the lazy arrays of one reader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:  # O_NONBLOCK: opening a pipe never waits for a writer (no effect on files)
            self.fd: int | None = os.open(path, flags)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"No checkpoint file at {str(path)!r}.") from None
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise CorruptCheckpointError(f"{str(path)!r} {not_regular(st.st_mode)}.")
        self.size = st.st_size

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"The reader of {str(self.path)!r} is closed.")
        return self.fd

    def pread(self, offset: int, size: int, what: str = "data") -> bytes:
        return pread_exact(self._fd(), offset, size, what=what, path=self.path)

    def readinto(self, buf: memoryview, offset: int, what: str = "data") -> None:
        pread_into_exact(self._fd(), buf, offset, what=what, path=self.path)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
