"""Contiguous-run arithmetic: which run of a C-order array an index or box's slices touch.

A lazy array reads only part of a stored value when sliced. For a basic index
(integers, slices, one ``...``) on a C-order array, :func:`element_span` finds
the one contiguous run of elements that holds everything the index selects:
leading integers fix a block, the first slice after them narrows it to a range
of rows. The caller reads that run (``span.byte_range(itemsize)`` in bytes),
reshapes it to ``span.shape`` and applies ``span.index`` to get exactly
``full[index]``. Anything else (``None``, arrays, booleans) is advanced
indexing: :func:`element_span` returns ``None`` and the caller reads the whole
value.

>>> import numpy as np
>>> full = np.arange(24).reshape(2, 3, 4)
>>> for index in [(1, slice(0, 2)), (..., 2), 0, (1, 2, 3), slice(None, None, -1)]:
...     span = element_span(index, full.shape)
...     block = full.reshape(-1)[span.start : span.start + span.count].reshape(span.shape)
...     assert np.array_equal(block[span.index], full[index])
>>> element_span((1, slice(0, 2)), (2, 3, 4)).byte_range(8)
(96, 64)
>>> element_span([0, 1], (2, 3)) is None
True

The same arithmetic for the step-1 slices of a box (:func:`run_start`,
:func:`span_bounds`) and the strides of a C-order array (:func:`c_strides`) live
here too: this module is their one home.

>>> run_start((slice(2, 4), slice(0, 3)), (5, 3))   # rows 2..3 of a (5, 3) array: one run
6
>>> run_start((slice(2, 4), slice(0, 2)), (5, 3)) is None   # a column cut: not one run
True
>>> span_bounds((slice(2, 4), slice(0, 2)), (5, 3))   # first to last element, flat
(6, 11)
>>> c_strides((2, 3, 4), 8)
(96, 32, 8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ElementSpan",
    "c_strides",
    "element_span",
    "expand_index",
    "leading_rows",
    "run_start",
    "span_bounds",
]


@dataclass(frozen=True, slots=True)
class ElementSpan:
    """``full.reshape(-1)[start:start + count].reshape(shape)[index]`` equals ``full[index]``."""

    start: int  # first element (flat, C order)
    count: int  # number of elements to read
    shape: tuple[int, ...]  # shape of the block those elements form
    index: tuple[Any, ...]  # what to apply to the block

    def byte_range(self, itemsize: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of the run, for elements of ``itemsize`` bytes."""
        return self.start * itemsize, self.count * itemsize


def _is_int(i: Any) -> bool:
    return isinstance(i, int | np.integer) and not isinstance(i, bool | np.bool_)


def expand_index(index: Any, ndim: int, *, name: str = "the array") -> tuple[Any, ...] | None:
    """``index`` as a tuple of integers and slices with ``...`` expanded, or ``None`` when
    it is not basic indexing (``None``, arrays, booleans: read the whole value instead).

    Raises ``IndexError`` as NumPy does for two ellipses or too many indices.
    """
    idx = index if isinstance(index, tuple) else (index,)
    ellipses = 0
    for i in idx:
        if i is Ellipsis:
            ellipses += 1
        elif not (isinstance(i, slice) or _is_int(i)):
            return None
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if ellipses:
        at = idx.index(Ellipsis)
        fill = max(0, ndim - (len(idx) - 1))
        idx = idx[:at] + (slice(None),) * fill + idx[at + 1 :]
    if len(idx) > ndim:
        raise IndexError(
            f"too many indices for {name}: array is {ndim}-dimensional, "
            f"but {len(idx)} were indexed"
        )
    return idx


def element_span(
    index: Any, shape: tuple[int, ...], *, name: str = "the array"
) -> ElementSpan | None:
    """The contiguous run of elements ``index`` touches in a C-order array of ``shape``.

    ``None`` for advanced indexing or a 0-d array. Raises ``IndexError`` for an
    integer out of bounds, naming the axis as NumPy does.
    """
    if not shape:
        return None
    idx = expand_index(index, len(shape), name=name)
    if idx is None:
        return None
    strides = c_strides(shape)
    base = 0
    ax = 0
    while ax < len(idx) and _is_int(idx[ax]):
        i = int(idx[ax])
        if not -shape[ax] <= i < shape[ax]:
            raise IndexError(f"index {i} is out of bounds for axis {ax} with size {shape[ax]}")
        base += (i % shape[ax]) * strides[ax]
        ax += 1
    if ax == len(shape):  # every axis fixed: one element (a 0-d array with ``...``)
        ell = any(i is Ellipsis for i in (index if isinstance(index, tuple) else (index,)))
        return ElementSpan(base, 1, (), (Ellipsis,) if ell else ())
    rest = idx[ax:]
    tail = shape[ax + 1 :]
    if not rest:  # leading integers only: the whole block they fix
        return ElementSpan(base, strides[ax - 1] if ax else math.prod(shape), shape[ax:], ())
    rng = range(*rest[0].indices(shape[ax]))
    if len(rng) == 0:
        return ElementSpan(base, 0, (0, *tail), (slice(None), *rest[1:]))
    lo, hi = min(rng[0], rng[-1]), max(rng[0], rng[-1]) + 1
    stop = rng[-1] - lo + (1 if rng.step > 0 else -1)
    first = slice(rng[0] - lo, stop if stop >= 0 else None, rng.step)
    return ElementSpan(base + lo * strides[ax], (hi - lo) * strides[ax], (hi - lo, *tail),
                       (first, *rest[1:]))


def leading_rows(index: Any, shape: tuple[int, ...]) -> tuple[int, int, tuple[Any, ...]] | None:
    """For an index whose first item picks rows by an integer array (or a 1-D boolean mask
    of the first axis): ``(lo, hi, sub)`` such that ``full[index]`` equals
    ``full[lo:hi][sub]``; ``None`` for any other index or when the rows span them all.

    Raises ``IndexError`` for a row out of bounds, as NumPy does.

    >>> leading_rows(([7, 3, -1], slice(None, 2)), (10, 4))
    (3, 10, (array([4, 0, 6]), slice(None, 2, None)))
    """
    idx = index if isinstance(index, tuple) else (index,)
    if not shape or not idx or not isinstance(idx[0], list | np.ndarray):
        return None
    rows = np.asarray(idx[0])
    if rows.dtype == np.bool_ and rows.shape == shape[:1]:
        rows = np.flatnonzero(rows)
    if rows.dtype.kind not in "iu" or not rows.size:
        return None
    n = shape[0]
    low, high = int(rows.min()), int(rows.max())
    for bad in (low, high):
        if not -n <= bad < n:
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
    rows = np.where(rows < 0, rows + n, rows)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    if lo == 0 and hi == n:
        return None
    return lo, hi, (rows - lo, *idx[1:])


def c_strides(shape: tuple[int, ...], itemsize: int = 1) -> tuple[int, ...]:
    """The strides of a C-order array of ``shape`` (in elements, or bytes of ``itemsize``)."""
    out = [itemsize] * len(shape)
    for ax in range(len(shape) - 2, -1, -1):
        out[ax] = out[ax + 1] * shape[ax + 1]
    return tuple(out)


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


def span_bounds(slices: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """``(first, stop)``: the flat elements from the first to past the last element of the
    step-1 ``slices`` of a C-ordered ``shape`` (each slice non-empty)."""
    if not shape:
        return 0, 1
    lo = int(np.ravel_multi_index([s.start for s in slices], shape))
    hi = int(np.ravel_multi_index([s.stop - 1 for s in slices], shape)) + 1
    return lo, hi
