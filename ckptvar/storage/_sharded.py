"""The multi-process checkpoint layout: one directory step, one ordinary file per writer, one index.

A checkpoint written by several processes is a directory ``prefix-N.h5`` (or
``.zarr``) holding

- ``rank-00000.h5`` ... (``.zarr``): an ordinary ckptvar checkpoint per process that
  wrote something, holding the boxes it wrote under the keys ``<key>/.box/<j>``
  (checksums as in any ckptvar file);
- ``ckptvar-index.msgpack``: the global index, written last by rank 0, which lists
  each logical key with its full shape, dtype, attributes and boxes
  ``(offset, shape, file, stored key)``, plus the checkpoint's metadata;
- for ``.zarr`` a root ``zarr.json`` (a plain Zarr v3 group whose members are the
  per-process groups) and, for each variable whose boxes form a regular grid, one
  plain Zarr v3 array at its key whose chunks are the boxes, each chunk file written
  by its box's writer (:mod:`._sharded_zarr`; index version 2 lists the grid and the
  chunks' checksums).

:class:`ShardedReader` shows the logical variables: a slice reads only the parts of
the stored boxes it overlaps (:func:`~ckptvar.distributed.read_plan`), never filling
a gap. The layout is found by its index (``backend_for`` hands an ``.h5``/``.zarr``
directory that is not an ordinary checkpoint to this backend).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .._dtypes import as_dtype
from ..distributed import Box, read_plan
from ..errors import (
    CkptError,
    CorruptCheckpointError,
    MissingKeyError,
    ShardLayoutError,
    UnsupportedFormatError,
)
from ._box_index import as_box, fits_whole
from ._container import ContainerReader
from ._record import BLOCK_SIZE, holder_step, is_sibling_name
from ._sharded_zarr import GridVariable, check_chunk, check_part, read_part
from ._step_files import LocalStepFiles, StepFiles
from ._zarr import ZarrReader
from .base import (
    ArrayInfo,
    Backend,
    LazyArray,
    Reader,
    SupportsDeltas,
    SupportsReadIntoMany,
    SupportsRuns,
    SupportsShared,
    SupportsStoredBoxes,
    SupportsVerifyAll,
    SupportsVerifyMany,
)
from .registry import register_backend
from .slicing import run_start, span_bounds

__all__ = [
    "INDEX_FILE",
    "INDEX_FORMAT",
    "ShardedBackend",
    "ShardedReader",
    "box_key",
    "pack_index",
    "rank_file",
]

INDEX_FILE = "ckptvar-index.msgpack"
INDEX_FORMAT = "ckptvar-sharded"
#: 2 when some variables are global Zarr arrays (``grid`` entries, ``checksums``), else 1.
INDEX_VERSION = 2
#: Stored boxes up to this size are read whole (and verified) even when only partly needed.
_SLICE_WHOLE_BELOW = 1 << 20
#: ... in a file of ckptvar's own format: a value of more than one checksum block (64 KiB
#: as written now) verifies by the blocks a run touches, so only a box of one block
#: (verified whole anyway) is read whole; a larger one fetches the run and its two edge
#: blocks.
_OWN_WHOLE_BELOW = BLOCK_SIZE


def rank_file(rank: int, suffix: str) -> str:
    """The name of one process's file inside the step directory."""
    return f"rank-{rank:05d}{suffix}"


def box_key(key: str, j: int) -> str:
    """The key under which box ``j`` of the logical ``key`` is stored in a process's file."""
    return f"{key}/.box/{j}"


def pack_index(
    container: str,
    processes: int,
    files: list[str],
    variables: bytes,
    metadata: dict[str, Any],
    *,
    checksums: dict[str, list[int]] | None = None,
) -> bytes:
    """The index record (msgpack map); ``variables`` is the packed ``variables`` map.

    ``checksums`` (the chunks of global Zarr arrays, per key) makes it version 2.
    See the module docstring and docs/FORMAT.md.
    """
    packer = msgpack.Packer(use_bin_type=True)
    head: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": 1 if checksums is None else INDEX_VERSION,
        "container": container,
        "processes": processes,
        "files": files,
        "metadata": metadata,
    }
    if checksums is not None:
        head["checksums"] = checksums
    parts = [packer.pack_map_header(len(head) + 1)]
    for k, v in head.items():
        parts += [packer.pack(k), packer.pack(v)]
    parts += [packer.pack("variables"), variables]
    return b"".join(parts)


def _load_index(files: StepFiles) -> dict[str, Any]:
    raw = files.read_index(INDEX_FILE)
    where = files.where(INDEX_FILE)
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is damage
        raise CorruptCheckpointError(f"{where!r} is damaged: {exc}.") from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise CorruptCheckpointError(f"{where!r} is not a ckptvar multi-process index.")
    version = doc.get("version")
    if type(version) is int and version > INDEX_VERSION:
        raise UnsupportedFormatError(
            f"{where!r} has index version {version}, newer than the 1-{INDEX_VERSION} this "
            "ckptvar reads; upgrade ckptvar to read it."
        )
    if type(version) is not int or not 1 <= version <= INDEX_VERSION:
        raise CorruptCheckpointError(
            f"{where!r} has index version {doc.get('version')!r}; this ckptvar reads up "
            f"to {INDEX_VERSION}."
        )
    if not isinstance(doc.get("variables"), dict) or not isinstance(doc.get("files"), list):
        raise CorruptCheckpointError(f"{where!r} is malformed (no variables/files).")
    for name in doc["files"]:
        if not is_sibling_name(name):
            raise CorruptCheckpointError(
                f"The index of {files.display!r} names the file {name!r}, which is not a "
                "plain name inside the step: the index is damaged."
            )
    _check_processes(doc, files.display)
    if not isinstance(doc.get("metadata", {}), dict):
        raise CorruptCheckpointError(
            f"The index of {files.display!r} is malformed: its metadata is a "
            f"{type(doc['metadata']).__name__}, not a map."
        )
    odd = next((k for k in doc["variables"] if not isinstance(k, str)), None)
    if odd is not None:
        raise CorruptCheckpointError(
            f"The index of {files.display!r} is malformed: it has the variable key {odd!r}, "
            "not a string."
        )
    return doc


def _check_processes(doc: dict[str, Any], display: str) -> None:
    """``processes``: an int of at least 1, one rank file each, the first ``processes``
    of ``files`` (the files after them are copies of replicated values)."""
    n, names = doc.get("processes"), doc["files"]
    if type(n) is not int or n < 1:
        raise CorruptCheckpointError(
            f"The index of {display!r} is malformed: its processes count is {n!r}, not an "
            "int of at least 1."
        )
    if n > len(names):
        raise CorruptCheckpointError(
            f"The index of {display!r} is malformed: it says {n} processes wrote the step "
            f"but lists {len(names)} file{'' if len(names) == 1 else 's'}."
        )
    for name in names[n:]:
        if isinstance(name, str) and name.startswith("rank-"):
            raise CorruptCheckpointError(
                f"The index of {display!r} is malformed: it lists the file {name!r} past "
                f"its {n} process{'' if n == 1 else 'es'}' files."
            )


class ShardedReader(Reader, SupportsVerifyAll, SupportsReadIntoMany, SupportsVerifyMany,
                    SupportsStoredBoxes, SupportsShared, SupportsDeltas):
    """The logical variables of a multi-process checkpoint; per-process files open on demand.

    :attr:`bytes_read` counts the value bytes this reader asked its files for.
    """

    def __init__(self, path: Path | str, files: StepFiles | None = None) -> None:
        #: the step: a local directory, or the URL of a committed step (``files`` given)
        self.path: Any = Path(path) if files is None else path
        self._src = LocalStepFiles(Path(path)) if files is None else files
        self._index = _load_index(self._src)
        #: what ``ckpt inspect`` shows: the per-process files' format, written by N processes
        n = self._index.get("processes")
        self.format = f"{self._index.get('container')} ({n} process{'' if n == 1 else 'es'})"
        self._files: list[str] = [str(f) for f in self._index["files"]]
        self._subs: dict[int, Reader] = {}
        self._infos: dict[str, ArrayInfo] = {}
        self._boxes: dict[str, list[tuple[Any, int, str]]] = {}
        #: variables stored as global Zarr arrays, and their chunks' checksums
        self._grids: dict[str, tuple[GridVariable, list[int]]] = {}
        self.bytes_read = 0
        sums = self._index.get("checksums") or {}
        for key, rec in self._index["variables"].items():
            try:
                shape = _index_shape(rec["shape"])
                dtype = as_dtype(rec["dtype"])  # a name (bfloat16) or a NumPy string
                attrs = rec.get("attrs") or {}
                if not isinstance(attrs, dict):
                    raise TypeError(f"its attrs are {type(attrs).__name__}, not a map")
                boxes = [
                    (Box(tuple(o), tuple(s)), _file_index(f, j), str(k))
                    for j, (o, s, f, k) in enumerate(rec["boxes"])
                ]
                if rec.get("grid") is not None:
                    gv = GridVariable.from_index(key, shape, dtype, rec["grid"],
                                                 [b for b, _, _ in boxes])
                    crcs = [int(c) for c in sums[key]]
                    if len(crcs) != len(boxes):
                        raise ValueError("it has not one checksum per chunk")
                    self._grids[key] = (gv, crcs)
            except (KeyError, TypeError, ValueError, AttributeError, CkptError) as exc:
                raise CorruptCheckpointError(
                    f"The index of {str(self.path)!r} is malformed at variable {key!r}: {exc}."
                ) from None
            if any(not 0 <= f < len(self._files) for _, f, _ in boxes):
                raise CorruptCheckpointError(
                    f"The index of {str(self.path)!r} names a file that it does not list "
                    f"for variable {key!r}."
                )
            self._infos[key] = ArrayInfo(key, dtype, shape, dict(attrs),
                                       piecewise=True)  # every box and chunk has one
            self._boxes[key] = boxes

    # -- the Reader interface ----------------------------------------------------------
    def keys(self) -> Any:
        return self._infos.keys()

    def info(self, key: str) -> ArrayInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise MissingKeyError(f"No variable {key!r} in {str(self.path)!r}.") from None

    def __getitem__(self, key: str) -> LazyArray:
        return ShardedLazyArray(self, self.info(key))

    def metadata(self) -> dict[str, Any]:
        meta = self._index.get("metadata")
        return dict(meta) if isinstance(meta, dict) else {}

    def read(self, key: str, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        info = self.info(key)
        full = Box.full(info.shape)
        if out is not None and (out.shape != tuple(info.shape) or out.dtype != info.dtype
                                or not out.flags.writeable):
            raise ValueError(
                f"out= for {key!r} has shape {out.shape} and dtype {out.dtype}"
                f"{'' if out.flags.writeable else ' (read-only)'}; the stored value has shape "
                f"{tuple(info.shape)} and dtype {info.dtype}, and out= must be a writeable "
                "array of those."
            )
        if out is None or not fits_whole(out, info):
            value = self.read_box(key, full, verify=verify)
            if out is None:
                return value
            out[...] = value
            return out
        self._read_into(key, full, out, verify)
        return out

    def read_into_many(self, pairs: list[tuple[str, np.ndarray]], *, verify: bool = True) -> None:
        """Read each ``(key, out)`` value into ``out`` (its shape and dtype, C-contiguous).

        Whole stored boxes go straight into ``out``, one bulk read per process file (that
        file's parallel engine); the rest as :meth:`read`. With ``verify`` a damaged
        value raises, but other buffers may already hold new bytes: verify first.
        """
        per_file: dict[int, list[tuple[str, str, np.ndarray]]] = {}
        for key, out in pairs:
            info = self.info(key)
            if not fits_whole(out, info):
                raise ValueError(
                    f"out= for {key!r} must be a writeable C-contiguous {info.dtype} array of "
                    f"shape {info.shape}, not {out.dtype} {out.shape}."
                )
            if key in self._grids:  # a global Zarr array: its chunks, not process files
                self._read_into(key, Box.full(info.shape), out, verify)
                continue
            boxes = self._boxes_of(key)
            plan = read_plan(key, Box.full(info.shape), [b for b, _, _ in boxes], info.shape)
            self._check_held(key, boxes, (i.source for i in plan))
            rest = []
            for item in plan:
                _, f, stored = boxes[item.source]
                dest = out[item.dest_slices] if out.ndim else out
                if dest.flags.c_contiguous:  # the whole stored box (a full read)
                    per_file.setdefault(f, []).append((key, stored, dest))
                    self.bytes_read += dest.nbytes
                else:
                    rest.append(item)
            if rest:
                self._copy_items(key, boxes, rest, out, verify)
        for f, jobs in sorted(per_file.items()):
            self._read_file(f, jobs, verify)

    def _read_file(self, f: int, jobs: list[tuple[str, str, np.ndarray]], verify: bool) -> None:
        """Read whole stored boxes of process file ``f`` into their buffers, in bulk."""
        sub = self._sub(jobs[0][0], f)
        try:
            if isinstance(sub, SupportsReadIntoMany):
                sub.read_into_many([(stored, dest) for _, stored, dest in jobs], verify=verify)
            else:
                for _, stored, dest in jobs:
                    sub.read(stored, out=dest, verify=verify)
        except (MissingKeyError, CorruptCheckpointError) as exc:
            names = ", ".join(sorted({repr(k) for k, _, _ in jobs}))
            raise CorruptCheckpointError(
                f"Variables {names}: a slice in file {self._where(f)!r} "
                f"is damaged or missing: {exc}"
            ) from exc

    def verify_many(self, keys: Iterable[str]) -> None:
        """Raise ``CorruptCheckpointError`` for a damaged value among ``keys`` (one bulk
        check per process file, that file's parallel engine)."""
        per_file: dict[int, list[tuple[str, str]]] = {}
        for key in keys:
            if key in self._grids:
                self.verify(key)
                continue
            boxes = self._boxes_of(key)
            self._check_held(key, boxes, range(len(boxes)))
            for _, f, stored in boxes:
                per_file.setdefault(f, []).append((key, stored))
        for f, jobs in sorted(per_file.items()):
            sub = self._sub(jobs[0][0], f)
            if isinstance(sub, SupportsVerifyMany):
                try:
                    sub.verify_many([stored for _, stored in jobs])
                    continue
                except (MissingKeyError, CorruptCheckpointError):
                    pass  # find the value, for the message below
            for key, stored in jobs:
                self._verify_one(key, f, stored)

    def verify(self, key: str) -> None:
        self.verify_box(key, Box.full(self.info(key).shape))

    def verify_box(self, key: str, target: Any) -> None:
        """Verify every stored box (or global array chunk) of ``key`` that overlaps
        ``target`` (a ``Box``), whole: what a later ``verify=False`` read of it may trust."""
        boxes = self._boxes_of(key)
        grid = self._grids.get(key)
        plan = read_plan(key, target, [b for b, _, _ in boxes], self._infos[key].shape)
        self._check_held(key, boxes, (i.source for i in plan))
        for item in plan:
            box, f, stored = boxes[item.source]
            if grid is None:
                self._verify_part(key, f, stored, item, box)
                continue
            with self._unless_gone():
                check_part(self._root(), Path(self._src.display), grid[0], item.source,
                           crc=grid[1][item.source])

    def verify_all(self) -> list[tuple[str, str]]:
        bad: list[tuple[str, str]] = []
        for key in self._infos:
            try:
                self.verify(key)
            except (CorruptCheckpointError, ShardLayoutError) as exc:  # boxes that leave a
                bad.append((key, str(exc)))  # gap or overlap: a damaged index
        return bad

    def close(self) -> None:
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            sub.close()
        self._src.close()

    def shared(self) -> dict[str, list[str]]:
        """The values whose stored boxes other steps beside this one hold or share (an
        incremental multi-process step): key -> those steps' names (HDF5: the steps whose
        files external links name; Zarr: those whose chunk files are the same files).
        On an object store, HDF5 only: a Zarr step there shares nothing (its unchanged
        values are server-side copies)."""
        out: dict[str, list[str]] = {}
        if not isinstance(self._src, LocalStepFiles):
            return self._held_elsewhere()
        step = Path(self._src.display)
        siblings: list[Path] = []
        for key, boxes in self._boxes.items():
            names: set[str] = set()
            for rel in self._chunk_files(key, boxes, names):
                try:
                    st = os.stat(step / rel, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    if not siblings:
                        siblings = sorted(p for p in step.parent.glob(f"*{step.suffix}")
                                          if p.name != step.name and not p.name.startswith("."))
                    names.update(_same_file(siblings, rel, st))
            if names:
                out[key] = sorted(names)
        return out

    def _held_elsewhere(self) -> dict[str, list[str]]:
        """:meth:`shared` of a step on an object store: the steps whose process files hold
        bytes of its HDF5 boxes (each process file's record names them)."""
        out: dict[str, list[str]] = {}
        for key, boxes in self._boxes.items():
            names: set[str] = set()
            for _, f, stored in boxes:
                if not self._files[f].endswith(".h5"):
                    continue
                sub = self._sub(key, f)
                if isinstance(sub, SupportsShared):
                    names.update(holder_step(n) for n in sub.shared().get(stored, ()))
            if names:
                out[key] = sorted(names)
        return out

    def deltas(self) -> dict[str, dict[str, Any]]:
        """The values with boxes stored as row deltas in their process files (format 1.5):
        key -> ``{"base": the steps that wrote those boxes' whole copies (joined by ", "),
        "patches": the most patches a box has, "rows": their rows, repeats counted, summed
        over the boxes, "boxes": how many boxes are deltas}``
        (:class:`.base.SupportsDeltas`)."""
        out: dict[str, dict[str, Any]] = {}
        for key, boxes in self._boxes.items():
            if key in self._grids:
                continue  # a global Zarr array: chunks, never deltas
            bases: set[str] = set()
            patches = rows = count = 0
            for _, f, stored in boxes:
                sub = self._sub(key, f)
                d = sub.deltas().get(stored) if isinstance(sub, SupportsDeltas) else None
                if d is not None:
                    bases.add(d["base"])
                    patches, rows, count = max(patches, d["patches"]), rows + d["rows"], count + 1
            if count:
                out[key] = {"base": ", ".join(sorted(bases)), "patches": patches, "rows": rows,
                            "boxes": count}
        return out

    def _chunk_files(self, key: str, boxes: list[tuple[Any, int, str]],
                     names: set[str]) -> list[str]:
        """The Zarr chunk files of ``key``'s boxes (relative to the step); the steps that
        hold its HDF5 boxes' bytes are added to ``names``."""
        grid = self._grids.get(key)
        if grid is not None:
            return [grid[0].chunk_rel(box) for box, _, _ in boxes]
        rels = []
        for _, f, stored in boxes:
            sub = self._sub(key, f)
            if not isinstance(sub, ContainerReader):
                continue
            if isinstance(sub, ZarrReader):
                rels += [f"{self._files[f]}/{rel}" for rel in sub.chunk_files(stored)]
            elif isinstance(sub, SupportsShared):
                names.update(holder_step(n) for n in sub.shared().get(stored, ()))
        return rels

    # -- boxes ---------------------------------------------------------------------------
    def stored_boxes(self, key: str) -> list[Any]:
        """The boxes stored for ``key`` (``Box`` objects, in index order)."""
        return [b for b, _, _ in self._boxes_of(key)]

    def read_box(self, key: str, target: Any, *, verify: bool = True) -> np.ndarray:
        """The part ``target`` (a ``Box``) of ``key``: only the overlapping bytes are read.

        A stored box read whole (needed whole, or up to 1 MiB) is verified against its
        checksum; a part of a larger box is read as its run of elements only
        (:attr:`bytes_read` counts what was read). Raises ``ShardLayoutError``
        when ``target`` is not fully covered, ``CorruptCheckpointError`` naming the
        variable and the file when a file is missing or damaged.
        """
        info = self.info(key)
        boxes = self._boxes_of(key)
        plan = read_plan(key, target, [b for b, _, _ in boxes], info.shape)
        # before allocating what the index claims
        self._check_held(key, boxes, (i.source for i in plan), chunks=True)
        out = np.empty(target.shape, dtype=info.dtype)
        self._copy_items(key, boxes, plan, out, verify)
        return out

    def read_box_into(
        self, key: str, target: Any, out: np.ndarray, *, verify: bool = True
    ) -> None:
        """:meth:`read_box` straight into ``out`` (``target``'s shape, the stored dtype,
        C-contiguous and writeable)."""
        info = self.info(key)
        if (out.shape != tuple(target.shape) or out.dtype != info.dtype
                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(
                f"out= for the box {target} of {key!r} must be a writeable C-contiguous "
                f"{info.dtype} array of shape {tuple(target.shape)}, not {out.dtype} {out.shape}."
            )
        self._read_into(key, target, out, verify)

    def _read_into(self, key: str, target: Any, out: np.ndarray, verify: bool) -> None:
        """:meth:`read_box` into ``out`` (``target``'s shape, the value's dtype)."""
        boxes = self._boxes_of(key)
        plan = read_plan(key, target, [b for b, _, _ in boxes], self._infos[key].shape)
        self._check_held(key, boxes, (i.source for i in plan))
        self._copy_items(key, boxes, plan, out, verify)

    def _check_held(
        self, key: str, boxes: list[tuple[Any, int, str]], sources: Iterable[int], *,
        chunks: bool = False,
    ) -> None:
        """Check that each stored box ``sources`` names (positions in ``boxes``, as a read
        plan's items give them) is held as the index says: a value
        of the box's shape and the variable's dtype in its process file, under the key its
        writer gave it (``<key>/.box/<j>``, which its checksum binds; with ``chunks``,
        also a global array's chunk files, by their sizes), else ``CorruptCheckpointError``
        naming the variable and the file. A read checks this before it allocates the
        index's shapes: a damaged index cannot make it allocate more than is stored."""
        grid = self._grids.get(key)
        dtype = self._infos[key].dtype
        for j in sorted(set(sources)):
            box, f, stored = boxes[j]
            if box.size == 0:  # nothing stored, nothing read
                continue
            if grid is not None:
                if chunks:
                    with self._unless_gone():
                        check_chunk(self._root(), Path(self._src.display), grid[0], j)
                continue
            if stored != box_key(key, j):  # the key its writer gave it: bound by its checksum
                raise CorruptCheckpointError(
                    f"Variable {key!r}: the index names {stored!r} in file {self._where(f)!r} "
                    f"as its slice {box}, which is stored as {box_key(key, j)!r}: the index "
                    "is damaged."
                )
            sub = self._sub(key, f)
            try:
                held = sub.info(stored)
            except MissingKeyError:
                raise CorruptCheckpointError(
                    f"Variable {key!r}: its slice {box} is missing from file "
                    f"{self._where(f)!r}."
                ) from None
            if held.shape != tuple(box.shape) or held.dtype != dtype:
                raise CorruptCheckpointError(
                    f"Variable {key!r}: the index says file {self._where(f)!r} holds its "
                    f"slice {box} as {stored!r} ({dtype}), but that value has shape "
                    f"{held.shape} and dtype {held.dtype}: the index or the file is damaged."
                )

    def _copy_items(
        self, key: str, boxes: list[tuple[Any, int, str]], plan: list[Any], out: np.ndarray,
        verify: bool,
    ) -> None:
        isz = out.dtype.itemsize
        grid = self._grids.get(key)
        for item in plan:
            box, f, stored = boxes[item.source]
            dest = out[item.dest_slices] if out.ndim else out
            if grid is not None:
                whole = item.box == box or box.size * isz <= _SLICE_WHOLE_BELOW
                with self._unless_gone():
                    part, nbytes = read_part(
                        self._root(), Path(self._src.display), grid[0], item.source,
                        item.source_slices, crc=grid[1][item.source], whole=whole,
                        verify=verify, out=dest,
                    )
                self.bytes_read += nbytes
                if part is not dest:
                    dest[...] = part
                continue
            sub = self._sub(key, f)
            try:
                if item.box == box and dest.flags.c_contiguous:  # straight into place
                    sub.read(stored, out=dest, verify=verify)
                    self.bytes_read += box.size * isz
                    continue
                if item.box == box or box.size * isz <= _OWN_WHOLE_BELOW:
                    part = sub.read(stored, verify=verify)[item.source_slices]
                    self.bytes_read += box.size * isz
                else:  # the run of elements from the first to the last one needed
                    start = run_start(item.source_slices, box.shape)
                    if (start is not None and dest.flags.c_contiguous
                            and isinstance(sub, SupportsRuns)):  # one run, in place
                        sub.read_run_into(stored, start, dest.reshape(-1), verify=verify)
                        self.bytes_read += dest.nbytes
                        continue
                    part = sub[stored][item.source_slices]
                    lo, hi = span_bounds(item.source_slices, box.shape)
                    self.bytes_read += (hi - lo) * isz
            except MissingKeyError:
                raise CorruptCheckpointError(
                    f"Variable {key!r}: its slice {box} is missing from file "
                    f"{self._where(f)!r}."
                ) from None
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    f"Variable {key!r}: its slice {box} in file "
                    f"{self._where(f)!r} is damaged: {exc}"
                ) from exc
            dest[...] = part

    def _boxes_of(self, key: str) -> list[tuple[Any, int, str]]:
        self.info(key)
        return self._boxes[key]

    @contextmanager
    def _unless_gone(self) -> Iterator[None]:
        """A missing or damaged file of a step deleted (pruned) since it was opened is
        ``CheckpointNotFoundError``, as a one-process reader says, not damage."""
        try:
            yield
        except CorruptCheckpointError:
            self._src.raise_if_gone()
            raise

    def _root(self) -> int:
        """The step directory, held open (chunk files are opened below it, no symlinks)."""
        return self._src.root_fd()

    def _verify_part(self, key: str, f: int, stored: str, item: Any, box: Any) -> None:
        """Verify the part ``item`` of a stored box: only its blocks when it is one run."""
        start = None if item.box == box else run_start(item.source_slices, box.shape)
        sub = self._sub(key, f)
        if start is None or not isinstance(sub, SupportsRuns):
            self._verify_one(key, f, stored)
            return
        try:
            sub.verify_run(stored, start, item.box.size)
        except (MissingKeyError, CorruptCheckpointError) as exc:
            raise CorruptCheckpointError(
                f"Variable {key!r}: its slice {box} in file {self._where(f)!r} is damaged "
                f"or missing: {exc}"
            ) from exc

    def _verify_one(self, key: str, f: int, stored: str) -> None:
        sub = self._sub(key, f)
        try:
            sub.verify(stored)
        except (MissingKeyError, CorruptCheckpointError) as exc:
            raise CorruptCheckpointError(
                f"Variable {key!r}: its slice in file {self._where(f)!r} "
                f"is damaged or missing: {exc}"
            ) from exc

    def _sub(self, key: str, f: int) -> Reader:
        sub = self._subs.get(f)
        if sub is not None:
            return sub
        where = self._where(f)
        try:
            sub = self._src.open_reader(self._files[f])
        except FileNotFoundError:
            self._src.raise_if_gone()
            raise CorruptCheckpointError(
                f"Variable {key!r}: its slice file {where!r} is missing."
            ) from None
        except (CkptError, OSError) as exc:
            raise CorruptCheckpointError(
                f"Variable {key!r}: its slice file {where!r} cannot be read: {exc}"
            ) from exc
        self._subs[f] = sub
        return sub

    def _where(self, f: int) -> str:
        return self._src.where(self._files[f])


def _file_index(value: Any, j: int) -> int:
    """A box's file index as the index stores it: an int (``True`` is no file index)."""
    if type(value) is not int:
        raise TypeError(f"its box #{j} has the file index {value!r}, not an int")
    return value


def _index_shape(value: Any) -> tuple[int, ...]:
    """A full shape as the index stores it: a list of non-negative ints, nothing else."""
    if not isinstance(value, list) or any(type(n) is not int or n < 0 for n in value):
        raise ValueError(f"its shape {value!r} is not a list of non-negative ints")
    return tuple(value)


def _same_file(steps: list[Path], rel: str, st: os.stat_result) -> list[str]:
    """The names of ``steps`` whose file ``rel`` is the file ``st`` (a hard link)."""
    out = []
    for other in steps:
        try:
            there = os.stat(other / rel, follow_symlinks=False)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
            out.append(other.name)
    return out


class ShardedLazyArray(LazyArray):
    """One logical variable of a :class:`ShardedReader`; slicing reads only what it needs."""

    def __init__(self, reader: ShardedReader, info: ArrayInfo) -> None:
        self._reader = reader
        self.info = info

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        return self._reader.read(self.info.key, out=out, verify=verify)

    def __getitem__(self, index: Any) -> np.ndarray:

        box, rest = as_box(index, self.shape)
        if box is None:
            return np.asarray(self.read()[index])
        value = self._reader.read_box(self.info.key, box)
        return np.asarray(value[rest]) if rest else value


class ShardedBackend(Backend, name="sharded", suffixes=(), sniff_priority=20):
    """Reads the multi-process layout (written by ``ckptvar.checkpoint._collective``).

    It sniffs before Zarr: a multi-process step directory may hold a Zarr group.
    """


    @classmethod
    def sniff(cls, path: Path) -> bool:
        return os.path.isfile(os.path.join(path, INDEX_FILE))

    @classmethod
    def open_reader(cls, path: Path) -> ShardedReader:
        return ShardedReader(Path(path))


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed multi-process checkpoint."""
    return ShardedBackend.sniff(Path(path))


register_backend(ShardedBackend)
