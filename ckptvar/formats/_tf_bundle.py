"""TensorFlow checkpoints (TensorBundle V2: ``prefix.index`` + ``prefix.data-*``) without TF.

Owns: the ``tf`` backend. The ``.index`` file is a table (see :mod:`._sstable`)
mapping each tensor key to a ``BundleEntryProto``; the empty key holds the
``BundleHeaderProto``. Entries are decoded with :mod:`._protobuf`:

- ``BundleHeaderProto``: 1 num_shards, 2 endianness (0 little, 1 big), 3 version.
- ``BundleEntryProto``: 1 dtype, 2 shape (``TensorShapeProto``: 2 dim{1 size}),
  3 shard_id, 4 offset, 5 size, 6 crc32c (fixed32, masked), 7 slices
  (``TensorSliceProto``: 1 extent{1 start, 2 length}).

Each value's bytes are checked against the entry's masked CRC32C when read
whole. Partitioned variables (TF1 ``partitioner=``) are stored as slice entries
under OrderedCode-encoded keys; they are reassembled into the full tensor.
Object-based (TF2) keys drop their ``/.ATTRIBUTES/VARIABLE_VALUE`` suffix; the
full key is accepted as an alias. String tensors (and any dtype NumPy cannot
hold) are user values that cannot be read: they are listed in ``reader.skipped``
with the reason. ``_CHECKPOINTABLE_OBJECT_GRAPH`` is the format's own
bookkeeping, listed in ``reader.bookkeeping``, never in ``skipped``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage.base import ArrayInfo, Backend, LazyArray, Reader
from ..storage.checksum import crc32c, unmask
from ._common import MAX_HEADER_BYTES, EntryReader, FileArray, FileHandle, overlap_problem
from ._protobuf import parse
from ._sstable import iter_table
from ._tf_index import TF_DTYPE_NAMES, TF_DTYPES, BundleEntry, decode_slice_key, parse_entry

__all__ = ["TFBackend"]

ATTRIBUTES_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"

_DATA_FILE = "{prefix}.data-{shard:05d}-of-{num:05d}"


# ----------------------------------------------------------------- arrays


class _Bundle:
    """Open shard files of one checkpoint, by shard id."""

    def __init__(self, prefix: str, num_shards: int) -> None:
        self.prefix = prefix
        self.num_shards = num_shards
        self._files: dict[int, FileHandle] = {}

    def shard(self, shard: int) -> FileHandle:
        fh = self._files.get(shard)
        if fh is None:
            name = _DATA_FILE.format(prefix=self.prefix, shard=shard, num=self.num_shards)
            try:
                fh = FileHandle(Path(name))
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"The TensorFlow checkpoint {self.prefix!r} lacks its data file {name!r}."
                ) from None
            self._files[shard] = fh
        return fh

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def _stored_array(
    info: ArrayInfo, entry: BundleEntry, bundle: _Bundle, stored: np.dtype, what: str
) -> FileArray:
    def fetch(offset: int, size: int) -> bytes:
        return bundle.shard(entry.shard).pread(offset, size, what)

    def readinto(buf: memoryview, offset: int) -> None:
        bundle.shard(entry.shard).readinto(buf, offset, what)

    def check(data: bytes | memoryview) -> None:
        if entry.crc is None:
            return
        actual = crc32c(data)
        if actual != unmask(entry.crc):
            raise CorruptCheckpointError(
                f"{what} fails its CRC32C check (stored {unmask(entry.crc):#010x}, computed "
                f"{actual:#010x}): the data file is damaged."
            )

    return FileArray(
        info,
        stored_dtype=stored,
        offset=entry.offset,
        fetch=fetch,
        readinto=readinto if stored.byteorder in ("=", "|") else None,
        check=check,
    )


class SlicedArray(LazyArray):
    """A partitioned variable: its slices, each a stored array, pasted into the full shape."""

    def __init__(self, info: ArrayInfo, parts: list[tuple[tuple[slice, ...], LazyArray]]) -> None:
        self.info = info
        self._parts = parts

    def read(self, *, out: np.ndarray | None = None, verify: bool = True) -> np.ndarray:
        if out is None:
            out = np.empty(self.info.shape, self.info.dtype)
        elif out.shape != self.info.shape or out.dtype != self.info.dtype:
            raise ValueError(
                f"out for {self.info.key!r} must have shape {self.info.shape} and dtype "
                f"{self.info.dtype}."
            )
        for region, part in self._parts:
            out[region] = part.read(verify=verify)
        return out

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.array(self.read()[index], copy=True)


@dataclass
class _Index:
    """A decoded ``.index`` file: its header and its entries, whole tensors and slices."""

    path: Path
    num_shards: int
    big_endian: bool
    entries: dict[str, BundleEntry]
    slices: dict[str, list[tuple[tuple[tuple[int, int], ...], BundleEntry]]]


def _read_index(prefix: str) -> _Index:
    index_path = Path(prefix + ".index")
    fh = FileHandle(index_path)
    try:
        if fh.size > MAX_HEADER_BYTES:
            raise CorruptCheckpointError(f"{str(index_path)!r} is implausibly large.")
        data = fh.pread(0, fh.size, "index")
    finally:
        fh.close()
    what = f"TensorFlow index {str(index_path)!r}"
    header: dict[int, list[Any]] | None = None
    entries: dict[str, BundleEntry] = {}
    slice_entries: dict[str, list[tuple[tuple[tuple[int, int], ...], BundleEntry]]] = {}
    for raw_key, value in iter_table(data, what=what):
        if raw_key == b"":
            header = parse(value, what=f"bundle header of {str(index_path)!r}")
        elif raw_key[:1] == b"\x00":
            name, extents = decode_slice_key(raw_key)
            entry = parse_entry(f"{name} (slice)", value, index_path)
            slice_entries.setdefault(name, []).append((extents, entry))
        else:
            key = raw_key.decode("utf-8", "surrogateescape")
            entries[key] = parse_entry(key, value, index_path)
    if header is None:
        raise CorruptCheckpointError(f"{what} has no bundle header (empty key).")
    num_shards = int(header.get(1, [1])[-1])
    endianness = int(header.get(2, [0])[-1])
    if num_shards < 1 or num_shards > 100_000:
        raise CorruptCheckpointError(f"{what} declares {num_shards} shards.")
    if endianness not in (0, 1):
        raise CorruptCheckpointError(f"{what} declares unknown endianness {endianness}.")
    return _Index(index_path, num_shards, endianness == 1, entries, slice_entries)


def _open_bundle(prefix: str, index: _Index) -> _Bundle:
    """The shard files of ``index``; every data file the index needs must exist."""
    bundle = _Bundle(prefix, index.num_shards)
    shards = {e.shard for e in index.entries.values() if not e.slices and e.dtype in TF_DTYPES}
    shards |= {e.shard for parts in index.slices.values() for _, e in parts}
    for shard in sorted(shards):
        if 0 <= shard < index.num_shards:
            bundle.shard(shard)
    return bundle


def _shown_key(key: str, entries: Mapping[str, BundleEntry]) -> str:
    """``key`` without its ``/.ATTRIBUTES/VARIABLE_VALUE`` suffix, unless that name is taken."""
    shown = key.removesuffix(ATTRIBUTES_SUFFIX)
    return key if shown != key and shown in entries else shown


def _open(prefix: str) -> Reader:
    index = _read_index(prefix)
    bundle = _open_bundle(prefix, index)
    arrays: dict[str, LazyArray] = {}
    aliases: dict[str, str] = {}
    skipped: dict[str, str] = {}
    bookkeeping: dict[str, str] = {}
    for key, entry in index.entries.items():
        shown = _shown_key(key, index.entries)
        if shown != key:
            aliases[key] = shown
        dtype = TF_DTYPES.get(entry.dtype)
        if key == OBJECT_GRAPH_KEY:
            bookkeeping[key] = "the TensorFlow object graph (a string tensor), not a value."
            continue
        if dtype is None:
            name = TF_DTYPE_NAMES.get(entry.dtype, f"enum {entry.dtype}")
            skipped[shown] = f"TensorFlow dtype {name} has no NumPy equivalent."
            continue
        info = ArrayInfo(
            key=shown,
            dtype=dtype,
            shape=entry.shape,
            attrs={"name": shown},
            checksum=None if entry.crc is None else unmask(entry.crc),
        )
        big = index.big_endian and dtype.itemsize > 1 and dtype.kind in "biufc"
        stored = dtype.newbyteorder(">") if big else dtype
        if entry.slices:
            arrays[shown] = _sliced(
                info, entry, index.slices.get(key, []),
                bundle=bundle, stored=stored, path=index.path,
            )
        else:
            _check_entry(entry, info, stored, index.num_shards, index.path)
            arrays[shown] = _stored_array(
                info, entry, bundle, stored, f"Tensor {shown!r} of {prefix!r}"
            )
    return EntryReader(
        Path(prefix),
        "tf",
        arrays,
        aliases=aliases,
        skipped=skipped,
        bookkeeping=bookkeeping,
        on_close=bundle.close,
    )


def _check_entry(
    entry: BundleEntry, info: ArrayInfo, stored: np.dtype, num_shards: int, path: Path
) -> None:
    expected = info.size * stored.itemsize
    if entry.size != expected:
        raise CorruptCheckpointError(
            f"Tensor {info.key!r} in {str(path)!r}: entry says {entry.size} bytes, its shape "
            f"{info.shape} and dtype {info.dtype} need {expected}."
        )
    if entry.offset < 0 or not 0 <= entry.shard < num_shards:
        raise CorruptCheckpointError(
            f"Tensor {info.key!r} in {str(path)!r}: offset {entry.offset} / shard "
            f"{entry.shard} is invalid ({num_shards} shards)."
        )


def _sliced(
    info: ArrayInfo,
    entry: BundleEntry,
    stored_slices: list[tuple[tuple[tuple[int, int], ...], BundleEntry]],
    *,
    bundle: _Bundle,
    stored: np.dtype,
    path: Path,
) -> SlicedArray:
    by_extent = {ext: e for ext, e in stored_slices}
    parts: list[tuple[tuple[slice, ...], LazyArray]] = []
    covered = 0
    for extents in entry.slices:
        if len(extents) != len(info.shape):
            raise CorruptCheckpointError(
                f"Partitioned {info.key!r} in {str(path)!r}: slice rank {len(extents)} != "
                f"tensor rank {len(info.shape)}."
            )
        region = []
        shape = []
        for (given_start, given_length), dim in zip(extents, info.shape, strict=True):
            start, length = (0, dim) if given_length == -1 else (given_start, given_length)
            if start < 0 or length < 0 or start + length > dim:
                raise CorruptCheckpointError(
                    f"Partitioned {info.key!r} in {str(path)!r}: slice {extents} is outside "
                    f"the shape {info.shape}."
                )
            region.append(slice(start, start + length))
            shape.append(length)
        part_entry = by_extent.get(extents) or by_extent.get(
            tuple(
                (0, -1) if (s, n) == (0, d) else (s, n)
                for (s, n), d in zip(extents, info.shape, strict=True)
            )
        )
        if part_entry is None:
            raise CorruptCheckpointError(
                f"Partitioned {info.key!r} in {str(path)!r}: slice {extents} has no stored data."
            )
        part_info = ArrayInfo(
            key=f"{info.key}[{extents}]", dtype=info.dtype, shape=tuple(shape), checksum=None
        )
        _check_entry(part_entry, part_info, stored, bundle.num_shards, path)
        parts.append(
            (
                tuple(region),
                _stored_array(
                    part_info, part_entry, bundle, stored, f"Slice {extents} of {info.key!r}"
                ),
            )
        )
        covered += part_info.size
    if covered != info.size:
        raise CorruptCheckpointError(
            f"Partitioned {info.key!r} in {str(path)!r}: its slices cover {covered} of "
            f"{info.size} elements."
        )
    problem = overlap_problem(info.shape, [
        (tuple(r.start for r in region), tuple(r.stop - r.start for r in region))
        for region, _ in parts
    ])
    if problem:
        raise CorruptCheckpointError(f"Partitioned {info.key!r} in {str(path)!r}: its slices {problem}.")
    return SlicedArray(info, parts)


_DATA_RE = re.compile(r"^(?P<prefix>.+)\.data-\d{5}-of-\d{5}$")


def _prefix_of(path: Path) -> str:
    s = str(path)
    if s.endswith(".index"):
        return s[: -len(".index")]
    m = _DATA_RE.match(s)
    if m:
        return m.group("prefix")
    return s


class TFBackend(Backend, name="tf", suffixes=(".index",)):
    """TensorFlow TensorBundle checkpoints (``prefix.index`` + ``prefix.data-*``), read-only."""


    @classmethod
    def sniff(cls, path: Path) -> bool:
        prefix = _prefix_of(Path(path))
        index = Path(prefix + ".index")
        try:
            if not index.is_file():  # a named pipe: opening it would wait for a writer
                return False
            with open(index, "rb") as f:
                f.seek(0, 2)
                if f.tell() < 48:
                    return False
                f.seek(-8, 2)
                return int.from_bytes(f.read(8), "little") == 0xDB4775248B80FB57
        except OSError:
            return False

    @classmethod
    def open_reader(cls, path: Path) -> Reader:
        prefix = _prefix_of(Path(path))
        if not Path(prefix + ".index").is_file():
            raise CheckpointNotFoundError(
                f"No TensorFlow checkpoint at {str(path)!r} (no {prefix + '.index'!r})."
            )
        return _open(prefix)
