"""Reading values in bounded blocks, and statistics merged block by block.

``inspect --stats``, ``diff`` and ``convert`` read a value larger than
``BLOCK_ELEMENTS`` elements through its lazy array, one row block at a time, so
memory stays flat however large the value is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import ckptvar as cv

from ._lazy import lazy_module
from ._output import finite_or_none

if TYPE_CHECKING:
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")

__all__ = ["BLOCK_ELEMENTS", "Stats", "is_floating", "iter_blocks", "value_blocks"]

#: Values with more elements than this are read in blocks of about this many elements,
#: so memory stays flat however large a value is.
BLOCK_ELEMENTS = 1 << 20


def iter_blocks(shape: Sequence[int], budget: int = BLOCK_ELEMENTS) -> Iterator[tuple[slice, ...]]:
    """Index tuples that cover an array of ``shape`` in row blocks of at most ``budget`` elements.

    A block is a run of rows along the first axis whose trailing size fits the budget;
    when even one row is too large the leading axes are walked one index at a time.

    >>> list(iter_blocks((5, 2), budget=4))
    [(slice(0, 2, None),), (slice(2, 4, None),), (slice(4, 5, None),)]
    >>> list(iter_blocks((2, 3), budget=2))[:2]
    [(slice(0, 1, None), slice(0, 2, None)), (slice(0, 1, None), slice(2, 3, None))]
    """
    if not shape:
        yield ()
        return
    if any(d == 0 for d in shape):
        return
    suffix = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        suffix[i] = suffix[i + 1] * shape[i]
    axis = next(i for i in range(len(shape)) if suffix[i + 1] <= budget)
    step = max(1, budget // suffix[axis + 1])
    for outer in itertools.product(*(range(n) for n in shape[:axis])):
        lead = tuple(slice(i, i + 1) for i in outer)
        for start in range(0, shape[axis], step):
            yield (*lead, slice(start, min(start + step, shape[axis])))


def value_blocks(
    reader: cv.storage.Reader,
    key: str,
    info: cv.storage.ArrayInfo,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
    """A value as ``(index, block)`` pairs of at most about ``BLOCK_ELEMENTS`` elements.

    A small value is read whole (its checksum is checked); a large one is sliced
    through the lazy array, so it is never in memory at once. ``on_bytes`` hears
    the bytes of each block as it arrives (for a progress bar).
    """
    shape = tuple(info.shape)
    budget = BLOCK_ELEMENTS
    if math.prod(shape) <= budget:
        block = np.asarray(reader.read(key))
        if on_bytes is not None:
            on_bytes(block.nbytes)
        yield tuple(slice(0, d) for d in shape), block
        return
    lazy = reader[key]
    for index in iter_blocks(shape, budget):
        block = np.asarray(lazy[index])
        if on_bytes is not None:
            on_bytes(block.nbytes)
        yield index, block


def is_floating(dtype: np.dtype) -> bool:
    """True for float16/32/64 and the ml_dtypes floats (bfloat16, float8_*)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def _as_float64(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "c":
        magnitude: np.ndarray = np.abs(x)
        return magnitude.astype(np.float64)
    return x.astype(np.float64)


class Stats:
    """Streaming min/max/mean/std over finite elements, plus NaN and Inf counts.

    Blocks are merged with Chan's parallel formula, so the result does not depend
    on the block size. Complex values are summarised by their magnitude.

    >>> s = Stats()
    >>> s.add(np.array([1.0, np.nan])); s.add(np.array([3.0, np.inf]))
    >>> s.as_dict()
    {'min': 1.0, 'max': 3.0, 'mean': 2.0, 'std': 1.0, 'nan': 1, 'inf': 1}
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min: float = math.inf
        self.max: float = -math.inf
        self.nan = 0
        self.inf = 0

    def add(self, block: np.ndarray) -> None:
        block = np.asarray(block)
        if block.dtype.kind in "biu" and block.size:  # exact extremes for integers
            lo, hi = int(block.min()), int(block.max())
            self.min = lo if self.n == 0 else min(self.min, lo)
            self.max = hi if self.n == 0 else max(self.max, hi)
            x = block.astype(np.float64).ravel()
            self._add_finite(x, extremes=False)
            return
        x = _as_float64(block).ravel()
        finite = np.isfinite(x)
        if not finite.all():
            nan = int(np.count_nonzero(np.isnan(x)))
            self.nan += nan
            self.inf += int(x.size - np.count_nonzero(finite)) - nan
            x = x[finite]
        self._add_finite(x, extremes=True)

    def _add_finite(self, x: np.ndarray, *, extremes: bool) -> None:
        if x.size == 0:
            return
        n_b = int(x.size)
        mean_b = float(x.mean())
        m2_b = float(np.square(x - mean_b).sum())
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.n * n_b / n
        self.n = n
        if extremes:
            self.min = min(self.min, float(x.min()))
            self.max = max(self.max, float(x.max()))

    def as_dict(self) -> dict[str, Any]:
        """The stats, ``None`` where no finite element exists."""
        has = self.n > 0
        return {
            "min": finite_or_none(self.min) if has else None,  # an int for integer values
            "max": finite_or_none(self.max) if has else None,
            "mean": finite_or_none(self.mean) if has else None,
            "std": finite_or_none(math.sqrt(self.m2 / self.n)) if has else None,
            "nan": self.nan,
            "inf": self.inf,
        }
