"""PyTorch ``.pt``/``.pth``/``.bin`` files read without PyTorch and without running pickle code.

Owns: the ``torch`` backend. Both layouts ``torch.save`` writes are read:

- the zip archive (``<dir>/data.pkl`` + ``<dir>/data/<key>`` storages + ``byteorder``),
  storages read in place at their offset in the file when stored uncompressed;
- the legacy stream (``_use_new_zipfile_serialization=False``): magic number,
  protocol version and system-info pickles, the object pickle, the storage-key
  list, then each storage as an 8-byte element count and its raw bytes.

The object pickle goes through :mod:`._unpickler` (an allow-list; nothing in
the file is ever called). Tensors become lazy arrays over their storage with
offsets and strides checked against the storage size. Nested dicts and lists
are flattened to ``a.b.0.c`` keys (a ``state_dict``'s own keys stay as they are);
plain Python leaves (``epoch``, ``name``) go to ``metadata()``.
TorchScript archives (``torch.jit.save``) are refused.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ._common import MAX_HEADER_BYTES, EntryReader, FileArray, FileHandle, check_shape, covers_whole
from ._unpickler import (
    PACKED_TORCH_DTYPES,
    StorageRef,
    TensorRef,
    TorchDtype,
    UnsupportedTensor,
    expanded_size,
    safe_load,
)
from ._zip import ZIP_ERRORS, ZipArchive, check_member_size, read_member_range, zip_crc_check

__all__ = ["TorchBackend"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_MAX_DEPTH = 64
_SUPPORTED = {
    np.dtype(n)
    for n in (
        "float32",
        "float64",
        "float16",
        "complex64",
        "complex128",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}


def _supported(dt: Any) -> bool:
    from .._dtypes import SUPPORTED_DTYPES

    return isinstance(dt, np.dtype) and (dt in _SUPPORTED or dt in SUPPORTED_DTYPES.values())


class _Source:
    """Where one storage's bytes are: ``fetch(offset, size)`` / ``readinto(buf, offset)``."""

    def __init__(
        self,
        fh: FileHandle,
        start: int,
        nbytes: int,
        what: str,
        info: zipfile.ZipInfo | None = None,
    ) -> None:
        self.fh, self.start, self.nbytes, self.what = fh, start, nbytes, what
        self.info = info  # the zip member, whose CRC-32 covers the whole storage
        self.crc = info.CRC if info is not None else None

    def fetch(self, offset: int, size: int) -> bytes:
        return self.fh.pread(self.start + offset, size, self.what)

    def readinto(self, buf: memoryview, offset: int) -> None:
        self.fh.readinto(buf, self.start + offset, self.what)


class _CompressedSource:
    """A storage in a deflated zip member: decompressed as a stream, bounded by its size."""

    readinto = None

    def __init__(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo, nbytes: int, what: str) -> None:
        self.zf, self.info, self.nbytes, self.what = zf, info, nbytes, what
        self.crc = info.CRC

    def fetch(self, offset: int, size: int) -> bytes:
        return read_member_range(self.zf, self.info, offset, size, self.what)


class TorchArray(LazyArray):
    """A (possibly strided) tensor view of a storage; only the spanned bytes are read.

    When the storage has a checksum (a zip member's CRC-32, which covers the whole
    storage), every read of the whole value is verified: a view covering its whole
    storage checks the bytes it reads; any other view (a slice, a strided view, one
    of several tensors sharing a storage) reads the whole storage, checks it, and
    takes its elements from those checked bytes. ``info.checksum`` is then the
    storage's CRC-32. A partial slice (``lazy[0:10]``) reads only its rows, unverified.
    """

    def __init__(self, info: ArrayInfo, ref: TensorRef, source: Any, stored: np.dtype) -> None:
        check = None
        crc = getattr(source, "crc", None)
        self._contiguous = _is_c_contiguous(ref.shape, ref.stride)
        self._whole = ref.offset == 0 and info.nbytes == source.nbytes and self._contiguous
        self._checked = crc is not None
        if crc is not None:
            info = dataclasses.replace(info, checksum=crc)
            if self._whole:
                check = zip_crc_check(source.info, b"", source.what)
        self.info = info
        self._ref = ref
        self._source = source
        self._stored = stored  # element dtype with the file's byte order
        item = stored.itemsize
        shape, stride = ref.shape, ref.stride
        if info.size:
            last = ref.offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
            self._span = (ref.offset * item, (last + 1) * item)
        else:
            self._span = (0, 0)
        if self._contiguous:
            self._flat = FileArray(
                info,
                stored_dtype=stored,
                offset=ref.offset * item,
                fetch=source.fetch,
                readinto=source.readinto if stored.byteorder in ("=", "|") else None,
                check=check,
            )

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        if self._contiguous and (self._whole or not (verify and self._checked)):
            return self._flat.read(out=out, verify=verify)
        arr = self._from_checked_storage() if verify and self._checked else self._strided()
        if out is not None:
            if out.shape != arr.shape or out.dtype != arr.dtype:
                raise ValueError(
                    f"out for {self.info.key!r} must have shape {arr.shape} and dtype {arr.dtype}."
                )
            out[...] = arr
            return out
        return arr

    def verify(self) -> None:
        """Check the value's bytes: a view through its storage's CRC-32 (or, unchecked, by
        reading the bytes it spans), never building the view, which may be far larger
        than its storage (``torch.zeros(1).expand(n)``)."""
        if self._whole:
            self.read(verify=True)
        elif self._checked:
            self._checked_storage()
        else:
            start, stop = self._span
            if stop > start:
                self._source.fetch(start, stop - start)

    def _checked_storage(self) -> bytes:
        src = self._source
        raw = src.fetch(0, src.nbytes) if src.nbytes else b""
        zip_crc_check(src.info, b"", src.what)(raw)
        return raw

    def _from_checked_storage(self) -> np.ndarray:
        """The whole storage read and CRC-checked, then this view's elements taken from it."""
        raw = self._checked_storage()
        start, stop = self._span
        return self._strided(raw[start:stop] if stop > start else b"")

    def _strided(self, raw: bytes | None = None, index: Any = ...) -> np.ndarray:
        """``view[index]`` copied out of the view's bytes (``raw``, else read); only the
        indexed elements are built, however large the view (a stride-0 expand)."""
        start, stop = self._span
        if raw is None:
            raw = self._source.fetch(start, stop - start) if stop > start else b""
        base = np.frombuffer(raw, dtype=self._stored)
        item = self._stored.itemsize
        view = (
            np.lib.stride_tricks.as_strided(
                base,
                shape=self._ref.shape,
                strides=tuple(s * item for s in self._ref.stride),
                writeable=False,
            )
            if len(base)
            else np.zeros(self._ref.shape, self._stored)
        )
        arr = np.array(
            view[index],
            dtype=self._stored.newbyteorder("=")
            if self._stored.byteorder not in ("=", "|")
            else self._stored,
            copy=True,
        )
        return arr.view(self.info.dtype) if arr.dtype != self.info.dtype else arr

    def __getitem__(self, index: Any) -> np.ndarray:
        if self._checked and not self._whole and covers_whole(index, self.info.shape):
            return np.array(self.read()[index], copy=True)  # verified through its storage
        if self._contiguous:
            return self._flat[index]
        return self._strided(index=index)


def _is_c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for d, s in zip(reversed(shape), reversed(stride), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


class _BoundedFile:
    """A read-only file view whose ``read(n)`` never asks for more than what is left."""

    def __init__(self, f: io.BufferedReader, size: int) -> None:
        self._f, self._size = f, size

    def read(self, n: int = -1) -> bytes:
        left = self._size - self._f.tell()
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def readinto(self, buf: Any) -> int:
        return self._f.readinto(buf)

    def readline(self) -> bytes:
        return self._f.readline(min(1 << 20, self._size - self._f.tell()))

    def tell(self) -> int:
        return self._f.tell()


def _check_walk_size(obj: Any, path: Path, budget: int) -> None:
    entries = expanded_size(obj, max_depth=_MAX_DEPTH)
    if entries is None:
        raise CorruptCheckpointError(f"{str(path)!r} nests containers too deeply.")
    if entries > max(budget, 4096):
        raise CorruptCheckpointError(
            f"{str(path)!r}: its pickle's containers, shared by reference, expand to "
            f"{entries} entries from {budget} bytes; refused."
        )


def _flatten(
    obj: Any, path: Path, budget: int
) -> tuple[dict[str, TensorRef], dict[str, Any], dict[str, str]]:
    """``(tensors, plain leaves for metadata, {key: reason} for anything else)``.

    ``budget``: the most entries the walk may visit (the pickle's size in bytes, at
    least 4096): a pickle without shared containers has fewer entries than bytes, so only
    containers shared by reference can exceed it, and those are refused before the walk.
    """
    _check_walk_size(obj, path, budget)
    tensors: dict[str, TensorRef] = {}
    meta: dict[str, Any] = {}
    skipped: dict[str, str] = {}

    def walk(prefix: str, value: Any, depth: int, parts: tuple[Any, ...] = ()) -> None:
        if depth > _MAX_DEPTH:
            raise CorruptCheckpointError(f"{str(path)!r} nests containers too deeply.")
        if isinstance(value, TensorRef):
            key = prefix or "tensor"
            if key in tensors:  # {"a.b": x, "a": {"b": y}}: both join to a.b
                skipped[f"{key} {parts!r}"] = (
                    f"its path {parts!r} joins with '.' to the key {key!r} of another "
                    "tensor, which is read under it")
                return
            tensors[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, depth + 1, (*parts, k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}" if prefix else str(i), v, depth + 1, (*parts, i))
        elif isinstance(value, bool | int | float | str) or value is None:
            meta[prefix or "value"] = value
        else:
            skipped[prefix or "value"] = _unreadable(value)

    walk("", obj, 0)
    return tensors, meta, skipped


def _unreadable(value: Any) -> str:
    """Why a leaf of the pickle is not read: a tensor of a dtype ckptvar cannot hold, or
    an object that is neither a tensor nor a plain value."""
    if isinstance(value, UnsupportedTensor):
        return value.reason()
    what = f"torch.{value.name}" if isinstance(value, TorchDtype) else type(value).__name__
    return f"a {what} object, neither a tensor nor a plain number or string"


def _storage_elems(ref: TensorRef) -> int:
    """The storage size in units of the tensor's dtype (untyped storages count bytes)."""
    st = ref.storage
    if st.dtype == ref.dtype:
        return st.numel
    return st.numel * st.dtype.itemsize // ref.dtype.itemsize


def _check_bounds(key: str, ref: TensorRef, path: Path) -> None:
    shape = check_shape(list(ref.shape), what=f"Tensor {key!r}", path=path)
    if not _supported(ref.dtype):
        raise CorruptCheckpointError(f"Tensor {key!r} in {str(path)!r} has dtype {ref.dtype!r}.")
    if ref.storage.dtype != ref.dtype and ref.storage.dtype != np.dtype("uint8"):
        raise CorruptCheckpointError(
            f"Tensor {key!r} in {str(path)!r}: dtype {ref.dtype} does not match its "
            f"{ref.storage.dtype} storage."
        )
    if 0 in shape:
        return
    last = ref.offset + sum((d - 1) * s for d, s in zip(shape, ref.stride, strict=True))
    elems = _storage_elems(ref)
    if last >= elems:
        raise CorruptCheckpointError(
            f"Tensor {key!r} in {str(path)!r} reaches element {last} of its storage "
            f"{ref.storage.key!r}, which holds only {elems} (offset {ref.offset}, "
            f"shape {shape}, stride {ref.stride})."
        )


def _info(key: str, ref: TensorRef) -> ArrayInfo:
    attrs: dict[str, Any] = {"name": key}
    if ref.is_parameter:
        attrs["parameter"] = True
    if ref.requires_grad:
        attrs["requires_grad"] = True
    return ArrayInfo(key=key, dtype=ref.dtype, shape=tuple(ref.shape), attrs=attrs)


def _storage_source(archive: ZipArchive, name: str, st: StorageRef, path: Path) -> Any:
    """Where one storage's bytes are: a stored member in place, or a deflated stream."""
    info = archive.members.get(name)
    if info is None:
        raise CorruptCheckpointError(f"{str(path)!r} lacks the storage member {name!r}.")
    nbytes = st.numel * st.dtype.itemsize
    if info.file_size != nbytes:
        raise CorruptCheckpointError(
            f"Storage {name!r} in {str(path)!r} holds {info.file_size} bytes; "
            f"its {st.numel} elements of {st.dtype} need {nbytes}."
        )
    what = f"storage {name!r} of {str(path)!r}"
    if info.compress_type == zipfile.ZIP_STORED:
        start = archive.data_offset(name)
        if start + nbytes > archive.fh.size:
            raise CorruptCheckpointError(f"{what} runs past the end of the file.")
        return _Source(archive.fh, start, nbytes, what, info)
    check_member_size(info, 1 << 62, path)
    return _CompressedSource(archive.zf, info, nbytes, what)


def _open_zip(path: Path) -> Reader:
    archive = ZipArchive(path, kind="zip")
    try:
        infos = archive.members
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if any(n.endswith("/constants.pkl") or "/code/" in n for n in infos):
            raise UnsupportedFormatError(
                f"{str(path)!r} is a TorchScript archive (torch.jit.save), not a torch.save "
                "checkpoint; load it with torch.jit.load and save its state_dict() instead."
            )
        if len(pkls) != 1:
            raise CorruptCheckpointError(
                f"{str(path)!r} is a zip but not a torch.save archive "
                f"(expected one '<dir>/data.pkl', found {len(pkls)})."
            )
        prefix = pkls[0][: -len("data.pkl")]
        pkl = archive.read(pkls[0], MAX_HEADER_BYTES)
        order = "little"
        if prefix + "byteorder" in infos:
            order = archive.read(prefix + "byteorder", 16).decode("ascii", "replace").strip()
            if order not in ("little", "big"):
                raise CorruptCheckpointError(f"{str(path)!r}: unknown byteorder {order!r}.")
        storages: dict[str, StorageRef] = {}
        obj = safe_load(io.BytesIO(pkl), storages=storages, source=repr(str(path)))
        tensors, meta, skipped = _flatten(obj, path, len(pkl))
        sources = {key: _storage_source(archive, f"{prefix}data/{key}", st, path)
                   for key, st in storages.items()}
        arrays = _arrays(tensors, sources, order, path)
    except BaseException:
        archive.close()
        raise

    return EntryReader(
        path, "torch", arrays, skipped=skipped, metadata=meta, on_close=archive.close,
        changed=_unpacked(arrays)
    )


def _arrays(
    tensors: dict[str, TensorRef], sources: dict[str, Any], order: str, path: Path
) -> dict[str, LazyArray]:
    arrays: dict[str, LazyArray] = {}
    for key, ref in tensors.items():
        _check_bounds(key, ref, path)
        stored = ref.dtype
        if order == "big" and stored.itemsize > 1 and stored.kind in "biufc":
            stored = stored.newbyteorder(">")
        array = TorchArray(_info(key, ref), ref, sources[ref.storage.key], stored)
        arrays[key] = array if ref.packed is None else PairsArray(array, ref.packed)
    return arrays


def _unpacked(arrays: Mapping[str, LazyArray]) -> dict[str, str]:
    """The reader's ``changed``: ``{key: how}`` of the tensors of a packed dtype."""
    return {key: str(a.info.attrs["unpacked"]) for key, a in arrays.items()
            if isinstance(a, PairsArray)}


class PairsArray(LazyArray):
    """A tensor of a packed torch dtype (``float4_e2m1fn_x2``: two values a byte) read as
    its unpacked values: the bytes (a :class:`TorchArray`, which checks them) split into
    the low nibble, then the high one, the last dimension doubled (a 0-d tensor's two
    values are a vector of 2). Slicing reads the whole tensor."""

    def __init__(self, packed: TorchArray, torch_dtype: str) -> None:
        self._packed = packed
        info = packed.info
        shape = (*info.shape[:-1], info.shape[-1] * 2) if info.shape else (2,)
        attrs = dict(info.attrs or {})
        attrs["torch_dtype"] = torch_dtype
        attrs["unpacked"] = (
            f"torch.{torch_dtype} of shape {list(info.shape)}, two values a byte: read as "
            f"{PACKED_TORCH_DTYPES[torch_dtype].name}, one a byte, the low nibble first, the "
            "last dimension doubled")
        self.info = dataclasses.replace(info, dtype=PACKED_TORCH_DTYPES[torch_dtype],
                                        shape=shape, attrs=attrs)

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        if out is not None and (out.shape != self.info.shape or out.dtype != self.info.dtype):
            raise ValueError(f"out for {self.info.key!r} must have shape {self.info.shape} "
                             f"and dtype {self.info.dtype}.")
        raw = self._packed.read(verify=verify)
        codes = np.empty((*raw.shape, 2), np.uint8)
        codes[..., 0] = raw & 0x0F
        codes[..., 1] = raw >> 4
        values = codes.reshape(self.info.shape).view(self.info.dtype)
        if out is None:
            return values
        out[...] = values
        return out

    def verify(self) -> None:
        self._packed.verify()

    def __getitem__(self, index: Any) -> np.ndarray:
        result = self.read()[index]
        return np.array(result, copy=True) if isinstance(result, np.ndarray) else result


def _open_legacy(path: Path) -> Reader:
    fh = FileHandle(path)
    try:
        with open(path, "rb") as raw:
            f = _BoundedFile(raw, fh.size)
            src = repr(str(path))
            magic = safe_load(f, storages={}, source=src)  # type: ignore[arg-type]
            if magic != _LEGACY_MAGIC:
                raise CorruptCheckpointError(f"{str(path)!r} is not a torch.save file.")
            version = safe_load(f, storages={}, source=src)  # type: ignore[arg-type]
            if version != _LEGACY_PROTOCOL:
                raise CorruptCheckpointError(
                    f"{str(path)!r}: legacy torch protocol {version!r} (expected 1001)."
                )
            sys_info = safe_load(f, storages={}, source=src)  # type: ignore[arg-type]
            big = isinstance(sys_info, dict) and sys_info.get("little_endian") is False
            storages: dict[str, StorageRef] = {}
            obj = safe_load(f, storages=storages, source=src, legacy=True)  # type: ignore[arg-type]
            keys = safe_load(f, storages={}, source=src)  # type: ignore[arg-type]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise CorruptCheckpointError(f"{str(path)!r}: malformed storage key list.")
            offset = raw.tell()
        sources: dict[str, Any] = {}
        for key in keys:
            st = storages.get(key)
            if st is None or key in sources:
                raise CorruptCheckpointError(f"{str(path)!r}: unexpected storage key {key!r}.")
            (count,) = struct.unpack("<q" if not big else ">q", fh.pread(offset, 8, "storage"))
            if count != st.numel:
                raise CorruptCheckpointError(
                    f"Storage {key!r} in {str(path)!r} records {count} elements; "
                    f"the pickle says {st.numel}."
                )
            nbytes = st.numel * st.dtype.itemsize
            start = offset + 8
            if start + nbytes > fh.size:
                raise CorruptCheckpointError(
                    f"Storage {key!r} in {str(path)!r} runs past the end of the file "
                    f"({start + nbytes} > {fh.size} bytes): truncated."
                )
            sources[key] = _Source(fh, start, nbytes, f"storage {key!r} of {str(path)!r}")
            offset = start + nbytes
        missing = set(storages) - set(sources)
        if missing:
            raise CorruptCheckpointError(f"{str(path)!r} lacks storages {sorted(missing)[:5]}.")
        tensors, meta, skipped = _flatten(obj, path, fh.size)
        arrays = _arrays(tensors, sources, "big" if big else "little", path)
    except BaseException:
        fh.close()
        raise
    return EntryReader(path, "torch", arrays, skipped=skipped, metadata=meta, on_close=fh.close,
                       changed=_unpacked(arrays))


class TorchBackend(Backend, name="torch", suffixes=(".pt", ".pth", ".bin")):
    """PyTorch ``torch.save`` files (zip and legacy), read-only."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError:
            return False
        if head.startswith(b"\x80\x02\x8a\x0a") and head[4:14] == _LEGACY_MAGIC.to_bytes(
            10, "little"
        ):
            return True
        if head.startswith(b"PK\x03\x04"):
            try:
                with zipfile.ZipFile(path) as zf:
                    return any(n.endswith("/data.pkl") for n in zf.namelist())
            except ZIP_ERRORS:
                return False
        return False

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        path = Path(path)
        if not path.is_file():
            from ..errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"No PyTorch file at {str(path)!r}.")
        with open(path, "rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04" or zipfile.is_zipfile(path):
            return _open_zip(path)
        if head[:2] == b"\x80\x02":
            return _open_legacy(path)
        raise CorruptCheckpointError(
            f"{str(path)!r} is neither a torch.save zip archive nor a legacy torch.save stream "
            f"(starts with {head!r})."
        )
