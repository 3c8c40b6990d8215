"""Between NumPy indexes and boxes: the box a basic index selects, and in-place targets.

Which box a basic index selects (:func:`as_box`) and whether a buffer can take a
value in place (:func:`fits_whole`). Which run of a C-ordered array a box's slices
cover is :mod:`._slicing`'s.

>>> box, rest = as_box((1, slice(0, 2)), (3, 4))
>>> str(box), rest
('[1:2, 0:2]', (0, slice(None, None, None)))
>>> as_box((True, 1), (3, 4))   # a Python bool is a mask, not the index 1: no box
(None, ())
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..distributed import Box
from .base import ArrayInfo

__all__ = ["as_box", "fits_whole"]


def fits_whole(out: Any, info: ArrayInfo) -> bool:
    """Whether ``out`` can take ``info``'s value in place (same shape and dtype, C order)."""
    return (
        isinstance(out, np.ndarray) and out.shape == tuple(info.shape)
        and out.dtype == info.dtype and out.flags.c_contiguous and out.flags.writeable
    )


def as_box(index: Any, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    """A box for basic step-1 slices/ints, and what is left to apply (ints drop axes)."""
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) > len(shape) or any(i is Ellipsis or i is None or isinstance(i, bool)
                                    for i in idx):  # True is an int, but a mask to NumPy
        return None, ()
    offset: list[int] = []
    extent: list[int] = []
    rest: list[Any] = []
    for i, n in zip(idx + (slice(None),) * (len(shape) - len(idx)), shape, strict=True):
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return None, ()
            offset.append(start)
            extent.append(max(stop - start, 0))
            rest.append(slice(None))
        elif isinstance(i, int | np.integer):
            k = int(i) + (n if int(i) < 0 else 0)
            if not 0 <= k < n:
                raise IndexError(f"index {int(i)} is out of bounds for an axis of size {n}")
            offset.append(k)
            extent.append(1)
            rest.append(0)
        else:
            return None, ()
    return Box(tuple(offset), tuple(extent)), tuple(rest)


