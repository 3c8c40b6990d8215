"""PyTorch Distributed Checkpoint (DCP) directories read without torch and without running pickle code.

Owns: the ``dcp`` backend. A DCP checkpoint (``torch.distributed.checkpoint.save``)
is a directory holding ``.metadata`` (a pickle of ``Metadata``: per key, its
dtype, global shape and chunks; per chunk, the file, offset and length of its
bytes) and the data files ``__<rank>_<n>.distcp``. Each chunk is a whole
``torch.save`` archive (the default) or, with DCP's safetensors serialization,
a value of the data file, which is then a safetensors file (keys: the DCP keys).

``.metadata`` goes through the restricted unpickler with only DCP's metadata
classes added (:data:`._unpickler.DCP_GLOBALS`): any other global is refused. A
sharded tensor is one value of its global shape: a read assembles it from the
chunks it needs (a slice reads only the chunks it touches). Every chunk is
checked before its bytes are used: inside the global shape, chunks of one value
covering it exactly once (checked pairwise up to 1024 chunks a value, beyond
by counting the chunks over each cell of the grid cut at every chunk edge),
its file present and holding its byte range, its archive's tensor of the
declared shape and dtype, within its storage, with the storage's
zip CRC-32 intact (or, with the safetensors serialization, the file's header
validated by the safetensors reader and the value of the declared shape and
dtype). DCP's metadata stores no checksums of its own, so values are
reported as unchecked (``ckpt verify`` says "not checksummed").

Non-tensor entries (``BytesStorageMetadata``: an optimizer's ``lr``, an
``epoch``) are read at open through the same unpickler: plain values go to
``metadata()`` under their flattened key, anything else to ``skipped``.
"""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, Reader
from ..storage.links import inside
from ._common import (
    MAX_HEADER_BYTES,
    BoxArray,
    EntryReader,
    FileHandle,
    check_shape,
    overlap_problem,
)
from ._safetensors import SafetensorsBackend
from ._unpickler import (
    DCP_GLOBALS,
    DcpRecord,
    StorageRef,
    TensorRef,
    TorchDtype,
    expanded_size,
    safe_load,
)
from ._zip import ZIP_ERRORS

__all__ = ["DcpBackend"]

METADATA_NAME = ".metadata"
_PLAIN = (bool, int, float, str, type(None))


def _record(obj: Any, kind: str, where: str) -> DcpRecord:
    if not isinstance(obj, DcpRecord) or obj.kind != kind:
        raise CorruptCheckpointError(
            f"{where}: expected a DCP {kind}, found {type(obj).__name__}."
        )
    return obj


def _int(value: Any, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptCheckpointError(f"{where}: {what} {value!r} is not a non-negative int.")
    return value


def _dims(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list):
        raise CorruptCheckpointError(f"{where}: {what} {value!r} is not a tuple of ints.")
    return tuple(_int(v, what, where) for v in value)


class _Chunk:
    """One stored piece of a value: where it sits in the value and where its bytes are."""

    def __init__(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: Path, start: int, length: int
    ) -> None:
        self.offsets, self.sizes = offsets, sizes
        self.file, self.start, self.length = file, start, length


class _Files:
    """The data files of one checkpoint, each opened on first use; a file DCP wrote with
    its safetensors serialization is read through the safetensors reader."""

    def __init__(self) -> None:
        self._open: dict[Path, FileHandle] = {}
        self._tables: dict[Path, Reader | None] = {}

    def get(self, path: Path) -> FileHandle:
        fh = self._open.get(path)
        if fh is None:
            fh = FileHandle(path)
            self._open[path] = fh
        return fh

    def safetensors(self, path: Path) -> Reader | None:
        """The safetensors reader of ``path`` when it is one, else None."""
        if path not in self._tables:
            fh = self.get(path)
            head = fh.pread(0, 9, "header") if fh.size >= 9 else b""
            self._tables[path] = (
                SafetensorsBackend.open_reader(path) if head[8:9] == b"{" else None
            )
        return self._tables[path]

    def close(self) -> None:
        for reader in self._tables.values():
            if reader is not None:
                reader.close()
        self._tables.clear()
        for fh in self._open.values():
            fh.close()
        self._open.clear()


def _torch_chunk(raw: bytes, what: str) -> tuple[TensorRef, StorageRef, bytes]:
    """The tensor, its storage and the storage's bytes (CRC-checked) of a torch.save archive."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            pkls = [m for m in zf.namelist() if m.endswith("/data.pkl") and m.count("/") == 1]
            if len(pkls) != 1:
                raise CorruptCheckpointError(f"{what} is not a torch.save archive.")
            if zf.getinfo(pkls[0]).file_size > min(MAX_HEADER_BYTES, 64 * len(raw) + 4096):
                raise CorruptCheckpointError(f"{what}: its pickle declares too many bytes.")
            storages: dict[str, StorageRef] = {}
            ref = safe_load(io.BytesIO(zf.read(pkls[0])), storages=storages, source=what)
            if not isinstance(ref, TensorRef) or len(storages) != 1:
                raise CorruptCheckpointError(f"{what} does not hold exactly one tensor.")
            st = next(iter(storages.values()))
            member = zf.getinfo(f"{pkls[0][: -len('data.pkl')]}data/{st.key}")
            nbytes = st.numel * st.dtype.itemsize
            if member.file_size != nbytes or member.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(
                    f"{what}: its storage holds {member.file_size} bytes; {st.numel} "
                    f"{st.dtype} elements need {nbytes}."
                )
            return ref, st, zf.read(member)  # zipfile checks the member's CRC-32
    except CorruptCheckpointError:
        raise
    except KeyError as exc:
        raise CorruptCheckpointError(f"{what} lacks a member: {exc}.") from None
    except ZIP_ERRORS as exc:
        raise CorruptCheckpointError(f"{what} is damaged: {exc}") from None


def _chunk_array(raw: bytes, chunk: _Chunk, dtype: np.dtype, what: str) -> np.ndarray:
    """The chunk's values from its bytes, a ``torch.save`` archive."""
    n = math.prod(chunk.sizes)
    if not raw.startswith(b"PK\x03\x04"):
        raise CorruptCheckpointError(
            f"{what} is not a torch.save archive (its file is not a safetensors file either)."
        )
    ref, st, data = _torch_chunk(raw, what)
    if ref.shape != chunk.sizes or ref.dtype != dtype or st.dtype not in (dtype, np.dtype("u1")):
        raise CorruptCheckpointError(
            f"{what} holds a {list(ref.shape)} {ref.dtype} tensor; the metadata says "
            f"{list(chunk.sizes)} {dtype}."
        )
    if not n:
        return np.zeros(chunk.sizes, dtype)
    elems = len(data) // dtype.itemsize
    last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride, strict=True))
    if last >= elems:
        raise CorruptCheckpointError(
            f"{what}: its tensor reaches element {last} of a {elems}-element storage."
        )
    # strided as opaque items of the dtype's width: NumPy cannot rebuild an ml_dtypes
    # float8 from its array interface ('<f1' not understood)
    base = np.frombuffer(data, dtype=np.dtype((np.void, dtype.itemsize)), count=elems)
    view = np.lib.stride_tricks.as_strided(
        base[ref.offset :],
        shape=ref.shape,
        strides=tuple(s * dtype.itemsize for s in ref.stride),
        writeable=False,
    )
    return np.array(view, copy=True).view(dtype)


class DcpArray(BoxArray):
    """One logical value of a DCP checkpoint, assembled from the chunks a read needs."""

    def __init__(self, info: ArrayInfo, chunks: list[_Chunk], files: _Files) -> None:
        self.info = info
        self._chunks = chunks
        self._files = files

    def _read_chunk(self, chunk: _Chunk) -> np.ndarray:
        what = (
            f"the chunk at {list(chunk.offsets)} of {self.info.key!r} in {str(chunk.file)!r}"
        )
        table = self._files.safetensors(chunk.file)
        if table is not None:  # DCP's safetensors serialization: the chunk is the key's value
            key = self.info.key
            if key not in table:
                raise CorruptCheckpointError(f"{what}: the file holds no {key!r}.")
            info = table.info(key)
            if info.shape != chunk.sizes or info.dtype != self.info.dtype:
                raise CorruptCheckpointError(
                    f"{what} holds a {list(info.shape)} {info.dtype} value; the metadata "
                    f"says {list(chunk.sizes)} {self.info.dtype}."
                )
            return table.read(key)
        fh = self._files.get(chunk.file)
        if chunk.start + chunk.length > fh.size:
            raise CorruptCheckpointError(
                f"{what} runs past the end of the file ({chunk.start + chunk.length} > "
                f"{fh.size} bytes): truncated."
            )
        raw = fh.pread(chunk.start, chunk.length, "chunk")
        return _chunk_array(raw, chunk, self.info.dtype, what)

    def fill(self, out: np.ndarray, lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        """Fill ``out`` with the box ``[lo, hi)`` of the value from the chunks that meet it."""
        for chunk in self._chunks:
            a = [max(x, o) for x, o in zip(lo, chunk.offsets, strict=True)]
            b = [min(h, o + s) for h, o, s in zip(hi, chunk.offsets, chunk.sizes, strict=True)]
            if any(x >= y for x, y in zip(a, b, strict=True)) and self.info.shape:
                continue
            part = self._read_chunk(chunk)
            src = tuple(slice(x - o, y - o) for x, y, o in zip(a, b, chunk.offsets, strict=True))
            dst = tuple(slice(x - z, y - z) for x, y, z in zip(a, b, lo, strict=True))
            out[dst] = part[src]


class DcpReader(EntryReader):
    """A read-only view of a DCP checkpoint directory (its rank files closed with it)."""

    def __init__(
        self,
        path: Path,
        arrays: dict[str, DcpArray],
        files: _Files,
        metadata: dict[str, Any],
        skipped: dict[str, str],
    ) -> None:
        super().__init__(path, "dcp", arrays, skipped=skipped, metadata=metadata,
                         on_close=files.close)


def _tensor_info(key: str, entry: DcpRecord, where: str) -> tuple[np.dtype, tuple[int, ...], list[Any]]:
    props = _record(entry.field("properties", 0), "TensorProperties", where)
    dtype = props.field("dtype", 0)
    if not isinstance(dtype, TorchDtype) or dtype.np_dtype is None:
        raise UnsupportedFormatError(f"{where}: {key!r} has dtype {dtype!r}, not supported.")
    shape = check_shape(list(_dims(entry.field("size", 1), "size", where)), what=key, path=where)
    chunks = entry.field("chunks", 2)
    if not isinstance(chunks, list):
        raise CorruptCheckpointError(f"{where}: the chunks of {key!r} are not a list.")
    return dtype.np_dtype, shape, chunks


def _check_tiling(key: str, shape: tuple[int, ...], chunks: list[_Chunk], where: str) -> None:
    total = 0
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
            o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)
        ):
            raise CorruptCheckpointError(
                f"{where}: the chunk of {key!r} at {list(c.offsets)} of size {list(c.sizes)} "
                f"lies outside its shape {list(shape)}."
            )
        total += math.prod(c.sizes)
    problem = overlap_problem(shape, [(c.offsets, c.sizes) for c in chunks])
    if problem:
        raise CorruptCheckpointError(f"{where}: the chunks of {key!r} {problem}.")
    if total != math.prod(shape):
        raise CorruptCheckpointError(
            f"{where}: the chunks of {key!r} hold {total} elements; its shape {list(shape)} "
            f"has {math.prod(shape)}."
        )


def _storage_map(meta: DcpRecord, folder: Path, where: str) -> dict[tuple[str, Any], tuple[Path, int, int]]:
    storage = meta.field("storage_data", 2)
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where}: storage_data is not a dict.")
    out: dict[tuple[str, Any], tuple[Path, int, int]] = {}
    sizes: dict[Path, int] = {}
    for raw_index, raw_info in storage.items():
        index = _record(raw_index, "MetadataIndex", where)
        info = _record(raw_info, "_StorageInfo", where)
        fqn = index.field("fqn", 0)
        offset = index.field("offset", 1, None)
        offset = None if offset is None else _dims(offset, "chunk offset", where)
        name = info.field("relative_path", 0)
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise CorruptCheckpointError(f"{where} names the data file {name!r}; refused.")
        start = _int(info.field("offset", 1), "offset", where)
        length = _int(info.field("length", 2), "length", where)
        transforms = info.field("transform_descriptors", 3, None)
        if transforms:
            raise UnsupportedFormatError(
                f"{where}: {fqn!r} is stored through the transforms {transforms!r} "
                "(DCP extensions), which are not supported."
            )
        file = folder / name
        if file not in sizes:
            inside(folder, file, f"{where} names the data file {name!r}:")
            try:
                sizes[file] = file.stat().st_size
            except OSError:
                raise CorruptCheckpointError(
                    f"{where} names the data file {name!r}, which is missing."
                ) from None
        if start + length > sizes[file]:
            raise CorruptCheckpointError(
                f"{where}: the bytes of {fqn!r} ({start}..{start + length}) run past the end "
                f"of {str(file)!r} ({sizes[file]} bytes): truncated."
            )
        out[(str(fqn), offset)] = (file, start, length)
    return out


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _bytes_entry(file: Path, start: int, length: int, key: str) -> tuple[Any, int]:
    """The object pickled in a non-tensor entry and the size of its pickle."""
    what = f"the entry {key!r} in {str(file)!r}"
    fh = FileHandle(file)
    try:
        raw = fh.pread(start, length, "entry")
    finally:
        fh.close()
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            pkls = [m for m in zf.namelist() if m.endswith("/data.pkl") and m.count("/") == 1]
            if len(pkls) != 1:
                raise CorruptCheckpointError(f"{what} is not a torch.save archive.")
            data = zf.read(pkls[0])
    except CorruptCheckpointError:
        raise
    except ZIP_ERRORS as exc:
        raise CorruptCheckpointError(f"{what} is damaged: {exc}") from None
    return safe_load(io.BytesIO(data), storages={}, source=what), len(data)


def _read_metadata(folder: Path) -> DcpRecord:
    meta_file = inside(folder, folder / METADATA_NAME, "The DCP metadata")
    where = repr(str(meta_file))
    fh = FileHandle(meta_file)
    try:
        if fh.size > MAX_HEADER_BYTES:
            raise CorruptCheckpointError(f"{where} is {fh.size} bytes (limit {MAX_HEADER_BYTES}).")
        data = fh.pread(0, fh.size, "metadata")
    finally:
        fh.close()
    storages: dict[str, StorageRef] = {}
    top = safe_load(io.BytesIO(data), storages=storages, source=where, extra_globals=DCP_GLOBALS)
    if storages:
        raise CorruptCheckpointError(f"{where} refers to tensor storages; not DCP metadata.")
    return _record(top, "Metadata", where)


def _chunks(
    key: str, raw_chunks: list[Any], places: dict[tuple[str, Any], tuple[Path, int, int]],
    where: str, itemsize: int,
) -> list[_Chunk]:
    """The chunks of ``key``, each placed in its file; a chunk declaring more bytes than
    are stored for it is refused before anything is allocated."""
    chunks = []
    for raw in raw_chunks:
        c = _record(raw, "ChunkStorageMetadata", where)
        offsets = _dims(c.field("offsets", 0), "chunk offsets", where)
        sizes = _dims(c.field("sizes", 1), "chunk sizes", where)
        place = places.get((key, offsets))
        if place is None:
            raise CorruptCheckpointError(
                f"{where}: the chunk of {key!r} at {list(offsets)} has no stored bytes."
            )
        nbytes = math.prod(sizes) * itemsize
        if nbytes > place[2]:
            raise CorruptCheckpointError(
                f"{where}: the chunk of {key!r} at {list(offsets)} declares {list(sizes)} "
                f"({nbytes} bytes), but {place[2]} bytes are stored for it."
            )
        chunks.append(_Chunk(offsets, sizes, *place))
    return chunks


def _bytes_value(
    key: str, places: dict[tuple[str, Any], tuple[Path, int, int]], where: str
) -> tuple[Any, str | None]:
    """``(value, None)`` for a plain non-tensor entry, ``(None, reason)`` otherwise."""
    place = places.get((key, None))
    if place is None:
        raise CorruptCheckpointError(f"{where}: no bytes stored for {key!r}.")
    try:
        value, nbytes = _bytes_entry(*place, key)
    except CorruptCheckpointError as exc:
        return None, f"a pickled Python object DCP stored for it is refused: {exc}"
    entries = expanded_size(value, max_depth=16)
    if entries is not None and entries > max(nbytes, 64):
        return None, (
            f"a pickled value whose containers, shared by reference, expand to {entries} "
            f"entries from {nbytes} bytes"
        )
    if entries is None or not _plain(value):
        return None, "a pickled Python object that is not a plain value"
    return value, None


def _open(path: Path) -> Reader:
    folder = path.parent if path.name == METADATA_NAME else path
    where = repr(str(folder / METADATA_NAME))
    meta = _read_metadata(folder)
    entries = meta.field("state_dict_metadata", 0)
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(f"{where}: state_dict_metadata is not a dict.")
    places = _storage_map(meta, folder, where)
    files = _Files()
    arrays: dict[str, DcpArray] = {}
    metadata: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where}: the key {key!r} is not a string.")
        if isinstance(entry, DcpRecord) and entry.kind == "BytesStorageMetadata":
            value, reason = _bytes_value(key, places, where)
            if reason is None:
                metadata[key] = value
            else:
                skipped[key] = reason
            continue
        tensor = _record(entry, "TensorStorageMetadata", where)
        try:
            dtype, shape, raw_chunks = _tensor_info(key, tensor, where)
        except UnsupportedFormatError as exc:
            skipped[key] = str(exc)
            continue
        chunks = _chunks(key, raw_chunks, places, where, dtype.itemsize)
        _check_tiling(key, shape, chunks, where)
        info = ArrayInfo(key=key, dtype=dtype, shape=shape, attrs={"name": key})
        arrays[key] = DcpArray(info, chunks, files)
    return DcpReader(folder, arrays, files, metadata, skipped)


class DcpBackend(Backend, name="dcp", suffixes=()):
    """PyTorch ``torch.distributed.checkpoint`` directories (read-only)."""

    @classmethod
    def sniff(cls, path: Path) -> bool:
        path = Path(path)
        meta = path if path.name == METADATA_NAME else path / METADATA_NAME
        try:
            if not meta.is_file():  # a named pipe: opening it would wait for a writer
                return False
            with open(meta, "rb") as f:
                return f.read(1) == b"\x80"
        except OSError:
            return False

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path))
