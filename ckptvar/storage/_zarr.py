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
zarr-python's own codecs for the values stored as arrays.

Reading uses only the root ``zarr.json``, the record and the chunk files; every
path is opened component by component without following symlinks, and a
missing chunk of a non-empty array is an error (Zarr itself would silently
return fill values).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from . import _checksum, _rawio, register_backend
from ._atomic import fsync_all
from ._container import (
    PACKED_PATH,
    ContainerReader,
    ContainerWriter,
    Source,
    WriteItem,
    WritePlan,
    scalar_attrs,
    storage_dtype,
    write_packed,
)
from ._paths import RESERVED_PREFIX
from ._record import FORMAT_VERSION, MAX_RECORD_NBYTES, PACKED, Entry, Location, Record, decode
from .base import Backend

__all__ = ["RECORD_PATH", "ZarrBackend", "ZarrReader", "ZarrWriter", "chunk_key"]

RECORD_PATH = f"{RESERVED_PREFIX}/record"
_MAX_JSON = 1 << 20
_CODECS = ("zstd", "gzip", "blosc")
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def chunk_key(ndim: int) -> str:
    """The single chunk's file inside an array: ``c`` for 0-d, else ``c.0.0...``.

    The default chunk key encoding with the ``.`` separator keeps the chunk beside the
    array's ``zarr.json`` (no ``c/0/`` directories to create: one directory per array).
    """
    return ".".join(["c"] + ["0"] * ndim)


def _fill(dt: np.dtype) -> Any:
    if dt.kind == "b":
        return False
    if dt.kind == "c":
        return [0.0, 0.0]
    if dt.kind == "f":
        return 0.0
    return 0


def array_meta(shape: tuple[int, ...], dt: np.dtype, attributes: dict[str, Any],
               codecs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``zarr.json`` document of a one-chunk, uncompressed Zarr v3 array."""
    if codecs is None:
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if dt.itemsize == 1:
            codecs = [{"name": "bytes"}]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dt.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [max(1, d) for d in shape]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": _fill(dt),
        "codecs": codecs,
        "attributes": attributes,
        "storage_transformers": [],
    }


_GROUP = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _write_file(path: Path, data: Any, sync: list[Path] | None, *, replace: bool = False) -> None:
    mode = os.O_TRUNC if replace else os.O_EXCL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if callable(data):
            data(fd)
        elif isinstance(data, list):
            _rawio.pwritev_all(fd, data, 0)
        elif sync is not None and len(data) >= 1 << 20:  # durable: writeback starts now
            _rawio.pwrite_flushing(fd, memoryview(data), 0)
        elif len(data):
            _rawio.pwrite_all(fd, memoryview(data), 0)
    finally:
        os.close(fd)
    if sync is not None:
        sync.append(path)


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
        **options: Any,
    ) -> None:
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

    def _array_loc(self, it: WriteItem) -> Location:
        if self.compression is not None:
            return Location.zarr(it.path)
        return Location.array(it.path, 0)

    def _write(self, tmp: Path, plan: WritePlan) -> None:
        arrays, packed, packed_nbytes = plan.arrays, plan.packed, plan.packed_nbytes
        sync: list[Path] | None = [] if self.durable else None
        dirs: list[Path] = [tmp]
        tmp.mkdir()
        made: set[str] = set()

        def make_dirs(rel: str, group_meta: bool) -> Path:
            parts = rel.split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub in made:
                    continue
                made.add(sub)
                d = tmp / sub
                d.mkdir()
                dirs.append(d)
                if group_meta and i < len(parts) and not (d / "zarr.json").exists():
                    _write_file(d / "zarr.json", _GROUP, sync)
            return tmp / rel

        def array_dir(rel: str) -> Path:
            parent = rel.rpartition("/")[0]
            if parent:
                make_dirs(parent, True)
                # make_dirs wrote zarr.json for all but the last level: finish the parent
                if not (tmp / parent / "zarr.json").exists():
                    _write_file(tmp / parent / "zarr.json", _GROUP, sync)
            d = tmp / rel
            d.mkdir()
            dirs.append(d)
            made.add(rel)
            return d

        def chunk_file(d: Path, ndim: int) -> Path:
            return d / chunk_key(ndim)

        raw = self.compression is None
        arr_dirs: list[Path | None] = [None] * len(arrays)
        ready = [threading.Event() for _ in arrays]

        def make_tree() -> None:
            # Directories and group documents are made on an I/O thread, ahead of the
            # chunk writes below (creating ~200 inodes costs as much as 1 GiB of pwrite
            # on some file systems; this way the two overlap).
            try:
                for i, it in enumerate(arrays):
                    arr_dirs[i] = array_dir(it.path)
                    ready[i].set()
            finally:
                for ev in ready:
                    ev.set()

        tree = _rawio.start_all([make_tree], background=True)
        # 1. the bytes, straight from the buffers (hashing runs meanwhile)
        try:
            for i, it in enumerate(arrays):
                ready[i].wait()
                d = arr_dirs[i]
                if d is None:  # making the tree failed: wait_all below raises why
                    break
                if raw and it.nbytes:
                    _write_file(chunk_file(d, len(it.shape)), it.view, sync)
        except BaseException:
            with contextlib.suppress(BaseException):
                _rawio.wait_all(tree)
            raise
        _rawio.wait_all(tree)
        pd = array_dir(PACKED_PATH) if packed else None
        if pd is not None and packed_nbytes:
            def packed_bytes(fd: int) -> None:
                write_packed(fd, packed, 0)
                if sync is not None:
                    _rawio.start_writeback(fd, 0, packed_nbytes)

            _write_file(chunk_file(pd, 1), packed_bytes, sync)
        plan.wait_hashes()
        # 2. metadata that needs the checksums
        for it, d in zip(arrays, arr_dirs, strict=True):
            assert d is not None
            sdt = storage_dtype(it.dtype)
            if raw:
                meta = array_meta(it.shape, sdt, scalar_attrs(it))
                _write_file(d / "zarr.json", json.dumps(meta).encode(), sync)
            else:
                self._write_compressed(tmp, it, sdt)
        if pd is not None:
            meta = array_meta((packed_nbytes,), np.dtype("u1"), {"ckptvar": "packed values"})
            _write_file(pd / "zarr.json", json.dumps(meta).encode(), sync)
        record = self._encode_record((PACKED_PATH, 0, packed_nbytes))
        rd = array_dir(RECORD_PATH)
        meta = array_meta((len(record),), np.dtype("u1"), {"ckptvar": "root record (msgpack)"})
        _write_file(rd / "zarr.json", json.dumps(meta).encode(), sync)
        if record:
            _write_file(chunk_file(rd, 1), record, sync)
        root_attrs = {
            "ckptvar": {
                "format_version": list(FORMAT_VERSION),
                "record": RECORD_PATH,
                "record_nbytes": len(record),
                "record_crc32c": _checksum.crc(record),
            }
        }
        root = {"zarr_format": 3, "node_type": "group", "attributes": root_attrs}
        _write_file(tmp / "zarr.json", json.dumps(root).encode(), sync, replace=True)
        if sync is not None:
            fsync_all(sync, dirs)

    def _write_compressed(self, tmp: Path, it: WriteItem, sdt: np.dtype) -> None:
        import zarr
        from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec
        from zarr.storage import LocalStore

        level = self.compression_level
        if self.compression == "zstd":
            codec: Any = ZstdCodec(level=3 if level is None else level)
        elif self.compression == "gzip":
            codec = GzipCodec(level=5 if level is None else level)
        else:
            codec = BloscCodec(cname="zstd", clevel=5 if level is None else level)
        (tmp / it.path).rmdir()  # zarr creates the node itself
        from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding

        arr = zarr.create_array(
            store=LocalStore(tmp),
            chunk_key_encoding=DefaultChunkKeyEncoding(separator="."),
            name=it.path,
            shape=it.shape,
            chunks=tuple(max(1, d) for d in it.shape),
            dtype=sdt,
            compressors=[codec],
            fill_value=_fill(sdt),
            attributes=scalar_attrs(it),
            overwrite=False,
        )
        if it.nbytes:
            arr[...] = it.array.view(sdt)


def _open_in(root_fd: int, rel: str, *, directory: bool = False) -> int:
    """Open ``rel`` under ``root_fd`` one component at a time, never following a symlink."""
    parts = rel.split("/")
    cur = root_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = (_O_DIR if (not last or directory) else os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            nxt = os.open(part, flags | _O_NOFOLLOW, dir_fd=cur)
            if cur != root_fd:
                os.close(cur)
            cur = nxt
    except BaseException:
        if cur != root_fd:
            os.close(cur)
        raise
    return cur


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def _read_root_meta(root_fd: int, path: Any) -> dict[str, Any] | None:
    """The root ``zarr.json`` as a dict, or None when there is none."""
    try:
        fd = _open_in(root_fd, "zarr.json")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptCheckpointError(f"{str(path)!r}: cannot open zarr.json ({exc}).") from None
    try:
        data = _rawio.pread_exact(fd, 0, min(os.fstat(fd).st_size, _MAX_JSON + 1),
                                  what="The root zarr.json", path=path)
    finally:
        os.close(fd)
    if len(data) > _MAX_JSON:
        raise CorruptCheckpointError(f"{str(path)!r}: the root zarr.json is larger than 1 MiB.")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{str(path)!r}: the root zarr.json is not valid JSON ({exc})."
        ) from None
    return doc if isinstance(doc, dict) else None


def _raise_if_deleted(root_fd: int, path: Path) -> None:
    """Tell "the checkpoint was deleted (pruned) under us" apart from damage.

    A reader holds the directory open; when a manager prunes the checkpoint, the path
    vanishes or names another directory. That is a clean not-found, not corruption.
    """
    held = os.fstat(root_fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino) or not held.st_nlink:
        raise CheckpointNotFoundError(
            f"Checkpoint {str(path)!r} was deleted while it was being read "
            "(pruned by a CheckpointManager?)."
        )


class ZarrReader(ContainerReader):
    """Reads a ckptvar ``.zarr`` directory through its record and chunk files."""

    format = "zarr"

    def __init__(self, path: Path) -> None:
        path = Path(path)
        try:
            root_fd = os.open(path, _O_DIR)
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
        super().__init__(path, record)

    @staticmethod
    def _load_record(root_fd: int, path: Path) -> Record:
        doc = _read_root_meta(root_fd, path)
        if doc is None:
            _raise_if_deleted(root_fd, path)
        info = (doc or {}).get("attributes", {})
        info = info.get("ckptvar") if isinstance(info, dict) else None
        if not isinstance(info, dict):
            raise CorruptCheckpointError(
                f"{str(path)!r} is not a ckptvar Zarr checkpoint (its root zarr.json has no "
                "'ckptvar' attribute)."
            )
        version = info.get("format_version")
        if (isinstance(version, list) and len(version) == 2 and type(version[0]) is int
                and version[0] > FORMAT_VERSION[0]):
            raise UnsupportedFormatError(
                f"Checkpoint {str(path)!r} has format version {version[0]}.{version[1]}, newer "
                f"than the {FORMAT_VERSION[0]}.x this ckptvar reads; upgrade ckptvar to read it."
            )
        n, crc = info.get("record_nbytes"), info.get("record_crc32c")
        if (info.get("record") != RECORD_PATH or type(n) is not int or type(crc) is not int
                or not 0 <= n <= MAX_RECORD_NBYTES):
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: the root zarr.json's ckptvar attribute is damaged "
                f"({info!r})."
            )
        try:
            fd = _open_in(root_fd, f"{RECORD_PATH}/{chunk_key(1)}")
        except OSError as exc:
            _raise_if_deleted(root_fd, path)
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: the root record ({RECORD_PATH}) is missing or "
                f"unreadable ({exc})."
            ) from None
        try:
            size = os.fstat(fd).st_size
            data = _rawio.pread_exact(fd, 0, n, what="The root record", path=path) if size == n else None
        finally:
            os.close(fd)
        if data is None or _checksum.crc(data) != crc:
            raise CorruptCheckpointError(
                f"Checkpoint {str(path)!r}: the root record fails its checksum or length check "
                f"(expected {n} bytes); the checkpoint is damaged."
            )
        record = decode(data, path, container="zarr")  # packed values: in the blob, no overlap
        paths = sorted(e.loc.path or "" for e in record.values.values() if e.loc.kind != PACKED)
        for a, b in zip(paths, paths[1:], strict=False):
            if b == a or b.startswith(a + "/"):
                raise CorruptCheckpointError(
                    f"Checkpoint {str(path)!r}: two values claim the container path {a!r}."
                )
        return record

    def _open_chunk(self, key: str, rel: str, nbytes: int) -> int:
        self._check()
        try:
            fd = _open_in(self._root_fd, rel)
        except FileNotFoundError:
            _raise_if_deleted(self._root_fd, self.path)
            raise self._corrupt(key, f"has lost its chunk file {rel!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._corrupt(key, f"has a symlink on its path {rel!r} (refused)") from None
            raise self._corrupt(key, f"cannot be opened at {rel!r} ({exc})") from None
        size = os.fstat(fd).st_size
        if size != nbytes:
            os.close(fd)
            raise self._corrupt(key, f"has a chunk of {size} bytes, expected {nbytes} ({rel!r})")
        return fd

    def _open_array(self, key: str, entry: Entry) -> Source:
        rel = f"{entry.loc.path}/{chunk_key(len(entry.shape))}"
        if entry.nbytes == 0:
            return Source(self._open_in_dir(key, entry.loc.path or ""), 0, True)
        return Source(self._open_chunk(key, rel, entry.nbytes), 0, True)

    def _open_in_dir(self, key: str, rel: str) -> int:
        try:
            return _open_in(self._root_fd, rel, directory=True)
        except OSError as exc:
            raise self._corrupt(key, f"has lost its array {rel!r} ({exc})") from None

    def _packed_source(self) -> tuple[int, int]:
        self._check()
        if self._packed_fd is None:
            assert self._record.packed is not None
            self._packed_fd = self._open_chunk(
                "(packed values)", f"{PACKED_PATH}/{chunk_key(1)}", self._record.packed[2]
            )
        return self._packed_fd, 0

    def _read_other(self, key: str, entry: Entry) -> np.ndarray:
        import zarr
        from zarr.storage import LocalStore

        rel = entry.loc.path or ""
        if entry.nbytes:
            fd = _open_in(self._root_fd, rel, directory=True)
            os.close(fd)
            try:
                os.close(_open_in(self._root_fd, f"{rel}/{chunk_key(len(entry.shape))}"))
            except OSError:
                raise self._corrupt(key, f"has lost its chunk file under {rel!r}") from None
        try:
            arr = zarr.open_array(store=LocalStore(self.path, read_only=True), path=rel, mode="r")
            data = np.asarray(arr[...])
        except Exception as exc:  # noqa: BLE001 - any decoding failure is damage
            raise self._corrupt(key, f"cannot be decoded ({type(exc).__name__}: {exc})") from None
        sdt = storage_dtype(entry.dtype)
        if data.shape != entry.shape or data.dtype != sdt:
            raise self._corrupt(
                key, f"is stored as {data.dtype}{data.shape}, the record says {sdt}{entry.shape}"
            )
        out = np.ascontiguousarray(data).view(entry.np_dtype)
        self._compare(key, entry, _checksum.value_checksum(key, entry.dtype, entry.shape, out))
        return out

    def close(self) -> None:
        if not self._closed:
            if self._packed_fd is not None:
                os.close(self._packed_fd)
            os.close(self._root_fd)
        super().close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()


class ZarrBackend(Backend):
    """ckptvar's own Zarr v3 directories."""

    name: ClassVar[str] = "zarr"
    suffixes: ClassVar[tuple[str, ...]] = (".zarr",)
    can_write: ClassVar[bool] = True
    hands_over_unrecognised: ClassVar[bool] = True

    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            fd = os.open(path, _O_DIR)
        except OSError:
            return False
        try:
            doc = _read_root_meta(fd, path)
        except CorruptCheckpointError:
            return False
        finally:
            os.close(fd)
        attrs = (doc or {}).get("attributes")
        return isinstance(attrs, dict) and isinstance(attrs.get("ckptvar"), dict)

    @classmethod
    def open_reader(cls, path: Path) -> ZarrReader:  # type: ignore[override]
        path = Path(path)
        if path.is_dir() and not cls.sniff(path):
            if (path / RECORD_PATH).is_dir():
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

    @classmethod
    def open_writer(cls, path: Path, **options: Any) -> ZarrWriter:  # type: ignore[override]
        return ZarrWriter(Path(path), **options)


register_backend(ZarrBackend)
