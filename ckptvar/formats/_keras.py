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

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from ..locations.positional import PositionalRaw
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ..storage.paths import RESERVED_PREFIX
from ._common import EntryReader, check_shape
from ._h5_safe import (
    H5_ERRORS,
    H5Array,
    ReadOptions,
    Walker,
    check_dataset,
    hard_group,
    link_type,
    plain_dtype,
    raw_dtype,
)
from ._zip import ZIP_ERRORS, ZipArchive, check_member_size

if TYPE_CHECKING:
    import h5py

__all__ = ["HDF5Backend", "KerasBackend", "check_dataset"]

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CKPTVAR_MAGIC = b"\x89CKPTVAR"
_ARCHIVE_WEIGHTS = "model.weights.h5"
_ARCHIVE_JSON = ("config.json", "metadata.json")
_MAX_JSON_BYTES = 64 << 20
_MAX_WEIGHTS_BYTES = 1 << 44


def _as_strings(values: Any) -> list[str]:
    arr = np.asarray(values)
    if arr.dtype.kind not in "SUO" or arr.ndim > 1:
        return []
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.ravel()]


def _layout(f: h5py.File) -> str:
    if "layer_names" in f.attrs:
        return "legacy-root"
    mw = hard_group(f, "model_weights")
    if mw is not None and "layer_names" in mw.attrs:
        return "legacy-model"
    if hard_group(f, "layers") is not None or hard_group(f, "vars") is not None:
        return "keras3"
    return "generic"


def _open(path: Path, fmt: str, *, read_unwritten: bool = False) -> Reader:
    import h5py

    if not path.is_file():
        raise CheckpointNotFoundError(f"No HDF5 file at {str(path)!r}.")
    try:
        f = h5py.File(path, "r")
    except H5_ERRORS as exc:
        raise CorruptCheckpointError(f"{str(path)!r} is not a readable HDF5 file: {exc}") from None
    return _reader(f, path, fmt, options=ReadOptions(read_unwritten=read_unwritten), close=f.close)


def _reader(
    f: h5py.File, path: Path, fmt: str, *, options: ReadOptions, close: Any, metadata: Any = None
) -> Reader:
    """An ``EntryReader`` over the open HDF5 file ``f``; ``close`` runs when it is closed."""
    try:
        if link_type(f, RESERVED_PREFIX) is not None:
            raise CorruptCheckpointError(
                f"{str(path)!r} holds a ckptvar record ({RESERVED_PREFIX!r}) but its user block "
                "magic is damaged; refusing to read its values without their checksums."
            )
        arrays, skipped = _collect(f, path, fmt, options)
    except CkptError:
        close()
        raise
    except H5_ERRORS as exc:  # libhdf5 failing on damaged metadata
        close()
        raise CorruptCheckpointError(
            f"{str(path)!r}: damaged HDF5 structure ({type(exc).__name__}: {exc})."
        ) from None
    except BaseException:
        close()
        raise
    return EntryReader(path, fmt, arrays, skipped=skipped, metadata=metadata, on_close=close)


class _MemberFile(PositionalRaw):
    """A read-only, seekable window onto ``size`` bytes at ``start`` of an open file."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__(size)
        self._fd, self._start = fd, start

    def read_at(self, pos: int, view: memoryview) -> int:
        data = os.pread(self._fd, len(view), self._start + pos)
        view[: len(data)] = data
        return len(data)


def _archive_metadata(archive: ZipArchive, path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` and ``metadata.json`` of a ``.keras`` archive."""
    metadata: dict[str, Any] = {}
    for name in _ARCHIVE_JSON:
        if name not in archive.members:
            continue
        raw = archive.read(name, _MAX_JSON_BYTES)
        try:
            metadata[name[: -len(".json")]] = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{name} in {str(path)!r}: {exc}") from None
    return metadata


def _weights_file(archive: ZipArchive, path: Path) -> tuple[Any, Any]:
    """``(file object, spill file or None)`` over the archive's ``model.weights.h5``.

    A stored member is read in place; a deflated one is decompressed once into an
    anonymous temporary file (the spill), which the caller closes with the reader.
    """
    info = archive.members[_ARCHIVE_WEIGHTS]
    check_member_size(info, _MAX_WEIGHTS_BYTES, path)
    if info.compress_type == zipfile.ZIP_STORED:
        start = archive.data_offset(_ARCHIVE_WEIGHTS)
        if start + info.file_size > archive.fh.size:
            raise CorruptCheckpointError(
                f"{_ARCHIVE_WEIGHTS} in {str(path)!r} runs past the end of the file."
            )
        assert archive.fh.fd is not None
        return _MemberFile(archive.fh.fd, start, info.file_size), None
    spill = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the reader
    try:
        with archive.zf.open(info) as member:
            shutil.copyfileobj(member, spill, 1 << 22)
    except ZIP_ERRORS as exc:
        spill.close()
        raise CorruptCheckpointError(
            f"{_ARCHIVE_WEIGHTS} in {str(path)!r} is damaged: {exc}"
        ) from None
    except BaseException:
        spill.close()
        raise
    spill.seek(0)
    return spill, spill


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
        metadata = _archive_metadata(archive, path)
        fileobj, spill = _weights_file(archive, path)
        try:
            f = h5py.File(fileobj, "r")
        except H5_ERRORS as exc:
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

    options = ReadOptions(read_unwritten=read_unwritten)
    return _reader(f, path, "keras", options=options, close=close, metadata=metadata)


_Item = tuple[str, Any, dict[str, Any]]  # (key, HDF5 object or link, extra attributes)


def _legacy_items(f: h5py.File, walker: Walker, layout: str, path: Path) -> list[_Item]:
    """Legacy Keras weights: ``layer_names``, each layer's ``weight_names``, the optimizer's."""
    import h5py

    items: list[_Item] = []
    root = f if layout == "legacy-root" else hard_group(f, "model_weights")
    assert root is not None
    for layer in _as_strings(root.attrs["layer_names"]):
        g = walker.resolve(root, layer, repr(layer))
        if not isinstance(g, h5py.Group):
            raise CorruptCheckpointError(f"Layer group {layer!r} is missing in {path}.")
        for wname in _as_strings(g.attrs.get("weight_names", [])):
            obj = walker.resolve(g, wname, repr(wname))
            items.append((wname, obj, {"layer": layer}))
    og = hard_group(f, "optimizer_weights")
    if og is not None:
        for wname in _as_strings(og.attrs.get("weight_names", [])):
            obj = walker.resolve(og, wname, repr(wname))
            items.append((f"optimizer_weights/{wname}", obj, {}))
    return items


def _dataset_items(f: h5py.File, walker: Walker, layout: str) -> list[_Item]:
    """Every dataset by its path; Keras 3 ``.../vars/<i>`` also get their layer's name."""
    items: list[_Item] = []
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
    return items


def _collect(
    f: h5py.File, path: Path, fmt: str, options: ReadOptions
) -> tuple[dict[str, LazyArray], dict[str, str]]:
    import h5py

    walker = Walker(f, path)
    layout = _layout(f) if fmt == "keras" else "generic"
    items = (_legacy_items(f, walker, layout, path) if layout.startswith("legacy")
             else _dataset_items(f, walker, layout))
    arrays: dict[str, LazyArray] = {}
    skipped: dict[str, str] = {}
    for key, obj, extra in items:
        if key in arrays or key in skipped:  # legacy Keras: two layers name a weight alike
            layer = extra.get("layer")
            where = f" of layer {layer!r}" if layer is not None else ""
            skipped[f"{key} ({layer or 'again'})"] = (
                f"a second weight named {key!r}{where}: the first is read under the name")
            continue
        if isinstance(obj, h5py.SoftLink):
            skipped[key] = f"a soft link to {obj.path!r} (links are not followed)"
            continue
        if not isinstance(obj, h5py.Dataset):
            raise CorruptCheckpointError(f"Weight {key!r} is missing in {str(path)!r}.")
        real = raw_dtype(obj)
        dt = real if real is not None else plain_dtype(obj.dtype)
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


class KerasBackend(Backend, name="keras", suffixes=(".weights.h5", ".keras"), sniff_priority=60):
    """Keras 3 ``.weights.h5``, ``.keras`` archives and legacy Keras HDF5 weights, read-only."""


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


class HDF5Backend(Backend, name="hdf5", suffixes=(), sniff_priority=90):
    """Any HDF5 file ckptvar did not write: every dataset by its path, read-only.

    It sniffs last: any HDF5 file is one, so every specific HDF5 layout goes first.
    """


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
