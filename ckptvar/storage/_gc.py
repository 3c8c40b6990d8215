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

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored as it was after it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
