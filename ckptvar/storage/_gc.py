"""Pausing the cyclic garbage collector while many small objects are made.

Decoding a record of 20,000 values, or a restore that makes an object per value,
would otherwise trigger collector passes that rescan every live object.
Exported as :func:`ckptvar.storage.paused_gc` for the layers above.

>>> import gc
>>> with paused_gc():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import gc
from types import TracebackType

__all__ = ["paused_gc"]


class _Paused:
    """The context of :func:`paused_gc` (a class: no generator frame to enter and leave,
    as ``contextlib.contextmanager``'s; a background save enters it in the caller's time)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._was:
            gc.enable()


def paused_gc() -> _Paused:
    """No cyclic garbage collection inside the block (restored as it was after it)."""
    return _Paused()
