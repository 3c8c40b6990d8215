"""The HDF5 backend (``.h5``/``.hdf5``): a valid HDF5 file that ckptvar reads without libhdf5.

Writing (docs/FORMAT.md, "HDF5 container"):

1. h5py's low-level API creates the file with a 512-byte user block and every
   large value as a contiguous dataset at its key path (allocated early, never
   filled), plus ``_ckptvar/packed`` for the small values; each dataset's file
   offset is read with ``get_offset()`` and the file is closed.
2. The values' bytes are written with ``pwrite``/``pwritev`` straight from the
   arrays' buffers while the checksum thread hashes them (on one CPU, each
   1 MiB piece is hashed just before it is written, while it is in the CPU cache).
3. h5py reopens the file to put the attributes (key, name, dtype, shape,
   trainable, checksum, ...) on each dataset and the root record into
   ``_ckptvar/manifest``.
4. The user block gets a magic, the record's offset, length and CRC-32C.

Reading never calls libhdf5: the user block leads to the record, the record to
each value's byte range, so external links, virtual datasets and filter plugins
in a hostile file cannot matter. A ``.h5`` file without the ckptvar magic is not
ours: :func:`ckptvar.storage.backend_for` hands it to another registered reader
that recognises it (Keras, generic HDF5), and this backend refuses it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import logging
import os
import re
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from . import checksum as _checksum
from . import rawio as _rawio
from ._container import (
    PACKED_PATH,
    ContainerReader,
    ContainerWriter,
    Source,
    ValueRanges,
    ValueWrite,
    WritePlan,
    check_regions,
    delta_attrs,
    hash_while_writing,
    scalar_attrs,
    storage_dtype,
    write_hashing,
    write_packed,
)
from ._container import source as _src
from ._container.delta import DeltaWrite, Patches, in_base, read_patches
from ._container.reuse import Held, Kept, KeptRecords, PatchRows
from ._container.source import Patched, RemoteFile
from ._record import (
    ARRAY,
    FORMAT_VERSION,
    MAX_RECORD_NBYTES,
    PACKED,
    Delta,
    Entry,
    Extent,
    Record,
    decode,
    holder_step,
)
from .base import Backend, SupportsShared
from .paths import RESERVED_PREFIX
from .registry import register_backend

logger = logging.getLogger("ckptvar")

__all__ = [
    "USERBLOCK_SIZE",
    "H5Backend",
    "H5Reader",
    "H5Writer",
    "external_files",
    "index_regions",
    "read_index",
    "read_userblock",
    "record_crc",
    "write_stand_in",
]

USERBLOCK_SIZE = 512
#: First 12 bytes of a ckptvar HDF5 file (the HDF5 superblock follows at byte 512).
MAGIC = b"\x89CKPTVAR\r\n\x1a\n"
# magic, major, minor, record offset, record nbytes, record crc32c; then crc32c of those 36 bytes
_UB = struct.Struct("<12sHHQQI")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
MANIFEST_PATH = f"{RESERVED_PREFIX}/manifest"
_NO_ROWS = np.empty(0, np.int64)


class H5Writer(ContainerWriter):
    """Writes one ``.h5`` file (see the module docstring for the steps)."""

    container = "h5"

    def __init__(self, path: Path, *, compression: Any = None, **options: Any) -> None:
        if compression not in (None, False, "none"):
            raise UnsupportedFormatError(
                f"The h5 format stores values uncompressed (got compression={compression!r}); "
                "use a .zarr checkpoint for compression."
            )
        super().__init__(path, **options)
        self._record_bytes: bytes | None = None  # the record written, once it is

    def commit(self) -> Path:
        """Write and publish the file; an incremental one's record is then kept as read
        (:func:`_committed_record`), so the manager's look at what it refers to and the
        next step's read of its base open nothing."""
        path = super().commit()
        record = self._record_bytes
        if record is not None and (self.base is not None or self.rows):
            with contextlib.suppress(OSError, CkptError):  # a read later does it instead
                _keep_record(path, record, self.patch_rows)
        return path

    def _open_base(self, base: Path) -> tuple[Any, Any] | None:
        """An incremental save's base: its record; a value's bytes are in the file that
        holds them (the base itself, or the file the base refers to), never a chain."""
        if base.parent == self.path.parent:
            name = base.name  # external links name a sibling file
        elif (base.name == self.path.name
              and base.parent.parent == self.path.parent.parent):
            # a process's file of a multi-process step: the same process's file in a
            # sibling step, ``../<step>/<file>`` (what it refers to is named so too)
            name = f"../{base.parent.name}/{base.name}"
        else:
            return None
        kept = _committed(base)
        record = kept.record
        self.base_patch_rows = kept.rows
        self._base_name = name

        def holder(key: str, entry: Entry) -> Held:
            file, path = record.external.get(key, (name, entry.loc.path or ""))
            return Held(file, path, entry.loc.offset)

        return record, holder

    def _array_loc(self, it: ValueWrite) -> Extent:
        if it.held is not None:
            return Extent.array(it.path, it.held.offset, it.nbytes)
        return super()._array_loc(it)

    def _open_base_reader(self, base: Path) -> H5Reader:
        return H5Reader(base)

    def _delta_for(self, it: ValueWrite, entry: Entry, was: Delta | None,
                   holder: Callable[[str, Entry], Held]) -> DeltaWrite | None:
        """An HDF5 delta refers to the files that hold the base's whole copy and its
        earlier patches (siblings: external links); its own patch is a dataset here."""
        name = self._base_name
        if was is None:
            held = holder(it.key, entry)
            base, earlier, since = (held.file, held.path, held.offset), [], holder_step(held.file)
        else:
            def named(f: str) -> str:
                return f or name
            base = (named(was.base[0]), was.base[1], was.base[2])
            earlier = [(named(f), p, o, n, c) for f, p, o, n, c in was.patches]
            since = was.since
        out = DeltaWrite(base, earlier, _NO_ROWS, 0, since)
        out.path = f"{it.path}/patch-{len(earlier)}"
        return out

    def _external(self, items: list[ValueWrite]) -> dict[str, tuple[str, str]] | None:
        return {it.key: (it.held.file, it.held.path) for it in items
                if it.held is not None} or None

    def _write(self, tmp: Path, plan: WritePlan) -> None:
        try:
            self._write_h5(tmp, plan)
        except (RuntimeError, OSError) as exc:
            raise _as_oserror(exc, tmp) from exc

    def _write_h5(self, tmp: Path, plan: WritePlan) -> None:
        # libhdf5 writes only metadata: every value's bytes, the record's included, are
        # written by us with pwrite. A raw-data write of libhdf5's own would be flushed
        # inside H5Dclose, and a close that fails there (disk full) leaves a dangling id
        # that crashes the process in libhdf5's exit handler.
        h5 = _H5File(os.fsencode(tmp))
        # 1. structure (the file stays open in libhdf5 until its metadata is complete:
        # one open and one flush of it per step; the bytes below are in the datasets'
        # allocated extents, which libhdf5 never writes)
        try:
            packed_off = h5.create_structure(plan)
            fd = os.open(tmp, os.O_WRONLY)
            try:
                # 2. bytes, straight from the buffers, hashed meanwhile (or piece by piece)
                self._write_bytes(fd, plan, packed_off)
                plan.wait_hashes()
                # 3. attributes and the root record, through h5py; the file closed
                record = self._encode_record((PACKED_PATH, packed_off, plan.packed_nbytes))
                record_off = h5.finish(plan.arrays, len(record), self.record_version)
                self._record_bytes = record
                # 4. the record's bytes, then the user block that leads a reader to them
                if record:
                    _rawio.pwrite_all(fd, memoryview(record), record_off)
                _rawio.pwrite_all(fd, memoryview(make_userblock(record_off, record,
                                                                   self.record_version)), 0)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            h5.close()

    def _writes_hashed(self, it: ValueWrite) -> bool:
        return (hash_while_writing() and it.held is None and it.delta is None
                and it.source is None and not it.hashed)

    def _write_bytes(self, fd: int, plan: WritePlan, packed_off: int) -> None:
        write = _rawio.pwrite_flushing if self.durable else _rawio.pwrite_pieces
        for it in plan.arrays:
            if it.held is not None:
                continue
            if it.delta is not None:  # only the patch: the rest is in other files
                if it.delta.patch_nbytes:
                    it.delta.write_patch(functools.partial(write, fd), it.delta.offset)
                continue
            if it.source is not None:  # a piece at a time, hashed on the way
                it.write_with(functools.partial(_write_at, write, fd, it.offset))
            elif self._writes_hashed(it):  # each piece hashed just before it is written
                write_hashing(it, fd, it.offset, durable=self.durable)
            elif it.nbytes:
                write(fd, it.view, it.offset)
        if plan.packed:
            write_packed(fd, plan.packed, packed_off)
            if self.durable:
                _rawio.start_writeback(fd, packed_off, plan.packed_nbytes)


def _write_at(write: Callable[[int, memoryview, int], None], fd: int, base: int,
              piece: memoryview, pos: int) -> None:
    write(fd, piece, base + pos)


def _h5py() -> Any:
    """h5py, loaded on the first write (reading never calls libhdf5)."""
    return importlib.import_module("h5py")


class _H5File:
    """The HDF5 side of a write: datasets allocated early, attributes, the manifest."""

    def __init__(self, name: bytes) -> None:
        h5py = self.h5py = _h5py()
        h5d, h5f, h5p, h5t = h5py.h5d, h5py.h5f, h5py.h5p, h5py.h5t
        self.name = name
        self.fapl = h5p.create(h5p.FILE_ACCESS)
        self.fapl.set_fclose_degree(h5f.CLOSE_STRONG)
        self.fcpl = h5p.create(h5p.FILE_CREATE)
        self.fcpl.set_userblock(USERBLOCK_SIZE)
        self.dcpl = h5p.create(h5p.DATASET_CREATE)
        self.dcpl.set_layout(h5d.CONTIGUOUS)
        self.dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        self.dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        self.lcpl = h5p.create(h5p.LINK_CREATE)
        self.lcpl.set_create_intermediate_group(True)
        self.lcpl.set_char_encoding(h5t.CSET_UTF8)
        self.types: dict[np.dtype, Any] = {}
        self.fid: Any = None  # open from create_structure to finish

    def close(self) -> None:
        """Close the file if :meth:`finish` did not (a write that failed on the way)."""
        fid, self.fid = self.fid, None
        if fid is not None:
            fid.close()

    def _create(self, fid: Any, path: str, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        """Allocate a contiguous dataset, never filled; its byte offset in the file."""
        h5d, h5s, h5t = self.h5py.h5d, self.h5py.h5s, self.h5py.h5t
        tid = self.types.get(dtype)
        if tid is None:
            tid = self.types[dtype] = h5t.py_create(dtype)
        space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
        dsid = h5d.create(fid, path.encode(), tid, space, dcpl=self.dcpl, lcpl=self.lcpl)
        off = dsid.get_offset()
        _close(dsid)
        return int(off) if off is not None else 0

    def create_structure(self, plan: WritePlan) -> int:
        """Create the file with every dataset; sets each array's offset, returns the blob's."""
        h5f = self.h5py.h5f
        fid = self.fid = h5f.create(self.name, h5f.ACC_TRUNC, fcpl=self.fcpl, fapl=self.fapl)
        for it in plan.arrays:
            if it.held is not None:  # the bytes are in another file: link to them
                fid.links.create_external(it.path.encode(), it.held.file.encode(),
                                          b"/" + it.held.path.encode(), lcpl=self.lcpl)
                continue
            if it.delta is not None:  # a group: the base and earlier patches by link
                d = it.delta
                self.h5py.h5g.create(fid, it.path.encode(), lcpl=self.lcpl)
                fid.links.create_external(f"{it.path}/base".encode(), d.base[0].encode(),
                                          b"/" + d.base[1].encode(), lcpl=self.lcpl)
                for j, (f, p, _, _, _) in enumerate(d.earlier):
                    fid.links.create_external(f"{it.path}/patch-{j}".encode(), f.encode(),
                                              b"/" + p.encode(), lcpl=self.lcpl)
                if d.rows.size:
                    d.offset = self._create(fid, d.path, np.dtype("u1"), (d.patch_nbytes,))
                continue
            it.offset = self._create(fid, it.path, storage_dtype(it.dtype), it.shape)
        if not plan.packed:
            return 0
        return self._create(fid, PACKED_PATH, np.dtype("u1"), (plan.packed_nbytes,))

    def finish(self, arrays: list[ValueWrite], record_nbytes: int,
               version: tuple[int, int]) -> int:
        """Put each array's attributes on its dataset and allocate the manifest dataset
        (written by the caller with pwrite like every value: libhdf5's own raw-data
        writes are flushed inside H5Dclose, where a failure is fatal); its offset."""
        h5py = self.h5py
        fid = self.fid
        try:
            attrs = _AttrWriter(h5py)
            root = h5py.h5o.open(fid, b"/")
            try:
                for k, v in root_attrs(version).items():
                    attrs.put(root, k, v)
            finally:
                _close(root)
            for it in arrays:
                if it.held is not None:  # a link: the attributes are the holder's
                    continue
                if it.delta is not None:  # the group says what it is
                    gid = h5py.h5o.open(fid, it.path.encode())
                    try:
                        for k, v in delta_attrs(it).items():
                            attrs.put(gid, k, np.uint32(v) if k == "checksum" else v)
                    finally:
                        _close(gid)
                    continue
                dsid = h5py.h5d.open(fid, it.path.encode())
                try:
                    for k, v in scalar_attrs(it).items():
                        attrs.put(dsid, k, np.uint32(v) if k == "checksum" else v)
                finally:
                    _close(dsid)
            return self._create(fid, MANIFEST_PATH, np.dtype("u1"), (record_nbytes,))
        finally:
            self.close()


def root_attrs(version: tuple[int, int]) -> dict[str, str]:
    """The attributes of an HDF5 checkpoint's root group: what the file is, for a stranger
    looking with ``h5dump -A`` or ``h5py.File(p).attrs`` (ckptvar itself never reads them);
    ``version``: the root record's."""
    return {
        "format": "ckptvar",
        "format_version": f"{version[0]}.{version[1]}",
        "manifest": MANIFEST_PATH,
        "description": (
            "A ckptvar checkpoint: each value is a dataset at its key (small values of a "
            f"checkpoint of many are packed into {PACKED_PATH}); the manifest (msgpack) "
            "lists every value and where its bytes are (docs/FORMAT.md)."
        ),
    }


class _AttrWriter:
    """Scalar attributes through h5py's low-level API, with one type and one dataspace per
    kind of value (h5py's ``attrs[k] = v`` costs ~60 µs each, most of a small dataset's
    write)."""

    def __init__(self, h5py: Any) -> None:
        self.h5py = h5py
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self.types: dict[Any, Any] = {}
        self.str_dtype = h5py.string_dtype()

    def put(self, oid: Any, name: str, value: Any) -> None:
        if isinstance(value, str):
            # an HDF5 string ends at NUL: such a character is written as the text "\x00"
            # (the manifest keeps every key and attribute exactly)
            arr = np.array(value.replace("\x00", "\\x00"), dtype=self.str_dtype)
        elif isinstance(value, list):
            arr = np.asarray(value, dtype=np.int64)
        else:
            arr = np.asarray(value)
        dt = arr.dtype
        types = self.types.get(dt)
        if types is None:  # the file's type, and the bit-for-bit one of the memory
            h5t = self.h5py.h5t
            types = self.types[dt] = (h5t.py_create(dt, logical=True), h5t.py_create(dt))
        space = self.scalar if arr.ndim == 0 else self.h5py.h5s.create_simple(arr.shape)
        aid = self.h5py.h5a.create(oid, name.encode(), types[0], space)
        try:
            aid.write(arr, mtype=types[1])
        finally:
            _close(aid)


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


def make_userblock(record_off: int, record: bytes,
                   version: tuple[int, int] = FORMAT_VERSION) -> bytes:
    """The user block leading a reader to the record (``version``: the record's)."""
    head = _UB.pack(MAGIC, version[0], version[1], record_off, len(record),
                    _checksum.crc(record))
    head += struct.pack("<I", _checksum.crc(head))
    return head + bytes(USERBLOCK_SIZE - len(head))


def read_userblock(fd: int | RemoteFile, path: Any) -> tuple[int, int, int, int, int]:
    """``(major, minor, record_offset, record_nbytes, record_crc)`` from a ckptvar HDF5 file."""
    if fd.__class__ is int:
        head = os.pread(fd, _UB.size + 4, 0)
    else:
        buf = bytearray(_UB.size + 4)
        head = bytes(buf[: _src.pread_into(fd, buf, 0)])
    if len(head) != _UB.size + 4 or head[:12] != MAGIC:
        raise CorruptCheckpointError(f"{str(path)!r} is not a ckptvar HDF5 file (no user block).")
    (crc,) = struct.unpack("<I", head[_UB.size :])
    if crc != _checksum.crc(head[: _UB.size]):
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: the user block (bytes 0-40) is damaged "
            "(its checksum does not match)."
        )
    _, major, minor, off, n, rcrc = _UB.unpack(head[: _UB.size])
    return major, minor, off, n, rcrc


def record_crc(local: Path) -> int:
    """The root record's CRC-32C of the local ckptvar HDF5 file ``local`` (its user block)."""
    fd = os.open(local, os.O_RDONLY)
    try:
        return read_userblock(fd, local)[4]
    finally:
        os.close(fd)


def read_index(local: Path) -> bytes:
    """The index of the local ckptvar HDF5 file ``local``: its user block, then its root
    record (the bytes a reader needs before any value; stored as an object of its own
    beside a remote step, :func:`index_regions`)."""
    fd = os.open(local, os.O_RDONLY)
    try:
        _, _, offset, nbytes, _ = read_userblock(fd, local)
        head = os.pread(fd, USERBLOCK_SIZE, 0)
        body = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(head) != USERBLOCK_SIZE or len(body) != nbytes:
        raise CorruptCheckpointError(f"{str(local)!r}: the file ends inside its root record.")
    return head + body


def write_stand_in(source: RemoteFile, path: Any, dest: Path) -> None:
    """A local sparse stand-in at ``dest`` of the remote ckptvar HDF5 object ``source``
    (``path`` names it in messages): the object's size, its user block and root record
    (what an incremental write reads of its base, :class:`H5Writer`), nothing else.
    Regions ``source`` knows already are not fetched again."""
    regions = dict(source.known)
    if 0 not in regions:  # the user block: one ranged GET
        head = bytearray(min(source.size, USERBLOCK_SIZE))
        source.pread_into(head, 0)
        regions[0] = bytes(head)
        source = RemoteFile(source.location, source.key, source.size, source.base,
                            list(regions.items()))
    _, _, offset, nbytes, _ = read_userblock(source, path)
    if offset < USERBLOCK_SIZE or offset + nbytes > source.size:
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: its root record at [{offset}, {offset + nbytes}) "
            f"lies outside the object ({source.size} bytes); it is damaged."
        )
    if offset not in regions:  # the root record: one ranged GET
        body = bytearray(nbytes)
        source.pread_into(body, offset)
        regions[offset] = bytes(body)
    with open(dest, "wb") as f:
        f.truncate(source.size)
        for at, data in regions.items():
            f.seek(at)
            f.write(data)


def index_regions(raw: bytes, index: RemoteFile, path: Any) -> list[tuple[int, bytes]]:
    """Where the bytes of an index (:func:`read_index`) sit in its file: ``[(0, user
    block), (record offset, root record)]``. ``index`` is the index object itself, for
    messages; ``CorruptCheckpointError`` if the two parts do not fit each other."""
    head, body = raw[:USERBLOCK_SIZE], raw[USERBLOCK_SIZE:]
    if len(head) < USERBLOCK_SIZE:
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: its index object {index.location.join(index.key)} "
            f"is damaged (it ends inside its user block)."
        )
    _, _, offset, nbytes, _ = read_userblock(index, path)
    if nbytes != len(body):
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: its index object {index.location.join(index.key)} "
            f"holds {len(body)} record bytes, its user block says {nbytes}; it is damaged."
        )
    return [(0, head), (offset, body)]


def _read_exact(fd: int | RemoteFile, offset: int, n: int, *, what: str, path: Any) -> bytes:
    if fd.__class__ is int:
        return _rawio.pread_exact(fd, offset, n, what=what, path=path)
    buf = bytearray(n)
    got = _src.pread_into(fd, buf, offset)
    if got != n:
        raise CorruptCheckpointError(
            f"{what} in {str(path)!r} is truncated: {got} of {n} bytes at offset {offset}."
        )
    return bytes(buf)


#: Where the HDF5 superblock's fields start, by its version: v0 and v1 (after the B-tree
#: parameters; v1 has four more bytes), v2 and v3 (after the flags). The end-of-file
#: address is the third address (after the base and one more).
_SUPERBLOCK_ADDRESSES = {0: 24, 1: 28, 2: 12, 3: 12}


def _check_end(fd: int, size: int, path: Any) -> None:
    """Refuse a local file shorter than its HDF5 superblock (after the user block) says:
    truncated behind the values and the record, which h5py refuses too. One small read;
    a file without a superblock there (a sparse stand-in of a remote base) is left be."""
    head = os.pread(fd, 96, USERBLOCK_SIZE)
    at = _SUPERBLOCK_ADDRESSES.get(head[8]) if head[:8] == _HDF5_SIGNATURE else None
    if at is None:
        return
    width = head[13] if head[8] < 2 else head[9]  # the size of an address
    raw = head[at + 2 * width : at + 3 * width]
    if width not in (2, 4, 8) or len(raw) != width:
        return
    stored = int.from_bytes(raw, "little")
    if size < stored < (1 << (8 * width)) - 1:  # all ones: an undefined address
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r} is truncated: it should be {stored} bytes long (its "
            f"HDF5 superblock says so) but is {size}; the checkpoint is damaged."
        )


def _load_record(fd: int | RemoteFile, size: int, path: Any) -> Record:
    major, minor, off, n, rcrc = read_userblock(fd, path)
    if isinstance(fd, int):
        _check_end(fd, size, path)
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
    data = _read_exact(fd, off, n, what="The root record", path=path)
    if _checksum.crc(data) != rcrc:
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: the root record fails its checksum; "
            "the file is damaged."
        )
    record = decode(data, path, container="h5", file_size=size)
    _check_h5_regions(record, path, size, (off, n))
    return record


class _Linked(Exception):
    """A holder named by a record is a symbolic link, or inside one."""


def _open_beside(here: Path, name: str) -> int:
    """A descriptor of the holder ``name`` (a sibling file, or ``../<step>/<file>``) beside
    the directory ``here``, opened without following a symbolic link to the step or the
    file (``here`` is the caller's own path and may be one)."""
    cloexec = getattr(os, "O_CLOEXEC", 0)
    folder, file, nofollow = here, name, 0
    if name.startswith("../"):
        step, file = name[3:].split("/")
        folder, nofollow = here / ".." / step, os.O_NOFOLLOW
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | nofollow | cloexec)
        try:
            return os.open(file, os.O_RDONLY | os.O_NOFOLLOW | cloexec, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(folder)):
            raise _Linked from None
        raise


class H5Reader(ContainerReader, SupportsShared):
    """Reads a ckptvar ``.h5`` file with ``pread`` only (libhdf5 is never called).

    ``source`` reads the file's bytes from an object store instead (ranged GETs);
    ``path`` is then its URL, and ``holders(name)`` the object that holds an incremental
    step's external values, ``name`` as the record gives it (a step beside it, or
    ``../<step>/<file>`` for a process's file of a multi-process step;
    ``FileNotFoundError`` when gone, ``ValueError`` for a name it does not take).
    """

    format = "h5"

    def __init__(self, path: Path | str, *, source: RemoteFile | None = None,
                 holders: Callable[[str], RemoteFile] | None = None) -> None:
        fd: int | RemoteFile
        if source is None:
            path = Path(path)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.") from None
        else:
            fd = source
        try:
            if source is None:
                st = os.fstat(fd)  # type: ignore[arg-type]
                if stat.S_ISDIR(st.st_mode):
                    raise UnsupportedFormatError(
                        f"{str(path)!r} is a directory, not an HDF5 file (nor a "
                        "multi-process step: it holds no complete step index)."
                    )
                size = st.st_size
            else:
                size = source.size
            record = _load_record(fd, size, path)
        except BaseException:
            _src.close(fd)
            raise
        self._fd = fd
        self._mm: Any = None
        self._holders: dict[str, int | RemoteFile] = {}  # where external values are, opened
        self._find_holder = holders
        #: a delta value's patches, read and checked on the I/O threads from the first
        #: time it is opened (folded into one when laid twice), once per reader
        self._patches: dict[str, Patches] = {}
        #: a delta value's base (this file's descriptor or a holder's), its range checked
        self._delta_bases: dict[str, Any] = {}
        self._delta_lock = threading.Lock()
        super().__init__(path, record)
        self._packed_base = record.packed[1] if record.packed else 0
        self._packed: int | RemoteFile = fd
        if source is not None and record.packed:
            # A window of the object: mapping it (verify) fetches the packed blob only.
            self._packed = RemoteFile(source.location, source.key, record.packed[2],
                                      source.base + self._packed_base)
            self._packed_base = 0

    def _open_array(self, key: str, entry: Entry) -> Source:
        self.check_open()
        if self._record.deltas and key in self._record.deltas:
            return Source(self._patched(key, entry), 0, True)
        if self._record.external and key in self._record.external:
            return Source(self._holder(key, entry), entry.loc.offset, False)
        return Source(self._fd, entry.loc.offset, False)

    def corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        """The error saying value ``key`` ``what``; a row delta's says where its base is
        when its assembled bytes fail a checksum (:func:`.delta.in_base`)."""
        d = self._record.deltas.get(key) if self._record.deltas else None
        return super().corrupt(key, what if d is None else in_base(what, d, Path(self.path).name))

    def _patched(self, key: str, entry: Entry) -> Patched:
        """A delta value (format 1.5): its base's bytes with its patches laid over them,
        their reads started at its first open (one thread at a time: the I/O threads may
        open a value at once)."""
        d = self._record.deltas[key]
        expect = self.base_expect(key, entry)
        if self.remote:  # the steps holding the base and patches: found in parallel
            steps = dict.fromkeys(f for f in (d.base[0], *(p[0] for p in d.patches))
                                  if f and f not in self._holders)
            if len(steps) > 1:
                _rawio.wait_all(_rawio.start_all(
                    [functools.partial(self._remote_holder, key, f) for f in steps]))
        with self._delta_lock:
            base = self._delta_bases.get(key)  # checked at its first open
            if base is None:
                base = self._delta_bases[key] = self._file(key, d.base[0], d.base[2],
                                                           entry.nbytes)
            patches = self._patches.get(key)
            if patches is None:
                rb = entry.nbytes // entry.shape[0]
                here = Path(self.path).name
                reads = [(self._file(key, f, off, 8 * n + n * rb), off, n, crc,
                          f"{p!r} in {f or here!r}")
                         for f, p, off, n, crc in d.patches]
                # verified by its parts, the patches are laid once: in order, no fold first
                patches = self._patches[key] = read_patches(
                    key, reads, rb, entry.shape[0],
                    seed=_checksum.header_crc(key, entry.dtype, entry.shape),
                    corrupt=self.corrupt, fold_all=expect is None)
        return Patched(base, d.base[2], entry.nbytes, entry.nbytes // entry.shape[0], patches,
                       owned=False, expect=expect)

    def _file(self, key: str, name: str, offset: int, nbytes: int) -> Any:
        """The descriptor holding ``nbytes`` of ``key``'s bytes at ``offset``: this file
        (``name`` empty) or a sibling's, the range checked against its size."""
        if not name:
            size = os.fstat(self._fd).st_size if self._fd.__class__ is int else self._fd.size  # type: ignore[union-attr]
            if offset < USERBLOCK_SIZE or offset + nbytes > size:
                raise self.corrupt(key, f"has bytes at [{offset}, {offset + nbytes}) outside "
                                        f"its file ({size} bytes)")
            return self._fd
        return self._open_holder(key, name, offset, nbytes)

    def _holder(self, key: str, entry: Entry) -> int | RemoteFile:
        """The descriptor of the sibling file holding ``key``'s bytes (an incremental step),
        its byte range checked against its size."""
        return self._open_holder(key, self._record.external[key][0], entry.loc.offset,
                                 entry.nbytes)

    def _open_holder(self, key: str, name: str, offset: int,
                     nbytes: int) -> int | RemoteFile:
        """The descriptor (or object) of the sibling file ``name`` holding ``nbytes`` of
        ``key``'s bytes at ``offset`` (an incremental step), the range checked against its
        size."""
        fd = self._holders.get(name)
        if fd is None and self.remote:
            fd = self._remote_holder(key, name)
        if fd is None:
            try:
                fd = _open_beside(Path(self.path).parent, name)
            except _Linked:
                raise CorruptCheckpointError(
                    f"Checkpoint {str(self.path)!r}: the bytes of {key!r} are in {name!r} "
                    "beside it (an incremental step), which is reached through a symbolic "
                    "link; refused (a step's values are read only from the steps beside it)."
                ) from None
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"Checkpoint {str(self.path)!r}: the bytes of {key!r} are in {name!r} "
                    "beside it (an incremental step), which is gone."
                ) from None
            except OSError as exc:  # a symlink (ELOOP), a directory, no permission
                raise CorruptCheckpointError(
                    f"Checkpoint {str(self.path)!r}: the bytes of {key!r} are in {name!r} "
                    f"beside it (an incremental step), which cannot be read ({exc.strerror})."
                ) from None
            try:
                size = os.fstat(fd).st_size
                _check_end(fd, size, Path(self.path).parent / name)
            except BaseException:
                os.close(fd)
                raise
            self._holders[name] = fd
        else:
            size = fd.size if isinstance(fd, RemoteFile) else os.fstat(fd).st_size
        # a value with no bytes (no rows) has no storage: HDF5 gives it no address
        if nbytes and (offset < USERBLOCK_SIZE or offset + nbytes > size):
            raise CorruptCheckpointError(
                f"Checkpoint {str(self.path)!r}: the bytes of {key!r} at "
                f"[{offset}, {offset + nbytes}) lie outside "
                f"{name!r} ({size} bytes), the file that holds them."
            )
        return fd

    def _remote_holder(self, key: str, name: str) -> RemoteFile:
        """The object of step ``name`` beside this remote step, which holds ``key``'s bytes."""
        if self._find_holder is None:
            raise UnsupportedFormatError(
                f"Checkpoint {str(self.path)!r} is an incremental step: {key!r} is stored in "
                f"{name!r}, which this reader cannot reach."
            )
        try:
            found = self._find_holder(name)
        except (OSError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"Checkpoint {str(self.path)!r}: the bytes of {key!r} are in the step "
                f"{name!r} beside it (an incremental step), which cannot be read: {exc}."
            ) from None
        self._holders[name] = found
        return found

    def packed_source(self) -> tuple[int | RemoteFile, int]:
        self.check_open()
        return self._packed, self._packed_base

    def _mmap_region(self, key: str, entry: Entry) -> tuple[Any, int, bool]:
        self.check_open()
        if self._fd.__class__ is not int or (self._record.external
                                             and key in self._record.external) or (
                self._record.deltas and key in self._record.deltas):
            return super()._mmap_region(key, entry)
        if self._mm is None:
            self._mm = _src.map_all(self._fd)
        if entry.loc.kind == PACKED:
            return self._mm, self._packed_base + entry.loc.offset, False
        return self._mm, entry.loc.offset, False

    def shared(self) -> dict[str, list[str]]:
        """The values an incremental step refers to: key -> [the files that hold their
        bytes] (a row delta: its base's holder first, then its earlier patches')."""
        out = {key: [file] for key, (file, _) in self._record.external.items()}
        for key, d in self._record.deltas.items():
            out[key] = list(dict.fromkeys(f for f in (d.base[0], *(p[0] for p in d.patches))
                                          if f))
        return out

    def close(self) -> None:
        if not self._closed:
            mm = self._mm
            if mm is not None and hasattr(mm, "close"):
                with contextlib.suppress(BufferError):  # a view of it is still alive
                    mm.close()
            for patches in self._patches.values():  # no read left on the descriptors
                patches.close()
            self._patches.clear()
            self._delta_bases.clear()
            _src.close(self._fd)
            for fd in self._holders.values():
                _src.close(fd)
            self._holders.clear()
        super().close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()


def _check_h5_regions(record: Record, path: Any, size: int, record_region: tuple[int, int]) -> None:
    """Refuse values, the packed blob, the record and the user block that overlap or end
    past the file (one sort over all of them)."""
    fixed: list[tuple[int, int, str]] = [(0, USERBLOCK_SIZE, "the user block")]
    fixed.append((record_region[0], record_region[1], "the root record"))
    if record.packed is not None:
        fixed.append((record.packed[1], record.packed[2], "the packed values"))
    cols = record.columns
    # an incremental step's values in other files (and row deltas): checked when read
    ext = {**record.external, **record.deltas} if record.deltas else record.external
    if cols is None:
        keys = [k for k, e in record.values.items() if e.loc.kind == ARRAY and k not in ext]
        starts = np.array([record.values[k].loc.offset for k in keys], np.int64)
        sizes = np.array([record.values[k].nbytes for k in keys], np.int64)
    else:
        mask = ~cols.packed
        if ext:
            mask &= np.array([k not in ext for k in cols.keys], bool)
        own = np.flatnonzero(mask)
        keys = [cols.keys[i] for i in own.tolist()]
        starts, sizes = cols.offsets[own], cols.nbytes[own]
    check_regions(fixed, path, size, ValueRanges(starts, sizes, keys))


class H5Backend(
    Backend, name="h5", suffixes=(".h5", ".hdf5"), writer=H5Writer, hands_over_unrecognised=True,
    sniff_priority=10,
):
    """ckptvar's own HDF5 files."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) == MAGIC
        except OSError:
            return False

    @classmethod
    def open_reader(cls, path: Path) -> H5Reader:
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
            with open(path, "rb") as f:
                head = f.read(8)
            if head == _HDF5_SIGNATURE:
                raise UnsupportedFormatError(
                    f"{str(path)!r} is an HDF5 file that ckptvar did not write, and no "
                    "registered reader recognises its layout."
                )
            if path.stat().st_size == 0:
                raise CorruptCheckpointError(f"{str(path)!r} is empty (0 bytes): not an HDF5 file.")
            with open(path, "rb") as f:
                f.seek(USERBLOCK_SIZE)
                behind = f.read(8)
            if behind == _HDF5_SIGNATURE:  # an HDF5 file after a user block: ours, damaged
                raise CorruptCheckpointError(
                    f"{str(path)!r} is an HDF5 file with a user block but no ckptvar magic "
                    "in it; the checkpoint is damaged."
                )
            raise CorruptCheckpointError(
                f"{str(path)!r} is not an HDF5 file (it does not start with the HDF5 "
                "signature), so not a checkpoint ckptvar can read."
            )
        return H5Reader(path)


def external_files(path: Path) -> set[str]:
    """The sibling checkpoints whose bytes the checkpoint at ``path`` refers to (an
    incremental HDF5 step's external values and its row deltas' bases and patches, format
    1.5; for a multi-process step directory, those
    of its per-process ``.h5`` files, by the step that holds them); empty for anything
    else, or nothing at ``path``."""
    path = Path(path)
    if path.is_dir():  # a multi-process step: its per-process files
        out: set[str] = set()
        for sub in sorted(path.glob("rank-*.h5")):
            out.update(holder_step(f) for f in _external_names(sub))
        return out
    return _external_names(path)


def _external_names(path: Path) -> set[str]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return set()
    record = _RECORDS.get(path, st)
    if record is None:
        if not stat.S_ISREG(st.st_mode) or not H5Backend.sniff(path):
            return set()
        record = _committed_record(path)
    out = {file for file, _ in record.external.values()}
    for d in record.deltas.values():
        out.update(d.files())
    return out


#: Decoded records of committed files (:class:`KeptRecords`): an incremental step's
#: record is read after its commit (what it refers to) and again as the next step's base.
_RECORDS = KeptRecords()


def _committed_record(path: Path) -> Record:
    """The root record of the committed ckptvar HDF5 file ``path`` (a committed file is
    never changed in place: its identity and size name its record)."""
    return _committed(path).record


def _committed(path: Path) -> Kept:
    """What is kept of the committed file ``path``: its record (read if not kept) and
    the rows of its patches where this process wrote them (:class:`.reuse.Kept`)."""
    st = os.stat(path)
    kept = _RECORDS.find(path, st)
    if kept is None:
        reader = H5Reader(path)
        try:
            record = reader.record
        finally:
            reader.close()
        _RECORDS.keep(path, record, st)
        return Kept(record)
    return kept


def _keep_record(path: Path, record: bytes, rows: PatchRows | None = None) -> None:
    """Keep the record bytes a writer just committed to ``path`` as its decoded record
    (what :func:`_committed_record` would read back: the same bytes, the same checks),
    and the rows of its patches as written (``rows``)."""
    st = os.stat(path)
    _RECORDS.keep(path, decode(record, path, container="h5", file_size=st.st_size), st,
                  rows)


register_backend(H5Backend)
