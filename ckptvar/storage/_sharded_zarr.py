"""Global Zarr arrays in a multi-process ``.zarr`` checkpoint (a regular grid of boxes).

When the boxes of a logical variable form Zarr's regular chunk grid (every box has
the shape of the box at the origin, except boxes truncated at the far edges; one box
per grid cell) and its value has at least 64 KiB (smaller ones stay packed in the
per-process files), the variable is stored as ONE plain Zarr v3 array in the step's root
group, its chunk shape the box shape, instead of one array per box in per-process
files. Each chunk file is written by exactly one process, the box's writer (no
sharding codec: a shard would hold boxes of several writers); edge chunks are padded
to the chunk shape with zeros, as Zarr stores them. ``zarr.open_group(step)[key]``
then reads the whole logical value with zarr-python alone.

ckptvar's checksums stay: each writer hashes its chunks (CRC-32C bound to the chunk's
path, dtype and chunk shape, :mod:`._checksum`) into ``sums-NNNNN.msgpack``; the
committing process moves them into the global index (``checksums``) and deletes the
files. Readers trust only the index, never zarr's metadata.

:func:`grid_layout` decides from a save plan which variables are stored this way;
:class:`GridLayout` writes one process's part and collects the checksums (with a
:class:`GridReuse`, an incremental step's chunk equal to its base step's is a hard link
to that file); :class:`GridVariable` is also what the reader builds from the index.

>>> grid_chunk((10, 4), [Box((0, 0), (4, 4)), Box((4, 0), (4, 4)), Box((8, 0), (2, 4))])
(4, 4)
>>> grid_chunk((10, 4), [Box((0, 0), (4, 4)), Box((4, 0), (6, 4))]) is None
True
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .._dtypes import as_dtype
from ..distributed import Box
from ..errors import CkptError, CorruptCheckpointError
from . import checksum as _checksum
from . import rawio as _rawio
from ._container import DEFAULT_PACK_THRESHOLD
from ._zarr_files import GROUP_DOC, array_meta, open_in, write_file
from .atomic import fsync_all
from .chunked import as_host
from .paths import container_paths, escape_key, is_valid_container_path
from .slicing import c_strides, run_start, span_bounds

__all__ = [
    "GRID_DTYPES",
    "GridLayout",
    "GridReuse",
    "GridVariable",
    "grid_chunk",
    "grid_layout",
    "sums_file",
]

#: The dtypes a global array may have: Zarr v3's core numeric types.
GRID_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "complex64", "complex128"]
)
_MAX_SUMS = 1 << 30


def sums_file(rank: int) -> str:
    """The temporary file in which ``rank`` leaves the checksums of the chunks it wrote."""
    return f"sums-{rank:05d}.msgpack"


def grid_chunk(full_shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...] | None:
    """The chunk shape when the non-empty ``boxes`` tile ``full_shape`` as a regular grid.

    ``None`` when they do not (or when there are none). Boxes may come in any order.
    """
    full = tuple(int(n) for n in full_shape)
    if not boxes:
        return None
    origin = [b for b in boxes if not any(b.offset)]
    if len(origin) != 1 or origin[0].ndim != len(full):
        return None
    chunk = origin[0].shape
    if any(c < 1 for c in chunk):
        return None
    cells = math.prod(-(-n // c) for n, c in zip(full, chunk, strict=True))
    if cells != len(boxes):
        return None
    seen: set[tuple[int, ...]] = set()
    for b in boxes:
        for o, s, n, c in zip(b.offset, b.shape, full, chunk, strict=True):
            if o % c or o >= n or s != min(c, n - o):
                return None
        seen.add(tuple(o // c for o, c in zip(b.offset, chunk, strict=True)))
    return chunk if len(seen) == len(boxes) else None


@dataclass(frozen=True)
class GridVariable:
    """One variable stored as a global array: where, its grid, and its boxes' writers."""

    key: str
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]
    boxes: tuple[Box, ...]
    writers: tuple[int, ...]
    meta_writer: int

    def __post_init__(self) -> None:
        # the chunks are stored little endian, whatever the variable's byte order
        object.__setattr__(self, "dtype", np.dtype(self.dtype).newbyteorder("<"))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk) * self.dtype.itemsize

    def chunk_rel(self, box: Box) -> str:
        """The chunk file of ``box``, relative to the step directory (``w/c.1.0``)."""
        coords = "".join(f".{o // c}" for o, c in zip(box.offset, self.chunk, strict=True))
        return f"{self.path}/c{coords}"

    def checksum(self, box: Box, data: np.ndarray) -> int:
        """The CRC-32C of one stored chunk (bound to its file, dtype and chunk shape)."""
        return _checksum.value_checksum(self.chunk_rel(box), self.dtype.name, self.chunk, data)

    def meta_doc(self) -> bytes:
        """The array's ``zarr.json``: a plain Zarr v3 array, chunks named ``c.i.j``."""
        meta = array_meta(self.shape, self.dtype, {
            "ckptvar": "a variable of a multi-process checkpoint; its checksums are in "
                       "ckptvar-index.msgpack"
        })
        meta["chunk_grid"]["configuration"]["chunk_shape"] = list(self.chunk)
        return json.dumps(meta).encode()

    def index_entry(self) -> dict[str, Any]:
        """What the global index says of the grid (beside the boxes)."""
        return {"path": self.path, "chunk_shape": list(self.chunk)}

    @classmethod
    def from_index(cls, key: str, shape: tuple[int, ...], dtype: np.dtype,
                   grid: Any, boxes: Sequence[Box]) -> GridVariable:
        """Rebuild from the index, refusing anything a writer cannot have produced."""
        if not isinstance(grid, dict) or not isinstance(grid.get("path"), str):
            raise ValueError("its grid entry is malformed")
        path = grid["path"]
        chunk = tuple(int(c) for c in grid.get("chunk_shape", ()))
        if not is_valid_container_path(path) or path.startswith("_ckptvar"):
            raise ValueError(f"its array path {path!r} is not one ckptvar writes")
        if len(chunk) != len(shape) or any(c < 1 for c in chunk):
            raise ValueError(f"its chunk shape {chunk} does not fit its shape {shape}")
        if dtype.name not in GRID_DTYPES:
            raise ValueError(f"dtype {dtype} cannot be a global array")
        if boxes and grid_chunk(shape, boxes) != chunk:
            raise ValueError(f"its boxes are not the regular grid of chunk shape {chunk}")
        if not boxes and all(n > 0 for n in shape):
            raise ValueError("it has no boxes")
        return cls(key, path, shape, dtype, chunk, tuple(boxes), (0,) * len(boxes), 0)


@dataclass
class GridReuse:
    """What one process's chunks of global arrays may take from a base step (an
    incremental save): its directory, its chunks' checksums by key, and what the process
    knows unchanged by key (True) or changed (False); other chunks are compared by their
    checksum, computed for the index anyway. The base has the same grid (the caller checks)."""

    base: Path
    sums: Mapping[str, Sequence[int]]
    known: Mapping[str, bool] = field(default_factory=dict)
    #: the chunks the last write hard-linked from the base (paths below the step)
    linked: list[str] = field(default_factory=list)

    def crc(self, key: str, j: int) -> int | None:
        """The base's checksum of chunk ``j`` of ``key`` (``None``: it has none)."""
        crcs = self.sums.get(key)
        return int(crcs[j]) if crcs is not None and 0 <= j < len(crcs) else None


def _link(source: Path, path: Path) -> bool:
    """``path`` becomes another name of the committed chunk file ``source`` (zero copy);
    False where it cannot (no hard links there, another file system, the base's chunk gone)."""
    try:
        os.link(source, path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                         errno.EOPNOTSUPP):
            return False
        raise
    return True


@dataclass
class GridLayout:
    """The variables of one save plan that are stored as global arrays."""

    size: int
    variables: dict[str, GridVariable]
    #: for each rank: the group documents it writes (every group above an array)
    groups: dict[int, list[str]] = field(default_factory=dict)

    def __contains__(self, key: object) -> bool:
        return key in self.variables

    def writers(self) -> set[int]:
        """The ranks that write at least one chunk (and so a checksum file)."""
        return {w for gv in self.variables.values() for w in gv.writers}

    def write(self, where: Path, rank: int,
              values: Mapping[str, tuple[np.ndarray, Any]], *, durable: bool = True,
              boxed: Mapping[tuple[str, tuple[int, ...]], np.ndarray] | None = None,
              reuse: GridReuse | None = None) -> None:
        """Write ``rank``'s chunks, the array and group documents it owns, and its
        checksum file, into the step directory ``where`` (fsynced when ``durable``).
        ``boxed`` gives the value of each box of a key ``rank`` holds several boxes of
        (by ``(key, offset)``); other keys' value is ``values[key]``'s. With ``reuse``
        (an incremental save), a chunk equal to the base's is a hard link to its file."""
        sync: list[Path] | None = [] if durable else None
        dirs: set[Path] = set()
        sums: dict[str, list[list[int]]] = {}

        def make(rel: str) -> Path:
            d = where / rel
            os.makedirs(d, exist_ok=True)
            parts = rel.split("/")
            dirs.update(where.joinpath(*parts[:i]) for i in range(len(parts) + 1))
            return d

        for gv in self.variables.values():
            if rank == gv.meta_writer:
                write_file(make(gv.path) / "zarr.json", gv.meta_doc(), sync)
            for j, (box, writer) in enumerate(zip(gv.boxes, gv.writers, strict=True)):
                if writer != rank:
                    continue
                make(gv.path)
                value = values[gv.key][0]
                if boxed:
                    value = boxed.get((gv.key, tuple(int(o) for o in box.offset)), value)
                # a chunk is one box: a staged GPU value is made whole for it
                crc = _put_chunk(where, gv, j, as_host(value), sync, reuse)
                sums.setdefault(gv.key, []).append([j, crc])
        for group in self.groups.get(rank, ()):
            write_file(make(group) / "zarr.json", GROUP_DOC, sync)
        if sums:
            write_file(where / sums_file(rank), msgpack.packb(sums, use_bin_type=True), sync)
            dirs.add(where)
        if sync is not None:
            fsync_all(sync, sorted(dirs))

    def collect(self, where: Path) -> dict[str, list[int]]:
        """The checksum of every chunk, from the writers' files (which it then removes)."""
        got: dict[str, list[int | None]] = {
            key: [None] * len(gv.boxes) for key, gv in self.variables.items()
        }
        files = [where / sums_file(r) for r in sorted(self.writers())]
        for f in files:
            raw = f.read_bytes()
            if len(raw) > _MAX_SUMS:
                raise CkptError(f"{str(f)!r} is larger than 1 GiB.")
            for key, pairs in msgpack.unpackb(raw, raw=False).items():
                for j, crc in pairs:
                    got[key][j] = int(crc)
        out: dict[str, list[int]] = {}
        for key, crcs in got.items():
            missing = [j for j, c in enumerate(crcs) if c is None]
            if missing:
                raise CkptError(
                    f"Variable {key!r}: no checksum was reported for chunk "
                    f"{self.variables[key].chunk_rel(self.variables[key].boxes[missing[0]])}."
                )
            out[key] = [int(c) for c in crcs if c is not None]
        for f in files:
            f.unlink()
        return out


def _put_chunk(  # noqa: PLR0917
    where: Path,
    gv: GridVariable,
    j: int,
    value: np.ndarray,
    sync: list[Path] | None,
    reuse: GridReuse | None,
) -> int:
    """Store chunk ``j`` of ``gv`` (``value``: its box's value) below ``where``; returns
    its checksum. With ``reuse``, a chunk known unchanged (not read) or equal to the
    base's by checksum is a hard link to the base's chunk file."""
    box = gv.boxes[j]
    rel = gv.chunk_rel(box)
    was = None if reuse is None else reuse.crc(gv.key, j)
    known = None if reuse is None else reuse.known.get(gv.key)
    if reuse is not None and was is not None and known and _link(reuse.base / rel,
                                                                  where / rel):
        reuse.linked.append(rel)
        return was
    data = _chunk_data(gv, box, value)
    crc = gv.checksum(box, data)
    if reuse is not None and was == crc and known is not False and _link(reuse.base / rel,
                                                                          where / rel):
        reuse.linked.append(rel)
    else:
        write_file(where / rel, _rawio.byte_view(data), sync)
    return crc


def _chunk_data(gv: GridVariable, box: Box, array: np.ndarray) -> np.ndarray:
    """The stored bytes of one chunk: ``array`` (the box's value), little endian, padded
    with zeros to the chunk shape at the far edges."""
    if tuple(array.shape) != box.shape:
        raise CkptError(
            f"Variable {gv.key!r}: the value to write for box {box} has shape "
            f"{tuple(array.shape)}, not {box.shape}."
        )
    if box.shape == gv.chunk:
        return np.ascontiguousarray(array, dtype=gv.dtype)
    out = np.zeros(gv.chunk, dtype=gv.dtype)
    out[tuple(slice(0, s) for s in box.shape)] = array
    return out


_CACHE: dict[int, tuple[Any, tuple[int, int], GridLayout | None]] = {}


def grid_layout(
    plan: Any, size: int, reserved: Iterable[str] = (), *, min_nbytes: int = DEFAULT_PACK_THRESHOLD
) -> GridLayout | None:
    """The variables of ``plan`` (a :class:`~ckptvar.distributed.SavePlan`) that a ``.zarr``
    step stores as global arrays, or ``None`` when there are none.

    A variable qualifies when its dtype is a core Zarr numeric type, its whole value
    has at least ``min_nbytes`` bytes (smaller values stay packed in the per-process
    files, as a one-process Zarr checkpoint packs them: thousands of tiny arrays
    would cost a directory and files each) and its boxes form a regular grid (a
    replicated value is one box). Array paths are the keys escaped as in any
    ckptvar container, clear of ``reserved`` names. The result is cached for the
    last plan.
    """
    hit = _CACHE.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] == (size, min_nbytes):
        return hit[2]
    taken = [*reserved, *(sums_file(r) for r in range(size))]
    top = {name.lower() for name in taken}
    chosen: list[tuple[str, Any, tuple[int, ...]]] = []
    for key, vp in plan.variables.items():
        dt = as_dtype(vp.dtype)
        if dt.name not in GRID_DTYPES or math.prod(vp.full_shape) * dt.itemsize < min_nbytes:
            continue
        if "/" in key and escape_key(key).split("/")[0].lower() in top:
            continue  # its group would be a per-process file's name
        chunk = grid_chunk(vp.full_shape, [item.box for item in vp.items])
        if chunk is not None:
            chosen.append((key, vp, chunk))
    layout: GridLayout | None = None
    if chosen:
        paths = container_paths([k for k, _, _ in chosen], taken)
        variables: dict[str, GridVariable] = {}
        for (key, vp, chunk), path in zip(chosen, paths, strict=True):
            writers = tuple(item.writer for item in vp.items)
            meta = writers[0] if writers else (vp.holders[0] if vp.holders else 0)
            variables[key] = GridVariable(
                key, path, tuple(vp.full_shape), np.dtype(vp.dtype), chunk,
                tuple(item.box for item in vp.items), writers, meta,
            )
        layout = GridLayout(size, variables, _group_writers(variables.values()))
    _CACHE.clear()
    _CACHE[id(plan)] = (plan, (size, min_nbytes), layout)
    return layout


def _group_writers(variables: Iterable[GridVariable]) -> dict[int, list[str]]:
    """Each group above an array, given to the writer of the first array below it."""
    owner: dict[str, int] = {}
    for gv in sorted(variables, key=lambda g: g.path):
        parts = gv.path.split("/")
        for i in range(1, len(parts)):
            owner.setdefault("/".join(parts[:i]), gv.meta_writer)
    out: dict[int, list[str]] = {}
    for group, rank in sorted(owner.items()):
        out.setdefault(rank, []).append(group)
    return out


def _damaged(gv: GridVariable, box: Box, where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Variable {gv.key!r}: its slice {box} in file {where!r} is damaged (checksum mismatch)."
    )


def _open_chunk(root_fd: int, root: Path, gv: GridVariable, j: int) -> tuple[int, str]:
    """Open chunk ``j``'s file below the step (no symlinks) and check its size; returns
    the descriptor (the caller closes it) and the file's path for messages."""
    box = gv.boxes[j]
    rel = gv.chunk_rel(box)
    where = str(root / rel)
    try:
        fd = open_in(root_fd, rel)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"Variable {gv.key!r}: its slice {box} is missing: no file {where!r}."
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"Variable {gv.key!r}: its slice file {where!r} cannot be opened: {exc}."
        ) from None
    try:
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
    if size != gv.chunk_nbytes:
        os.close(fd)
        raise CorruptCheckpointError(
            f"Variable {gv.key!r}: its slice {box} in file {where!r} is damaged: the "
            f"file holds {size} bytes, a chunk is {gv.chunk_nbytes}."
        )
    return fd, where


def check_chunk(root_fd: int, root: Path, gv: GridVariable, j: int) -> None:
    """``CorruptCheckpointError`` naming the variable and the file unless chunk ``j``'s
    file is there, below the step, one chunk long (nothing is read)."""
    fd, _ = _open_chunk(root_fd, root, gv, j)
    os.close(fd)


def check_part(root_fd: int, root: Path, gv: GridVariable, j: int, *, crc: int) -> None:
    """Verify chunk ``j`` of a global array whole, hashed through a memory map (no copy)."""
    fd, where = _open_chunk(root_fd, root, gv, j)
    try:
        with mmap.mmap(fd, gv.chunk_nbytes, prot=mmap.PROT_READ) as mapped:
            chunk = np.frombuffer(mapped, dtype=gv.dtype).reshape(gv.chunk)
            bad = gv.checksum(gv.boxes[j], chunk) != crc
            del chunk  # the map closes only once no array views it
    finally:
        os.close(fd)
    if bad:
        raise _damaged(gv, gv.boxes[j], where)


def read_part(
    root_fd: int,
    root: Path,
    gv: GridVariable,
    j: int,
    part: tuple[slice, ...],
    *,
    crc: int,
    whole: bool,
    verify: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """``part`` (slices of box ``j``) of a global array, and the bytes read for it.

    With ``whole`` the chunk is read whole and, with ``verify``, checked against
    ``crc``; otherwise only the run of elements from the first to the last one
    needed is read: straight into ``out`` (C-contiguous, ``part``'s shape) when given
    and ``part`` is one run, then returned. ``CorruptCheckpointError`` names the
    variable and the file when the chunk is missing, not exactly one chunk long, or
    fails its checksum.
    """
    box = gv.boxes[j]
    fd, where = _open_chunk(root_fd, root, gv, j)
    isz = gv.dtype.itemsize
    try:
        if whole:
            data = _rawio.pread_exact(fd, 0, gv.chunk_nbytes, what="A chunk", path=where)
            chunk = np.frombuffer(data, dtype=gv.dtype).reshape(gv.chunk)
            if verify and gv.checksum(box, chunk) != crc:
                raise _damaged(gv, box, where)
            return chunk[part], gv.chunk_nbytes
        start = run_start(part, gv.chunk)
        if out is not None and start is not None and out.flags.c_contiguous:
            _rawio.pread_into_exact(fd, _rawio.byte_view(out), start * isz, what="A chunk",
                                    path=where)
            return out, out.nbytes
        lo, hi = span_bounds(part, gv.chunk)
        data = _rawio.pread_exact(fd, lo * isz, (hi - lo) * isz, what="A chunk", path=where)
    finally:
        os.close(fd)
    flat = np.frombuffer(data, dtype=gv.dtype)
    strides = c_strides(gv.chunk, isz)
    shape = tuple(s.stop - s.start for s in part)
    view = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides, writeable=False)
    return view, len(data)
