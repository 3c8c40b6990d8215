"""HDF5 files ckptvar did not write, read safely: a walk that stays inside, lazy datasets.

Owns: :class:`Walker` (resolves paths one link at a time; refuses external and
user-defined links, virtual datasets, external raw storage and filters other than
gzip, shuffle, fletcher32 and LZF: :func:`check_dataset`), :class:`H5Array` (a
dataset read through hyperslabs, refusing never-written data unless
``ReadOptions.read_unwritten``), and which HDF5 dtypes are read (:func:`plain_dtype`,
:func:`raw_dtype` for Keras 3 raw-bits values). h5py is imported when a file is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..storage.base import ArrayInfo, LazyArray
from ..storage.slicing import element_span, expand_index

if TYPE_CHECKING:
    import h5py

__all__ = [
    "H5_ERRORS",
    "H5Array",
    "ReadOptions",
    "Walker",
    "check_dataset",
    "hard_group",
    "link_type",
    "plain_dtype",
    "raw_dtype",
]

_ALLOWED_FILTERS = {1: "gzip", 2: "shuffle", 3: "fletcher32", 32000: "lzf"}  # H5Z filter ids
_MAX_OBJECTS = 1_000_000
#: What h5py raises when libhdf5 meets damaged metadata.
H5_ERRORS: tuple[type[BaseException], ...] = (
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


def plain_dtype(dt: np.dtype) -> np.dtype | None:
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        return None
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def raw_dtype(dset: h5py.Dataset) -> np.dtype | None:
    """The real dtype of a Keras 3 raw-bits dataset (``attrs["dtype"]``), if it has one."""
    try:
        name = dset.attrs.get("dtype")
    except H5_ERRORS:
        return None
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    if not isinstance(name, str):
        return None
    import ml_dtypes

    real = getattr(ml_dtypes, name, None)
    if real is None:
        return None
    wanted: np.dtype = np.dtype(real)
    stored = dset.dtype
    raw = stored.kind == "V" and stored.fields is None and stored.subdtype is None
    if not (raw or stored.kind in "iu") or stored.itemsize != wanted.itemsize:
        return None
    return wanted


class ReadOptions:
    """Per-reader choices shared by its arrays."""

    def __init__(self, *, read_unwritten: bool = False) -> None:
        self.read_unwritten = read_unwritten


def unwritten(dset: h5py.Dataset, nbytes: int) -> str | None:
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
        self, info: ArrayInfo, dset: h5py.Dataset, options: ReadOptions, *, raw: bool = False
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
            reason = unwritten(self._dset, self.info.nbytes)
        except H5_ERRORS as exc:
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
            except H5_ERRORS as exc:
                raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        shape = self.info.shape
        self._check_written()
        try:
            simple = expand_index(index, len(shape)) if shape and self.info.size else None
            if simple is not None and all(h5_simple(i) for i in simple):
                result = self._dset[simple if simple else ()]
            elif (span := element_span(index, shape)) is not None and self.info.size:
                # negative steps: read the rows the span covers, index here
                row = self.info.size // shape[0]
                first, last = span.start // row, -(-(span.start + span.count) // row)
                flat = np.asarray(self._dset[first:last]).reshape(-1)
                at = span.start - first * row
                result = flat[at : at + span.count].reshape(span.shape)[span.index]
            else:  # a 0-d or empty value, newaxis, fancy indices: read it all, index here
                return np.array(self.read()[index], copy=True)
        except IndexError:
            raise
        except H5_ERRORS as exc:
            raise CorruptCheckpointError(f"Cannot read {self.info.key!r}: {exc}") from None
        if self._raw:
            return np.array(np.asarray(result).view(self.info.dtype), copy=True)
        return np.asarray(result).astype(self.info.dtype, copy=False)


def h5_simple(i: Any) -> bool:
    if isinstance(i, slice):
        return i.step is None or (isinstance(i.step, int) and i.step > 0)
    return isinstance(i, int | np.integer) and not isinstance(i, bool)


class Walker:
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
        kind = link_type(group, name)
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


def link_type(group: h5py.Group, name: str) -> int | None:
    """The link class of one member, without following the link (no other file is opened)."""

    if not name or "/" in name or name in (".", ".."):
        return None
    bname = name.encode("utf-8")
    if not group.id.links.exists(bname):
        return None
    return int(group.id.links.get_info(bname).type)


def hard_group(group: h5py.Group, name: str) -> h5py.Group | None:
    import h5py

    if link_type(group, name) != h5py.h5l.TYPE_HARD:
        return None
    obj = group[name]
    return obj if isinstance(obj, h5py.Group) else None
