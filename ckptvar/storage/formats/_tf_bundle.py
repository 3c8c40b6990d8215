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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from ...errors import CheckpointNotFoundError, CorruptCheckpointError
from ..base import ArrayInfo, Backend, LazyArray, Reader
from ._common import (
    MAX_HEADER_BYTES,
    EntryReader,
    FileArray,
    FileHandle,
    check_shape,
    normalize_index,
)
from ._crc32c import crc32c, unmask
from ._protobuf import parse, signed64
from ._sstable import iter_table

__all__ = ["TF_DTYPES", "TFBackend"]

ATTRIBUTES_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"

#: TensorFlow ``DataType`` enum values NumPy / ml_dtypes can hold.
TF_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("float32"),
    2: np.dtype("float64"),
    3: np.dtype("int32"),
    4: np.dtype("uint8"),
    5: np.dtype("int16"),
    6: np.dtype("int8"),
    8: np.dtype("complex64"),
    9: np.dtype("int64"),
    10: np.dtype("bool"),
    11: np.dtype("int8"),  # qint8, stored as plain int8
    12: np.dtype("uint8"),  # quint8
    13: np.dtype("int32"),  # qint32
    14: np.dtype(ml_dtypes.bfloat16),
    15: np.dtype("int16"),  # qint16
    16: np.dtype("uint16"),  # quint16
    17: np.dtype("uint16"),
    18: np.dtype("complex128"),
    19: np.dtype("float16"),
    22: np.dtype("uint32"),
    23: np.dtype("uint64"),
    24: np.dtype(ml_dtypes.float8_e5m2),
    25: np.dtype(ml_dtypes.float8_e4m3fn),
}
_TF_DTYPE_NAMES = {
    7: "string",
    20: "resource",
    21: "variant",
    26: "float8_e4m3fnuz",
    27: "float8_e4m3b11fnuz",
    28: "float8_e5m2fnuz",
    29: "int4",
    30: "uint4",
}
_DATA_FILE = "{prefix}.data-{shard:05d}-of-{num:05d}"


@dataclass
class _Entry:
    key: str
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    crc: int | None
    slices: list[tuple[tuple[int, int], ...]]


def _parse_shape(data: bytes, what: str) -> tuple[int, ...] | None:
    fields = parse(data, what=what)
    if fields.get(3, [0])[-1]:  # unknown_rank
        return None
    dims = []
    for dim in fields.get(2, []):
        if not isinstance(dim, bytes):
            raise CorruptCheckpointError(f"{what}: malformed shape dimension.")
        size = signed64(int(parse(dim, what=what).get(1, [0])[-1]))
        dims.append(size)
    return tuple(dims)


def _parse_slice(data: bytes, what: str) -> tuple[tuple[int, int], ...]:
    extents = []
    for ext in parse(data, what=what).get(1, []):
        if not isinstance(ext, bytes):
            raise CorruptCheckpointError(f"{what}: malformed slice extent.")
        f = parse(ext, what=what)
        start = signed64(int(f.get(1, [0])[-1]))
        length = signed64(int(f[2][-1])) if 2 in f else -1
        extents.append((start, length))
    return tuple(extents)


def _parse_entry(key: str, data: bytes, path: Path) -> _Entry:
    what = f"index entry {key!r} of {str(path)!r}"
    f = parse(data, what=what)

    def num(field: int, default: int = 0) -> int:
        value = f.get(field, [default])[-1]
        if not isinstance(value, int):
            raise CorruptCheckpointError(f"{what}: field {field} has the wrong wire type.")
        return value

    shape_raw = f.get(2, [b""])[-1]
    if not isinstance(shape_raw, bytes):
        raise CorruptCheckpointError(f"{what}: shape has the wrong wire type.")
    shape = _parse_shape(shape_raw, what)
    if shape is None:
        raise CorruptCheckpointError(f"{what}: a stored tensor cannot have unknown rank.")
    slices = []
    for s in f.get(7, []):
        if not isinstance(s, bytes):
            raise CorruptCheckpointError(f"{what}: slice has the wrong wire type.")
        slices.append(_parse_slice(s, what))
    return _Entry(
        key=key,
        dtype=num(1),
        shape=check_shape(list(shape), what=f"Tensor {key!r}", path=path),
        shard=signed64(num(3)),
        offset=signed64(num(4)),
        size=signed64(num(5)),
        crc=num(6) if 6 in f else None,
        slices=slices,
    )


# ----------------------------------------------------------------- OrderedCode slice keys


def _read_num_increasing(data: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(data):
        raise CorruptCheckpointError("Truncated slice key.")
    n = data[pos]
    if n > 8 or pos + 1 + n > len(data):
        raise CorruptCheckpointError("Malformed number in a slice key.")
    return int.from_bytes(data[pos + 1 : pos + 1 + n], "big"), pos + 1 + n


def _read_string(data: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    n = len(data)
    while pos < n:
        b = data[pos]
        if b == 0x00:
            if pos + 1 >= n:
                break
            nxt = data[pos + 1]
            if nxt == 0x01:
                return bytes(out), pos + 2
            if nxt == 0xFF:
                out.append(0x00)
                pos += 2
                continue
            break
        if b == 0xFF:
            if pos + 1 < n and data[pos + 1] == 0x00:
                out.append(0xFF)
                pos += 2
                continue
            break
        out.append(b)
        pos += 1
    raise CorruptCheckpointError("Malformed string in a slice key.")


def _read_signed_num_increasing(data: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(data):
        raise CorruptCheckpointError("Truncated signed number in a slice key.")
    negative = not data[pos] & 0x80
    xor = 0xFF if negative else 0x00
    first = data[pos] ^ xor
    # Count the header's leading one bits (they may continue into the second byte).
    length = 0
    bits = first
    while length < 8 and bits & 0x80:
        length += 1
        bits = (bits << 1) & 0xFF
    if length == 8:
        if pos + 1 >= len(data):
            raise CorruptCheckpointError("Truncated signed number in a slice key.")
        second = data[pos + 1] ^ xor
        extra = 0
        bits = second
        while extra < 2 and bits & 0x80:
            extra += 1
            bits = (bits << 1) & 0xFF
        length += extra
    if length == 0 or length > 10 or pos + length > len(data):
        raise CorruptCheckpointError("Malformed signed number in a slice key.")
    raw = bytearray(b ^ xor for b in data[pos : pos + length])
    # Clear the header bits: `length` leading one bits followed by a zero bit.
    header_bits = length + 1
    for i in range(min(len(raw), (header_bits + 7) // 8)):
        clear = min(8, header_bits - 8 * i)
        if clear > 0:
            raw[i] &= (0xFF >> clear) if clear < 8 else 0
    value = int.from_bytes(raw, "big")
    return (~value if negative else value), pos + length


def decode_slice_key(key: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``(full tensor name, ((start, length), ...))`` of a partitioned-variable slice key."""
    zero, pos = _read_num_increasing(key, 0)
    if zero != 0:
        raise CorruptCheckpointError(f"Slice key {key!r} does not start with 0.")
    name, pos = _read_string(key, pos)
    rank, pos = _read_num_increasing(key, pos)
    if rank > 64:
        raise CorruptCheckpointError(f"Slice key {key!r} declares rank {rank}.")
    extents = []
    for _ in range(rank):
        start, pos = _read_signed_num_increasing(key, pos)
        length, pos = _read_signed_num_increasing(key, pos)
        extents.append((start, length))
    if pos != len(key):
        raise CorruptCheckpointError(f"Slice key {key!r} has trailing bytes.")
    return name.decode("utf-8", "surrogateescape"), tuple(extents)


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
    info: ArrayInfo, entry: _Entry, bundle: _Bundle, stored: np.dtype, what: str
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
        return np.array(self.read()[normalize_index(index, self.info.shape)], copy=True)


def _open(prefix: str) -> Reader:
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
    entries: dict[str, _Entry] = {}
    slice_entries: dict[str, list[tuple[tuple[tuple[int, int], ...], _Entry]]] = {}
    for raw_key, value in iter_table(data, what=what):
        if raw_key == b"":
            header = parse(value, what=f"bundle header of {str(index_path)!r}")
            continue
        if raw_key[:1] == b"\x00":
            name, extents = decode_slice_key(raw_key)
            entry = _parse_entry(f"{name} (slice)", value, index_path)
            slice_entries.setdefault(name, []).append((extents, entry))
            continue
        key = raw_key.decode("utf-8", "surrogateescape")
        entries[key] = _parse_entry(key, value, index_path)
    if header is None:
        raise CorruptCheckpointError(f"{what} has no bundle header (empty key).")
    num_shards = int(header.get(1, [1])[-1])
    endianness = int(header.get(2, [0])[-1])
    if num_shards < 1 or num_shards > 100_000:
        raise CorruptCheckpointError(f"{what} declares {num_shards} shards.")
    if endianness not in (0, 1):
        raise CorruptCheckpointError(f"{what} declares unknown endianness {endianness}.")
    bundle = _Bundle(prefix, num_shards)
    shards = {e.shard for e in entries.values() if not e.slices and e.dtype in TF_DTYPES}
    shards |= {e.shard for parts in slice_entries.values() for _, e in parts}
    for shard in sorted(shards):
        if 0 <= shard < num_shards:
            bundle.shard(shard)  # every data file the index needs must exist
    arrays: dict[str, LazyArray] = {}
    aliases: dict[str, str] = {}
    skipped: dict[str, str] = {}
    bookkeeping: dict[str, str] = {}
    for key, entry in entries.items():
        shown = key.removesuffix(ATTRIBUTES_SUFFIX)
        if shown != key:
            if shown in entries:
                shown = key
            else:
                aliases[key] = shown
        dtype = TF_DTYPES.get(entry.dtype)
        if key == OBJECT_GRAPH_KEY:
            bookkeeping[key] = "the TensorFlow object graph (a string tensor), not a value."
            continue
        if dtype is None:
            name = _TF_DTYPE_NAMES.get(entry.dtype, f"enum {entry.dtype}")
            skipped[shown] = f"TensorFlow dtype {name} has no NumPy equivalent."
            continue
        info = ArrayInfo(
            key=shown,
            dtype=dtype,
            shape=entry.shape,
            attrs={"name": shown},
            checksum=None if entry.crc is None else unmask(entry.crc),
        )
        stored = (
            dtype.newbyteorder(">")
            if endianness == 1 and dtype.itemsize > 1 and (dtype.kind in "biufc")
            else dtype
        )
        if entry.slices:
            arrays[shown] = _sliced(
                info, entry, slice_entries.get(key, []), bundle, stored, index_path
            )
        else:
            _check_entry(entry, info, stored, num_shards, index_path)
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
    entry: _Entry, info: ArrayInfo, stored: np.dtype, num_shards: int, path: Path
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
    entry: _Entry,
    stored_slices: list[tuple[tuple[tuple[int, int], ...], _Entry]],
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
        for (start, length), dim in zip(extents, info.shape, strict=True):
            if length == -1:
                start, length = 0, dim
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


class TFBackend(Backend):
    """TensorFlow TensorBundle checkpoints (``prefix.index`` + ``prefix.data-*``), read-only."""

    name: ClassVar[str] = "tf"
    suffixes: ClassVar[tuple[str, ...]] = (".index",)

    @classmethod
    def sniff(cls, path: Path) -> bool:
        prefix = _prefix_of(Path(path))
        index = Path(prefix + ".index")
        try:
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
