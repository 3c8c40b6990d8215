"""The HDF5 backend (``.h5``/``.hdf5``): a valid HDF5 file that ckptvar reads without libhdf5.

Writing (docs/FORMAT.md, "HDF5 container"):

1. h5py's low-level API creates the file with a 512-byte user block and every
   large value as a contiguous dataset at its key path (allocated early, never
   filled), plus ``_ckptvar/packed`` for the small values; each dataset's file
   offset is read with ``get_offset()`` and the file is closed.
2. The values' bytes are written with ``pwrite``/``pwritev`` straight from the
   arrays' buffers while the checksum thread hashes them.
3. h5py reopens the file to put the attributes (key, name, dtype, shape,
   trainable, checksum, ...) on each dataset and the root record into
   ``_ckptvar/manifest``.
4. The user block gets a magic, the record's offset, length and CRC-32C.

Reading never calls libhdf5: the user block leads to the record, the record to
each value's byte range, so external links, virtual datasets and filter plugins
in a hostile file cannot matter. A ``.h5`` file without the ckptvar magic is not
ours: it is handed to another registered reader that recognises it (Keras,
generic HDF5), or refused.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .._dtypes import SUPPORTED_DTYPES
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from . import _checksum, _rawio, register_backend
from ._native import PACKED_PATH, NativeReader, NativeWriter, WriteItem, write_packed
from ._native import scalar_attrs
from ._paths import RESERVED_PREFIX
from ._record import FORMAT_VERSION, MAX_RECORD_NBYTES, Record, decode
from .base import Backend

__all__ = ["H5Backend", "H5Reader", "H5Writer", "USERBLOCK_SIZE", "read_userblock"]

USERBLOCK_SIZE = 512
#: First 12 bytes of a ckptvar HDF5 file (the HDF5 superblock follows at byte 512).
MAGIC = b"\x89CKPTVAR\r\n\x1a\n"
# magic, major, minor, record offset, record nbytes, record crc32c; then crc32c of those 36 bytes
_UB = struct.Struct("<12sHHQQI")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
MANIFEST_PATH = f"{RESERVED_PREFIX}/manifest"
#: Dtypes stored as themselves; the others (bfloat16, float8, int4, ...) as unsigned bits.
NATIVE_TYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})


def _storage_dtype(name: str) -> np.dtype:
    """The HDF5 storage dtype: the value's own, or unsigned bits for ml_dtypes kinds."""
    dt = SUPPORTED_DTYPES[name]
    if name not in NATIVE_TYPES:
        return np.dtype(f"<u{dt.itemsize}")
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


class H5Writer(NativeWriter):
    """Writes one ``.h5`` file (see the module docstring for the steps)."""

    container = "h5"

    def __init__(self, path: Path, *, compression: Any = None, **options: Any) -> None:
        if compression not in (None, False, "none"):
            raise UnsupportedFormatError(
                f"The h5 format stores values uncompressed (got compression={compression!r}); "
                "use a .zarr checkpoint for compression."
            )
        super().__init__(path, **options)

    def _write(
        self,
        tmp: Path,
        arrays: list[WriteItem],
        packed: list[WriteItem],
        packed_nbytes: int,
        wait_hashes: Callable[[], None],
    ) -> None:
        try:
            self._write_h5(tmp, arrays, packed, packed_nbytes, wait_hashes)
        except (RuntimeError, OSError) as exc:
            raise _as_oserror(exc, tmp) from exc

    def _write_h5(
        self,
        tmp: Path,
        arrays: list[WriteItem],
        packed: list[WriteItem],
        packed_nbytes: int,
        wait_hashes: Callable[[], None],
    ) -> None:
        from h5py import h5d, h5f, h5p, h5s, h5t

        name = os.fsencode(tmp)
        fapl = h5p.create(h5p.FILE_ACCESS)
        fapl.set_fclose_degree(h5f.CLOSE_STRONG)
        fcpl = h5p.create(h5p.FILE_CREATE)
        fcpl.set_userblock(USERBLOCK_SIZE)
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_layout(h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        lcpl = h5p.create(h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        lcpl.set_char_encoding(h5t.CSET_UTF8)
        types: dict[str, Any] = {}

        def create(path: str, dtype_name: str | None, shape: tuple[int, ...]) -> int:
            if dtype_name is None:
                tid = h5t.py_create(np.dtype("u1"))
            else:
                tid = types.get(dtype_name)
                if tid is None:
                    tid = types[dtype_name] = h5t.py_create(_storage_dtype(dtype_name))
            space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
            dsid = h5d.create(fid, path.encode(), tid, space, dcpl=dcpl, lcpl=lcpl)
            off = dsid.get_offset()
            _close(dsid)
            return int(off) if off is not None else 0

        # libhdf5 writes only metadata: every value's bytes, the record's included, are
        # written by us with pwrite. A raw-data write of libhdf5's own would be flushed
        # inside H5Dclose, and a close that fails there (disk full) leaves a dangling id
        # that crashes the process in libhdf5's exit handler.
        # 1. structure
        fid = h5f.create(name, h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl)
        try:
            for it in arrays:
                it.offset = create(it.path, it.dtype, it.shape)
            packed_off = create(PACKED_PATH, None, (packed_nbytes,)) if packed else 0
        finally:
            fid.close()
        fd = os.open(tmp, os.O_WRONLY)
        try:
            # 2. bytes, straight from the buffers, hashed on the checksum thread meanwhile
            write = _rawio.pwrite_flushing if self.durable else _rawio.pwrite_all
            for it in arrays:
                if it.nbytes:
                    write(fd, it.view, it.offset)
            if packed:
                write_packed(fd, packed, packed_off)
                if self.durable:
                    _rawio.start_writeback(fd, packed_off, packed_nbytes)
            wait_hashes()
            # 3. attributes and the root record, through h5py
            record = self._encode_record((PACKED_PATH, packed_off, packed_nbytes))
            fid = h5f.open(name, h5f.ACC_RDWR, fapl=fapl)
            try:
                record_off = self._finish_h5(fid, arrays, record, dcpl, lcpl)
            finally:
                fid.close()
            # 4. the record's bytes, then the user block that leads a reader to them
            if record:
                _rawio.pwrite_all(fd, memoryview(record), record_off)
            _rawio.pwrite_all(fd, memoryview(make_userblock(record_off, record)), 0)
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _finish_h5(fid: Any, arrays: list[WriteItem], record: bytes, dcpl: Any, lcpl: Any) -> int:
        import h5py
        from h5py import h5d, h5s, h5t

        for it in arrays:
            ds = h5py.Dataset(h5d.open(fid, it.path.encode()))
            attrs = ds.attrs
            for k, v in scalar_attrs(it).items():
                attrs[k] = np.array(v, np.uint32) if k == "checksum" else v
            _close(ds.id)
        # Allocated here, written by the caller with pwrite like every value: libhdf5's
        # own raw-data writes are flushed inside H5Dclose, where a failure is fatal.
        space = h5s.create_simple((len(record),))
        dsid = h5d.create(fid, MANIFEST_PATH.encode(), h5t.py_create(np.dtype("u1")), space,
                          dcpl=dcpl, lcpl=lcpl)
        off = dsid.get_offset()
        _close(dsid)
        return int(off)


def _close(oid: Any) -> None:
    """Close an h5py id; if libhdf5 fails to (disk full while flushing), disown it.

    libhdf5 keeps an id whose close failed registered; the strong file close then tears
    the object down, and h5py releasing the stale id later crashes inside libhdf5
    (``H5FO_top_decr``). A locked id is never released by h5py, so nothing is freed twice.
    """
    try:
        oid.close()
    except BaseException:
        oid.locked = True
        raise


def _as_oserror(exc: BaseException, path: Path) -> BaseException:
    """libhdf5 reports a failed write (ENOSPC, EFBIG, EIO) as RuntimeError or a bare OSError;
    give the caller an ``OSError`` carrying the errno."""
    if isinstance(exc, OSError) and exc.errno:
        return exc
    m = re.search(r"errno = (\d+)", str(exc))
    if m is None:
        return exc
    code = int(m.group(1))
    return OSError(code, f"{os.strerror(code)} while writing {str(path)!r} ({exc})", str(path))


def make_userblock(record_off: int, record: bytes) -> bytes:
    head = _UB.pack(MAGIC, FORMAT_VERSION[0], FORMAT_VERSION[1], record_off, len(record),
                    _checksum.crc(record))
    head += struct.pack("<I", _checksum.crc(head))
    return head + bytes(USERBLOCK_SIZE - len(head))


def read_userblock(fd: int, path: Any) -> tuple[int, int, int, int, int]:
    """``(major, minor, record_offset, record_nbytes, record_crc)`` from a ckptvar HDF5 file."""
    head = _rawio.pread_exact(fd, _UB.size + 4, 0)
    if head is None or head[:12] != MAGIC:
        raise CorruptCheckpointError(f"{str(path)!r} is not a ckptvar HDF5 file (no user block).")
    (crc,) = struct.unpack("<I", head[_UB.size :])
    if crc != _checksum.crc(head[: _UB.size]):
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: the user block (bytes 0-40) is damaged "
            "(its checksum does not match)."
        )
    _, major, minor, off, n, rcrc = _UB.unpack(head[: _UB.size])
    return major, minor, off, n, rcrc


class H5Reader(NativeReader):
    """Reads a ckptvar ``.h5`` file with ``pread`` only (libhdf5 is never called)."""

    format = "h5"

    def __init__(self, path: Path) -> None:
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            from ..errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.") from None
        try:
            size = os.fstat(fd).st_size
            major, minor, off, n, rcrc = read_userblock(fd, path)
            if major > FORMAT_VERSION[0]:
                raise UnsupportedFormatError(
                    f"Checkpoint {str(path)!r} has format version {major}.{minor}, newer than "
                    f"the {FORMAT_VERSION[0]}.x this ckptvar reads; upgrade ckptvar to read it."
                )
            if n > MAX_RECORD_NBYTES or off < USERBLOCK_SIZE or off + n > size:
                raise CorruptCheckpointError(
                    f"Checkpoint {str(path)!r}: the root record [{off}, {off + n}) lies outside "
                    f"the file ({size} bytes); the file is truncated or damaged."
                )
            data = _rawio.pread_exact(fd, n, off)
            if data is None or _checksum.crc(data) != rcrc:
                raise CorruptCheckpointError(
                    f"Checkpoint {str(path)!r}: the root record fails its checksum; "
                    "the file is damaged."
                )
            record = decode(data, path, container="h5", file_size=size)
            _check_h5_regions(record, path, size, (off, n))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        super().__init__(path, record)
        self._packed_base = record.packed[1] if record.packed else 0

    def _open_array(self, key: str, entry: Any) -> tuple[int, int, bool]:
        self._check()
        return self._fd, entry.loc[2], False

    def _packed_source(self) -> tuple[int, int]:
        self._check()
        return self._fd, self._packed_base

    def _mmap_region(self, key: str, entry: Any) -> tuple[Any, int, bool]:
        self._check()
        if getattr(self, "_mm", None) is None:
            self._mm = self._map(self._fd)
        if entry.loc[0] == "packed":
            return self._mm, self._packed_base + entry.loc[1], False
        return self._mm, entry.loc[2], False

    def close(self) -> None:
        if not self._closed:
            mm = getattr(self, "_mm", None)
            if mm is not None and hasattr(mm, "close"):
                try:
                    mm.close()
                except BufferError:
                    pass
            os.close(self._fd)
        super().close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - best effort at interpreter exit
            pass


def _check_h5_regions(record: Record, path: Any, size: int, record_region: tuple[int, int]) -> None:
    """Refuse values, the packed blob, the record and the user block that overlap or end
    past the file (one sort over all of them)."""
    fixed: list[tuple[int, int, str]] = [(0, USERBLOCK_SIZE, "the user block")]
    fixed.append((record_region[0], record_region[1], "the root record"))
    if record.packed is not None:
        fixed.append((record.packed[1], record.packed[2], "the packed values"))
    cols = record.columns
    if cols is None:
        keys = [k for k, e in record.values.items() if e.loc[0] == "array"]
        starts = np.array([record.values[k].loc[2] for k in keys], np.int64)
        sizes = np.array([record.values[k].nbytes for k in keys], np.int64)
    else:
        own = np.flatnonzero(~cols.packed)
        keys = [cols.keys[i] for i in own.tolist()]
        starts, sizes = cols.offsets[own], cols.nbytes[own]
    labels = [w for _, _, w in fixed]
    all_starts = np.concatenate([np.array([f[0] for f in fixed], np.int64), starts])
    all_sizes = np.concatenate([np.array([f[1] for f in fixed], np.int64), sizes])
    keep = np.flatnonzero(all_sizes > 0)
    order = keep[np.argsort(all_starts[keep], kind="stable")]
    s, e = all_starts[order], all_starts[order] + all_sizes[order]

    def what(i: int) -> str:
        return labels[i] if i < len(labels) else f"value {keys[i - len(labels)]!r}"

    bad = np.flatnonzero(s[1:] < np.maximum.accumulate(e)[:-1])
    if bad.size:
        j = int(bad[0]) + 1
        prev = int(order[int(np.argmax(e[:j]))])
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: {what(int(order[j]))} overlaps {what(prev)} (bytes "
            f"{int(s[j])}..{int(e[:j].max())}); the file is damaged or hostile."
        )
    past = np.flatnonzero(e > size)
    if past.size:
        j = int(past[0])
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: {what(int(order[j]))} ends at byte {int(e[j])}, past the "
            f"end of the file ({size} bytes); the file is truncated."
        )


def check_regions(regions: list[tuple[int, int, str]], path: Any, size: int | None) -> None:
    """Refuse byte ranges that overlap or end past ``size``."""
    regions = [r for r in regions if r[1] > 0]
    regions.sort()
    end, prev = 0, ""
    for start, n, what in regions:
        if start < end:
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: {what} overlaps {prev} (bytes {start}..{end}); "
                "the file is damaged or hostile."
            )
        end, prev = start + n, what
        if size is not None and end > size:
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: {what} ends at byte {end}, past the end of the "
                f"file ({size} bytes); the file is truncated."
            )


class H5Backend(Backend):
    """ckptvar's own HDF5 files."""

    name: ClassVar[str] = "h5"
    suffixes: ClassVar[tuple[str, ...]] = (".h5", ".hdf5")
    can_write: ClassVar[bool] = True

    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) == MAGIC
        except OSError:
            return False

    @classmethod
    def open_reader(cls, path: Path) -> H5Reader:  # type: ignore[override]
        path = Path(path)
        try:
            return cls._open_reader(path)
        except FileNotFoundError as exc:  # deleted (pruned) between our look and our open
            if isinstance(exc, CheckpointNotFoundError):
                raise
            raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.") from None

    @classmethod
    def _open_reader(cls, path: Path) -> H5Reader:
        if path.is_file() and not cls.sniff(path):
            other = _other_reader(cls, path)
            if other is not None:
                return other  # type: ignore[return-value]
            with open(path, "rb") as f:
                head = f.read(8)
            if head == _HDF5_SIGNATURE:
                raise UnsupportedFormatError(
                    f"{str(path)!r} is an HDF5 file that ckptvar did not write, and no "
                    "registered reader recognises its layout."
                )
            raise CorruptCheckpointError(
                f"{str(path)!r} is neither a ckptvar checkpoint nor an HDF5 file "
                "(no user block magic, no HDF5 signature); the file is damaged."
            )
        return H5Reader(path)

    @classmethod
    def open_writer(cls, path: Path, **options: Any) -> H5Writer:  # type: ignore[override]
        return H5Writer(Path(path), **options)


def _other_reader(me: type[Backend], path: Path) -> Any:
    from . import _BACKENDS

    for cls in _BACKENDS.values():
        if cls is me:
            continue
        try:
            ok = cls.sniff(path)
        except Exception:  # noqa: BLE001 - a sniffer that fails just does not claim the file
            ok = False
        if ok:
            return cls.open_reader(path)
    return None


register_backend(H5Backend)
