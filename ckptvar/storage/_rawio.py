"""Raw positional I/O and the background checksum worker shared by the native backends.

Writes go straight from the arrays' buffers (``os.pwrite``/``os.pwritev``, no
copy); reads go straight into the destination buffer (``os.preadv``). Checksums
run on one background thread (CRC-32C releases the GIL on large buffers), so
hashing overlaps with the reads and writes on the calling thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from . import _checksum

__all__ = [
    "IOV_MAX",
    "PIECE",
    "CrcChain",
    "byte_view",
    "pread_exact",
    "pread_into",
    "preadv_all",
    "pwrite_all",
    "pwritev_all",
    "submit",
]

#: Large values are read in pieces this big, so reading and hashing overlap.
PIECE = 32 << 20
_MAX_IO = 1 << 30  # Linux moves at most ~2 GiB per call; stay well below
#: Most buffers handed to one ``pwritev``/``preadv``.
IOV_MAX = min(getattr(os, "IOV_MAX", 1024) if hasattr(os, "IOV_MAX") else 1024, 1024)

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on the shared checksum thread (tasks run in submission order)."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptvar-crc")
    return _executor.submit(fn, *args)


class CrcChain:
    """A CRC-32C fed piece by piece on the checksum thread (pieces hash in order)."""

    __slots__ = ("_last", "value")

    def __init__(self, seed: int) -> None:
        self.value = seed
        self._last: Future[Any] | None = None

    def _feed(self, piece: Any) -> None:
        self.value = _checksum.crc(piece, self.value)

    def feed_async(self, piece: Any) -> None:
        self._last = submit(self._feed, piece)

    def result(self) -> int:
        if self._last is not None:
            self._last.result()
        return self.value


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat ``uint8`` memoryview of a C-contiguous array's bytes (no copy)."""
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8))


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (loops over short writes)."""
    done, n = 0, len(buf)
    while done < n:
        done += os.pwrite(fd, buf[done : done + _MAX_IO], offset + done)


def _bytes_of(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        return byte_view(buf)
    mv = memoryview(buf)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def pwritev_all(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Write the buffers (memoryviews or C-contiguous arrays) back to back from ``offset``.

    Returns the bytes written; at most ``IOV_MAX`` buffers go to one ``pwritev``.
    """
    total = 0
    i = 0
    while i < len(bufs):
        batch = list(bufs[i : i + IOV_MAX])
        want = sum(b.nbytes for b in batch)
        got = os.pwritev(fd, batch, offset + total)
        if got < want:  # short write: finish this batch piece by piece
            pos = got
            for b in batch:
                b = _bytes_of(b)
                if pos >= len(b):
                    pos -= len(b)
                    continue
                pwrite_all(fd, b[pos:], offset + total + got)
                got += len(b) - pos
                pos = 0
        total += want
        i += IOV_MAX
    return total


def preadv_all(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill the buffers back to back from ``offset``; returns the bytes read (short at EOF).

    ``IOV_MAX`` buffers go to one ``preadv`` (a scatter read straight into them).
    """
    total = 0
    i = 0
    while i < len(bufs):
        batch = list(bufs[i : i + IOV_MAX])
        want = sum(b.nbytes for b in batch)
        got = os.preadv(fd, batch, offset + total)
        if got < want:  # short read: finish this batch piece by piece
            pos = got
            done = got
            for b in batch:
                b = _bytes_of(b)
                if pos >= len(b):
                    pos -= len(b)
                    continue
                n = pread_into(fd, b[pos:], offset + total + done)
                done += n
                if n < len(b) - pos:
                    return total + done
                pos = 0
            got = done
        total += got
        i += IOV_MAX
    return total


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done : done + _MAX_IO]], offset + done)
        if got == 0:
            break
        done += got
    return done


def pread_exact(fd: int, n: int, offset: int) -> bytes | None:
    """``n`` bytes at ``offset``, or None if the file ends first."""
    buf = bytearray(n)
    if pread_into(fd, memoryview(buf), offset) != n:
        return None
    return bytes(buf)
