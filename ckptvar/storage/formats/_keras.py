"""Keras weight files, ``.keras`` archives and other HDF5 files ckptvar did not write.

Owns: the ``keras`` backend (Keras 3 ``.weights.h5``: ``layers/<name>/vars/<i>``,
``optimizer/vars/<i>``; Keras 3 ``.keras`` archives: a zip of ``config.json``,
``metadata.json`` and ``model.weights.h5``, checked by :class:`._zip.ZipArchive`,
with the parsed JSON as the reader's metadata; legacy Keras HDF5 weights: root or
``model_weights`` attributes ``layer_names`` and per-layer ``weight_names``) and
the ``hdf5`` backend (any other HDF5 file: every dataset by its path). h5py is
imported when a file is opened, not when ckptvar is imported.

Keras 3 stores dtypes NumPy lacks (bfloat16) as raw 16-bit data (an HDF5 opaque
or integer type) with ``attrs["dtype"] = "bfloat16"``; such datasets are read
with that dtype (any ml_dtypes name of the same width is accepted).

A dataset whose storage was never written (a chunked dataset with missing
chunks, a contiguous one never allocated) would read as its fill value, which
is not data; reading it raises ``CorruptCheckpointError`` naming the dataset,
before anything of its declared size is allocated, unless the reader was opened
with ``read_unwritten=True``.

Keys: Keras 3 files keep their HDF5 paths (``layers/dense/vars/0``, with the
user-facing layer name in ``attrs["layer"]``); legacy files use the weight
names Keras gave (``dense/kernel:0``, ``optimizer_weights/Adam/iter:0``).

No HDF5 object may reach outside the file: before any dataset is indexed the
walk refuses external links (soft links are not followed), datasets with
external raw storage, virtual datasets, and datasets needing any filter other
than the built-in gzip, shuffle, fletcher32 and LZF. Only plain numeric and bool
dtypes are read; anything else is listed in ``reader.skipped``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ...errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from .._paths import RESERVED_PREFIX
from ..base import ArrayInfo, Backend, LazyArray, Reader
from ._common import EntryReader, check_shape, normalize_index, row_span
from ._zip import ZIP_ERRORS, ZipArchive, check_member_size

if TYPE_CHECKING:
    import h5py

__all__ = ["HDF5Backend", "KerasBackend", "check_dataset"]

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CKPTVAR_MAGIC = b"\x89CKPTVAR"
_ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 32000: "lzf"}  # H5Z filter ids
_ARCHIVE_WEIGHTS = "model.weights.h5"
_ARCHIVE_JSON = ("config.json", "metadata.json")
_MAX_JSON_BYTES = 64 << 20
_MAX_WEIGHTS_BYTES = 1 << 44
_MAX_OBJECTS = 1_000_000
#: What h5py raises when libhdf5 meets damaged metadata.
_H5_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    RuntimeError,
    KeyError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
)


def check_dataset(dset: h5py.Dataset, what: str) -> None:
    """Refuse a dataset whose reading could touch another file or an unknown plugin."""
    import h5py

    dcpl = dset.id.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise CorruptCheckpointError(
            f"{what} is a virtual dataset (it reads other files); refused."
        )
    if dcpl.get_external_count() > 0:
        names = [dcpl.get_external(i)[0] for i in range(min(dcpl.get_external_count(), 3))]
        raise CorruptCheckpointError(
            f"{what} keeps its data in external file(s) {names!r}; refused."
        )
    for i in range(dcpl.get_nfilters()):
        code = dcpl.get_filter(i)[0]
        if code not in _ALLOWED_FILTERS:
            raise CorruptCheckpointError(
                f"{what} needs HDF5 filter {code} (only gzip, shuffle, fletcher32 and lzf are "
                "allowed; plugins are never loaded); refused."
            )


def _native(dt: np.dtype) -> np.dtype | None:
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        return None
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def _attr_dtype(dset: h5py.Dataset) -> np.dtype | None:
    """The real dtype of a Keras 3 raw-bits dataset (``attrs["dtype"]``), if it has one."""
    try:
        name = dset.attrs.get("dtype")
    except _H5_ERRORS:
        return None
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    if not isinstance(name, str):
        return None
    import ml_dtypes

    real = getattr(ml_dtypes, name, None)
    if real is None:
        return None
    real = np.dtype(real)
    stored = dset.dtype
    raw = stored.kind == "V" and stored.fields is None and stored.subdtype is None
    if not (raw or stored.kind in "iu") or stored.itemsize != real.itemsize:
        return None
    return real


class _Options:
    """Per-reader choices shared by its arrays."""

    def __init__(self, *, read_unwritten: bool = False) -> None:
        self.read_unwritten = read_unwritten


def _unwritten(dset: h5py.Dataset, nbytes: int) -> str | None:
    """Why ``dset``'s declared data is not all in the file (``None`` when it is)."""
    import h5py

    if nbytes == 0:
        return None
    dcpl = dset.id.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.COMPACT:
        return None
    if layout == h5py.h5d.CHUNKED:
        chunks = dset.chunks or ()
        expected = 1
        for d, c in zip(dset.shape, chunks, strict=True):
            expected *= -(-d // c) if c else 0
        written = dset.id.get_num_chunks()
        if written < expected:
            return f"only {written} of its {expected} chunks are written"
        return None
    stored = dset.id.get_storage_size()
    if stored < nbytes:
        return f"the file holds {stored} of its {nbytes} bytes"
    return None


class H5Array(LazyArray):
    """An HDF5 dataset read through hyperslabs: ``lazy[0:10]`` reads only those rows.

    ``raw`` datasets (Keras 3 bfloat16) hold the bits of ``info.dtype`` in an opaque
    or integer type of the same width; they are read as bytes and viewed.
    """

    def __init__(
        self, info: ArrayInfo, dset: h5py.Dataset, options: _Options, *, raw: bool = False
    ) -> None:
        self.info = info
        self._dset = dset
        self._options = options
        self._raw = raw
        self._checked = False

    def _check_written(self) -> None:
        """Refuse (before allocating) a dataset whose data was never written."""
        if self._checked or self._options.read_unwritten:
            return
        try:
            reason = _unwritten(self._dset, self.info.nbytes)
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        if reason is not None:
            raise CorruptCheckpointError(
                f"HDF5 dataset {self.info.key!r} in {self._dset.file.filename!r} declares "
                f"shape {self.info.shape} of {self.info.dtype} ({self.info.nbytes} bytes), but "
                f"{reason}: the rest would read as the fill value, which is not data. "
                "Refused; open the file with read_unwritten=True to read fill values."
            )
        self._checked = True

    def _stored(self, arr: np.ndarray) -> np.ndarray:
        return arr.view(self._dset.dtype) if self._raw else arr

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        if out is not None and (out.shape != self.info.shape or out.dtype != self.info.dtype):
            raise ValueError(
                f"out for {self.info.key!r} must have shape {self.info.shape} and dtype "
                f"{self.info.dtype}."
            )
        self._check_written()
        if out is None:
            out = np.empty(self.info.shape, self.info.dtype)
        if out.size:
            try:
                if out.flags.c_contiguous:
                    self._dset.read_direct(self._stored(out))
                else:
                    out[...] = np.asarray(self._dset[()]).view(self.info.dtype)
            except _H5_ERRORS as exc:
                raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        index = normalize_index(index, self.info.shape)
        self._check_written()
        try:
            if not self.info.shape or not self.info.size:
                return np.array(self.read()[index], copy=True)
            if all(_h5_simple(i) for i in index) and len(index) <= len(self.info.shape):
                result = self._dset[index if index else ()]
            else:  # negative steps, newaxis, fancy indices: read the rows spanned, index here
                start, stop, rest = row_span(index, self.info.shape)
                result = self._dset[start:stop][rest]
        except IndexError:
            raise
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        if self._raw:
            return np.array(np.asarray(result).view(self.info.dtype), copy=True)
        return np.asarray(result).astype(self.info.dtype, copy=False)


def _h5_simple(i: Any) -> bool:
    if isinstance(i, slice):
        return i.step is None or (isinstance(i.step, int) and i.step > 0)
    return isinstance(i, int | np.integer) and not isinstance(i, bool)


class _Walker:
    """Resolves paths one link at a time, refusing links and datasets that reach outside."""

    def __init__(self, f: h5py.File, path: Path) -> None:
        self.f = f
        self.path = path
        self.count = 0

    def child(self, group: h5py.Group, name: str, where: str) -> Any:
        import h5py

        self.count += 1
        if self.count > _MAX_OBJECTS:
            raise CorruptCheckpointError(f"{str(self.path)!r} has too many HDF5 objects.")
        kind = _link_type(group, name)
        if kind is None:
            return None
        if kind == h5py.h5l.TYPE_EXTERNAL:
            target = group.id.links.get_val(name.encode("utf-8"))
            raise CorruptCheckpointError(
                f"{where} in {str(self.path)!r} is an external link to {target!r}; refused "
                "(a checkpoint never reads other files)."
            )
        if kind == h5py.h5l.TYPE_SOFT:
            return h5py.SoftLink(
                group.id.links.get_val(name.encode("utf-8")).decode("utf-8", "replace")
            )  # never followed
        if kind != h5py.h5l.TYPE_HARD:
            raise CorruptCheckpointError(
                f"{where} in {str(self.path)!r} is a user-defined HDF5 link; refused."
            )
        obj = group[name]
        if isinstance(obj, h5py.Dataset):
            check_dataset(obj, f"{where} in {str(self.path)!r}")
        return obj

    def resolve(self, group: h5py.Group, relpath: str, where: str) -> Any:
        import h5py

        obj: Any = group
        for part in [p for p in relpath.split("/") if p]:
            if not isinstance(obj, h5py.Group):
                return None
            obj = self.child(obj, part, where)
            if obj is None or isinstance(obj, h5py.SoftLink):
                return None
        return obj

    def datasets(self, group: h5py.Group, prefix: str = "") -> list[tuple[str, Any]]:
        import h5py

        out: list[tuple[str, Any]] = []
        seen: set[Any] = set()

        def walk(g: h5py.Group, pre: str, depth: int) -> None:
            if depth > 64:
                raise CorruptCheckpointError(f"{str(self.path)!r} nests groups too deeply.")
            for name in g:
                full = f"{pre}{name}"
                obj = self.child(g, name, repr(full))
                if obj is None:
                    continue
                if isinstance(obj, h5py.SoftLink):
                    out.append((full, obj))
                    continue
                if isinstance(obj, h5py.Group):
                    addr = obj.id
                    if addr in seen:
                        continue
                    seen.add(addr)
                    walk(obj, full + "/", depth + 1)
                elif isinstance(obj, h5py.Dataset):
                    out.append((full, obj))

        walk(group, prefix, 0)
        return out


def _link_type(group: h5py.Group, name: str) -> int | None:
    """The link class of one member, without following the link (no other file is opened)."""

    if not name or "/" in name or name in (".", ".."):
        return None
    bname = name.encode("utf-8")
    if not group.id.links.exists(bname):
        return None
    return int(group.id.links.get_info(bname).type)


def _hard_group(group: h5py.Group, name: str) -> h5py.Group | None:
    import h5py

    if _link_type(group, name) != h5py.h5l.TYPE_HARD:
        return None
    obj = group[name]
    return obj if isinstance(obj, h5py.Group) else None


def _as_strings(values: Any) -> list[str]:
    arr = np.asarray(values)
    if arr.dtype.kind not in "SUO" or arr.ndim > 1:
        return []
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.ravel()]


def _layout(f: h5py.File) -> str:
    if "layer_names" in f.attrs:
        return "legacy-root"
    mw = _hard_group(f, "model_weights")
    if mw is not None and "layer_names" in mw.attrs:
        return "legacy-model"
    if _hard_group(f, "layers") is not None or _hard_group(f, "vars") is not None:
        return "keras3"
    return "generic"


def _open(path: Path, fmt: str, *, read_unwritten: bool = False) -> Reader:
    import h5py

    if not path.is_file():
        raise CheckpointNotFoundError(f"No HDF5 file at {str(path)!r}.")
    try:
        f = h5py.File(path, "r")
    except _H5_ERRORS as exc:
        raise CorruptCheckpointError(f"{str(path)!r} is not a readable HDF5 file: {exc}") from None
    return _reader(f, path, fmt, _Options(read_unwritten=read_unwritten), f.close)


def _reader(
    f: h5py.File, path: Path, fmt: str, options: _Options, close: Any, metadata: Any = None
) -> Reader:
    """An ``EntryReader`` over the open HDF5 file ``f``; ``close`` runs when it is closed."""
    try:
        if _link_type(f, RESERVED_PREFIX) is not None:
            raise CorruptCheckpointError(
                f"{str(path)!r} holds a ckptvar record ({RESERVED_PREFIX!r}) but its user block "
                "magic is damaged; refusing to read its values without their checksums."
            )
        arrays, skipped = _collect(f, path, fmt, options)
    except CkptError:
        close()
        raise
    except _H5_ERRORS as exc:  # libhdf5 failing on damaged metadata
        close()
        raise CorruptCheckpointError(
            f"{str(path)!r}: damaged HDF5 structure ({type(exc).__name__}: {exc})."
        ) from None
    except BaseException:
        close()
        raise
    return EntryReader(path, fmt, arrays, skipped=skipped, metadata=metadata, on_close=close)


class _MemberFile(io.RawIOBase):
    """A read-only, seekable window onto ``size`` bytes at ``start`` of an open file."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__()
        self._fd, self._start, self._size, self._pos = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), max(0, self._size - self._pos))
        if n == 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _open_archive(path: Path, *, read_unwritten: bool = False) -> Reader:
    """A Keras 3 ``.keras`` zip: its ``model.weights.h5`` values, its JSON as metadata."""
    import h5py

    if not path.is_file():
        raise CheckpointNotFoundError(f"No .keras archive at {str(path)!r}.")
    archive = ZipArchive(path, kind=".keras archive")
    spill: Any = None
    try:
        members = archive.members
        if _ARCHIVE_WEIGHTS not in members:
            other = [n for n in members if n.startswith("model.weights")]
            raise CorruptCheckpointError(
                f"{str(path)!r} has no {_ARCHIVE_WEIGHTS!r}"
                + (f" (it holds {other[0]!r}, which ckptvar does not read)" if other else "")
                + f"; members: {sorted(members)[:10]}."
            )
        metadata: dict[str, Any] = {}
        for name in _ARCHIVE_JSON:
            if name not in members:
                continue
            raw = archive.read(name, _MAX_JSON_BYTES)
            try:
                metadata[name[: -len(".json")]] = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise CorruptCheckpointError(f"{name} in {str(path)!r}: {exc}") from None
        info = members[_ARCHIVE_WEIGHTS]
        check_member_size(info, _MAX_WEIGHTS_BYTES, path)
        if info.compress_type == zipfile.ZIP_STORED:
            start = archive.data_offset(_ARCHIVE_WEIGHTS)
            if start + info.file_size > archive.fh.size:
                raise CorruptCheckpointError(
                    f"{_ARCHIVE_WEIGHTS} in {str(path)!r} runs past the end of the file."
                )
            assert archive.fh.fd is not None
            fileobj: Any = _MemberFile(archive.fh.fd, start, info.file_size)
        else:  # deflated: decompressed once, into an anonymous temporary file
            spill = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the reader
            try:
                with archive.zf.open(info) as member:
                    shutil.copyfileobj(member, spill, 1 << 22)
            except ZIP_ERRORS as exc:
                raise CorruptCheckpointError(
                    f"{_ARCHIVE_WEIGHTS} in {str(path)!r} is damaged: {exc}"
                ) from None
            spill.seek(0)
            fileobj = spill
        try:
            f = h5py.File(fileobj, "r")
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                f"{_ARCHIVE_WEIGHTS} in {str(path)!r} is not a readable HDF5 file: {exc}"
            ) from None
    except BaseException:
        if spill is not None:
            spill.close()
        archive.close()
        raise

    def close() -> None:
        f.close()
        if spill is not None:
            spill.close()
        archive.close()

    return _reader(f, path, "keras", _Options(read_unwritten=read_unwritten), close, metadata)


def _collect(
    f: h5py.File, path: Path, fmt: str, options: _Options
) -> tuple[dict[str, LazyArray], dict[str, str]]:
    import h5py

    walker = _Walker(f, path)
    layout = _layout(f) if fmt == "keras" else "generic"
    items: list[tuple[str, Any, dict[str, Any]]] = []
    if layout.startswith("legacy"):
        root = f if layout == "legacy-root" else _hard_group(f, "model_weights")
        assert root is not None
        for layer in _as_strings(root.attrs["layer_names"]):
            g = walker.resolve(root, layer, repr(layer))
            if not isinstance(g, h5py.Group):
                raise CorruptCheckpointError(f"Layer group {layer!r} is missing in {path}.")
            for wname in _as_strings(g.attrs.get("weight_names", [])):
                obj = walker.resolve(g, wname, repr(wname))
                items.append((wname, obj, {"layer": layer}))
        og = _hard_group(f, "optimizer_weights")
        if og is not None:
            for wname in _as_strings(og.attrs.get("weight_names", [])):
                obj = walker.resolve(og, wname, repr(wname))
                items.append((f"optimizer_weights/{wname}", obj, {}))
    else:
        for full, obj in walker.datasets(f):
            extra: dict[str, Any] = {}
            parts = full.split("/")
            if layout == "keras3" and len(parts) >= 3 and parts[-2] == "vars":
                vars_group = walker.resolve(f, "/".join(parts[:-1]), repr(full))
                name = vars_group.attrs.get("name")
                if isinstance(name, bytes):
                    name = name.decode("utf-8", "replace")
                if isinstance(name, str):
                    extra["layer"] = name
            items.append((full, obj, extra))
    arrays: dict[str, LazyArray] = {}
    skipped: dict[str, str] = {}
    for key, obj, extra in items:
        if isinstance(obj, h5py.SoftLink):
            skipped[key] = f"a soft link to {obj.path!r} (links are not followed)"
            continue
        if not isinstance(obj, h5py.Dataset):
            raise CorruptCheckpointError(f"Weight {key!r} is missing in {str(path)!r}.")
        real = _attr_dtype(obj)
        dt = real if real is not None else _native(obj.dtype)
        if dt is None:
            skipped[key] = f"HDF5 dtype {obj.dtype} is not a plain numeric type"
            continue
        if obj.shape is None:
            skipped[key] = "an empty (null dataspace) dataset"
            continue
        shape = check_shape(list(obj.shape), what=f"Dataset {key!r}", path=path)
        info = ArrayInfo(key=key, dtype=dt, shape=shape, attrs={"name": key, **extra})
        arrays[key] = H5Array(info, obj, options, raw=real is not None)
    return arrays, skipped


def _is_hdf5(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:8] == _CKPTVAR_MAGIC:
                return False
            if head == _HDF5_SIGNATURE:
                return True
            for off in (512, 1024, 2048, 4096):  # a user block shifts the superblock
                f.seek(off)
                if f.read(8) == _HDF5_SIGNATURE:
                    return True
    except OSError:
        return False
    return False


class KerasBackend(Backend):
    """Keras 3 ``.weights.h5``, ``.keras`` archives and legacy Keras HDF5 weights, read-only."""

    name: ClassVar[str] = "keras"
    suffixes: ClassVar[tuple[str, ...]] = (".weights.h5", ".keras")

    @classmethod
    def sniff(cls, path: Path) -> bool:
        path = Path(path)
        if path.name.lower().endswith(".keras"):
            try:
                with zipfile.ZipFile(path) as zf:
                    return _ARCHIVE_WEIGHTS in zf.namelist()
            except ZIP_ERRORS:
                return False
        if not _is_hdf5(path):
            return False
        try:
            import h5py

            with h5py.File(path, "r") as f:
                return _layout(f) != "generic"
        except Exception:  # noqa: BLE001 - a sniffer never raises; unreadable = not ours
            return False

    @classmethod
    def open_reader(cls, path: Path, *, read_unwritten: bool = False) -> Reader:
        """Open ``path``; ``read_unwritten=True`` reads never-written data as fill values."""
        path = Path(path)
        if _is_zip(path):
            return _open_archive(path, read_unwritten=read_unwritten)
        return _open(path, "keras", read_unwritten=read_unwritten)


class HDF5Backend(Backend):
    """Any HDF5 file ckptvar did not write: every dataset by its path, read-only."""

    name: ClassVar[str] = "hdf5"
    suffixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def sniff(cls, path: Path) -> bool:
        return _is_hdf5(Path(path))

    @classmethod
    def open_reader(cls, path: Path, *, read_unwritten: bool = False) -> Reader:
        """Open ``path``; ``read_unwritten=True`` reads never-written data as fill values."""
        return _open(Path(path), "hdf5", read_unwritten=read_unwritten)


def _is_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False
