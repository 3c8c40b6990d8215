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
import os
import threading
from types import TracebackType

__all__ = ["paused_gc"]

#: how many blocks are inside a pause now (of every thread: the collector is the
#: process's), and whether the first of them found it enabled; changed under the lock
_DEPTH: list[int] = [0, 0]
_LOCK = [threading.Lock()]


def _new_lock_in_child() -> None:
    """In a fork's child: a lock of its own (another thread may have held it at the fork)."""
    _LOCK[0] = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


class _Paused:
    """The context of :func:`paused_gc` (a class: no generator frame to enter and leave,
    as ``contextlib.contextmanager``'s; a background save enters it in the caller's time).

    The pauses of all threads are one: the collector is enabled again when the last
    block ends, if it was when the first began (a background save's pause that ends
    while the caller's goes on neither turns it back on under the caller nor, racing
    with the caller's start, leaves it off for good)."""

    __slots__ = ()

    def __enter__(self) -> None:
        with _LOCK[0]:
            if not _DEPTH[0]:
                _DEPTH[1] = gc.isenabled()
                gc.disable()
            _DEPTH[0] += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with _LOCK[0]:
            _DEPTH[0] -= 1
            if not _DEPTH[0] and _DEPTH[1]:
                gc.enable()


def paused_gc() -> _Paused:
    """No cyclic garbage collection inside the block (restored as it was after it)."""
    return _Paused()
