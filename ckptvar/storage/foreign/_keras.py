"""Keras weight files and other HDF5 files ckptvar did not write, read with h5py.

Owns: the ``keras`` backend (Keras 3 ``.weights.h5``: ``layers/<name>/vars/<i>``,
``optimizer/vars/<i>``; legacy Keras HDF5 weights: root or ``model_weights``
attributes ``layer_names`` and per-layer ``weight_names``) and the
``hdf5`` backend (any other HDF5 file: every dataset by its path).

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

from pathlib import Path
from typing import Any, ClassVar

import h5py
import numpy as np

from ...errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from .._paths import RESERVED_PREFIX
from ..base import ArrayInfo, Backend, LazyArray, Reader
from ._common import EntryReader, check_shape, normalize_index, row_span

__all__ = ["HDF5Backend", "KerasBackend", "check_dataset"]

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CKPTVAR_MAGIC = b"\x89CKPTVAR"
_ALLOWED_FILTERS = {
    h5py.h5z.FILTER_DEFLATE: "gzip",
    h5py.h5z.FILTER_SHUFFLE: "shuffle",
    h5py.h5z.FILTER_FLETCHER32: "fletcher32",
    32000: "lzf",
}
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


class H5Array(LazyArray):
    """An HDF5 dataset read through hyperslabs: ``lazy[0:10]`` reads only those rows."""

    def __init__(self, info: ArrayInfo, dset: h5py.Dataset) -> None:
        self.info = info
        self._dset = dset

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        if out is None:
            out = np.empty(self.info.shape, self.info.dtype)
        elif out.shape != self.info.shape or out.dtype != self.info.dtype:
            raise ValueError(
                f"out for {self.info.key!r} must have shape {self.info.shape} and dtype "
                f"{self.info.dtype}."
            )
        if out.size:
            try:
                if out.flags.c_contiguous:
                    self._dset.read_direct(out)
                else:
                    out[...] = self._dset[()]
            except _H5_ERRORS as exc:
                raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        index = normalize_index(index, self.info.shape)
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
        obj: Any = group
        for part in [p for p in relpath.split("/") if p]:
            if not isinstance(obj, h5py.Group):
                return None
            obj = self.child(obj, part, where)
            if obj is None or isinstance(obj, h5py.SoftLink):
                return None
        return obj

    def datasets(self, group: h5py.Group, prefix: str = "") -> list[tuple[str, Any]]:
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


def _open(path: Path, fmt: str) -> Reader:
    if not path.is_file():
        raise CheckpointNotFoundError(f"No HDF5 file at {str(path)!r}.")
    try:
        f = h5py.File(path, "r")
    except _H5_ERRORS as exc:
        raise CorruptCheckpointError(f"{str(path)!r} is not a readable HDF5 file: {exc}") from None
    try:
        if _link_type(f, RESERVED_PREFIX) is not None:
            raise CorruptCheckpointError(
                f"{str(path)!r} holds a ckptvar record ({RESERVED_PREFIX!r}) but its user block "
                "magic is damaged; refusing to read its values without their checksums."
            )
        arrays, skipped = _collect(f, path, fmt)
    except CkptError:
        f.close()
        raise
    except _H5_ERRORS as exc:  # libhdf5 failing on damaged metadata
        f.close()
        raise CorruptCheckpointError(
            f"{str(path)!r}: damaged HDF5 structure ({type(exc).__name__}: {exc})."
        ) from None
    except BaseException:
        f.close()
        raise
    return EntryReader(path, fmt, arrays, skipped=skipped, on_close=f.close)


def _collect(f: h5py.File, path: Path, fmt: str) -> tuple[dict[str, LazyArray], dict[str, str]]:
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
        dt = _native(obj.dtype)
        if dt is None:
            skipped[key] = f"HDF5 dtype {obj.dtype} is not a plain numeric type"
            continue
        if obj.shape is None:
            skipped[key] = "an empty (null dataspace) dataset"
            continue
        shape = check_shape(list(obj.shape), what=f"Dataset {key!r}", path=path)
        info = ArrayInfo(key=key, dtype=dt, shape=shape, attrs={"name": key, **extra})
        arrays[key] = H5Array(info, obj)
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
    """Keras 3 ``.weights.h5`` and legacy Keras HDF5 weight files, read-only."""

    name: ClassVar[str] = "keras"
    suffixes: ClassVar[tuple[str, ...]] = (".weights.h5",)

    @classmethod
    def sniff(cls, path: Path) -> bool:
        if not _is_hdf5(Path(path)):
            return False
        try:
            with h5py.File(path, "r") as f:
                return _layout(f) != "generic"
        except Exception:  # noqa: BLE001 - a sniffer never raises; unreadable = not ours
            return False

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path), "keras")


class HDF5Backend(Backend):
    """Any HDF5 file ckptvar did not write: every dataset by its path, read-only."""

    name: ClassVar[str] = "hdf5"
    suffixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def sniff(cls, path: Path) -> bool:
        return _is_hdf5(Path(path))

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        return _open(Path(path), "hdf5")
