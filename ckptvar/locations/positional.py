"""A read-only, seekable raw stream over bytes that are fetched by position.

:class:`PositionalRaw` keeps the position and answers ``seek``/``tell``/``readinto``;
a subclass says only how to read bytes at an offset (``os.pread`` on a window of a
local file, one ranged GET on an object store). Wrap it in ``io.BufferedReader`` to
hand it to a library that wants a file (h5py, zipfile).

>>> class Bytes(PositionalRaw):
...     def __init__(self, data: bytes) -> None:
...         super().__init__(len(data))
...         self._data = data
...     def read_at(self, pos: int, view: memoryview) -> int:
...         view[:] = self._data[pos : pos + len(view)]
...         return len(view)
>>> f = Bytes(b"hello world")
>>> _ = f.seek(6)
>>> f.read(5)
b'world'
"""

from __future__ import annotations

import io
from abc import abstractmethod

__all__ = ["PositionalRaw"]


class PositionalRaw(io.RawIOBase):
    """A read-only, seekable raw stream over ``size`` bytes; :meth:`read_at` fetches them.

    It keeps the position; a subclass says only how to read bytes at one.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size, self._pos = size, 0

    @abstractmethod
    def read_at(self, pos: int, view: memoryview) -> int:
        """Fill ``view`` (at most ``size - pos`` bytes) from ``pos``; returns how many."""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self._size - self._pos))
        if n:
            n = self.read_at(self._pos, view[:n])
            self._pos += n
        return n
