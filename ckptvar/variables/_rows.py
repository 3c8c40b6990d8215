"""Which rows of a variable were written since a version: the row log behind row deltas.

Owns :class:`RowLog`, kept by a ``cv.Variable`` once something asks for it
(:func:`ckptvar.variables.track_rows`; an incremental ``CheckpointManager`` does at each
save), and :func:`rows_of`, the first-axis indices an index expression writes. Each
finished write adds ``(version after it, rows)``: the rows for a slice or index
assignment and the ``scatter_*`` family, "all" for anything that writes the whole value
(``assign`` and its family, NumPy ``out=``, a restore, initialization). ``since(v)`` is
then the sorted rows written after version ``v``, or ``None`` when that is not known
(the log started later, or some write took the whole value). Entries beyond
:data:`LIMIT` are merged, oldest first, into one flag per row (so many small writes
between two saves cost what their rows cost): merged rows count at the latest merged
version, so an answer may hold more rows than were written, never fewer.

>>> log = RowLog(start=3)
>>> log.add(4, np.array([5, 1]))
>>> log.add(5, np.array([1, 2]))
>>> log.since(3).tolist(), log.since(4).tolist(), log.since(2)
([1, 2, 5], [1, 2], None)
>>> log.add(6, None)
>>> log.since(5), log.since(6).tolist()
(None, [])
>>> for v in range(7, 7 + 2 * LIMIT):
...     log.add(v, np.array([v]))
>>> log.since(6).tolist() == list(range(7, 7 + 2 * LIMIT)), log.since(7 + LIMIT).size
(True, 15)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LIMIT", "RowLog", "rows_of", "unique_rows"]

#: Entries kept before the oldest two are merged.
LIMIT = 16
_EMPTY = np.empty(0, np.int64)


def unique_rows(rows: np.ndarray) -> np.ndarray:
    """The sorted unique values of the 1-d integer array ``rows``, as int64 (``np.unique``,
    by a sort and a mask: several times faster for the few thousand rows of a write).

    >>> unique_rows(np.array([5, 1, 5, 3])).tolist()
    [1, 3, 5]
    """
    out = np.sort(np.asarray(rows, np.int64).reshape(-1))
    if out.size < 2:
        return out
    keep = np.empty(out.size, bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out if keep.all() else out[keep]


class RowLog:
    """Rows written per version, complete from version ``start`` on."""

    __slots__ = ("entries", "older", "older_version", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        #: ``(version after the write, sorted unique rows, or None: every row)``
        self.entries: list[tuple[int, np.ndarray | None]] = []
        #: The rows of the entries merged away (one flag per row), all counted at
        #: ``older_version``; None: none merged.
        self.older: np.ndarray | None = None
        self.older_version = start

    def add(self, version: int, rows: np.ndarray | None) -> None:
        """Note a finished write of ``rows`` (None: the whole value) at ``version``."""
        if rows is None:
            self.entries, self.older = [(version, None)], None  # it covers all before
            return
        self.entries.append((version, unique_rows(rows)))
        if len(self.entries) > LIMIT:  # the oldest into the flags: O(its rows), no sort
            v, old = self.entries.pop(0)
            if old is None:
                self.entries.insert(0, (v, None))  # an "every row" entry stays first
                v, old = self.entries.pop(1)
                if old is None:
                    return
            flags = self.older
            top = int(old[-1]) + 1 if old.size else 0
            if flags is None or flags.size < top:
                grown = np.zeros(max(top, 0 if flags is None else flags.size), bool)
                if flags is not None:
                    grown[: flags.size] = flags
                flags = self.older = grown
            flags[old] = True
            self.older_version = max(self.older_version, v)

    def since(self, version: int) -> np.ndarray | None:
        """The sorted rows written after ``version``; None when not known (all of them)."""
        if version < self.start:
            return None
        parts = []
        if self.older is not None and self.older_version > version:
            parts.append(np.flatnonzero(self.older))
        for v, rows in self.entries:
            if v > version:
                if rows is None:
                    return None
                parts.append(rows)
        if not parts:
            return _EMPTY
        return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


def rows_of(index: Any, nrows: int) -> np.ndarray | None:
    """The first-axis indices (sorted, unique) that ``buf[index] = ...`` writes in an array
    of ``nrows`` rows; None when they cannot be told (``...`` first, new axes, anything
    unusual): the caller then counts every row.

    >>> rows_of(3, 10).tolist(), rows_of(slice(2, 8, 3), 10).tolist(), rows_of((-1, 0), 10).tolist()
    ([3], [2, 5], [9])
    >>> rows_of(np.array([True, False, True]), 3).tolist(), rows_of(..., 10)
    ([0, 2], None)
    """
    first = index[0] if isinstance(index, tuple) and index else index
    if isinstance(index, tuple) and not index:
        return None
    if first is Ellipsis or first is None:
        return None
    try:
        if isinstance(first, slice | int | np.integer):
            picked = np.arange(nrows)[first]
        else:
            arr = np.asarray(first)
            if arr.dtype == bool:
                if arr.ndim != 1 or arr.shape[0] != nrows:
                    return None
                picked = np.flatnonzero(arr)
            elif arr.dtype.kind in "iu":
                picked = np.arange(nrows)[arr.reshape(-1)]
            else:
                return None
    except (IndexError, TypeError, ValueError):
        return None
    return unique_rows(picked)
