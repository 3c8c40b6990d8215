"""The Zarr v3 backend (``.zarr`` directories): a valid Zarr v3 hierarchy, written directly.

zarr-python's per-array API costs milliseconds per array, so the writer lays
out the hierarchy's files itself (docs/FORMAT.md, "Zarr v3 container"): a
``zarr.json`` per group and per array, and one chunk file per non-empty array
holding the whole value (regular chunk grid with ``chunk_shape == shape``,
``bytes`` codec, little endian), written straight from the array's buffer while
the checksum thread hashes it. Small values share the single chunk of the 1-D
``uint8`` array ``_ckptvar/packed``; the root record is the single chunk of
``_ckptvar/record``, and the root group's ``zarr.json`` attributes say where it
is, how long it is and its CRC-32C.

Compression is opt-in (``compression="zstd" | "gzip" | "blosc"``) and then uses
zarr-python's own codecs for the values stored as arrays, in chunks of about 4 MiB
along the first axis (whole rows; a staged GPU tensor's compressed as its pieces
arrive), so a read holds one chunk at a time and a lazy slice decodes them in turn
(:mod:`._zarr_chunks`). With ``piece_bytes`` (an
incremental manager's local steps) a value larger than that is stored as several chunks
along its first axis instead of one (format 1.4, docs/FORMAT.md "Pieces"), so that a
step shares its unchanged chunks with the base step by hard link.

Reading uses only the root ``zarr.json``, the record and the chunk files; every
path is opened component by component without following symlinks, and a
missing chunk of a non-empty array is an error (Zarr itself would silently
return fill values).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    ValueWrite,
    WritePlan,
    delta_attrs,
    scalar_attrs,
    storage_dtype,
    write_packed,
)
from ._container.blocks import BLOCK_SIZE, block_crcs, join_blocks
from ._container.delta import DeltaWrite, Patches, in_base, read_patches
from ._container.reuse import BaseFileLost, Held, KeptRecords
from ._container.source import Patched, Pieces
from ._record import ARRAY, Delta, Entry, Extent, Record, decode
from ._zarr_chunks import ChunkMismatch, decode_rows, in_row_chunks
from ._zarr_files import (
    GROUP_DOC,
    O_DIR,
    RECORD_PATH,
    array_meta,
    chunk_key,
    fill_value,
    open_in,
    piece_key,
    piece_rows,
    raise_if_deleted,
    read_root_meta,
    root_record_ref,
    write_file,
)
from .atomic import fsync_all, remove_path
from .base import Backend, SupportsShared
from .chunked import Regroup
from .registry import register_backend

logger = logging.getLogger("ckptvar")

__all__ = ["PIECE_BYTES", "RECORD_PATH", "ZarrBackend", "ZarrReader", "ZarrWriter", "chunk_key"]

#: The size of the chunks of a value stored as several (``piece_bytes=True``; format 1.4).
PIECE_BYTES = 4 << 20

_CODECS = ("zstd", "gzip", "blosc")

#: A reader keeps at most this many descriptors of row deltas' base chunk files open
#: between opens of their values (a 1 GiB base in 4 MiB chunks: 256).
_HOLD_BASES = 256

#: About the size of a chunk of a compressed value (whole rows): what a read or a lazy
#: slice holds decoded at once; a staged GPU tensor's are compressed as they arrive.
COMPRESSED_CHUNK = 4 << 20

#: The largest object one server-side copy takes (S3 ``CopyObject``): a larger reused chunk
#: of an object-store step is written again instead.
COPY_LIMIT = 5 * 2**30

#: Decoded records of the local incremental steps this process committed, by their record
#: file (:class:`KeptRecords`): the next step's base, not read back.
_RECORDS = KeptRecords()


class ZarrWriter(ContainerWriter):
    """Writes one ``.zarr`` directory (see the module docstring)."""

    container = "zarr"
    is_directory = True

    @classmethod
    def replaceable(cls, path: Path) -> bool:
        return ZarrBackend.sniff(path)

    def __init__(
        self,
        path: Path,
        *,
        compression: str | None = None,
        compression_level: int | None = None,
        copies: list[tuple[str, str]] | None = None,
        piece_bytes: int | bool | None = None,
        spare: Path | None = None,
        **options: Any,
    ) -> None:
        """``copies``: a reused chunk file (or array document) is not linked but listed
        there as ``(path in the base, path in the new checkpoint)``, both relative, for
        the caller to copy (an object store's incremental step: ``base`` then holds
        only the base's record, read from the store). ``piece_bytes`` (``True``:
        :data:`PIECE_BYTES`): an uncompressed value larger than that is stored as several
        chunks of about that size along its first axis (format 1.4), so that an
        incremental step shares its unchanged chunks. ``spare``: a pruned step of the same
        directory, set aside (renamed to a temporary name) for this save to take as its
        staging directory: the array directories of it that hold the very files this step
        links are kept as they are (:meth:`_Tree.recycle`), the rest is removed; the
        writer owns it from now on (removed when it is not used)."""
        self.copies = copies
        self.spare = None if spare is None else Path(spare)
        if piece_bytes is True:
            piece_bytes = PIECE_BYTES
        if piece_bytes is not None and (piece_bytes is False or int(piece_bytes) < BLOCK_SIZE):
            raise ValueError(f"piece_bytes must be at least {BLOCK_SIZE}, got {piece_bytes!r}.")
        self.piece_bytes = None if piece_bytes is None else int(piece_bytes)
        self._base_record: Record | None = None
        self._record_bytes: bytes | None = None  # the record written, once it is
        #: per key: the chunks the base holds unchanged -> the base's chunk file
        self._held_pieces: dict[str, dict[int, str]] = {}
        #: per key: the base's block checksums and array directory, for a value whose
        #: chunks are compared with the base's as they are written (:class:`_Compare`)
        self._compare: dict[str, _Compare] = {}
        if compression in (False, "none"):
            compression = None
        if compression is not None and compression not in _CODECS:
            raise UnsupportedFormatError(
                f"Unknown Zarr compression {compression!r}; choose one of {', '.join(_CODECS)} "
                "or None."
            )
        self.compression = compression
        self.compression_level = compression_level
        super().__init__(path, **options)

    def _open_base(self, base: Path) -> tuple[Any, Any] | None:
        """An incremental save's base: its record; a value's bytes are its chunk file
        there, which the new step hard-links (so every step stands alone)."""
        if self.compression is not None:
            return None  # compressed values are written by zarr-python: always whole
        kept = _RECORDS.find(base / RECORD_PATH / chunk_key(1))
        if kept is None:  # not kept as this process wrote it (:meth:`commit`): read
            reader = ZarrReader(base)
            record = reader.record
            reader.close()
        else:  # and the rows of its patches, as written
            record, self.base_patch_rows = kept.record, kept.rows
        self._base_record = record

        def holder(key: str, entry: Entry) -> Held:
            path = entry.loc.path or ""
            return Held(os.fspath(base / path / chunk_key(len(entry.shape))), path, 0)

        return record, holder

    def _open_base_reader(self, base: Path) -> ZarrReader:
        return ZarrReader(base)

    def commit(self) -> Path:
        """Write and publish the directory; a local incremental step's record is then kept
        as written (decoded with the checks of a read, by the identity of its record file:
        :class:`.reuse.KeptRecords`), so the next step's read of its base opens nothing."""
        path = super().commit()
        record = self._record_bytes
        if record is not None and self.copies is None and (self.base is not None or self.rows):
            with contextlib.suppress(OSError, CkptError):  # a read later does it instead
                _RECORDS.keep(path / RECORD_PATH / chunk_key(1),
                              decode(record, path, container="zarr"), rows=self.patch_rows)
        return path

    def _delta_for(self, it: ValueWrite, entry: Entry, was: Delta | None,
                   holder: Any) -> DeltaWrite | None:
        """A Zarr delta takes the base's whole copy and earlier patches into this step by
        hard link (so the step stands alone); its own patch is an array here. On an object
        store (``copies``) they are server-side copies instead, of a base in one chunk
        object that one copy can take."""
        if self.compression is not None or self.base is None:
            return None
        rec = self._base_record
        if rec is None:
            return None
        if self.copies is not None and (it.key in rec.pieces or entry.nbytes > COPY_LIMIT):
            return None
        if was is None:
            src, earlier, since = entry.loc.path or "", [], _step_name(self.base, self.path)
        else:
            src, since = was.base[1], was.since
            earlier = [("", f"{it.path}/patch-{j}", 0, n, c)
                       for j, (_, _, _, n, c) in enumerate(was.patches)]
        out = DeltaWrite(("", f"{it.path}/base", 0), earlier, np.empty(0, np.int64), 0, since,
                         pieces=rec.pieces.get(it.key))
        out.links = [(src, f"{it.path}/base")]
        if was is not None:
            out.links += [(p, f"{it.path}/patch-{j}") for j, (_, p, _, _, _) in
                          enumerate(was.patches)]
        out.path = f"{it.path}/patch-{len(earlier)}"
        return out

    def rows_of(self, it: ValueWrite) -> int | None:
        """Rows per chunk of a value stored as several chunks; ``None``: one chunk."""
        if it.delta is not None:
            return it.delta.pieces
        if self.piece_bytes is None or self.compression is not None or not it.nbytes:
            return None
        return piece_rows(it.shape, it.nbytes, self.piece_bytes, BLOCK_SIZE)

    def _pieces(self, items: list[ValueWrite]) -> dict[str, int] | None:
        out = {}
        for it in items:
            rows = None if it.packed else self.rows_of(it)
            if rows is not None:
                out[it.key] = rows
        return out or None

    def _match_base(self, plan: WritePlan, base: Path) -> None:
        """As every container's, with the chunks of a value stored as several: a value
        the base holds whole must be chunked alike; otherwise each chunk whose block
        checksums equal the base's is shared. A chunk to be copied on a server must fit
        one copy."""
        super()._match_base(plan, base)
        rec = self._base_record
        for it in plan.arrays:
            rows = self.rows_of(it)
            was = None if rec is None else rec.pieces.get(it.key)
            if it.held is not None and was != rows:
                it.held = None  # the base's chunks are not this step's
            if (it.held is None and it.delta is None and rows is not None and rows == was
                    and rec is not None and it.key not in rec.deltas):
                self._match_pieces(it, rows, rec, base)
        self.reused = [it.key for it in plan.arrays if it.held is not None]
        if self.copies is None:
            return
        for it in plan.arrays:
            if it.held is not None and it.nbytes > COPY_LIMIT:
                it.held = None  # written (and hashed) like a changed value
        self.reused = [it.key for it in plan.arrays if it.held is not None]

    def _match_pieces(self, it: ValueWrite, rows: int, rec: Record, base: Path) -> None:
        """Note the chunks of ``it`` whose bytes the base holds, by block checksums: a host
        value's chunk by chunk as they are written (:meth:`_Tree._write_compared`), a value
        that comes in pieces (a GPU tensor) hashed now, before the write."""
        entry = rec.values.get(it.key)
        if (entry is None or entry.loc.kind != ARRAY or entry.dtype != it.dtype
                or tuple(entry.shape) != it.shape or entry.blocks is None
                or rec.block_size != BLOCK_SIZE):  # a base of other blocks: written whole
            return
        if not it.hashed and it.source is None and it.nbytes > BLOCK_SIZE:  # as written
            self._compare[it.key] = _Compare(entry.blocks, base / (entry.loc.path or ""))
            return
        if not it.hashed:
            it.hash(parallel=True)  # before the write, which waits for it
            it.hashed = True
        if it.blocks is None:
            return
        per = rows * (it.nbytes // it.shape[0]) // BLOCK_SIZE  # blocks per chunk
        held = {}
        for i in range(-(-it.shape[0] // rows)):
            a, b = 4 * i * per, 4 * (i + 1) * per
            if it.blocks[a:b] == entry.blocks[a:b]:
                held[i] = os.fspath(base / (entry.loc.path or "") / piece_key(len(it.shape), i))
        if held:
            self._held_pieces[it.key] = held

    def _writes_hashed(self, it: ValueWrite) -> bool:
        return it.key in self._compare

    def _array_loc(self, it: ValueWrite) -> Extent:
        if self.compression is not None:
            return Extent.zarr(it.path, it.nbytes)
        return Extent.array(it.path, 0, it.nbytes)

    def _write_array_docs(
        self, tree: _Tree, tmp: Path, plan: WritePlan, arr_dirs: list[Path]
    ) -> None:
        """Each value's ``zarr.json`` (a reused one linked), once its checksums are known."""
        raw = self.compression is None
        for it, d in zip(plan.arrays, arr_dirs, strict=True):
            sdt = storage_dtype(it.dtype)
            if it.path in tree.kept:  # the spare's: the base's document already
                continue
            if it.delta is not None:  # a group: what it is, in its attributes
                doc = {"zarr_format": 3, "node_type": "group", "attributes": delta_attrs(it)}
                write_file(d / "zarr.json", _doc(doc), tree.sync, replace=True)
            elif it.held is not None and it.held.same_attrs:  # the same document: share it
                tree.link(os.fspath(Path(it.held.file).parent / "zarr.json"), d / "zarr.json")
            elif raw:
                meta = array_meta(it.shape, sdt, scalar_attrs(it))
                rows = self.rows_of(it)
                if rows is not None:
                    meta["chunk_grid"]["configuration"]["chunk_shape"][0] = rows
                tree.write(d / "zarr.json", _doc(meta))
            else:
                self._write_compressed(tmp, it, sdt)

    def _tree(self, tmp: Path, deferred: tuple[Path, list[tuple[str, str]]] | None,
              plan: WritePlan) -> _Tree:
        """The tree to write into ``tmp``: the spare taken over where it can be."""
        spare, self.spare = self.spare, None
        if spare is not None and (self.compression is not None or deferred is not None
                                  or self.base is None or not self.durable):
            remove_path(spare)  # of no use here
            spare = None
        tree = _Tree(tmp, [] if self.durable else None, deferred, spare=spare)
        tree.base = self.base
        tree.compare = self._compare
        if tree.recycled:
            tree.recycle(plan.arrays, self.rows_of)
        return tree

    def _write(self, tmp: Path, plan: WritePlan) -> None:
        deferred = None
        if self.copies is not None and self.base is not None:
            deferred = (self.base, self.copies)
        tree = self._tree(tmp, deferred, plan)
        raw = self.compression is None
        # 1. the bytes, straight from the buffers (hashing runs meanwhile)
        arr_dirs = tree.write_chunks(plan.arrays, raw, self.rows_of, self._held_pieces)
        pd = tree.array_dir(PACKED_PATH) if plan.packed else None
        if pd is not None and plan.packed_nbytes:
            def packed_bytes(fd: int) -> None:
                write_packed(fd, plan.packed, 0)
                if tree.sync is not None:
                    _rawio.start_writeback(fd, 0, plan.packed_nbytes)

            tree.write(pd / chunk_key(1), packed_bytes)
        else:  # only empty values (a zero-size Zarr array has no chunk): hash them here
            for it in plan.packed:
                it.hash()
        plan.wait_hashes()
        # 2. metadata that needs the checksums
        self._write_array_docs(tree, tmp, plan, arr_dirs)
        if pd is not None:
            meta = array_meta((plan.packed_nbytes,), np.dtype("u1"), {"ckptvar": "packed values"})
            tree.write(pd / "zarr.json", _doc(meta))
        record = self._record_bytes = self._encode_record((PACKED_PATH, 0, plan.packed_nbytes))
        rd = tree.array_dir(RECORD_PATH)
        meta = array_meta((len(record),), np.dtype("u1"), {"ckptvar": "root record (msgpack)"})
        tree.write(rd / "zarr.json", _doc(meta))
        if record:
            tree.write(rd / chunk_key(1), record)
        root_attrs = {
            "format": "ckptvar",
            "format_version": "{}.{}".format(*self.record_version),
            "manifest": RECORD_PATH,
            "description": (
                "A ckptvar checkpoint: each value is an array at its key (small values of a "
                f"checkpoint of many are packed into {PACKED_PATH}); the manifest (msgpack) "
                "lists every value and where its bytes are (docs/FORMAT.md)."
            ),
            "ckptvar": {
                "format_version": list(self.record_version),
                "record": RECORD_PATH,
                "record_nbytes": len(record),
                "record_crc32c": _checksum.crc(record),
            }
        }
        root = {"zarr_format": 3, "node_type": "group", "attributes": root_attrs}
        write_file(tmp / "zarr.json", _doc(root), tree.sync, replace=True)
        if tree.sync is not None:  # each once (a document written again is listed twice)
            fsync_all(list(dict.fromkeys(tree.sync)), tree.dirs[1:])  # the root: by publish()

    def _write_compressed(self, tmp: Path, it: ValueWrite, sdt: np.dtype) -> None:
        zarr = zarr_api()
        level = self.compression_level
        if self.compression == "zstd":
            codec: Any = zarr.codecs.ZstdCodec(level=3 if level is None else level)
        elif self.compression == "gzip":
            codec = zarr.codecs.GzipCodec(level=5 if level is None else level)
        else:
            codec = zarr.codecs.BloscCodec(cname="zstd", clevel=5 if level is None else level)
        (tmp / it.path).rmdir()  # zarr creates the node itself
        arr = zarr.create_array(
            store=zarr.storage.LocalStore(tmp),
            chunk_key_encoding=zarr.core.chunk_key_encodings.DefaultChunkKeyEncoding(separator="."),
            name=it.path,
            shape=it.shape,
            chunks=(self._compressed_rows(it), *(max(1, d) for d in it.shape[1:]))
            if it.shape else (),
            dtype=sdt,
            compressors=[codec],
            fill_value=0j if sdt.kind == "c" else fill_value(sdt),  # (JSON: [0.0, 0.0])
            attributes=scalar_attrs(it),
            overwrite=False,
        )
        if it.source is not None:  # compressed a chunk at a time as the pieces come
            self._fill_compressed(arr, it, sdt)
        elif it.nbytes:
            arr[...] = it.array.view(sdt)

    @staticmethod
    def _compressed_rows(it: ValueWrite) -> int:
        """Rows per chunk of a compressed value: about :data:`COMPRESSED_CHUNK` bytes of
        whole rows (at least one row; a 0-d or empty value: one chunk)."""
        if len(it.shape) == 0 or not it.nbytes:
            return max(1, it.shape[0]) if it.shape else 1
        row = it.nbytes // it.shape[0]
        return max(1, min(it.shape[0], COMPRESSED_CHUNK // row))

    def _fill_compressed(self, arr: Any, it: ValueWrite, sdt: np.dtype) -> None:
        """Write chunked value ``it`` into zarr array ``arr`` chunk by chunk, hashing it."""
        rows = arr.chunks[0] if it.shape else 1
        row = it.nbytes // it.shape[0] if it.shape else it.nbytes
        tail = tuple(it.shape[1:])

        def put(run: memoryview, i: int) -> None:
            n = len(run) // row
            block = np.frombuffer(run, np.uint8).view(sdt).reshape((n, *tail))
            if it.shape:
                arr[i * rows: i * rows + n] = block
            else:
                arr[...] = block.reshape(())

        regroup = Regroup(rows * row, put)
        it.write_with(lambda piece, pos: regroup.push(piece))
        regroup.finish()


def zarr_api() -> Any:
    """zarr-python, loaded only for compressed arrays (with the modules used from it)."""
    for name in ("zarr.codecs", "zarr.storage", "zarr.core.chunk_key_encodings"):
        importlib.import_module(name)
    return importlib.import_module("zarr")


def _doc(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


#: At most this many array directories to make: made on the writing thread, not ahead of
#: the writes on an I/O thread (whose start and hand-over cost more than they save).
_INLINE_DIRS = 4


def _sharing(siblings: list[tuple[str, Path]], rel: str, ident: tuple[int, int]) -> list[str]:
    """The names of the ``siblings`` (name, checkpoint) whose file ``rel`` is the file
    ``ident`` (device, inode)."""
    out = []
    for name, other in siblings:
        try:
            st = os.stat(other / rel, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == ident:
            out.append(name)
    return out


class _Tree:
    """The directories and files of a Zarr checkpoint being written under ``root``."""

    def __init__(self, root: Path, sync: list[Path] | None,
                 deferred: tuple[Path, list[tuple[str, str]]] | None = None,
                 spare: Path | None = None) -> None:
        self.root = root
        #: ``(base, copies)``: links are listed in ``copies`` (relative), not made
        self.deferred = deferred
        #: The base step a delta's arrays are linked from (an incremental save).
        self.base: Path | None = None
        #: Per key: a value whose chunks are compared with the base's as they are written.
        self.compare: Mapping[str, _Compare] = {}
        #: Files to fsync (None when the write is not durable), and every directory made.
        self.sync = sync
        self.dirs: list[Path] = [root]
        self._made: set[str] = set()
        #: The array directories taken from the spare as they are (:meth:`recycle`).
        self.kept: set[str] = set()
        #: Whether ``root`` is a spare taken over (see :meth:`recycle`).
        self.recycled = False
        #: Row deltas' groups kept from the spare around kept arrays (made already).
        self._delta_groups: set[str] = set()
        #: Row deltas' groups: their document is the delta's (written once the checksums
        #: are known), never the plain group document first.
        self._docless: set[Path] = set()
        #: The entries of the base's arrays a delta links (by path in the base), listed once.
        self._listed: dict[str, list[str]] = {}
        if spare is not None:
            try:
                os.rename(spare, root)  # both temporaries of one directory: atomic
                self.recycled = True
            except OSError:  # gone (reclaimed by another process): made afresh
                remove_path(spare)
        if not self.recycled:
            root.mkdir()

    def recycle(self, arrays: list[ValueWrite], rows_of: Callable[[ValueWrite], int | None]
                ) -> None:
        """Keep the spare's array directories that hold exactly the files this step links
        from the base (the same inodes: a value unchanged since the spare was written, with
        the same document and chunks); remove everything else but their parent groups.

        A kept directory was fsynced when the step it comes from was committed and is not
        changed since (the spare was cut down to such directories when it was set aside:
        ``set_aside`` in ``checkpoint/_files``), so it is not fsynced again; every group kept
        around one is (entries may have gone from it).
        """
        for it in arrays:
            if it.delta is not None:
                self._recycle_delta(it.delta)
                continue
            if it.held is None or not it.held.same_attrs or not it.nbytes:
                continue
            ndim, rows = len(it.shape), rows_of(it)
            names = ([chunk_key(ndim)] if rows is None else
                     [piece_key(ndim, i) for i in range(-(-it.shape[0] // rows))])
            if _same_files(self.root / it.path, Path(it.held.file).parent, [*names, "zarr.json"]):
                self.kept.add(it.path)
        groups = {"/".join(p.split("/")[:i]) for p in self.kept
                  for i in range(1, p.count("/") + 1)}
        if os.path.isdir(self.root / RECORD_PATH.partition("/")[0]):
            groups.add(RECORD_PATH.partition("/")[0])  # _ckptvar: its arrays made again
        self._clear("", groups)
        self._made |= self.kept | groups
        for g in sorted(groups):
            d = self.root / g
            self.dirs.append(d)
            self._group(d)

    def _recycle_delta(self, delta: DeltaWrite) -> None:
        """Keep the spare's arrays of a row delta (its base's whole copy, its earlier
        patches) that hold exactly the files this step links from the base: a delta
        carried over or appended to is not linked again array by array."""
        if self.base is None:
            return
        for src, dst in delta.links:
            there = self.base / src
            try:
                files = _regular_files(there)
            except OSError:
                continue
            self._listed[src] = sorted(files)  # what _write_delta links, if not kept
            if files and _same_files(self.root / dst, there, list(files), files):
                self.kept.add(dst)
                self._delta_groups.add(dst.rpartition("/")[0])
                self._docless.add(self.root / dst.rpartition("/")[0])

    def _clear(self, rel: str, groups: set[str]) -> None:
        """Remove what is under ``rel`` but the kept arrays and the groups around them
        (a group's own document stays when it is the plain group document)."""
        with os.scandir(self.root / rel if rel else self.root) as entries:
            listed = list(entries)
        for e in listed:
            sub = f"{rel}/{e.name}" if rel else e.name
            if sub in self.kept:
                continue
            if sub in groups and e.is_dir(follow_symlinks=False):
                self._clear(sub, groups)
                continue
            if rel and e.name == "zarr.json" and _holds(e.path, GROUP_DOC):
                continue
            remove_path(Path(e.path))

    def write(self, path: Path, data: Any) -> None:
        write_file(path, data, self.sync)

    def link(self, source: str, path: Path) -> None:
        """``path`` becomes another name of the committed chunk file ``source`` (zero copy);
        a copy where the file system has no hard links or ``source`` is on another one."""
        if self.deferred is not None:
            base, copies = self.deferred
            copies.append((Path(source).relative_to(base).as_posix(),
                           path.relative_to(self.root).as_posix()))
            return
        try:
            os.link(source, path, follow_symlinks=False)
        except FileNotFoundError:
            if self.base is None or os.path.lexists(source):
                raise
            raise BaseFileLost(os.fspath(self.base), _rel(source, self.base)) from None
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                                 errno.EOPNOTSUPP):
                raise
            shutil.copyfile(source, path, follow_symlinks=False)
            if self.sync is not None:
                self.sync.append(path)

    def _streamed(self, it: ValueWrite) -> Callable[[int], None]:
        """Write a chunked value's pieces into a chunk file (``write_file``'s callable)."""
        def fill(fd: int) -> None:
            write = _rawio.pwrite_flushing if self.sync is not None else _rawio.pwrite_all
            it.write_with(lambda piece, pos: write(fd, piece, pos))

        return fill

    def _group(self, d: Path) -> None:
        if d not in self._docless and not (d / "zarr.json").exists():
            self.write(d / "zarr.json", GROUP_DOC)

    def _make_dirs(self, rel: str) -> None:
        """Make the groups on the way to ``rel`` and ``rel`` itself, each with its document
        except the last (its caller finishes it)."""
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub in self._made:
                continue
            self._made.add(sub)
            d = self.root / sub
            d.mkdir()
            self.dirs.append(d)
            if i < len(parts):
                self._group(d)

    def array_dir(self, rel: str) -> Path:
        """Make an array's directory (and the groups above it); a row delta's group kept
        from the spare around its kept arrays is there already (:meth:`recycle`)."""
        if rel in self._delta_groups:
            return self.root / rel
        parent = rel.rpartition("/")[0]
        if parent:
            self._make_dirs(parent)
            self._group(self.root / parent)
        d = self.root / rel
        d.mkdir()
        self.dirs.append(d)
        self._made.add(rel)
        return d

    def write_chunks(self, arrays: list[ValueWrite], raw: bool,
                     rows_of: Callable[[ValueWrite], int | None],
                     held: Mapping[str, Mapping[int, str]]) -> list[Path]:
        """Each array's directory, and its chunk file when ``raw`` (uncompressed); a value
        with ``rows_of(it)`` rows per chunk as several chunk files, those in ``held``
        (by key: chunk -> the base's file) linked.

        Directories and group documents are made on an I/O thread, ahead of the chunk
        writes (creating ~200 inodes costs as much as 1 GiB of pwrite on some file
        systems; this way the two overlap).
        """
        if sum(it.path not in self.kept for it in arrays) <= _INLINE_DIRS:
            return self._write_inline(arrays, raw, rows_of, held)
        arr_dirs: list[Path | None] = [None] * len(arrays)
        ready = [threading.Event() for _ in arrays]

        def make_tree() -> None:
            try:
                for i, it in enumerate(arrays):
                    arr_dirs[i] = (self.root / it.path if it.path in self.kept
                                   else self.array_dir(it.path))
                    ready[i].set()
            finally:
                for ev in ready:
                    ev.set()

        tree = _rawio.start_all([make_tree], background=True)
        try:
            for i, it in enumerate(arrays):
                ready[i].wait()
                d = arr_dirs[i]
                if d is None:  # making the tree failed: wait_all below raises why
                    break
                if it.path in self.kept:  # the spare's files are the base's already
                    continue
                self._write_value(it, d, rows_of(it) if raw else None, raw, held)
        except BaseException:
            with contextlib.suppress(BaseException):
                _rawio.wait_all(tree)
            raise
        _rawio.wait_all(tree)
        return [d for d in arr_dirs if d is not None]

    def _write_inline(self, arrays: list[ValueWrite], raw: bool,
                      rows_of: Callable[[ValueWrite], int | None],
                      held: Mapping[str, Mapping[int, str]]) -> list[Path]:
        """:meth:`write_chunks` with the few directories to make made on this thread."""
        out = []
        for it in arrays:
            d = self.root / it.path
            if it.path not in self.kept:
                d = self.array_dir(it.path)
                self._write_value(it, d, rows_of(it) if raw else None, raw, held)
            out.append(d)
        return out

    def _write_value(self, it: ValueWrite, d: Path, rows: int | None, raw: bool,
                     held: Mapping[str, Mapping[int, str]]) -> None:
        """One value's chunk file (or, with ``rows``, chunk files) into ``d``."""
        if it.delta is not None:
            assert self.base is not None
            self._docless.add(d)
            self._write_delta(it.delta, self.base, tuple(it.shape))
        elif rows is not None:
            self._write_pieces(it, d, rows, held.get(it.key, {}))
        elif it.held is not None and it.nbytes:
            self.link(it.held.file, d / chunk_key(len(it.shape)))
        elif raw and it.source is not None:  # a piece at a time, hashed on the way
            self.write(d / chunk_key(len(it.shape)), self._streamed(it))
        elif raw and it.nbytes:
            self.write(d / chunk_key(len(it.shape)), it.view)

    def _write_delta(self, delta: DeltaWrite, base: Path, shape: tuple[int, ...]) -> None:
        """A delta's arrays: the base's whole copy and earlier patches linked from the
        base step ``base`` (every file of each array directory; listed for a server-side
        copy: the document and the one chunk; ``shape`` the value's), its own patch
        written. A file of the base gone from it (deleted by hand) is :class:`BaseFileLost`:
        the step would lack it."""
        for j, (src, dst) in enumerate(delta.links):
            if dst in self.kept:  # the spare's: these very files already (recycle)
                continue
            d = self.array_dir(dst)
            listed = self._listed.get(src)  # listed by _recycle_delta this save
            files = (["zarr.json", chunk_key(len(shape) if j == 0 else 1)]
                     if self.deferred is not None
                     else listed if listed is not None else _listing(base, src))
            if self.deferred is None:  # a file gone from the base: not a step without it
                for f in _delta_files(delta, j, shape):
                    if f not in files:
                        raise BaseFileLost(os.fspath(base), f"{src}/{f}")
            for f in files:
                self.link(os.fspath(base / src / f), d / f)
        if not delta.rows.size:  # unchanged: the base's delta as it is
            return
        d = self.array_dir(delta.path)
        meta = array_meta((delta.patch_nbytes,), np.dtype("u1"),
                          {"ckptvar": "row patch: uint64 row indices, then the rows' bytes"})
        self.write(d / "zarr.json", _doc(meta))
        if delta.patch_nbytes:
            write = _rawio.pwrite_flushing if self.sync is not None else _rawio.pwrite_all
            self.write(d / chunk_key(1), lambda fd: delta.write_patch(
                functools.partial(write, fd), 0))

    def _write_pieces(self, it: ValueWrite, d: Path, rows: int, held: Mapping[int, str]
                      ) -> None:
        """``it``'s chunks of ``rows`` rows (the last padded with zeros, as Zarr stores
        it): linked from the base where it holds them (all of them when ``it.held``)."""
        ndim = len(it.shape)
        size = rows * (it.nbytes // it.shape[0])
        compare = self.compare.get(it.key)
        if compare is not None and it.source is None and it.held is None:
            self._write_compared(it, d, size, compare)
            return

        def put(part: memoryview, i: int) -> None:
            name = piece_key(ndim, i)
            src = (os.fspath(Path(it.held.file).parent / name) if it.held is not None
                   else held.get(i))
            if src is not None:
                self.link(src, d / name)
            elif len(part) == size:
                self.write(d / name, part)
            else:
                self.write(d / name, functools.partial(_padded, part, size))

        if it.source is not None:  # each chunk filled from the pieces as they come
            if it.held is not None:  # all held: nothing to read
                for i in range(-(-it.shape[0] // rows)):
                    put(memoryview(b""), i)
                return
            regroup = Regroup(size, put)
            it.write_with(lambda piece, pos: regroup.push(piece))
            regroup.finish()
            return
        view = it.view
        for i in range(-(-it.shape[0] // rows)):
            put(view[i * size: (i + 1) * size], i)

    def _write_compared(self, it: ValueWrite, d: Path, size: int, compare: _Compare) -> None:
        """``it``'s chunks of ``size`` bytes, each hashed by blocks just before it is
        written, and linked from the base instead where its blocks equal the base's;
        ``it``'s checksums are set from the chunks' blocks.

        The next chunk is hashed on the checksum thread (:func:`block_crcs`, the GIL held)
        while this one is written (``pwrite`` releases it): the hash overlaps the writes
        where a second CPU is free, and no chunk the base holds is written. Hashing the
        value before the write, as every chunk had to be compared first, kept the writes
        waiting for it (docs/benchmarks.md, "Zarr chunks hashed as they are written")."""
        view, ndim = it.view, len(it.shape)
        count = -(-it.nbytes // size)
        parts = [view[i * size: (i + 1) * size] for i in range(count)]
        per = 4 * (size // BLOCK_SIZE)  # bytes of block checksums per chunk
        ahead = []  # chunk i + 1's hash, while chunk i is hashed (the first) or written
        crcs = []
        try:
            for i, part in enumerate(parts):
                if i + 1 < count:
                    ahead.append(_rawio.submit(block_crcs, parts[i + 1]))
                blocks = block_crcs(part) if i == 0 else ahead[i - 1].result()
                crcs.append(blocks)
                name = piece_key(ndim, i)
                if blocks == compare.blocks[i * per: i * per + len(blocks)]:
                    self.link(os.fspath(compare.directory / name), d / name)
                elif len(part) == size:
                    self.write(d / name, part)
                else:
                    self.write(d / name, functools.partial(_padded, part, size))
        finally:
            for f in ahead:  # never leave hashing running on a dropped buffer
                f.exception()
        blocks = b"".join(crcs)
        seed = _checksum.header_crc(it.key, it.dtype, it.shape)
        it.checksum = join_blocks(seed, np.frombuffer(blocks, "<u4"), it.nbytes, BLOCK_SIZE)
        it.blocks = blocks
        it.hashed = True


@dataclass(frozen=True, slots=True)
class _Compare:
    """A base's value, for a step's chunks of it to be compared with as they are written."""

    #: the base's block checksums (``uint32`` little-endian, one per block)
    blocks: bytes
    #: the base's array directory of the value (its chunk files)
    directory: Path


def _rel(path: str, base: Path) -> str:
    """``path`` relative to ``base`` (as a checkpoint names its files)."""
    return Path(os.path.relpath(path, base)).as_posix()


def _listing(base: Path, src: str) -> list[str]:
    """The names in the base's array directory ``src`` (:class:`BaseFileLost` if gone)."""
    try:
        return sorted(os.listdir(base / src))
    except FileNotFoundError:
        raise BaseFileLost(os.fspath(base), src) from None


def _delta_files(delta: DeltaWrite, j: int, shape: tuple[int, ...]) -> list[str]:
    """The files the ``j``-th array a row delta links must hold: its document and its
    chunks (the base's whole copy, ``j == 0``: one chunk, or one per ``delta.pieces``
    rows; a patch: one)."""
    if j:
        return ["zarr.json", chunk_key(1)]
    if delta.pieces is None:
        return ["zarr.json", chunk_key(len(shape))]
    return ["zarr.json", *(piece_key(len(shape), i)
                           for i in range(-(-shape[0] // delta.pieces)))]


def _same_files(d: Path, src: Path, names: list[str],
                there: dict[str, int | None] | None = None) -> bool:
    """Whether directory ``d`` holds exactly ``names``, each the same regular file (inode)
    as in ``src`` (never following a symlink; ``there``: ``src`` listed already, by
    :func:`_regular_files`).

    The inodes come from the two listings (``d_ino``; one ``getdents`` each, no ``stat``
    per file): on one file system, as the directories' own ``stat`` checks."""
    try:
        a, b = os.lstat(d), os.lstat(src)
        if not stat.S_ISDIR(a.st_mode) or a.st_dev != b.st_dev:
            return False
        here = _regular_files(d)
        if there is None:
            there = _regular_files(src)
    except OSError:
        return False
    want = set(names)
    return (len(names) == len(want) and set(here) == want
            and all(here[n] is not None and here[n] == there.get(n) for n in names))


def _regular_files(d: Path) -> dict[str, int | None]:
    """Each entry of ``d`` by name: its inode when it is a regular file, else None."""
    with os.scandir(d) as entries:
        return {e.name: e.inode() if e.is_file(follow_symlinks=False) else None
                for e in entries}


def _holds(path: str, data: bytes) -> bool:
    """Whether the regular file ``path`` holds exactly ``data``."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW_FILE)
    except OSError:
        return False
    try:
        return os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)


_O_NOFOLLOW_FILE = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _close_source(fd: Any) -> None:
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


def _padded(part: memoryview, size: int, fd: int) -> None:
    """Write ``part`` into ``fd`` and extend the file with zeros to ``size`` bytes."""
    _rawio.pwrite_pieces(fd, part, 0)
    os.ftruncate(fd, size)


class ZarrReader(ContainerReader, SupportsShared):
    """Reads a ckptvar ``.zarr`` directory through its record and chunk files."""

    format = "zarr"

    def __init__(self, path: Path) -> None:
        path = Path(path)
        try:
            root_fd = os.open(path, O_DIR)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.") from None
        except NotADirectoryError:
            raise CorruptCheckpointError(
                f"{str(path)!r} is not a directory, so not a Zarr checkpoint."
            ) from None
        try:
            record = self._load_record(root_fd, path)
        except BaseException:
            os.close(root_fd)
            raise
        self._root_fd = root_fd
        self._packed_fd: int | None = None
        #: a delta value's patches, read and checked on the I/O threads from the first
        #: time it is opened (folded into one when laid twice), once per reader
        self._patches: dict[str, Patches] = {}
        #: a delta value's base chunk files, and a value's stored as several chunks,
        #: opened (and their sizes checked) once per reader, up to ``_HOLD_BASES``
        #: descriptors in all (the rest at each open)
        self._bases: dict[str, int | Pieces] = {}
        self._held = 0
        self._delta_lock = threading.Lock()
        super().__init__(path, record)

    def shared(self) -> dict[str, list[str]]:
        """The values whose chunk file other checkpoints beside this one share (hard links
        of an incremental step): key -> those checkpoints' names (a value whose files'
        other names are elsewhere only is not listed)."""
        out: dict[str, list[str]] = {}
        linked = []
        for key in self.keys():
            for rel in self.chunk_files(key):
                try:
                    st = os.stat(rel, dir_fd=self._root_fd, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    linked.append((key, rel, (st.st_dev, st.st_ino)))
        if not linked:
            return out
        here = Path(self.path)
        siblings = [(p.name, p) for p in sorted(here.parent.glob("*.zarr"))
                    if p.name != here.name and not p.name.startswith(".")]
        if here.name.startswith("rank-"):  # one process's file of a multi-process step:
            step = here.parent  # the same process's file of the steps beside it
            siblings += [(p.name, p / here.name) for p in sorted(step.parent.glob("*.zarr"))
                         if p.name != step.name and not p.name.startswith(".")]
        for key, rel, ident in linked:  # another name elsewhere (a temporary, a backup
            names = out.get(key, [])  # made with cp -al) is no step: not listed
            names += [n for n in _sharing(siblings, rel, ident) if n not in names]
            if names:  # a value in chunks: any chunk shared
                out[key] = names
        return out

    @staticmethod
    def _load_record(root_fd: int, path: Path) -> Record:
        doc = read_root_meta(root_fd, path)
        if doc is None:
            raise_if_deleted(root_fd, path)
        n, crc = root_record_ref(doc or {}, str(path), not_ours=CorruptCheckpointError)
        try:
            fd = open_in(root_fd, f"{RECORD_PATH}/{chunk_key(1)}")
        except OSError as exc:
            raise_if_deleted(root_fd, path)
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: the root record ({RECORD_PATH}) is missing or "
                f"unreadable ({exc})."
            ) from None
        try:
            size = os.fstat(fd).st_size
            data = None
            if size == n:
                data = _rawio.pread_exact(fd, 0, n, what="The root record", path=path)
        finally:
            os.close(fd)
        if data is None or _checksum.crc(data) != crc:
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: the root record fails its checksum or length check "
                f"(expected {n} bytes); the checkpoint is damaged."
            )
        # packed values in the blob without overlap, no two values on one container path
        # (checked with the columns: at once, or through the key index when all are needed)
        return decode(data, path, container="zarr")

    def _open_chunk(self, key: str, rel: str, nbytes: int, *, at: int | None = None) -> int:
        """The chunk file ``rel`` of ``key`` opened, its size checked (``at``: a descriptor
        of its directory, already open: the file is opened by its last name there)."""
        self.check_open()
        try:
            fd = (open_in(self._root_fd, rel) if at is None else
                  open_in(at, rel.rpartition("/")[2]))
        except FileNotFoundError:
            raise_if_deleted(self._root_fd, self.path)
            raise self.corrupt(key, f"has lost its chunk file {rel!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.corrupt(key, f"has a symlink on its path {rel!r} (refused)") from None
            raise self.corrupt(key, f"cannot be opened at {rel!r} ({exc})") from None
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise self.corrupt(key, f"has a chunk of {size} bytes, expected {nbytes} ({rel!r})")
        return fd

    def _open_array(self, key: str, entry: Entry) -> Source:
        rel = f"{entry.loc.path}/{chunk_key(len(entry.shape))}"
        if entry.nbytes == 0:
            return Source(self._open_in_dir(key, entry.loc.path or ""), 0, True)
        if self._record.deltas and key in self._record.deltas:
            return Source(self._patched(key, entry), 0, True)
        if self._record.pieces and key in self._record.pieces:
            return self._held_pieces(key, entry)
        return Source(self._open_chunk(key, rel, entry.nbytes), 0, True)

    def _held_pieces(self, key: str, entry: Entry) -> Source:
        """A value stored as several chunks: its chunk files opened (and their sizes
        checked) at its first open and kept for this reader's later ones, within
        ``_HOLD_BASES`` descriptors in all (a restore opens a value once per piece of
        work: 16 chunk files opened at each of ~20 opens cost more than reading them)."""
        with self._delta_lock:
            pieces = self._bases.get(key)
            if pieces is not None:
                return Source(pieces, 0, False)
            pieces = self._open_pieces(key, entry)
            if self._held + len(pieces.fds) > _HOLD_BASES:
                return Source(pieces, 0, True)
            self._bases[key], self._held = pieces, self._held + len(pieces.fds)
            return Source(pieces, 0, False)

    def corrupt(self, key: str, what: str) -> CorruptCheckpointError:
        """The error saying value ``key`` ``what``; a row delta's says where its base is
        when its assembled bytes fail a checksum (:func:`.delta.in_base`). A step that is
        no longer at its path (pruned; a local manager may have set it aside and written its
        next step into it) raises ``CheckpointNotFoundError`` instead: its files' bytes are
        another step's now, not damage."""
        if not self._closed:
            raise_if_deleted(self._root_fd, self.path)
        d = self._record.deltas.get(key) if self._record.deltas else None
        return super().corrupt(key, what if d is None else in_base(what, d, Path(self.path).name))

    def _patched(self, key: str, entry: Entry) -> Patched:
        """A delta value (format 1.5): its base array's bytes with its patches over them;
        the base's files opened and the patches' reads started at its first open (one
        thread at a time: the I/O threads may open a value at once)."""
        d = self._record.deltas[key]
        expect = self.base_expect(key, entry)
        with self._delta_lock:
            base = self._bases.get(key)
            owned = base is None
            if base is None:
                if self._record.pieces and key in self._record.pieces:
                    base = self._open_pieces(key, entry, d.base[1])
                else:
                    base = self._open_chunk(key, f"{d.base[1]}/{chunk_key(len(entry.shape))}",
                                            entry.nbytes)
                n = 1 if isinstance(base, int) else len(base.fds)
                if self._held + n <= _HOLD_BASES:  # kept for this reader's later opens
                    self._bases[key], self._held, owned = base, self._held + n, False
            try:
                patches = self._patches.get(key)
                if patches is None:
                    # verified by its parts, the patches are laid once: in order, no fold
                    patches = self._patches[key] = self._read_patches(
                        key, entry, d, fold_all=expect is None)
            except BaseException:
                if owned:
                    _close_source(base)
                raise
        return Patched(base, 0, entry.nbytes, entry.nbytes // entry.shape[0], patches,
                       owned=owned, expect=expect)

    def _read_patches(self, key: str, entry: Entry, d: Delta, *, fold_all: bool) -> Patches:
        rb = entry.nbytes // entry.shape[0]
        fds: list[int] = []
        try:
            for _, p, _, n, _ in d.patches:
                fds.append(self._open_chunk(key, f"{p}/{chunk_key(1)}", 8 * n + n * rb))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        reads = [(fd, 0, n, crc, repr(f"{p}/{chunk_key(1)}"))
                 for fd, (_, p, _, n, crc) in zip(fds, d.patches, strict=True)]
        return read_patches(key, reads, rb, entry.shape[0],
                            seed=_checksum.header_crc(key, entry.dtype, entry.shape),
                            corrupt=self.corrupt, fold_all=fold_all, fds=fds)

    def _piece_layout(self, key: str, entry: Entry) -> tuple[int, int]:
        """A value stored as several chunks (format 1.4): a chunk file's size and how
        many there are (checked against its shape)."""
        rows = self._record.pieces[key]
        if not entry.shape or not 0 < rows < entry.shape[0]:
            raise self.corrupt(key, f"has {rows} rows per chunk, which its shape "
                                    f"{entry.shape} cannot have")
        return rows * (entry.nbytes // entry.shape[0]), -(-entry.shape[0] // rows)

    def _open_pieces(self, key: str, entry: Entry, path: str | None = None) -> Pieces:
        """Each chunk opened in turn (a missing one stops at once, whatever the record
        claims), its size checked; the last one's value bytes are the rest. ``path``: the
        array holding them (a delta's base), else the value's own."""
        size, n = self._piece_layout(key, entry)
        where = entry.loc.path if path is None else path
        try:  # the directory once, each chunk in it (else each by its whole path: the error)
            at: int | None = open_in(self._root_fd, where or "", directory=True)
        except OSError:
            at = None
        fds: list[int] = []
        try:
            for i in range(n):
                rel = f"{where}/{piece_key(len(entry.shape), i)}"
                fds.append(self._open_chunk(key, rel, size, at=at))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            if at is not None:
                os.close(at)
        return Pieces(fds, [size] * (n - 1) + [entry.nbytes - (n - 1) * size])

    def chunk_files(self, key: str) -> list[str]:
        """The chunk files (relative to the checkpoint) holding ``key``'s bytes, if it is
        stored as its own uncompressed array; else none."""
        e = self.entry(key)
        if e.loc.kind != ARRAY or not e.nbytes or e.loc.path is None:
            return []
        where, extra = e.loc.path, []
        if self._record.deltas and key in self._record.deltas:  # the base, then the patches
            d = self._record.deltas[key]
            where, extra = d.base[1], [f"{p}/{chunk_key(1)}" for _, p, _, _, _ in d.patches]
        if not (self._record.pieces and key in self._record.pieces):
            return [f"{where}/{chunk_key(len(e.shape))}", *extra]
        out = []
        for i in range(self._piece_layout(key, e)[1]):
            rel = f"{where}/{piece_key(len(e.shape), i)}"
            try:
                os.stat(rel, dir_fd=self._root_fd, follow_symlinks=False)
            except OSError:
                break  # the rest is damage, which reading it reports
            out.append(rel)
        return out + extra

    def _open_in_dir(self, key: str, rel: str) -> int:
        try:
            return open_in(self._root_fd, rel, directory=True)
        except OSError as exc:
            raise self.corrupt(key, f"has lost its array {rel!r} ({exc})") from None

    def packed_source(self) -> tuple[Any, int]:
        self.check_open()
        if self._packed_fd is None:
            assert self._record.packed is not None
            if self._record.packed[2] == 0:  # only empty values: Zarr stores no chunk
                self._packed_fd = self._open_in_dir("(packed values)", PACKED_PATH)
            else:
                self._packed_fd = self._open_chunk(
                    "(packed values)", f"{PACKED_PATH}/{chunk_key(1)}", self._record.packed[2]
                )
        return self._packed_fd, 0

    def _read_other(self, key: str, entry: Entry) -> np.ndarray:
        return self._other_rows(key, entry, None)

    def _read_other_rows(self, key: str, entry: Entry, lo: int, hi: int) -> np.ndarray:
        return self._other_rows(key, entry, (lo, hi))

    def _other_rows(self, key: str, entry: Entry, rows: tuple[int, int] | None) -> np.ndarray:
        """A value stored by zarr-python's codecs (compressed): all of it, or ``rows``,
        decoded a chunk at a time (:func:`._zarr_chunks.decode_rows`)."""
        zarr = zarr_api()
        rel = entry.loc.path or ""
        if entry.nbytes:
            fd = open_in(self._root_fd, rel, directory=True)
            os.close(fd)
            try:
                os.close(open_in(self._root_fd, f"{rel}/{chunk_key(len(entry.shape))}"))
            except OSError:
                raise self.corrupt(key, f"has lost its chunk file under {rel!r}") from None
        store = zarr.storage.LocalStore(self.path, read_only=True)
        arr = self._decode(key, lambda: zarr.open_array(store=store, path=rel, mode="r"))

        def rows_of(i: int, a: int, b: int) -> np.ndarray:
            try:
                os.stat(f"{rel}/{piece_key(len(entry.shape), i)}", dir_fd=self._root_fd)
            except OSError:
                raise self.corrupt(key, f"has lost its chunk file {piece_key(len(entry.shape), i)!r}"
                                        f" under {rel!r}") from None
            return np.asarray(self._decode(key, lambda: arr[a:b]))

        return self._decoded(key, entry, arr, rows, rows_of)

    def _decode(self, key: str, how: Callable[[], Any]) -> Any:
        """``how()`` (zarr-python opening or decoding); any failure is damage."""
        try:
            return how()
        except Exception as exc:  # noqa: BLE001 - any decoding failure is damage
            raise self.corrupt(key, f"cannot be decoded ({type(exc).__name__}: {exc})") from None

    def _decoded(self, key: str, entry: Entry, arr: Any, rows: tuple[int, int] | None,
                 rows_of: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
        """``rows`` of zarr-python array ``arr`` (None: all), checked against ``entry``:
        chunk by chunk when it is chunked by rows, else decoded whole."""
        sdt = storage_dtype(entry.dtype)
        shape = tuple(arr.shape)
        chunks = tuple(getattr(arr.metadata.chunk_grid, "chunk_shape", ()) or ())
        if shape != entry.shape or not entry.nbytes or not in_row_chunks(shape, chunks):
            data = self._checked_value(key, entry, np.asarray(self._decode(key, lambda: arr[...])))
            return data if rows is None else data[rows[0]:rows[1]]
        lo, hi = rows if rows is not None else (0, shape[0])
        try:
            out, value = decode_rows(
                shape, sdt, chunks[0], rows=(lo, hi), rows_of=rows_of,
                seed=_checksum.header_crc(key, entry.dtype, entry.shape))
        except ChunkMismatch as exc:
            raise self.corrupt(key, f"is stored otherwise than its record says: {exc}") from None
        self._compare(key, entry, value)
        return out.view(entry.np_dtype)

    def _checked_value(self, key: str, entry: Entry, data: np.ndarray) -> np.ndarray:
        """``data`` decoded from Zarr, checked against ``entry`` and viewed as its dtype."""
        sdt = storage_dtype(entry.dtype)
        if data.shape != entry.shape or data.dtype != sdt:
            raise self.corrupt(
                key, f"is stored as {data.dtype}{data.shape}, the record says {sdt}{entry.shape}"
            )
        out = np.asarray(data, order="C").view(entry.np_dtype)  # 0-d stays 0-d
        self._compare(key, entry, _checksum.value_checksum(key, entry.dtype, entry.shape, out))
        return out

    def close(self) -> None:
        if not self._closed:
            for patches in self._patches.values():  # no read left on the descriptors
                patches.close()
            self._patches.clear()
            for base in self._bases.values():
                _close_source(base)
            self._bases.clear()
            if self._packed_fd is not None:
                os.close(self._packed_fd)
            os.close(self._root_fd)
        super().close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()


class ZarrBackend(
    Backend, name="zarr", suffixes=(".zarr",), writer=ZarrWriter, hands_over_unrecognised=True,
    sniff_priority=30,
):
    """ckptvar's own Zarr v3 directories."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            fd = os.open(path, O_DIR)
        except OSError:
            return False
        try:
            doc = read_root_meta(fd, path)
        except CorruptCheckpointError:
            return False
        finally:
            os.close(fd)
        attrs = (doc or {}).get("attributes")
        return isinstance(attrs, dict) and isinstance(attrs.get("ckptvar"), dict)

    @classmethod
    def open_reader(cls, path: Path) -> ZarrReader:
        path = Path(path)
        if path.is_dir() and not cls.sniff(path):
            root = path / "zarr.json"
            if root.is_symlink():  # read through no link, even one that stays inside
                raise CorruptCheckpointError(
                    f"The root zarr.json {str(root)!r} is a symbolic link to "
                    f"{str(root.resolve())!r}; ckptvar's Zarr reads no file through a link."
                )
            if (path / RECORD_PATH).is_dir():
                _root_meta_problem(path)  # its reason, when it has one
                raise CorruptCheckpointError(
                    f"Checkpoint {str(path)!r} holds a ckptvar record ({RECORD_PATH}) but its "
                    "root zarr.json is damaged or missing; the checkpoint is damaged."
                )
            if not path.exists():  # pruned while we looked at it
                raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.")
            raise UnsupportedFormatError(
                f"{str(path)!r} is not a ckptvar Zarr checkpoint (no 'ckptvar' attribute in its "
                "root zarr.json), and no registered reader recognises it."
            )
        return ZarrReader(path)


def _root_meta_problem(path: Path) -> None:
    """Raise why the root ``zarr.json`` of ``path`` cannot be read (a pipe, bad JSON, ...),
    if that is what kept it from being recognised."""
    try:
        fd = os.open(path, O_DIR)
    except OSError:
        return
    try:
        read_root_meta(fd, path)
    finally:
        os.close(fd)


register_backend(ZarrBackend)


def _step_name(base: Path, path: Path) -> str:
    """The checkpoint ``base`` belongs to, as ``ckpt inspect`` names a delta's base: the
    step directory when ``base`` is a process's file of a multi-process step (the same
    file name as ``path``'s, in a sibling step), else ``base`` itself.

    >>> _step_name(Path("r/ckpt-1.zarr/rank-00001.zarr"), Path("r/.tmp/rank-00001.zarr"))
    'ckpt-1.zarr'
    >>> _step_name(Path("r/ckpt-1.zarr"), Path("r/ckpt-2.zarr"))
    'ckpt-1.zarr'
    """
    if base.name == path.name and base.parent != path.parent:
        return base.parent.name
    return base.name
