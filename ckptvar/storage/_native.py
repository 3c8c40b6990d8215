"""The parts the two native backends (HDF5, Zarr v3) share: writer plan, reader, lazy arrays.

A :class:`NativeWriter` normalises each value to its little-endian C-order byte
image (a copy only for big-endian or non-contiguous input), decides which values
are packed into ``_ckptvar/packed`` and which get their own array, hashes on the
checksum thread while the backend writes, and publishes atomically. A
:class:`NativeReader` answers everything from the root record and reads bytes
with ``preadv`` straight into the destination. Large values are split into
pieces that the I/O threads read and hash at once (:class:`_Transfer`); the
pieces' CRCs are joined with :func:`_checksum.combine`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import functools
import mmap
import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np

from .._dtypes import SUPPORTED_DTYPES, as_dtype, dtype_to_str
from ..errors import CorruptCheckpointError, MissingKeyError
from . import _checksum, _rawio
from ._atomic import check_destination, publish, temporary_sibling
from ._paths import RESERVED_PREFIX, container_paths
from ._record import Entry, Record, check_plain, encode_columns
from .base import ArrayInfo, LazyArray, Reader, Writer

__all__ = ["ALIGN", "DEFAULT_PACK_THRESHOLD", "NativeReader", "NativeWriter", "WriteItem"]

#: Values smaller than this many bytes are packed together into ``_ckptvar/packed``.
DEFAULT_PACK_THRESHOLD = 64 << 10
#: Alignment of each packed value inside the packed blob.
ALIGN = 64
#: Values up to this size are read whole (and verified) even when only sliced.
_SLICE_WHOLE_BELOW = 1 << 20
_ZEROS = memoryview(bytes(ALIGN))

PACKED_PATH = f"{RESERVED_PREFIX}/packed"

#: Values at least this large are read on the I/O threads, in pieces of ``_SPLIT``.
_PARALLEL_FROM = 1 << 20
_SPLIT = 8 << 20
#: Each I/O task moves about this many bytes (small values are grouped).
_TASK = 8 << 20
#: ``read_many`` reads this many bytes ahead of what it has yielded.
_WINDOW = 256 << 20
#: ``read_into_many`` reads across gaps up to this size between packed values.
_MAX_GAP = 32 << 20
#: Scratch buffer each I/O thread hashes through when only verifying.
_SCRATCH = 256 << 10


class _Value:
    """One value moved by a :class:`_Transfer`: read into ``dest``, or only hashed."""

    __slots__ = ("crcs", "dest", "entry", "got", "key", "pieces", "view")

    def __init__(self, key: str, entry: Entry, dest: np.ndarray | None) -> None:
        self.key, self.entry, self.dest = key, entry, dest
        self.view = _rawio.byte_view(dest) if dest is not None else None
        n = entry.nbytes
        self.pieces = [(pos, min(_SPLIT, n - pos)) for pos in range(0, n, _SPLIT)]
        self.got = [0] * len(self.pieces)
        self.crcs = [0] * len(self.pieces)


_local = threading.local()
def _scratch() -> memoryview:
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = memoryview(bytearray(_SCRATCH))
    return buf


class _Transfer:
    """Whole values read into their buffers (or hashed) in pieces on the I/O threads.

    :meth:`finish` waits for every piece, then checks sizes and checksums in the
    values' order, so the first damaged value is the one reported.
    """

    def __init__(
        self, reader: NativeReader, values: list[_Value], verify: bool, *, ahead: bool = False
    ) -> None:
        self.reader, self.values, self.verify = reader, values, verify
        groups: list[list[tuple[_Value, int]]] = []
        group: list[tuple[_Value, int]] = []
        size = 0
        for v in values:
            for i, (_, n) in enumerate(v.pieces):
                group.append((v, i))
                size += n
                if size >= _TASK:
                    groups.append(group)
                    group, size = [], 0
        if group:
            groups.append(group)
        #: True when the pieces run in file order on one thread (the bytes are on disk).
        self.sequential = False
        if len(groups) > 1 and not self._cached():
            # From disk, one reader in file order is fastest: the kernel's readahead sees
            # one sequential stream (measured: 1 thread 0.36 s/GiB, 4 threads 0.55 s/GiB).
            groups = [[piece for g in groups for piece in g]]
            self.sequential = True
        tasks = [functools.partial(self._run, g) for g in groups]
        self.futures = _rawio.start_all(tasks, background=ahead)

    def _cached(self) -> bool:
        """Whether the values' bytes are in the page cache (probed at a few pages)."""
        values = self.values
        probe = [values[0], values[len(values) // 2], values[-1]]
        for v in dict.fromkeys(probe):
            try:
                fd, base, owned = self.reader._source(v.key, v.entry)
            except (OSError, CorruptCheckpointError):
                return False  # the read itself reports it
            try:
                last = v.entry.nbytes - 1
                if not (_rawio.cached(fd, base) and _rawio.cached(fd, base + last)):
                    return False
            finally:
                if owned:
                    os.close(fd)
        return True

    def _run(self, group: list[tuple[_Value, int]]) -> None:
        reader, verify = self.reader, self.verify
        src: tuple[int, int, bool] | None = None
        last: _Value | None = None
        try:
            for v, i in group:
                if v is not last:
                    if src is not None and src[2]:
                        os.close(src[0])
                    src, last = None, v
                    src = reader._source(v.key, v.entry)
                fd, base, _ = src  # type: ignore[misc]
                pos, n = v.pieces[i]
                if v.view is not None:
                    buf = v.view[pos : pos + n]
                    got = _rawio.pread_into(fd, buf, base + pos)
                    if verify and got == n:
                        v.crcs[i] = _checksum.crc(buf)
                    v.got[i] = got
                    continue
                value = done = 0
                scratch = _scratch()
                while done < n:
                    want = min(len(scratch), n - done)
                    got = _rawio.pread_into(fd, scratch[:want], base + pos + done)
                    value = _checksum.crc(scratch[:got], value)
                    done += got
                    if got < want:
                        break
                v.got[i], v.crcs[i] = done, value
        finally:
            if src is not None and src[2]:
                os.close(src[0])

    def finish(self) -> None:
        _rawio.wait_all(self.futures)
        reader = self.reader
        for v in self.values:
            e = v.entry
            got = sum(v.got)
            if got != e.nbytes:
                raise reader._corrupt(v.key, f"is truncated: {got} of {e.nbytes} bytes present")
            if self.verify or v.dest is None:
                value = _checksum.header_crc(v.key, e.dtype, e.shape)
                for (_, n), part in zip(v.pieces, v.crcs, strict=True):
                    value = _checksum.combine(value, part, n)
                reader._compare(v.key, e, value)

    def abandon(self) -> None:
        """Wait for the pieces still running; their errors no longer matter."""
        with contextlib.suppress(BaseException):
            _rawio.wait_all(self.futures)


@dataclass(slots=True)
class WriteItem:
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

    @property
    def view(self) -> memoryview:
        return _rawio.byte_view(self.array)

    def hash(self) -> None:
        self.checksum = _checksum.value_checksum(self.key, self.dtype, self.shape, self.view)


#: Native-byte-order dtypes and their names (the common case of ``_prepare``).
_NAMES: dict[np.dtype, str] = {
    dt: name for name, dt in SUPPORTED_DTYPES.items() if dt.byteorder in ("=", "|")
}


def _prepare(key: Any, array: Any) -> tuple[np.ndarray, str]:
    if type(array) is np.ndarray and array.flags.c_contiguous and np.little_endian:
        name = _NAMES.get(array.dtype)
        if name is not None:
            return array, name
    arr = np.asarray(array)
    dt = as_dtype(arr.dtype)  # raises TypeError for unsupported dtypes
    name = dtype_to_str(dt)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr, name


class NativeWriter(Writer):
    """Collects values; the backend's :meth:`_write` lays them out in a temporary path."""

    container: str = ""
    #: True when the container is a directory (Zarr), False for one file (HDF5).
    is_directory: bool = False

    @classmethod
    def replaceable(cls, path: Path) -> bool:
        """True when the directory at ``path`` is a checkpoint this writer may replace."""
        return False

    def __init__(
        self,
        path: Path,
        *,
        durable: bool = True,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
    ) -> None:
        self.path = Path(path)
        self.durable = bool(durable)
        if int(pack_threshold) < 0:
            raise ValueError(f"pack_threshold must be >= 0, got {pack_threshold!r}.")
        self.pack_threshold = int(pack_threshold)
        self._items: dict[str, WriteItem] = {}
        self._metadata: dict[str, Any] = {}
        self._state = "open"

    def add(self, key: str, array: np.ndarray, attrs: Mapping[str, Any] | None = None) -> None:
        if self._state != "open":
            self._check_open()
        if type(key) is not str:
            if not isinstance(key, str):
                raise TypeError(f"Checkpoint keys are strings, got {type(key).__name__} {key!r}.")
            key = str(key)
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"Key {key!r} is not valid Unicode text.") from None
        if key in self._items:
            raise ValueError(f"Key {key!r} was already added to the checkpoint {str(self.path)!r}.")
        arr, name = _prepare(key, array)
        self._items[key] = WriteItem(key, arr, name, arr.shape, dict(attrs) if attrs else {},
                                     arr.nbytes)

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        self._check_open()
        self._metadata = dict(metadata)

    def abort(self) -> None:
        self._items.clear()
        self._state = "aborted"

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"The writer for {str(self.path)!r} is already {self._state}.")

    def commit(self) -> Path:
        self._check_open()
        self._state = "committing"
        try:
            items = list(self._items.values())
            threshold = self.pack_threshold
            arrays = [it for it in items if it.nbytes >= threshold]
            packed = [it for it in items if it.nbytes < threshold]
            for it, p in zip(arrays, container_paths([it.key for it in arrays]), strict=True):
                it.path = p
            pos = 0
            for it in packed:
                it.packed = True
                it.offset = pos
                pos += (it.nbytes + ALIGN - 1) & -ALIGN
            packed_nbytes = pos
            try:
                check_plain(self._metadata, "the checkpoint metadata")
            except ValueError as exc:
                raise TypeError(f"Cannot store metadata in {str(self.path)!r}: {exc}.") from None
            # Refuse early what publish() would refuse: nothing is written in vain.
            check_destination(self.path, directory=self.is_directory,
                              replaceable=self.replaceable)
            # Large values hash on the checksum thread while the backend writes (in the same
            # order); packed values hash on this thread as they are written (write_packed).
            futures: list[Future[Any]] = [_rawio.submit(it.hash) for it in arrays]

            def wait_hashes() -> None:
                for f in futures:
                    f.result()

            with temporary_sibling(self.path) as tmp:
                try:
                    self._write(tmp, arrays, packed, packed_nbytes, wait_hashes)
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

    def _encode_record(self, packed_loc: tuple[str, int, int] | None) -> bytes:
        """The root record of everything added (call after the checksums are known)."""
        items = list(self._items.values())
        array_loc = self._array_loc
        locs = [("packed", it.offset, it.nbytes) if it.packed else array_loc(it) for it in items]
        return encode_columns(
            self.container,
            packed_loc if any(it.packed for it in items) else None,
            [it.key for it in items],
            [it.dtype for it in items],
            [it.shape for it in items],
            [it.checksum for it in items],
            locs,
            [it.attrs for it in items],
            self._metadata,
        )

    def _array_loc(self, it: WriteItem) -> tuple[Any, ...]:
        return ("array", it.path, it.offset)

    @abc.abstractmethod
    def _write(
        self,
        tmp: Path,
        arrays: list[WriteItem],
        packed: list[WriteItem],
        packed_nbytes: int,
        wait_hashes: Callable[[], None],
    ) -> None:
        """Write everything into ``tmp`` (fsynced when durable); the caller publishes it."""


def write_packed(fd: int, packed: list[WriteItem], base: int) -> None:
    """Hash the packed values and write them from ``base`` (each padded to ALIGN).

    Straight from the arrays' buffers, ``IOV_MAX`` buffers per ``pwritev``; each batch is
    hashed just before it is written, while its bytes are still in the CPU cache.
    """
    crc = _crc32c.crc32c
    limit = _rawio.IOV_MAX - 1
    bufs: list[Any] = []
    start = 0
    for it in packed:
        if not bufs:
            start = it.offset
        a = it.array
        it.checksum = crc(a, _checksum.header_crc(it.key, it.dtype, it.shape))
        n = it.nbytes
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


def packed_iovecs(packed: list[WriteItem]) -> list[memoryview]:
    """The buffers that lay the packed values out back to back, each padded to ALIGN."""
    bufs: list[memoryview] = []
    for it in packed:
        if it.nbytes:
            bufs.append(it.view)
        pad = -it.nbytes % ALIGN
        if pad:
            bufs.append(_ZEROS[:pad])
    return bufs


def scalar_attrs(it: WriteItem) -> dict[str, Any]:
    """The per-array attributes stored on the container object itself."""
    out: dict[str, Any] = {}
    for k, v in it.attrs.items():
        if isinstance(k, str) and (v is None or isinstance(v, bool | int | float | str)):
            if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < 1 << 63:
                continue
            if v is not None:
                out[k] = v
    out.update(
        key=it.key,
        dtype=it.dtype,
        shape=list(it.shape),
        checksum=it.checksum,
    )
    out.setdefault("name", it.key)
    return out


# --------------------------------------------------------------------------- reading


class NativeReader(Reader):
    """A reader over a decoded record; backends say where each value's bytes are."""

    def __init__(self, path: Path, record: Record) -> None:
        self.path = Path(path)
        self._record = record
        self._values = record.values
        self._closed = False
        self._infos: dict[str, ArrayInfo] = {}

    # -- backend hooks
    @abc.abstractmethod
    def _open_array(self, key: str, entry: Entry) -> tuple[int, int, bool]:
        """``(fd, byte_offset, close_after)`` for an ``("array", ...)`` value."""

    @abc.abstractmethod
    def _packed_source(self) -> tuple[int, int]:
        """``(fd, byte_offset_of_blob_start)``."""

    def _read_other(self, key: str, entry: Entry) -> np.ndarray:
        raise self._corrupt(key, f"has an unknown location {entry.loc!r}")

    def _source(self, key: str, entry: Entry) -> tuple[int, int, bool]:
        """``(fd, byte_offset, close_after)`` of an ``array`` or ``packed`` value's bytes."""
        if entry.loc[0] == "packed":
            fd, base = self._packed_source()
            return fd, base + entry.loc[1], False
        return self._open_array(key, entry)

    def _check_source(self, key: str, entry: Entry) -> None:
        """Open and close the value's source: opening checks the stored size against the
        record, so a forged record declaring a huge value is refused before allocating."""
        fd, _, owned = self._source(key, entry)
        if owned:
            os.close(fd)

    def _parallel(self, e: Entry) -> bool:
        return e.nbytes >= _PARALLEL_FROM and e.loc[0] in ("array", "packed")

    def _mmap_region(self, key: str, entry: Entry) -> tuple[Any, int, bool]:
        """A buffer (mmap) holding the value's bytes, its start, and whether to close it."""
        if entry.loc[0] == "packed":
            fd, base = self._packed_source()
            return self._map(fd), base + entry.loc[1], True
        fd, off, owned = self._open_array(key, entry)
        try:
            return self._map(fd), off, True
        finally:
            if owned:
                os.close(fd)

    def _map(self, fd: int) -> Any:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)

    # -- Mapping
    def keys(self) -> Any:
        return self._values.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def _entry(self, key: str) -> Entry:
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
            e = self._entry(key)
            info = _make_info(key, e.np_dtype, e.shape, e.attrs, e.checksum)
            self._infos[key] = info
        return info

    def __getitem__(self, key: str) -> LazyArray:
        return NativeLazyArray(self, key, self.info(key))

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """The stored value's shape and dtype, straight from the record."""
        e = self._entry(key)
        return e.shape, SUPPORTED_DTYPES[e.dtype]

    def metadata(self) -> dict[str, Any]:
        return self._record.metadata

    @property
    def format_version(self) -> tuple[int, int]:
        return self._record.format_version

    def close(self) -> None:
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            raise ValueError(f"The reader of {str(self.path)!r} is closed.")

    def _corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"Checkpoint {str(self.path)!r}: value {key!r} {what}.")

    # -- whole-value reads
    def _dest(self, key: str, e: Entry, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return np.empty(e.shape, e.np_dtype)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out= must be a NumPy array, got {type(out).__name__}.")
        if out.shape != e.shape or out.dtype != e.np_dtype:
            raise ValueError(
                f"out= for {key!r} has shape {out.shape} and dtype {out.dtype}; the stored "
                f"value has shape {e.shape} and dtype {e.dtype}."
            )
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out= for {key!r} must be a writeable C-contiguous array.")
        return out

    def _read_whole(self, key: str, e: Entry, out: np.ndarray | None, verify: bool) -> np.ndarray:
        """Read a value below ``_PARALLEL_FROM`` (or stored elsewhere) on this thread."""
        if e.loc[0] not in ("array", "packed"):
            arr = self._read_other(key, e)
            if out is not None:
                dest = self._dest(key, e, out)
                dest[...] = arr
                arr = dest
            return arr
        n = e.nbytes
        # Open the source first: opening checks the stored size against the record, so a
        # forged record declaring a huge value is refused before anything is allocated.
        fd, off, owned = self._source(key, e)
        try:
            arr = self._dest(key, e, out)
            dst = _rawio.byte_view(arr)
            got = _rawio.pread_into(fd, dst, off) if n else 0
        finally:
            if owned:
                os.close(fd)
        if got != n:
            raise self._corrupt(key, f"is truncated: {got} of {n} bytes present")
        if verify:
            self._compare(key, e, _checksum.crc(dst, _checksum.header_crc(key, e.dtype, e.shape)))
        return arr

    def _compare(self, key: str, e: Entry, computed: int) -> None:
        if computed != e.checksum:
            raise self._corrupt(
                key,
                f"fails its checksum (stored {e.checksum:#010x}, computed {computed:#010x}); "
                "the checkpoint is damaged",
            )

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        self._check()
        e = self._entry(key)
        if not self._parallel(e):
            return self._read_whole(key, e, out, verify)
        self._check_source(key, e)
        arr = self._dest(key, e, out)
        _Transfer(self, [_Value(key, e, arr)], verify).finish()
        return arr

    def read_many(
        self, keys: Iterable[str], *, verify: bool = True
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Read values in order into fresh arrays, reading ahead on the I/O threads.

        Values are read in windows of about ``_WINDOW`` bytes; the next window is
        read while this one is yielded. Packed values come from one read of the
        packed blob (when they make up most of it) and are returned as aligned
        views into that buffer, each verified before it is yielded.
        """
        self._check()
        keys = list(keys)
        entry = self._entry
        entries = [entry(k) for k in keys]
        blob, blob_lo = self._read_packed_span(entries)
        # Split into windows: runs of keys holding about _WINDOW bytes read apart.
        windows: list[list[tuple[str, Entry]]] = []
        cur: list[tuple[str, Entry]] = []
        size = 0
        for key, e in zip(keys, entries, strict=True):
            cur.append((key, e))
            if not (blob is not None and e.loc[0] == "packed"):
                size += e.nbytes
            if size >= _WINDOW:
                windows.append(cur)
                cur, size = [], 0
        if cur:
            windows.append(cur)

        def launch(window: list[tuple[str, Entry]]) -> tuple[Any, dict[str, np.ndarray], _Transfer]:
            values = []
            for k, e in window:
                if self._parallel(e) and not (blob is not None and e.loc[0] == "packed"):
                    self._check_source(k, e)
                    values.append(_Value(k, e, np.empty(e.shape, e.np_dtype)))
            transfer = _Transfer(self, values, verify, ahead=True)
            return window, {v.key: v.dest for v in values}, transfer

        crc = _crc32c.crc32c
        queue: deque[tuple[Any, dict[str, np.ndarray], _Transfer]] = deque()
        it = iter(windows)
        try:
            first = next(it, None)
            if first is not None:
                queue.append(launch(first))
            while queue:
                # From the page cache, the next window is read while this one is finished
                # and handed out; from disk, one window at a time (one sequential stream),
                # the next one starting as soon as this one is in.
                if not queue[0][2].sequential and len(queue) < 2:
                    nxt = next(it, None)
                    if nxt is not None:
                        queue.append(launch(nxt))
                window, big, transfer = queue[0]
                transfer.finish()
                if transfer.sequential and len(queue) < 2:
                    nxt = next(it, None)
                    if nxt is not None:
                        queue.append(launch(nxt))
                for key, e in window:
                    arr = big.get(key)
                    if arr is None and blob is not None and e.loc[0] == "packed":
                        start = e.loc[1] - blob_lo
                        n = e.loc[2]
                        raw = blob[start : start + n]
                        if verify:
                            got = crc(raw, _checksum.header_crc(key, e.dtype, e.shape))
                            if got != e.checksum:
                                self._compare(key, e, got)
                        arr = (
                            raw.view(e.np_dtype).reshape(e.shape)
                            if n
                            else np.empty(e.shape, e.np_dtype)
                        )
                    elif arr is None:
                        arr = self.read(key, verify=verify)
                    yield key, arr
                queue.popleft()
                # Hold nothing of this window past here, so a consumer that drops each
                # value (a GPU load) keeps at most two windows alive, not three.
                window = big = transfer = arr = None  # type: ignore[assignment]
        finally:
            for _, _, transfer in queue:
                transfer.abandon()

    def _read_packed_span(self, entries: list[Entry]) -> tuple[np.ndarray | None, int]:
        locs = [e.loc for e in entries if e.loc[0] == "packed"]
        if len(locs) < 2:
            return None, 0
        starts = [loc[1] for loc in locs]
        lo = min(starts)
        hi = max(map(operator.add, starts, [loc[2] for loc in locs]))
        want = sum(loc[2] for loc in locs)
        if hi - lo > 2 * want + (1 << 20):
            return None, 0
        fd, base = self._packed_source()
        blob = np.empty(hi - lo, np.uint8)
        got = _rawio.pread_into(fd, memoryview(blob), base + lo)
        if got != hi - lo:
            raise CorruptCheckpointError(
                f"Checkpoint {str(self.path)!r}: the packed values are truncated "
                f"({got} of {hi - lo} bytes present)."
            )
        return blob, lo

    def verify_many(self, keys: Iterable[str]) -> None:
        """Raise ``CorruptCheckpointError`` for the first damaged value among ``keys``.

        Packed values are hashed in place through one read-only map of the packed blob
        (no copy, no per-value system call); large values in pieces on the I/O threads;
        the rest one by one (:meth:`verify`).
        """
        self._check()
        entry = self._entry
        keyed = [(k, entry(k)) for k in keys]
        packed: list[tuple[str, Entry]] = []
        big: list[_Value] = []
        for k, e in keyed:
            loc = e.loc
            if loc[0] == "packed" and loc[2]:
                packed.append((k, e))
            elif loc[0] == "array" and e.nbytes >= _PARALLEL_FROM:
                big.append(_Value(k, e, None))
            else:
                self.verify(k)
        if big:
            _Transfer(self, big, True).finish()
        if not packed:
            return
        fd, base = self._packed_source()
        hi = base + max(e.loc[1] + e.loc[2] for _, e in packed)
        crc = _crc32c.crc32c
        seed = _checksum.header_crc
        mm = self._map(fd)
        try:
            with memoryview(mm) as mv:
                if hi > len(mv):
                    raise CorruptCheckpointError(
                        f"Checkpoint {str(self.path)!r}: the packed values are truncated "
                        f"({len(mv) - base} of {hi - base} bytes present)."
                    )
                for key, e in packed:
                    start = base + e.loc[1]
                    got = crc(mv[start : start + e.loc[2]], seed(key, e.dtype, e.shape))
                    if got != e.checksum:
                        self._compare(key, e, got)
        finally:
            if isinstance(mm, mmap.mmap):
                mm.close()

    def read_into_many(self, pairs: list[tuple[str, np.ndarray]], *, verify: bool = True) -> None:
        """Read each ``(key, out)`` value into ``out`` (same shape and dtype, C-contiguous).

        Packed values are scattered straight into their buffers by ``preadv`` (one call per
        run of up to ``IOV_MAX`` buffers). With ``verify`` each value is checked after it
        is read, so on damage some buffers already hold new bytes: verify first
        (:meth:`verify_many`) when that matters.
        """
        self._check()
        entry = self._entry
        packed: list[tuple[int, str, Entry, np.ndarray]] = []
        big: list[_Value] = []
        for key, out in pairs:
            e = entry(key)
            out = self._dest(key, e, out)
            if e.loc[0] == "packed" and e.loc[2]:
                packed.append((e.loc[1], key, e, out))
            elif self._parallel(e):
                big.append(_Value(key, e, out))
            else:
                self.read(key, out=out, verify=verify)
        if big:
            _Transfer(self, big, verify).finish()
        if not packed:
            return
        packed.sort(key=operator.itemgetter(0))
        fd, base = self._packed_source()
        scratch = np.empty(_MAX_GAP, np.uint8)  # skips bytes no key asked for
        crc = _crc32c.crc32c
        i = 0
        while i < len(packed):
            start = packed[i][0]
            pos = start
            bufs: list[Any] = []
            j = i
            while j < len(packed) and len(bufs) < _rawio.IOV_MAX - 1:
                off, _, e, out = packed[j]
                if off < pos:  # two keys on one range: read it apart
                    break
                gap = off - pos
                if gap > scratch.size:
                    if bufs:
                        break
                    start = pos = off
                    gap = 0
                if gap:
                    bufs.append(scratch[:gap])
                bufs.append(out)
                pos = off + e.loc[2]
                j += 1
            if j == i:  # an overlapping duplicate: read it on its own
                off, key, e, out = packed[i]
                self.read(key, out=out, verify=verify)
                i += 1
                continue
            got = _rawio.preadv_all(fd, bufs, base + start)
            if got != pos - start:
                raise CorruptCheckpointError(
                    f"Checkpoint {str(self.path)!r}: the packed values are truncated "
                    f"({got} of {pos - start} bytes present)."
                )
            if verify:
                for _, key, e, out in packed[i:j]:
                    got = crc(out, _checksum.header_crc(key, e.dtype, e.shape))
                    if got != e.checksum:
                        self._compare(key, e, got)
            i = j

    # -- partial reads
    def _read_elements(self, key: str, e: Entry, start: int, count: int) -> np.ndarray:
        """Elements ``[start, start + count)`` of the flat value (no checksum)."""
        self._check()
        if count == 0:
            return np.empty(0, e.np_dtype)
        item = e.np_dtype.itemsize
        if e.loc[0] == "packed":  # opening checks the stored size before anything is allocated
            fd, base = self._packed_source()
            off, owned = base + e.loc[1], False
        else:
            fd, off, owned = self._open_array(key, e)
        try:
            out = np.empty(count, e.np_dtype)
            want = count * item
            got = _rawio.pread_into(fd, _rawio.byte_view(out), off + start * item)
            if got != want:
                raise self._corrupt(key, "is truncated")
        finally:
            if owned:
                os.close(fd)
        return out

    # -- verification
    def verify(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` if ``key`` is damaged (hashes through mmap, no copy)."""
        self._check()
        e = self._entry(key)
        if e.loc[0] not in ("array", "packed"):
            self.read(key, verify=True)
            return
        seed = _checksum.header_crc(key, e.dtype, e.shape)
        if e.nbytes == 0:
            if e.loc[0] == "array":
                fd, _, owned = self._open_array(key, e)
                if owned:
                    os.close(fd)
            self._compare(key, e, seed)
            return
        if e.loc[0] == "array":  # pread in pieces on the I/O threads (no map: no SIGBUS)
            _Transfer(self, [_Value(key, e, None)], True).finish()
            return
        buf, start, close = self._mmap_region(key, e)
        try:
            with memoryview(buf) as mv:
                if start + e.nbytes > len(mv):
                    raise self._corrupt(key, "is truncated")
                with mv[start : start + e.nbytes] as region:
                    computed = _checksum.crc(region, seed)
            self._compare(key, e, computed)
        finally:
            if close and isinstance(buf, mmap.mmap):
                buf.close()

    def verify_all(self) -> list[tuple[str, str]]:
        """Check every value; return ``[(key, reason), ...]`` for each damaged one (empty if none)."""
        bad: list[tuple[str, str]] = []
        for key in self._values:
            try:
                self.verify(key)
            except CorruptCheckpointError as exc:
                bad.append((key, str(exc)))
            except OSError as exc:
                bad.append((key, f"cannot be read: {exc}"))
        return bad


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


class NativeLazyArray(LazyArray):
    """A stored value; slicing reads only the rows (byte range) the index covers."""

    def __init__(self, reader: NativeReader, key: str, info: ArrayInfo) -> None:
        self._reader = reader
        self._key = key
        self.info = info

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        return self._reader.read(self._key, out=out, verify=verify)

    def __getitem__(self, index: Any) -> np.ndarray:
        e = self._reader._entry(self._key)
        shape = e.shape
        if e.nbytes <= _SLICE_WHOLE_BELOW or e.loc[0] not in ("array", "packed") or not shape:
            return self.read()[index]
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is None for i in idx) or not all(
            isinstance(i, slice | int | np.integer) or i is Ellipsis for i in idx
        ):
            return self.read()[index]  # advanced indexing: read the whole value (verified)
        if sum(i is Ellipsis for i in idx) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if Ellipsis in idx:
            at = idx.index(Ellipsis)
            fill = len(shape) - (len(idx) - 1)
            idx = idx[:at] + (slice(None),) * fill + idx[at + 1 :]
        if len(idx) > len(shape):
            raise IndexError(
                f"too many indices for {self._key!r}: array is {len(shape)}-dimensional, "
                f"but {len(idx)} were indexed"
            )
        strides = [1] * len(shape)
        for ax in range(len(shape) - 2, -1, -1):
            strides[ax] = strides[ax + 1] * shape[ax + 1]
        base = 0
        ax = 0
        while ax < len(idx) and isinstance(idx[ax], int | np.integer):
            i = int(idx[ax])
            if not -shape[ax] <= i < shape[ax]:
                raise IndexError(
                    f"index {i} is out of bounds for axis {ax} with size {shape[ax]}"
                )
            base += (i % shape[ax]) * strides[ax]
            ax += 1
        rest = idx[ax:]
        if ax == len(shape):
            return self._reader._read_elements(self._key, e, base, 1).reshape(())[()]
        sub_shape = shape[ax:]
        if rest and isinstance(rest[0], slice):
            rng = range(*rest[0].indices(shape[ax]))
            if len(rng) == 0:
                return np.empty((0, *shape[ax + 1 :]), e.np_dtype)[rest[1:]]
            lo, hi = min(rng[0], rng[-1]), max(rng[0], rng[-1]) + 1
            block = self._reader._read_elements(self._key, e, base + lo * strides[ax],
                                                (hi - lo) * strides[ax])
            block = block.reshape((hi - lo, *shape[ax + 1 :]))
            stop = rng[-1] - lo + (1 if rng.step > 0 else -1)
            first = slice(rng[0] - lo, stop if stop >= 0 else None, rng.step)
            return block[(first, *rest[1:])]
        n = strides[ax - 1] if ax else e.size
        block = self._reader._read_elements(self._key, e, base, n).reshape(sub_shape)
        return block[rest] if rest else block
