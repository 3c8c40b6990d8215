"""Write planning and packing for ckptvar's own containers (HDF5, Zarr v3).

Owns: normalising each value to its little-endian C-order byte image (a copy
only for big-endian or non-contiguous input), deciding which values are packed
into ``_ckptvar/packed`` and which get their own array (:class:`WritePlan`),
hashing on the checksum thread while the backend writes, the root record of
what was added, and publishing atomically. A backend only lays the plan out in
a temporary path (:meth:`ContainerWriter._write`).
"""

from __future__ import annotations

import abc
import functools
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np

from ..._dtypes import SUPPORTED_DTYPES, as_dtype, dtype_to_str
from ...errors import DTypeLockError
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._plain import check_plain
from .._record import (
    FORMAT_VERSION,
    PACKED,
    ZARR,
    Extent,
    ValueColumns,
    encode_columns,
    record_version,
)
from ..atomic import check_destination, publish, temporary_sibling
from ..base import Writer
from ..chunked import Chunked, HostPieces, is_chunked, materialize, piece_bytes
from ..paths import container_paths
from .blocks import (
    BLOCK_SIZE,
    BlockHasher,
    hash_blocks,
    hash_blocks_parallel,
    join_blocks,
)
from .delta import DeltaLimits, DeltaWrite, merged, plan
from .layout import ALIGN, pack_limit
from .reuse import Held, PatchRows, match

__all__ = ["HASH_WHILE_WRITING", "ContainerWriter", "ValueWrite", "WritePlan", "delta_attrs",
           "hash_while_writing", "scalar_attrs", "write_hashing", "write_packed"]

_ZEROS = memoryview(bytes(ALIGN))
_NO_ROWS = np.empty(0, np.int64)
_NO_BYTES = np.empty(0, np.uint8)
logger = logging.getLogger("ckptvar")


@dataclass(slots=True)
class ValueWrite:
    """One value on its way to disk."""

    key: str
    array: np.ndarray  # C-contiguous little-endian byte image holder
    dtype: str
    shape: tuple[int, ...]
    attrs: dict[str, Any]
    nbytes: int
    packed: bool = False
    checksum: int = 0
    path: str = ""  # container path, for values stored as their own array
    offset: int = 0  # offset in the packed blob, or the backend's byte offset
    blocks: bytes | None = None  # CRC-32C per block, for values of more than one block
    held: Held | None = None  # the base's bytes, reused (an incremental save)
    delta: DeltaWrite | None = None  # stored as the base plus a row patch (format 1.5)
    hashed: bool = False  # hashed already (to compare with the base)
    #: The value's bytes come a piece at a time from here (``array`` is then empty until
    #: :meth:`materialize`): a GPU tensor through the pinned staging buffer.
    source: Chunked | None = None

    @property
    def view(self) -> memoryview:
        return _rawio.byte_view(self.array)

    def hash(self, *, parallel: bool = False) -> None:
        """Its checksum and block checksums (``parallel``: on the I/O threads)."""
        if self.source is not None:  # one pass over the pieces, nothing written
            self.write_with(None)
            return
        seed = _checksum.header_crc(self.key, self.dtype, self.shape)
        if self.nbytes > BLOCK_SIZE:
            hasher = hash_blocks_parallel if parallel else hash_blocks
            self.checksum, self.blocks = hasher(self.view, seed)
        else:
            self.checksum = _checksum.crc(self.view, seed)

    def materialize(self) -> None:
        """Make a chunked value one host array (packed or compressed values need it)."""
        if self.source is not None:
            self.array = materialize(self.source).reshape(-1).view(np.uint8)
            self.source = None

    def write_with(self, write: Callable[[memoryview, int], None] | None) -> None:
        """``write(piece, position)`` each piece of a chunked value, hashing it on the way
        (``write=None``: only hash). The checksums are known when it returns."""
        assert self.source is not None
        hasher = BlockHasher(_checksum.header_crc(self.key, self.dtype, self.shape))
        pos = 0
        for piece in self.source.byte_chunks():
            hasher.update(piece)
            if write is not None:
                write(piece, pos)
            pos += len(piece)
        if pos != self.nbytes:
            raise ValueError(f"Value {self.key!r} of {self.nbytes} bytes gave {pos} bytes.")
        self.checksum, blocks = hasher.result()
        self.blocks = blocks if self.nbytes > BLOCK_SIZE else None
        self.hashed = True


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Whether an HDF5 save hashes each large value a piece at a time just before writing it,
#: on the writing thread (:func:`write_hashing`), rather than on the checksum thread
#: beside the writes: on one CPU only. Hashed from the cache it costs less CPU, but
#: beside the writes the hash overlaps them wherever a second CPU is free: on a quiet
#: 2-CPU machine a 1 GiB non-durable save took 266-267 ms (minima) with the checksum
#: thread against 304-305 ms hashing while writing (docs/benchmarks.md, "Goal 3").
HASH_WHILE_WRITING = _cpus() < 2
#: ... in pieces of this many bytes (whole blocks).
_HOT_PIECE = 1 << 20


def hash_while_writing() -> bool:
    """:data:`HASH_WHILE_WRITING` (read when a save starts)."""
    return HASH_WHILE_WRITING


def write_hashing(it: ValueWrite, fd: int, base: int, *, durable: bool = False) -> None:
    """Write a host value's bytes at ``base`` in ``fd``, each 1 MiB piece hashed by blocks
    just before it is written, and set its checksums: one pass over memory (the kernel
    copies the piece from the cache the CRC just read it into). ``durable``: each piece's
    writeback starts once it is written.

    >>> import tempfile
    >>> a = np.arange(300_000, dtype=np.float32)
    >>> it = ValueWrite("w", a, "float32", a.shape, {}, a.nbytes)
    >>> fd, name = tempfile.mkstemp()
    >>> write_hashing(it, fd, 16)
    >>> os.pread(fd, a.nbytes, 16) == a.tobytes()
    True
    >>> os.close(fd); os.unlink(name)
    >>> whole, blocks = it.checksum, it.blocks
    >>> it.hash()
    >>> (it.checksum, it.blocks) == (whole, blocks) and len(blocks) == 4 * 19
    True
    """
    n, bs = it.nbytes, BLOCK_SIZE
    view = it.view
    crc: Callable[..., int] = _crc32c.crc32c
    crcs: list[int] = []
    for pos in range(0, n, _HOT_PIECE):
        piece = view[pos : pos + _HOT_PIECE]
        crcs += [crc(piece[k : k + bs], 0, 1) for k in range(0, len(piece), bs)]
        _rawio.pwrite_all(fd, piece, base + pos)
        if durable:
            _rawio.start_writeback(fd, base + pos, len(piece))
    seed = _checksum.header_crc(it.key, it.dtype, it.shape)
    it.checksum = join_blocks(seed, crcs, n)
    it.blocks = np.array(crcs, "<u4").tobytes() if n > bs else None
    it.hashed = True


@dataclass(slots=True)
class WritePlan:
    """What a backend lays out: values stored as their own arrays, and packed ones."""

    arrays: list[ValueWrite]
    packed: list[ValueWrite]
    #: Size of the packed blob (each packed value padded to ``ALIGN``).
    packed_nbytes: int
    #: Blocks until every large value's checksum is known (they hash meanwhile).
    wait_hashes: Callable[[], None] = field(default=lambda: None)


#: Dtypes already in the host's byte order and their names (the common case of ``_prepare``).
_NAMES: dict[np.dtype, str] = {
    dt: name for name, dt in SUPPORTED_DTYPES.items() if dt.byteorder in ("=", "|")
}
_HOST_IS_LITTLE_ENDIAN = bool(np.little_endian)


def _prepare(array: Any) -> tuple[np.ndarray, str]:
    """The value's little-endian C-order byte image and its dtype name."""
    if type(array) is np.ndarray and array.flags.c_contiguous and _HOST_IS_LITTLE_ENDIAN:
        name = _NAMES.get(array.dtype)
        if name is not None:
            return array, name
    arr = np.asarray(array)
    dt = as_dtype(arr.dtype)  # raises TypeError for unsupported dtypes
    name = dtype_to_str(dt)
    order = arr.dtype.byteorder
    if order == ">" or (order == "=" and not _HOST_IS_LITTLE_ENDIAN):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr, name


def _check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"Checkpoint keys are strings, got {type(key).__name__} {key!r}.")
    text = str(key)  # the same object for a str; a plain str for a subclass
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"Key {text!r} is not valid Unicode text.") from None
    return text


class ContainerWriter(Writer):
    """Collects values; the backend's :meth:`_write` lays them out in a temporary path."""

    container: str = ""
    #: True when the container is a directory (Zarr), False for one file (HDF5).
    is_directory: bool = False

    @classmethod
    def replaceable(cls, path: Path) -> bool:
        """True when the directory at ``path`` is a checkpoint this writer may replace."""
        return False

    @property
    def streams_chunks(self) -> bool:
        """Whether :meth:`_write` takes chunked values a piece at a time (else they are
        made whole on the host first)."""
        return True

    def __init__(
        self,
        path: Path,
        *,
        durable: bool = True,
        pack_threshold: int | None = None,
        base: Path | None = None,
        known: Mapping[str, bool] | None = None,
        rows: Mapping[str, np.ndarray] | None = None,
        base_reader: Callable[[], Any] | None = None,
        limits: DeltaLimits | None = None,
        names: tuple[str, str] | None = None,
    ) -> None:
        """``base``: a committed checkpoint of this container whose bytes the new one may
        refer to instead of writing them again (an incremental save; ``known``: key -> True
        when unchanged since ``base`` was written, False when changed; others are compared
        by their block checksums; ``rows``: key -> the sorted rows (first-axis indices)
        written since ``base``, of changed values whose writes were tracked: such a value
        may be stored as a row delta, docs/FORMAT.md "Row deltas"; ``base_reader()``: a
        reader of the base where ``base`` is a local stand-in of a step on an object
        store, holding only its record; ``limits``: the row delta rule's, default
        :class:`.delta.DeltaLimits`; ``names``: how the log names this checkpoint and its
        base, default their paths: a step on an object store is written through a local
        staging copy, and its log names the step's and the base's URLs)."""
        self.path = Path(path)
        self.base = None if base is None else Path(base)
        self._names = names
        self.known: Mapping[str, bool] = known or {}
        self.rows: Mapping[str, np.ndarray] = rows or {}
        self._base_reader = base_reader
        self.limits = limits or DeltaLimits()
        #: The keys stored as row deltas (set by ``commit``).
        self.deltas: list[str] = []
        #: The keys whose bytes the base holds (set by ``commit``).
        self.reused: list[str] = []
        #: The rows each patch of each row delta holds, as written (set by ``commit``; a
        #: delta whose earlier patches' rows this process does not know is left out): the
        #: backend keeps them with the committed record, so the step that merges them
        #: reads none back. At most one int64 per patched row (the rule's share bounds
        #: them), shared with the base's where carried over.
        self.patch_rows: dict[str, tuple[np.ndarray, ...]] = {}
        #: The base's :attr:`patch_rows`, where the backend found them kept with its record.
        self.base_patch_rows: PatchRows = {}
        #: The format version the root record is written as (set with the record:
        #: ``record_version``; the containers' headers and root attributes say it too).
        self.record_version: tuple[int, int] = FORMAT_VERSION
        self.durable = bool(durable)
        if pack_threshold is not None:
            if isinstance(pack_threshold, bool) or not isinstance(pack_threshold, int | np.integer):
                raise TypeError(
                    f"pack_threshold is a number of bytes (or None), got {pack_threshold!r}."
                )
            if int(pack_threshold) < 0:
                raise ValueError(f"pack_threshold must be >= 0, got {pack_threshold!r}.")
            pack_threshold = int(pack_threshold)
        #: Values under this many bytes are packed; None: the default rule (``pack_limit``).
        self.pack_threshold = pack_threshold
        self._items: dict[str, ValueWrite] = {}
        self._metadata: dict[str, Any] = {}
        self._state = "open"

    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        if self._state != "open":
            self._check_open()
        key = _check_key(key)
        if key in self._items:
            raise ValueError(f"Key {key!r} was already added to the checkpoint {str(self.path)!r}.")
        if type(array) is np.ndarray:
            if (not (array.flags.c_contiguous and _HOST_IS_LITTLE_ENDIAN
                     and array.dtype in _NAMES)
                    and array.ndim and array.nbytes > piece_bytes()):
                # strided or big-endian: a slab at a time, no full C-ordered copy
                self._add_chunked(key, HostPieces(array), attrs)
                return
        elif is_chunked(array):
            chunked: Any = array  # a Chunked value given where a host array is declared
            self._add_chunked(key, chunked, attrs)
            return
        try:
            arr, name = _prepare(array)
        except DTypeLockError:
            raise
        except TypeError as exc:  # an object or string array: no dtype a checkpoint holds
            raise DTypeLockError(f"Cannot store {key!r}: {exc}") from None
        self._items[key] = ValueWrite(key, arr, name, arr.shape, dict(attrs) if attrs else {},
                                     arr.nbytes)

    def _add_chunked(self, key: str, value: Chunked, attrs: Mapping[str, Any] | None) -> None:
        dt = as_dtype(np.dtype(value.dtype))
        self._items[key] = ValueWrite(key, _NO_BYTES, dtype_to_str(dt), tuple(value.shape),
                                     dict(attrs) if attrs else {}, int(value.nbytes),
                                     source=value)

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self._check_open()
        self._metadata = dict(metadata)

    def abort(self) -> None:
        self._items.clear()
        self._state = "aborted"

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"The writer for {str(self.path)!r} is already {self._state}.")

    def _plan(self) -> WritePlan:
        """Own arrays (with their container paths) and packed values (with their offsets)."""
        items = list(self._items.values())
        threshold = pack_limit(self.pack_threshold, len(items))
        arrays = [it for it in items if it.nbytes >= threshold]
        packed = [it for it in items if it.nbytes < threshold]
        for it in packed:  # small: copied whole from their device, one at a time
            it.materialize()
        for it, p in zip(arrays, container_paths([it.key for it in arrays]), strict=True):
            it.path = p
        pos = 0
        for it in packed:
            it.packed = True
            it.offset = pos
            pos += (it.nbytes + ALIGN - 1) & -ALIGN
        return WritePlan(arrays, packed, pos)

    def commit(self) -> Path:
        self._check_open()
        self._state = "committing"
        try:
            plan = self._plan()
            try:
                check_plain(self._metadata, "the checkpoint metadata")
            except ValueError as exc:
                raise TypeError(f"Cannot store metadata in {str(self.path)!r}: {exc}.") from None
            # Refuse early what publish() would refuse: nothing is written in vain.
            check_destination(self.path, directory=self.is_directory,
                              replaceable=self.replaceable)
            if not self.streams_chunks:  # e.g. a compressing codec takes whole values
                for it in plan.arrays:
                    it.materialize()
            if self.base is not None:
                self._match_base(plan, self.base)
            # Values the backend writes hashed (write_hashing: each piece hashed just
            # before it is written, on one CPU) and chunked ones
            # (ValueWrite.write_with) hash as they are written, packed ones on this thread
            # just before (write_packed); any other large value on the checksum thread
            # while the backend writes (in order).
            futures: list[Future[Any]] = [_rawio.submit(it.hash) for it in plan.arrays
                                          if it.held is None and not it.hashed
                                          and it.source is None
                                          and not self._writes_hashed(it)]

            def wait_hashes() -> None:
                for f in futures:
                    f.result()

            plan.wait_hashes = wait_hashes
            with temporary_sibling(self.path) as tmp:
                try:
                    self._write(tmp, plan)
                finally:
                    for f in futures:  # never leave hashing running on a dropped buffer
                        f.exception()
                publish(tmp, self.path, durable=self.durable, replaceable=self.replaceable)
        except BaseException:
            self._state = "failed"
            raise
        finally:
            self._items.clear()
        self._state = "committed"
        return self.path

    def _match_base(self, plan: WritePlan, base: Path) -> None:
        """Mark the values whose bytes ``base`` holds (``held``); a base that cannot be
        read is logged and everything is written."""
        try:
            found = self._open_base(base)
        except (OSError, ValueError) as exc:  # CkptError subclasses ValueError or OSError
            logger.warning("Incremental save of %s: cannot read the base %s (%s); writing "
                           "every value.", *self._shown(base), exc)
            return
        if found is None:
            return
        record, holder = found
        match(plan.arrays, record, self.known, holder)
        self.reused = [it.key for it in plan.arrays if it.held is not None]
        if self.rows or record.deltas:
            self._match_rows(plan.arrays, record, holder)

    def _match_rows(self, arrays: list[ValueWrite], record: Any,
                    holder: Callable[[str, Any], Held]) -> None:
        """Make the changed values whose changed rows are known row deltas where the rule
        (:func:`.delta.plan`) says so; their patches are built here. A value the base
        stores as a delta and that is unchanged (known, or by its checksums) carries the
        base's delta over, with no patch of its own."""
        for it in arrays:
            if it.held is not None or it.source is not None:
                continue
            entry = record.values.get(it.key)
            if (entry is None or entry.loc.kind != "array" or entry.dtype != it.dtype
                    or tuple(entry.shape) != tuple(it.shape)):
                continue
            was = record.deltas.get(it.key)
            rows = self._delta_rows(it, entry, was)
            if rows is None:
                continue
            found = self._delta_for(it, entry, was, holder)
            if found is None:
                continue
            got = self._patch_rows(it, rows, was, found)
            if got is None:
                continue  # too many rows since the whole copy: written whole
            rows, before = got
            found.rows = rows
            found.base_checksum, found.base_blocks = _base_checksums(entry, was,
                                                                     record.block_size)
            if found.base_checksum is None:
                continue  # an older delta's base of unknown checksum: written whole
            found.by_parts = True
            if rows.size:  # gathered as it is written (``DeltaWrite.write_patch``)
                found.take(it.view, it.nbytes // it.shape[0],
                           _checksum.header_crc(it.key, it.dtype, it.shape))
            # verified by its parts: the base's checksum stands for the value's, and no
            # byte of the value is hashed (a step costs its rows, not the table)
            it.checksum, it.blocks, it.hashed = found.base_checksum, None, True
            it.delta = found
            if before is not None:
                self.patch_rows[it.key] = (*before, rows) if rows.size else before
        self.deltas = [it.key for it in arrays if it.delta is not None]

    def _delta_rows(self, it: ValueWrite, entry: Any, was: Any) -> np.ndarray | None:
        """The rows of ``it``'s own patch if it is to be a delta (empty: the base's delta
        ``was`` carried over unchanged), else None."""
        rows = self.rows.get(it.key)
        if rows is None and was is not None:
            state = self.known.get(it.key)
            if state is False:
                return None
            if state is None:  # not known unchanged: a delta by its parts has no
                if was.by_parts:  # checksum of its whole value to compare with
                    return None
                if not it.hashed:
                    it.hash()
                    it.hashed = True
                if it.checksum != entry.checksum or it.blocks != entry.blocks:
                    return None
            return _NO_ROWS  # unchanged: the base's delta as it is
        if rows is None or plan(rows, it.shape, it.nbytes,
                                () if was is None else was.patches, self.limits) is None:
            return None
        return rows

    def _patch_rows(self, it: ValueWrite, rows: np.ndarray, was: Any, found: DeltaWrite
                    ) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None] | None:
        """The rows of ``it``'s own patch and those of the patches before it in ``found``
        (None: not known); ``found`` made a merge of the base's patches where the rule
        says so. None: a merge of too many rows (the value is written whole)."""
        before: tuple[np.ndarray, ...] | None = ()
        if was is not None and rows.size and plan(
                rows, it.shape, it.nbytes, was.patches, self.limits) == "merge":
            rows_since = merged(rows, self._base_rows(it.key, was), it.shape[0], self.limits)
            if rows_since is None:
                return None
            rows = rows_since  # one patch of them, on the whole copy alone
            found.earlier, found.links = [], found.links[:1]
            found.path = found.path.rpartition("/")[0] + "/patch-0"
        elif was is not None:
            before = self._known_rows(it.key, was)
        if rows.size:  # owned and read-only: kept past this step
            rows = np.array(rows, np.int64)
            rows.flags.writeable = False
        return rows, before

    def _known_rows(self, key: str, was: Any) -> tuple[np.ndarray, ...] | None:
        """The rows of each of the base's patches of ``key`` (its delta ``was``), as the
        process that wrote them kept them with the base's record; None: not known (the
        base was written by another process or writer, or before a restart), or not
        those of ``was`` (their count or sizes differ: never taken on a guess)."""
        rows = self.base_patch_rows.get(key)
        if rows is None or len(rows) != len(was.patches) or any(
                r.size != p[3] for r, p in zip(rows, was.patches, strict=True)):
            return None
        return rows

    def _base_rows(self, key: str, was: Any) -> np.ndarray | None:
        """The rows the base's patches of ``key`` hold (its delta ``was``; with repeats
        when known as written, :meth:`_known_rows`; else read and verified), or None
        when they cannot be read (the value is then written whole)."""
        known = self._known_rows(key, was)
        if known is not None:
            return np.concatenate(known) if known else _NO_ROWS
        assert self.base is not None
        try:
            reader = (self._open_base_reader(self.base) if self._base_reader is None
                      else self._base_reader())
            try:
                rows: np.ndarray = reader.delta_rows(key)
                return rows
            finally:
                reader.close()
        except (OSError, ValueError) as exc:  # CkptError subclasses ValueError or OSError
            shown, base_shown = self._shown(self.base)
            logger.warning("Incremental save of %s: cannot read the row patches of %r in "
                           "%s (%s); writing it whole.", shown, key, base_shown, exc)
            return None

    def _shown(self, base: Path) -> tuple[str, str]:
        """How the log names this checkpoint and its ``base`` (``names``, else the paths)."""
        return self._names or (str(self.path), str(base))

    def _open_base_reader(self, base: Path) -> Any:
        """This container's reader of ``base`` (its ``delta_rows``); only a backend that
        writes row deltas (:meth:`_delta_for`) is asked."""
        raise NotImplementedError

    def _delta_for(self, it: ValueWrite, entry: Any, was: Any,
                   holder: Callable[[str, Any], Held]) -> DeltaWrite | None:
        """What a delta of ``it`` refers to, as this checkpoint names it (``was``: the
        base's own delta of it, if any; ``holder``: where the base's whole bytes are);
        None: this backend stores no delta of it."""
        return None

    def _writes_hashed(self, it: ValueWrite) -> bool:
        """Whether :meth:`_write` writes ``it`` through :func:`write_hashing` (which hashes
        it), so the checksum thread need not."""
        return False

    def _open_base(self, base: Path) -> tuple[Any, Callable[[str, Any], Held]] | None:
        """The base's record and where each of its values' bytes are; None: not supported."""
        return None

    def _encode_record(self, packed_loc: tuple[str, int, int] | None) -> bytes:
        """The root record of everything added (call after the checksums are known)."""
        items = list(self._items.values())
        array_loc = self._array_loc
        packed_at = functools.partial(tuple.__new__, Extent)  # no Python call per value
        locs = [packed_at((PACKED, None, it.offset, it.nbytes)) if it.packed else array_loc(it)
                for it in items]
        cols = ValueColumns(
            [it.key for it in items],
            [it.dtype for it in items],
            [it.shape for it in items],
            [it.checksum for it in items],
            locs,
            [it.attrs for it in items],
            [None if loc.kind == ZARR else it.blocks for it, loc in zip(items, locs, strict=True)],
        )
        packed = packed_loc if any(it.packed for it in items) else None
        deltas = {it.key: it.delta.record() for it in items if it.delta is not None}
        external, pieces = self._external(items), self._pieces(items)
        self.record_version = record_version(external, pieces, deltas)
        return encode_columns(self.container, packed, cols, self._metadata,
                              external=external, pieces=pieces, deltas=deltas or None)

    def _external(self, items: list[ValueWrite]) -> dict[str, tuple[str, str]] | None:
        """The record's ``external`` map (values another file holds); None: none."""
        return None

    def _pieces(self, items: list[ValueWrite]) -> dict[str, int] | None:
        """The record's ``pieces`` map (values stored as several chunks); None: none."""
        return None

    def _array_loc(self, it: ValueWrite) -> Extent:
        if it.delta is not None:
            return Extent.array(it.path, 0, it.nbytes)
        return Extent.array(it.path, it.offset, it.nbytes)

    @abc.abstractmethod
    def _write(self, tmp: Path, plan: WritePlan) -> None:
        """Write everything into ``tmp`` (fsynced when durable); the caller publishes it."""


def _base_checksums(entry: Any, was: Any, block_size: int) -> tuple[int | None, bytes | None]:
    """The checksum and block checksums of a delta's base, for its record entry (a reader
    verifies the base's bytes by them): the base step's own (``entry``), or those its
    delta ``was`` carries; block checksums of other blocks than this record's are left
    out (a base of 256 KiB blocks, before 2026-11-27)."""
    if was is not None:
        return was.base_checksum, was.base_blocks
    return entry.checksum, entry.blocks if block_size == BLOCK_SIZE else None


def write_packed(fd: int, packed: list[ValueWrite], base: int) -> None:
    """Hash the packed values and write them from ``base`` (each padded to ALIGN).

    Straight from the arrays' buffers, ``IOV_MAX`` buffers per ``pwritev``; each batch is
    hashed just before it is written, while its bytes are still in the CPU cache.
    """
    crc: Callable[[Any, int], int] = _crc32c.crc32c  # straight over each array's buffer
    limit = _rawio.IOV_MAX - 1
    bufs: list[Any] = []
    start = 0
    for it in packed:
        if not bufs:
            start = it.offset
        a = it.array
        n = it.nbytes
        if n > BLOCK_SIZE:
            it.hash()
        else:
            it.checksum = crc(a, _checksum.header_crc(it.key, it.dtype, it.shape))
        if n:
            bufs.append(a)
        pad = -n % ALIGN
        if pad:
            bufs.append(_ZEROS[:pad])
        if len(bufs) >= limit:
            _rawio.pwritev_all(fd, bufs, base + start)
            bufs = []
    if bufs:
        _rawio.pwritev_all(fd, bufs, base + start)


def scalar_attrs(it: ValueWrite) -> dict[str, Any]:
    """The per-array attributes stored on the container object itself."""
    out: dict[str, Any] = {}
    for k, v in it.attrs.items():
        if not isinstance(k, str) or v is None or not isinstance(v, bool | int | float | str):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < 1 << 63:
            continue
        out[k] = v
    out.update(
        key=it.key,
        dtype=it.dtype,
        shape=list(it.shape),
        checksum=it.checksum,
    )
    out.setdefault("name", it.key)
    return out


def delta_attrs(it: ValueWrite) -> dict[str, Any]:
    """The attributes of a delta value's group (HDF5) or group document (Zarr): the value's
    own, and how to put it together."""
    out = scalar_attrs(it)
    out["ckptvar_delta"] = (
        "This value is stored as a row delta (docs/FORMAT.md, 'Row deltas'): 'base' is "
        "its whole copy at an earlier step; apply each 'patch-N' in order: uint64 row "
        "indices, then those rows' bytes."
    )
    return out
