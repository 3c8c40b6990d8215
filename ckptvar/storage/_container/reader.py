"""Single reads of ckptvar's own containers: the reader base and its lazy arrays.

Owns: answering keys, infos and metadata from the decoded root record; reading
one whole value with ``preadv`` straight into its destination (large ones in
pieces on the I/O threads, :mod:`.transfer`); verifying one value or all of
them; and lazy slices that read only the byte run an index covers
(:mod:`.._slicing`). Reading many values at once lives in :mod:`.bulk`. A
backend says where each value's bytes are (:meth:`ContainerReader._open_array`,
:meth:`ContainerReader.packed_source`). The reader is the :class:`.access.ValueAccess`
the read engines receive.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import mmap
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..._dtypes import SUPPORTED_DTYPES
from ...errors import CorruptCheckpointError, MissingKeyError
from .. import base
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import ARRAY, PACKED, Entry, Record, RowValues, ValueRows
from .._record_index import IndexedValues
from ..base import ArrayInfo, LazyArray, Reader, verify_each
from ..slicing import element_span, leading_rows
from . import access, bulk, delta
from . import source as _src
from .blocks import SpanError, blocks_agree, hash_range, read_span, stream_units
from .layout import Source
from .source import RemoteFile
from .transfer import Transfer, TransferValue

__all__ = ["ContainerLazyArray", "ContainerReader"]

#: Values up to this size without block checksums are read whole when only sliced.
_SLICE_WHOLE_BELOW = 1 << 20


class ContainerReader(
    Reader,
    base.SupportsShapeAndDtype,
    base.SupportsReadIntoMany,
    base.SupportsStageIntoMany,
    base.SupportsRuns,
    base.SupportsVerifyMany,
    base.SupportsVerifyAll,
    base.SupportsDeltas,
):
    """A reader over a decoded record; backends say where each value's bytes are."""

    def __init__(self, path: Path | str, record: Record) -> None:
        # A URL stays a str: Path would turn "s3://" into "s3:/".
        self.path: Any = path if isinstance(path, str) and "://" in path else Path(path)
        #: Whether the bytes are in an object store (read by streamed ranged GETs).
        self.remote = isinstance(path, str) and "://" in path
        self._record = record
        self._values = record.values
        self._closed = False
        self._infos: dict[str, ArrayInfo] = {}
        #: a row delta's base checksum, its block checksums checked (:meth:`base_expect`)
        self._expects: dict[str, int | None] = {}

    # -- backend hooks
    @abc.abstractmethod
    def _open_array(self, key: str, entry: Entry) -> Source:
        """Where the bytes of a value stored as its own array are."""

    @abc.abstractmethod
    def packed_source(self) -> tuple[int | RemoteFile, int]:
        """``(fd, byte_offset_of_blob_start)``: a descriptor or a remote byte source."""

    def _read_other(self, key: str, entry: Entry) -> np.ndarray:
        raise self.corrupt(key, f"has an unknown location {entry.loc!r}")

    def _read_other_rows(self, key: str, entry: Entry, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of a value :meth:`_read_other` reads, verified (a backend
        that can decodes only a part at a time)."""
        return self._read_other(key, entry)[lo:hi]

    def source(self, key: str, entry: Entry) -> Source:
        """Where an ``array`` or ``packed`` value's bytes are."""
        if entry.loc.kind == PACKED:
            fd, base = self.packed_source()
            return Source(fd, base + entry.loc.offset, False)
        return self._open_array(key, entry)

    def _mmap_region(self, key: str, entry: Entry) -> tuple[Any, int, bool]:
        """A buffer (mmap) holding the value's bytes, its start, and whether to close it."""
        if entry.loc.kind == PACKED:
            fd, base = self.packed_source()
            return _src.map_all(fd), base + entry.loc.offset, True
        src = self._open_array(key, entry)
        try:
            return _src.map_all(src.fd), src.offset, True
        finally:
            if src.owned:
                _src.close(src.fd)

    # -- Mapping
    def keys(self) -> Any:
        keys = self._values.keys()
        if isinstance(self._values, IndexedValues):  # listing decodes every value:
            full = self._values.decoded()  # look them up in that mapping from now on
            if full is not None:
                self._values = full
        return keys

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def entry(self, key: str) -> Entry:
        """The record's entry of ``key``; ``MissingKeyError`` naming close keys if none."""
        try:
            return self._values[key]
        except (KeyError, TypeError):
            pass
        hint = ""
        if isinstance(key, str) and len(self._values) < 100_000:
            close = difflib.get_close_matches(key, list(self._values), n=3)
            if close:
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?"
        raise MissingKeyError(
            f"Checkpoint {str(self.path)!r} has no value {key!r} "
            f"({len(self._values)} values stored).{hint}"
        )

    def info(self, key: str) -> ArrayInfo:
        info = self._infos.get(key)
        if info is None:
            e = self.entry(key)
            d = self._record.deltas.get(key) if self._record.deltas else None
            if d is not None and d.by_parts:  # its record's checksum is its base's
                info = ArrayInfo(key, e.np_dtype, e.shape, e.attrs, None, piecewise=True)
            else:
                info = _make_info(key, e.np_dtype, e.shape, e.attrs, e.checksum)
            self._infos[key] = info
        return info

    def __getitem__(self, key: str) -> LazyArray:
        return ContainerLazyArray(self, key, self.info(key))

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """The stored value's shape and dtype, straight from the record."""
        e = self.entry(key)
        return e.shape, SUPPORTED_DTYPES[e.dtype]

    def shapes_and_dtypes(self, keys: list[str]) -> tuple[list[tuple[int, ...]], list[np.dtype]]:
        """``([shape, ...], [dtype, ...])`` of the keys, in one pass each."""
        rows = self.value_rows(keys)
        return rows.shapes, list(map(SUPPORTED_DTYPES.__getitem__, rows.dtypes))

    def value_rows(self, keys: list[str]) -> ValueRows:
        """The record's columns of ``keys``, in their order (read-only lists; no
        :class:`Entry` made from a decoded record); ``MissingKeyError`` for an unknown key."""
        values = self._values
        if isinstance(values, RowValues):
            try:
                return values.rows(keys)
            except (KeyError, TypeError):
                pass  # entry_list names the key
        return ValueRows.of_entries(self.entry_list(keys))

    def entry_list(self, keys: list[str]) -> list[Entry]:
        """:meth:`entry` of each key, in one pass (no Python call per key from a decoded
        record); ``MissingKeyError`` for the first unknown key."""
        values = self._values
        try:
            if isinstance(values, RowValues):  # entries made in bulk when many are asked for
                return values.entry_list(keys)
            return list(map(values.__getitem__, keys))
        except (KeyError, TypeError):
            return [self.entry(key) for key in keys]

    def metadata(self) -> dict[str, Any]:
        return self._record.metadata

    def deltas(self) -> dict[str, dict[str, Any]]:
        """The values stored as row deltas (format 1.5): key -> ``{"base", "patches",
        "rows"}`` (:class:`.base.SupportsDeltas`)."""
        return {k: {"base": d.since, "patches": len(d.patches),
                    "rows": sum(p[3] for p in d.patches)}
                for k, d in self._record.deltas.items()}

    def delta_rows(self, key: str) -> np.ndarray:
        """The rows a row delta's patches hold, read and verified (sorted, unique); none
        for a value that is not a delta."""
        e = self.entry(key)
        if key not in self._record.deltas:
            return np.empty(0, np.int64)
        src = self._open_array(key, e)
        try:
            patched = src.fd
            assert isinstance(patched, _src.Patched)
            return patched.rows
        finally:
            if src.owned:
                _src.close(src.fd)

    @property
    def format_version(self) -> tuple[int, int]:
        return self._record.format_version

    @property
    def record(self) -> Record:
        """The decoded root record (treat it as read-only)."""
        return self._record

    def close(self) -> None:
        self._closed = True

    def check_open(self) -> None:
        """Raise ``ValueError`` if the reader is closed."""
        if self._closed:
            raise ValueError(f"The reader of {str(self.path)!r} is closed.")

    def corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        """The error saying value ``key`` ``what``."""
        return access.corrupt(self.path, key, what)

    def base_expect(self, key: str, e: Entry) -> int | None:
        """The checksum a row delta's base bytes must have (:func:`.delta.base_checksum`,
        checked once per reader), or None: the value is then verified by its assembled
        bytes."""
        if key in self._expects:
            return self._expects[key]
        try:
            got = delta.base_checksum(self._record.deltas[key],
                                      _checksum.header_crc(key, e.dtype, e.shape), e.nbytes,
                                      self._record.block_size)
        except ValueError as exc:
            raise self.corrupt(key, str(exc)) from None
        self._expects[key] = got
        return got

    def _by_parts(self, key: str, e: Entry, fd: Any) -> tuple[_src.Patched, Entry] | None:
        """For a row delta verified by its parts (its record has the base's checksums):
        its patched source, its patches read and checked, and an entry of the base's
        bytes alone (the base's checksum and block checksums); else None (the value's
        own checksums verify what is read)."""
        if not isinstance(fd, _src.Patched) or fd.expect is None:
            return None
        fd.check()  # every patch passes its checksum before any byte is handed out
        d = self._record.deltas[key]
        return fd, dataclasses.replace(e, checksum=fd.expect, blocks=d.base_blocks)

    def _compare(self, key: str, e: Entry, computed: int) -> None:
        access.compare(self, key, e, computed)

    # -- whole-value reads
    def _read_whole(self, key: str, e: Entry, out: np.ndarray | None, verify: bool) -> np.ndarray:
        """Read a value below ``PARALLEL_FROM`` (or stored elsewhere) on this thread."""
        if e.loc.kind not in (ARRAY, PACKED):
            arr = self._read_other(key, e)
            if out is not None:
                dest = access.destination(key, e, out)
                dest[...] = arr
                arr = dest
            return arr
        n = e.loc.nbytes
        # Open the source first: opening checks the stored size against the record, so a
        # forged record declaring a huge value is refused before anything is allocated.
        src = self.source(key, e)
        try:
            arr = access.destination(key, e, out)
            dst = _rawio.byte_view(arr)
            got = _src.pread_into(src.fd, dst, src.offset) if n else 0
        finally:
            if src.owned:
                _src.close(src.fd)
        if got != n:
            raise self.corrupt(key, f"is truncated: {got} of {n} bytes present")
        if verify:
            self._compare(key, e, _checksum.crc(dst, _checksum.header_crc(key, e.dtype, e.shape)))
        return arr

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        self.check_open()
        e = self.entry(key)
        if not access.parallel(e):
            return self._read_whole(key, e, out, verify)
        # opened first (the size check precedes the allocation), then read through
        src = self.source(key, e)
        try:
            arr = access.destination(key, e, out, src)
            value = TransferValue(key, e, arr, src, padded=out is None and arr.base is not None)
        except BaseException:
            if src.owned:
                _src.close(src.fd)
            raise
        Transfer(self, [value], verify).finish()
        return arr

    # -- many values at once (bulk.py)
    def read_many(
        self, keys: Iterable[str], *, verify: bool = True
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Read values in order into fresh arrays, reading ahead on the I/O threads
        (:func:`.bulk.read_many`)."""
        return bulk.read_many(self, keys, verify)

    def verify_many(self, keys: Iterable[str]) -> None:
        """Raise ``CorruptCheckpointError`` for the first damaged value among ``keys``
        (:func:`.bulk.verify_many`)."""
        self.check_open()
        bulk.verify_many(self, keys)

    def read_into_many(self, pairs: list[tuple[str, np.ndarray]], *, verify: bool = True) -> None:
        """Read each ``(key, out)`` value into ``out`` (same shape and dtype, C-contiguous)
        (:func:`.bulk.read_into_many`)."""
        self.check_open()
        bulk.read_into_many(self, pairs, verify)

    def stage_into_many(
        self, pairs: list[tuple[str, np.ndarray]], *, checked: bool = False
    ) -> Callable[[], None]:
        """Read and verify every ``(key, out)`` value now; the function returned copies
        them into the buffers (:func:`.bulk.stage_into_many`)."""
        self.check_open()
        return bulk.stage_into_many(self, pairs, checked=checked)

    # -- partial reads
    def read_run_into(
        self, key: str, start: int, out: np.ndarray, *, verify: bool = True
    ) -> None:
        """Fill the flat ``out`` with elements ``[start, start + out.size)`` of ``key``."""
        e = self.entry(key)
        count = out.size
        if (out.dtype != e.np_dtype or out.ndim != 1 or not out.flags.c_contiguous
                or not out.flags.writeable or not 0 <= start <= start + count <= e.size):
            raise ValueError(
                f"read_run_into({key!r}): out must be a writeable flat C-contiguous "
                f"{e.np_dtype} array inside the value's {e.size} elements, not {out.dtype} "
                f"{out.shape} from element {start}."
            )
        if e.loc.kind not in (ARRAY, PACKED) or (
                e.blocks is None and e.nbytes <= _SLICE_WHOLE_BELOW):
            out[...] = self.read(key, verify=verify).reshape(-1)[start:start + count]
            return
        self._read_elements(key, e, start, count, verify=verify, out=out)

    def verify_run(self, key: str, start: int, count: int) -> None:
        """Raise ``CorruptCheckpointError`` unless elements ``[start, start + count)`` of
        ``key`` verify: the blocks that hold them (without block checksums: the value)."""
        e = self.entry(key)
        if e.blocks is None or e.loc.kind not in (ARRAY, PACKED) or count <= 0:
            self.verify(key)
            return
        item, size = e.np_dtype.itemsize, self._record.block_size
        crcs = np.frombuffer(e.blocks, "<u4")
        src = self.source(key, e)
        try:
            if isinstance(src.fd, RemoteFile):  # one request over the blocks, not one each
                self._verify_blocks_remote(key, e, src, start * item, (start + count) * item)
                return
            for k in range(start * item // size, ((start + count) * item - 1) // size + 1):
                lo, hi = k * size, min((k + 1) * size, e.nbytes)
                got, value = hash_range(src.fd, src.offset + lo, hi - lo)
                if got != hi - lo:
                    raise self.corrupt(key, f"is truncated: bytes {lo}..{hi} of {e.nbytes} "
                                             "are not present")
                if value != int(crcs[k]):
                    raise self.corrupt(key, f"fails the checksum of its block {k} (bytes "
                                             f"{lo}..{hi}); the checkpoint is damaged")
        finally:
            if src.owned:
                _src.close(src.fd)

    def _verify_blocks_remote(self, key: str, e: Entry, src: Source, lo: int, hi: int) -> None:
        """Verify the blocks holding bytes ``[lo, hi)`` of a value in an object store,
        streamed by one request and hashed as they arrive."""
        size = self._record.block_size
        crcs = np.frombuffer(e.blocks or b"", "<u4")
        units = [(k * size, min((k + 1) * size, e.nbytes), 0, int(crcs[k]))
                 for k in range(lo // size, (hi - 1) // size + 1)]
        assert isinstance(src.fd, RemoteFile)
        try:
            values = stream_units(src.fd, src.offset, units, memoryview(b""), units[0][0])
        except SpanError as exc:
            raise self.corrupt(key, exc.what) from None
        for (a, b, _, want), value in zip(units, values, strict=True):
            if value != want:
                raise self.corrupt(key, f"fails the checksum of its block {a // size} (bytes "
                                         f"{a}..{b}); the checkpoint is damaged")

    def _read_elements(self, key: str, e: Entry, start: int, count: int, *,
                       verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, start + count)`` of the flat value, read straight into the
        result (``out`` when given); verified by the blocks that hold them (format 1.2),
        or for a value without block checksums by hashing the whole value
        (:func:`.blocks.read_span`)."""
        self.check_open()
        if count == 0:
            return np.empty(0, e.np_dtype) if out is None else out
        item = e.np_dtype.itemsize
        src = self.source(key, e)  # opening checks the stored size before allocating
        try:
            if out is None:
                out = np.empty(count, e.np_dtype)
            dst = _rawio.byte_view(out)
            patched = self._by_parts(key, e, src.fd) if verify else None
            if patched is None:
                read_span(src.fd, src.offset, e, dst, start * item,
                          verify=verify, block_size=self._record.block_size,
                          seed=lambda: _checksum.header_crc(key, e.dtype, e.shape))
            else:  # the base's bytes verified by its blocks, then the checked rows laid
                fd, base_entry = patched
                read_span(fd.base, fd.offset + src.offset, base_entry, dst, start * item,
                          verify=True, block_size=self._record.block_size,
                          seed=lambda: _checksum.header_crc(key, e.dtype, e.shape))
                fd.lay(out.reshape(-1).view(np.uint8), start * item)
        except SpanError as exc:
            raise self.corrupt(key, exc.what) from None
        finally:
            if src.owned:
                _src.close(src.fd)
        return out

    # -- verification
    def verify(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` if ``key`` is damaged (hashes through mmap, no copy)."""
        self.check_open()
        e = self.entry(key)
        kind = e.loc.kind
        if kind not in (ARRAY, PACKED):
            self.read(key, verify=True)
            return
        seed = _checksum.header_crc(key, e.dtype, e.shape)
        if e.blocks is not None and not blocks_agree(seed, e.blocks, e.nbytes,
                                                     self._record.block_size, e.checksum):
            raise self.corrupt(key, "has block checksums that do not join to its checksum; "
                                     "the checkpoint's record is damaged")
        if e.nbytes == 0:
            if kind == ARRAY:
                src = self._open_array(key, e)
                if src.owned:
                    _src.close(src.fd)
            self._compare(key, e, seed)
            return
        if kind == ARRAY:  # pread in pieces on the I/O threads (no map: no SIGBUS)
            Transfer(self, [TransferValue(key, e, None)], True).finish()
            return
        buf, start, close = self._mmap_region(key, e)
        try:
            with memoryview(buf) as mv:
                if start + e.nbytes > len(mv):
                    raise self.corrupt(key, "is truncated")
                with mv[start : start + e.nbytes] as region:
                    computed = _checksum.crc(region, seed)
            self._compare(key, e, computed)
        finally:
            if close and isinstance(buf, mmap.mmap):
                buf.close()

    def verify_all(self) -> list[tuple[str, str]]:
        """Check every value; ``[(key, reason), ...]`` for each damaged one (empty if none)."""
        return verify_each(self, self._values)


def _make_info(key: str, dtype: np.dtype, shape: tuple[int, ...], attrs: Any,
               checksum: int) -> ArrayInfo:
    """``ArrayInfo(key, dtype, shape, attrs, checksum)``, made without the frozen
    dataclass's per-field ``object.__setattr__`` (a restore makes one per value)."""
    if _FAST_INFO:
        info = object.__new__(ArrayInfo)
        info.__dict__.update(key=key, dtype=dtype, shape=shape, attrs=attrs, checksum=checksum)
        return info
    return ArrayInfo(key, dtype, shape, attrs, checksum)


_FAST_INFO = (
    not hasattr(ArrayInfo, "__slots__")
    and [f.name for f in dataclasses.fields(ArrayInfo)]
    == ["key", "dtype", "shape", "attrs", "checksum"]
    and getattr(ArrayInfo, "__post_init__", None) is None
)


class ContainerLazyArray(LazyArray):
    """A stored value; slicing reads only the run of elements the index covers."""

    def __init__(self, reader: ContainerReader, key: str, info: ArrayInfo) -> None:
        self._reader = reader
        self._key = key
        self.info = info

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        return self._reader.read(self._key, out=out, verify=verify)

    def __getitem__(self, index: Any) -> np.ndarray:
        e = self._reader.entry(self._key)
        whole: np.ndarray
        other = e.loc.kind not in (ARRAY, PACKED)
        if not other and e.blocks is None and e.nbytes <= _SLICE_WHOLE_BELOW:
            whole = self.read()[index]
            return whole
        span = element_span(index, e.shape, name=repr(self._key))
        if span is None:  # advanced indexing or 0-d: rows picked by an array, their run
            picked = leading_rows(index, e.shape)
            if picked is not None:
                return self[picked[0]:picked[1]][picked[2]]  # type: ignore[no-any-return]
        if span is None or span.count == e.size:  # advanced indexing, 0-d, or all of it
            whole = self.read()[index]
            return whole
        if other:  # stored by codecs (compressed): the rows that hold the run
            self._reader.check_open()
            row = e.size // e.shape[0]
            lo, hi = span.start // row, -(-(span.start + span.count) // row)
            rows = self._reader._read_other_rows(self._key, e, lo, hi).reshape(-1)
            first = span.start - lo * row
            block = rows[first:first + span.count]
        else:
            block = self._reader._read_elements(self._key, e, span.start, span.count)
        return block.reshape(span.shape)[span.index]  # type: ignore[no-any-return]
