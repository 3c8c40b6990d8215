"""Reusing a committed checkpoint's stored bytes: the storage side of incremental saves.

Owns the decision, for each value stored as its own array, whether the **base** (a
committed checkpoint of the same container, usually the previous step) already holds
exactly its bytes, and where they are (:class:`Held`). The caller says what it knows
(``known``: key -> True when the value is unchanged since the base was written, False when
it changed; the version counter of a ``cv.Variable``); any other value is hashed by blocks
(which the write does anyway) and reused when its checksum and every block checksum equal
the base's. The backend then refers to the bytes instead of writing them: an HDF5 external
link, a hard-linked Zarr chunk file (docs/FORMAT.md, "Incremental steps").

Granularity is the whole value: a value with one changed block is written whole
(docs/checkpoints.md says why). Packed (small) values are always written.

Also :class:`KeptRecords`: the decoded records of the last few committed steps, kept by
the identity of the file that holds the record, so that the next step's look at its
base opens nothing (a committed checkpoint is never changed in place); with each, the
rows of its row deltas' patches as the writer wrote them (:attr:`Kept.rows`), so a
merge of those patches reads none of them back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError
from .._record import ARRAY, BLOCK_SIZE, Entry, Record

__all__ = ["BaseFileLost", "Held", "Kept", "KeptRecords", "PatchRows", "match"]

#: key -> the rows (sorted, unique, read-only int64) each patch of the value's row delta
#: holds, in the order of its record's patches.
PatchRows = Mapping[str, tuple[np.ndarray, ...]]


@dataclass(frozen=True, slots=True)
class Kept:
    """A committed step's decoded record and, when the process that wrote it knows them,
    the rows of its row deltas' patches (:data:`PatchRows`; a key left out: not known)."""

    record: Record
    rows: PatchRows = field(default_factory=dict)


class KeptRecords:
    """Decoded records of committed checkpoints by the identity of the file holding the
    record's bytes: its path, inode, size and modification time (a committed file is
    never changed in place; a step written anew under a pruned step's name is a new file).
    The newest ``most`` only (a step needs its own and its base's), so a long run keeps
    few; safe to use from several threads (background saves).

    >>> import tempfile
    >>> kept = KeptRecords()
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     kept.keep(f.name, Record("h5"))
    ...     before = kept.get(f.name)
    ...     _ = f.write(b"x"); f.flush()  # another file now (its size)
    ...     (before is not None, kept.get(f.name))
    (True, None)
    """

    def __init__(self, most: int = 4) -> None:
        self.most = most
        self._kept: dict[tuple[str, int, int, int], Kept] = {}
        self._lock = threading.Lock()

    @staticmethod
    def identity(path: str | os.PathLike[str], st: os.stat_result
                 ) -> tuple[str, int, int, int]:
        return (os.fspath(path), st.st_ino, st.st_size, st.st_mtime_ns)

    def get(self, path: str | os.PathLike[str], st: os.stat_result | None = None
            ) -> Record | None:
        """The record kept for the file at ``path`` as it is now (``st``: its ``stat``,
        if taken already); None if none is (or no file is there)."""
        kept = self.find(path, st)
        return None if kept is None else kept.record

    def find(self, path: str | os.PathLike[str], st: os.stat_result | None = None
             ) -> Kept | None:
        """What is kept for the file at ``path`` as it is now: its record and its patches'
        rows (``st``: its ``stat``, if taken already); None if nothing is."""
        if st is None:
            try:
                st = os.stat(path)
            except OSError:
                return None
        with self._lock:
            return self._kept.get(self.identity(path, st))

    def keep(self, path: str | os.PathLike[str], record: Record,
             st: os.stat_result | None = None, rows: PatchRows | None = None) -> None:
        """Keep ``record`` as the record of the file now at ``path``, and ``rows``: the
        rows of its row deltas' patches as written (only a writer that wrote them says)."""
        ident = self.identity(path, os.stat(path) if st is None else st)
        with self._lock:
            while len(self._kept) >= self.most:
                del self._kept[next(iter(self._kept))]  # the oldest (insertion order)
            self._kept[ident] = Kept(record, dict(rows) if rows else {})

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


class BaseFileLost(CorruptCheckpointError):
    """A file of the base that an incremental step takes bytes from is gone (deleted by
    hand from a committed step): the step cannot be built on it. ``base``: its path.

    >>> str(BaseFileLost("runs/ckpt-3.zarr", "frozen/c.0"))  # doctest: +ELLIPSIS
    "Checkpoint 'runs/ckpt-3.zarr', the step this save builds on, has lost 'frozen/c.0'..."
    """

    def __init__(self, base: str, rel: str) -> None:
        super().__init__(f"Checkpoint {base!r}, the step this save builds on, has lost "
                         f"{rel!r} (deleted by hand?): nothing of it can be taken.")
        self.base = base


@dataclass(frozen=True, slots=True)
class Held:
    """Where a reused value's bytes are, in the file that physically holds them.

    ``file``: the holder (HDF5: its file name, a sibling of the new file; Zarr: the chunk
    file's full path), ``path``: the value's container path there, ``offset``: the byte
    offset of the data in it (0 in a Zarr chunk).
    """

    file: str
    path: str
    offset: int
    #: The base stored the value with the same attributes (its metadata may be reused too).
    same_attrs: bool = False


def _same(entry: Entry | None, dtype: str, shape: tuple[int, ...]) -> bool:
    return (entry is not None and entry.loc.kind == ARRAY and entry.dtype == dtype
            and tuple(entry.shape) == tuple(shape))


def match(
    items: list[Any],
    base: Record,
    known: Mapping[str, bool],
    holder: Callable[[str, Entry], Held],
) -> int:
    """Set ``held`` (and the base's checksums) on each of ``items`` whose bytes ``base``
    holds; returns how many. Items hashed to decide are marked ``hashed``.

    ``items`` are the writer's own-array items (``key``, ``dtype``, ``shape``, ``hash()``,
    ``checksum``, ``blocks``; the attributes may differ: the new record has the new ones); ``holder(key, entry)`` says where the base's
    bytes of ``key`` are.
    """
    values = base.values
    # a base written with blocks of another size (256 KiB, before 2026-11-27): its block
    # checksums are not this record's, so a value is hashed and compared by its checksum
    same_blocks = base.block_size == BLOCK_SIZE
    reused = 0
    for it in items:
        entry = values.get(it.key)
        if entry is None or not _same(entry, it.dtype, it.shape) or it.key in base.deltas:
            continue  # (a row delta of the base is carried over by the writer, .delta)
        state = known.get(it.key)
        if state is False:  # written since the base: no need to look
            continue
        if state is None or not same_blocks:
            if not it.hashed:
                it.hash()
                it.hashed = True
            if it.checksum != entry.checksum or (same_blocks and it.blocks != entry.blocks):
                continue
        if same_blocks:
            it.checksum, it.blocks = entry.checksum, entry.blocks
        where = holder(it.key, entry)
        it.held = Held(where.file, where.path, where.offset,
                       same_attrs=dict(entry.attrs) == dict(it.attrs))
        reused += 1
    return reused
