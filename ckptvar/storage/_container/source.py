"""Byte sources of the container readers: a local file descriptor, or an object's bytes.

Owns the few calls the readers make on a value's source (:class:`.layout.Source`
``fd``): ``pread_into``, ``preadv_all``, ``close``, ``map_all`` and ``cached``.
A local source is an ``int`` descriptor and takes the same ``preadv`` path as
before (one type check per call); a :class:`RemoteFile` reads ranges of one
object (or a window of it) through a :class:`~ckptvar.locations.Location`:
each read is ranged GETs straight into the caller's buffer, in parallel; a
:class:`Pieces` is one value's bytes in several local files back to back (a Zarr
value stored as several chunks, format 1.4).
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .. import rawio as _rawio

__all__ = ["Patched", "Pending", "Pieces", "RemoteFile", "cached", "close", "map_all", "pread_into", "preadv_all"]


class RemoteFile:
    """``size`` bytes of object ``key`` from byte ``base``, read by ranged GETs.

    ``known``: ``(offset, bytes)`` regions already fetched (the user block, the record);
    reads inside one of them send no request.
    """

    __slots__ = ("base", "key", "known", "location", "size")

    def __init__(
        self,
        location: Any,
        key: str,
        size: int,
        base: int = 0,
        known: Sequence[tuple[int, bytes]] = (),
    ) -> None:
        self.location = location
        self.key = key
        self.size = size
        self.base = base
        self.known = tuple(known)

    def pread_into(self, buf: Any, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only past ``size``)."""
        view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
        n = max(0, min(len(view), self.size - offset))
        for at, data in self.known:
            if at <= offset and offset + n <= at + len(data):
                view[:n] = data[offset - at : offset - at + n]
                return n
        if n:
            self.location.read_into(self.key, self.base + offset, view[:n])
        return n

    def preadv_all(self, bufs: Sequence[Any], offset: int) -> int:
        """Fill the buffers back to back from ``offset``: one parallel ranged read."""
        offsets: list[int] = []
        outs: list[memoryview] = []
        pos = offset
        for b in bufs:
            view = memoryview(b).cast("B")
            n = max(0, min(len(view), self.size - pos))
            if n:
                offsets.append(self.base + pos)
                outs.append(view[:n])
            pos += len(view)
            if n < len(view):
                break
        if outs:
            self.location.read_ranges_into(self.key, offsets, outs)
        return sum(len(o) for o in outs)

    def read_all(self) -> bytearray:
        out = bytearray(self.size)
        if self.size:
            self.location.read_into(self.key, self.base, memoryview(out))
        return out


class Pieces:
    """One value's bytes in several local files back to back: ``sizes[i]`` bytes from the
    start of descriptor ``fds[i]`` (a file may hold more: a padded last chunk).

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory()
    >>> d = scratch.name
    >>> fds = []
    >>> for name, data in (("a", b"abc"), ("b", b"de--")):
    ...     with open(os.path.join(d, name), "wb") as f:
    ...         _ = f.write(data)
    ...     fds.append(os.open(os.path.join(d, name), os.O_RDONLY))
    >>> src = Pieces(fds, [3, 2])
    >>> buf = bytearray(4)
    >>> src.pread_into(buf, 1), bytes(buf), bytes(src.read_all())
    (4, b'bcde', b'abcde')
    >>> src.close(); scratch.cleanup()
    """

    __slots__ = ("fds", "sizes", "starts")

    def __init__(self, fds: Sequence[int], sizes: Sequence[int]) -> None:
        self.fds = list(fds)
        self.sizes = list(sizes)
        self.starts = list(itertools.accumulate(self.sizes, initial=0))

    def _runs(self, offset: int, n: int) -> Iterator[tuple[int, int, int, int]]:
        """``(fd, offset in it, position in the caller's buffer, bytes)`` of each run."""
        i = bisect.bisect_right(self.starts, offset) - 1
        pos = 0
        while n > 0 and 0 <= i < len(self.fds):
            at = offset - self.starts[i]
            take = min(n, self.sizes[i] - at)
            if take <= 0:
                break
            yield self.fds[i], at, pos, take
            offset, pos, n, i = offset + take, pos + take, n - take, i + 1

    def pread_into(self, buf: Any, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only past the end)."""
        view = memoryview(buf).cast("B")
        i = bisect.bisect_right(self.starts, offset) - 1
        if 0 <= i < len(self.fds) and offset + len(view) <= self.starts[i + 1]:
            return _rawio.pread_into(self.fds[i], view, offset - self.starts[i])  # one file
        got = 0
        for fd, at, pos, take in self._runs(offset, len(view)):
            k = _rawio.pread_into(fd, view[pos : pos + take], at)
            got += k
            if k < take:
                break
        return got

    def preadv_all(self, bufs: Sequence[Any], offset: int) -> int:
        """Fill the buffers back to back from ``offset``."""
        return _fill_back_to_back(self.pread_into, bufs, offset)

    def read_all(self) -> bytearray:
        out = bytearray(self.starts[-1])
        self.pread_into(out, 0)
        return out

    def cached(self, offset: int) -> bool:
        for fd, at, _, _ in self._runs(offset, 1):
            return _rawio.cached(fd, at)
        return False

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class Pending(Protocol):
    """Patches still being read (:class:`.delta.Patches`)."""

    def result(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The patches in order, once read and checked; raises the first damaged one's error."""


class Patched:
    """A value's ``nbytes`` bytes: those of ``base`` from ``offset`` (a descriptor or
    :class:`Pieces`), with row ``rows[i]`` (``row_bytes`` each) replaced by ``data[i]``.

    ``patch`` is ``(rows, data)``: ``rows`` sorted and unique, ``data`` one ``V<row_bytes>``
    item per row (whole rows copy as single items); or a list of them, laid in order (a
    later one's row wins); or a :class:`Pending` list still being read, waited for when
    first laid or checked (:meth:`check`). The base is closed with this source only when
    ``owned``.
    ``expect``: the checksum of the base's ``nbytes`` bytes alone (the record's, format
    1.5), when the value is to be verified by its parts (the base by it, the patches by
    their CRCs: :meth:`check`); None: by its assembled bytes.

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory()
    >>> d = scratch.name
    >>> with open(os.path.join(d, "b"), "wb") as f:
    ...     _ = f.write(b"aabbccdd")
    >>> fd = os.open(os.path.join(d, "b"), os.O_RDONLY)
    >>> patch = np.array([1, 3]), np.frombuffer(b"XXYY", "V2")
    >>> src = Patched(fd, 0, 8, 2, patch)
    >>> bytes(src.read_all()), bytearray(src.read_all()[3:6])
    (b'aaXXccYY', bytearray(b'Xcc'))
    >>> buf = bytearray(3)
    >>> src.pread_into(buf, 3), bytes(buf)
    (3, b'Xcc')
    >>> src.close(); scratch.cleanup()
    """

    __slots__ = ("_patches", "base", "expect", "nbytes", "offset", "owned", "row_bytes")

    def __init__(self, base: Any, offset: int, nbytes: int, row_bytes: int,
                 patch: tuple[np.ndarray, np.ndarray] | list[tuple[np.ndarray, np.ndarray]]
                 | Pending,
                 *, owned: bool = True, expect: int | None = None) -> None:
        self.base, self.offset, self.nbytes, self.row_bytes = base, offset, nbytes, row_bytes
        self._patches = [patch] if isinstance(patch, tuple) else patch
        self.owned, self.expect = owned, expect

    @property
    def patches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The patches, in order (waited for if still being read; their error if damaged)."""
        got = self._patches
        return got if isinstance(got, list) else got.result()

    def check(self) -> None:
        """Raise the error of the first damaged patch (waiting for them if still read)."""
        _ = self.patches

    @property
    def rows(self) -> np.ndarray:
        """The rows the patches hold (sorted, unique)."""
        patches = self.patches
        if len(patches) == 1:
            return patches[0][0]
        return np.unique(np.concatenate([rows for rows, _ in patches]))

    def pread_into(self, buf: Any, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only past the end)."""
        view = memoryview(buf).cast("B")
        want = max(0, min(len(view), self.nbytes - offset))
        got = pread_into(self.base, view[:want], self.offset + offset)
        if got:
            self.lay(np.asarray(view[:got]), offset)
        return got

    def lay(self, out: np.ndarray, offset: int) -> None:
        """Put the patched rows that fall in ``[offset, offset + len(out))`` of the value
        into ``out`` (``uint8``: the base's bytes there), each patch in turn."""
        for rows, data in self.patches:
            self._lay_one(out, offset, rows, data)

    def _lay_one(self, out: np.ndarray, offset: int, rows: np.ndarray, data: np.ndarray
                 ) -> None:
        rb = self.row_bytes
        end = offset + out.size
        if not (offset % rb or end % rb):  # whole rows (a piece of a read): one assignment
            lo, hi = offset // rb, end // rb
            grid = out.view(data.dtype)
            if rows.size and lo <= rows[0] and rows[-1] < hi:  # all of them (a whole value)
                at = rows if lo == 0 else rows - lo
                # "clip": inside, checked (the default mode buffers what it lays)
                np.put(grid, at, data, mode="clip")
                return
            i, j = rows.searchsorted((lo, hi)).tolist()
            if j > i:
                np.put(grid, rows[i:j] - lo, data[i:j], mode="clip")
            return
        i, j = rows.searchsorted((offset // rb, (end - 1) // rb + 1)).tolist()
        if i == j:
            return
        full_lo, full_hi = -(-offset // rb), end // rb  # rows wholly inside
        a, b = (rows[i:j].searchsorted((full_lo, full_hi)) + i).tolist()
        if b > a:
            grid = out[full_lo * rb - offset: full_hi * rb - offset].view(data.dtype)
            grid[rows[a:b] - full_lo] = data[a:b]
        for k in (*range(i, a), *range(b, j)):  # rows cut by the range's ends (two at most)
            start = int(rows[k]) * rb
            lo, hi = max(start, offset), min(start + rb, end)
            out[lo - offset: hi - offset] = data[k: k + 1].view(np.uint8)[
                lo - start: hi - start]

    def preadv_all(self, bufs: Sequence[Any], offset: int) -> int:
        """Fill the buffers back to back from ``offset``."""
        return _fill_back_to_back(self.pread_into, bufs, offset)

    def read_all(self) -> bytearray:
        out = bytearray(self.nbytes)
        self.pread_into(out, 0)
        return out

    def cached(self, offset: int) -> bool:
        return cached(self.base, self.offset + offset)

    def close(self) -> None:
        base, self.base = self.base, -1
        if self.owned and base != -1:
            close(base)


def pread_into(fd: int | RemoteFile | Pieces | Patched, buf: Any, offset: int) -> int:
    """``_rawio.pread_into`` on a descriptor, a ranged read on a :class:`RemoteFile`."""
    if fd.__class__ is int:
        return _rawio.pread_into(fd, buf, offset)
    return fd.pread_into(buf, offset)  # type: ignore[union-attr]


def preadv_all(fd: int | RemoteFile | Pieces | Patched, bufs: Sequence[Any], offset: int) -> int:
    """``_rawio.preadv_all`` on a descriptor, parallel ranged reads on a :class:`RemoteFile`."""
    if fd.__class__ is int:
        return _rawio.preadv_all(fd, bufs, offset)
    return fd.preadv_all(bufs, offset)  # type: ignore[union-attr]


def close(fd: int | RemoteFile | Pieces | Patched) -> None:
    """Close a descriptor, or the descriptors of :class:`Pieces` (a remote source holds
    nothing open)."""
    if fd.__class__ is int:
        os.close(fd)
    elif isinstance(fd, Pieces | Patched):
        fd.close()


def map_all(fd: int | RemoteFile | Pieces | Patched) -> Any:
    """A buffer of the whole source: a read-only map of a file, the bytes of a remote one."""
    if fd.__class__ is int:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    return fd.read_all()  # type: ignore[union-attr]


def cached(fd: int | RemoteFile | Pieces | Patched, offset: int) -> bool:
    """Whether a page is in the page cache; a remote source counts as cached (its pieces
    are best read in parallel)."""
    if fd.__class__ is int:
        return _rawio.cached(fd, offset)
    if isinstance(fd, Pieces | Patched):
        return fd.cached(offset)
    return True


def _fill_back_to_back(pread_into: Callable[[Any, int], int], bufs: Sequence[Any],
                       offset: int) -> int:
    """Fill ``bufs`` one after another from ``offset`` through ``pread_into(view, at)``;
    the bytes read (fewer at the end of the source)."""
    total = 0
    for b in bufs:
        view = memoryview(b).cast("B")
        k = pread_into(view, offset + total)
        total += k
        if k < len(view):
            break
    return total
