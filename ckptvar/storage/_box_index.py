"""Between NumPy indexes and boxes: the box an index selects, the run it covers, in place.

Which box a basic index selects, which run of a C-ordered array a box's slices cover,
and whether a buffer can take a value in place.

>>> run_start((slice(2, 4), slice(0, 3)), (5, 3))   # rows 2..3 of a (5, 3) array: one run
6
>>> run_start((slice(2, 4), slice(0, 2)), (5, 3)) is None   # a column cut: not one run
True
>>> span_of((slice(2, 4), slice(0, 2)), (5, 3))   # the run from the first to the last one
5
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..distributed import Box
from .base import ArrayInfo

__all__ = ["as_box", "fits_whole", "run_start", "span_of"]


def run_start(slices: tuple[slice, ...], shape: tuple[int, ...]) -> int | None:
    """The first flat element of ``slices`` (step 1) of a C-ordered ``shape`` when they
    select one contiguous run of elements, else ``None``.

    They do when, past the first axis they cut to more than one index, every axis is
    taken whole.
    """
    if not shape:
        return 0
    cut = False
    for s, n in zip(slices, shape, strict=True):
        if cut and (s.start, s.stop) != (0, n):
            return None
        if s.stop - s.start > 1:
            cut = True
    return int(np.ravel_multi_index([s.start for s in slices], shape)) if all(
        s.stop > s.start for s in slices) else None


def fits_whole(out: Any, info: ArrayInfo) -> bool:
    """Whether ``out`` can take ``info``'s value in place (same shape and dtype, C order)."""
    return (
        isinstance(out, np.ndarray) and out.shape == tuple(info.shape)
        and out.dtype == info.dtype and out.flags.c_contiguous and out.flags.writeable
    )


def span_of(slices: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    """Elements from the first to the last element of ``slices`` of a C-ordered ``shape``."""
    first = [s.start for s in slices]
    last = [s.stop - 1 for s in slices]
    if not shape:
        return 1
    return int(np.ravel_multi_index(last, shape) - np.ravel_multi_index(first, shape) + 1)


def as_box(index: Any, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    """A box for basic step-1 slices/ints, and what is left to apply (ints drop axes)."""
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) > len(shape) or any(i is Ellipsis or i is None for i in idx):
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


