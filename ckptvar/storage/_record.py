"""The root record: one msgpack map that describes every stored value (docs/FORMAT.md).

The record is columnar: one list per field (keys, dtypes, shapes, checksums,
layouts, paths, offsets) and one list per attribute every value carries, so a
checkpoint of 20,000 small values decodes as a handful of long arrays rather
than 20,000 maps, and is validated with a few passes over those lists.

Encoding is plain msgpack (``use_bin_type=True``). Decoding is strict, because
the record comes from a file that may be damaged or hostile: bounded sizes and
nesting, no ext types, no duplicate map keys or value keys, strict UTF-8, and
exact schema validation (types, dtype names from the explicit list, non-negative
dims, sizes that do not overflow, packed values inside the blob and not
overlapping). Every violation is a :class:`CorruptCheckpointError` naming the
file and the key.

>>> rec = Record(container="h5", values={"w": Entry("float32", (2,), 7, {}, Extent.packed(0, 8))},
...              packed=("_ckptvar/packed", 512, 64))
>>> back = decode(encode(rec), "f.h5", container="h5")
>>> back.values["w"].shape, back.values["w"].nbytes, back.format_version
((2,), 8, (1, 2))

A value larger than one block (format 1.2) also carries the CRC-32C of each block of
``block_size`` bytes (``Entry.blocks``), so a slice is verified by the blocks it reads.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import ItemsView, Iterator, KeysView, Mapping, MutableMapping, ValuesView
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .._dtypes import SUPPORTED_DTYPES
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ._gc import paused_gc
from ._plain import (
    MAX_DEPTH,
    BadRecord,
    build_attrs,
    check_attrs,
    check_plain,
    row_attrs,
    split_attrs,
    unique_pairs,
)
from ._record_checks import (
    BLOCK_SIZE,
    COLUMNS,
    ITEMSIZE,
    MAX_NDIM,
    block_count,
    check_block_size,
    check_blocks,
    check_dtypes_and_shapes,
    check_locations,
    columns,
    is_count,
)
from ._record_index import (
    INDEX_FROM,
    LAYOUT_CODES,
    IndexedValues,
    KeyIndex,
    SortedKeys,
    check_packed,
    encode_index,
    read_head,
)
from .paths import is_valid_container_path

__all__ = [
    "BLOCK_SIZE",
    "DELTA",
    "DELTAS_VERSION",
    "EXTERNAL_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_DEPTH",
    "MAX_NDIM",
    "MAX_RECORD_NBYTES",
    "PARTS_VERSION",
    "PIECES_VERSION",
    "Columns",
    "Delta",
    "Entry",
    "Extent",
    "Record",
    "RowValues",
    "ValueColumns",
    "ValueRows",
    "block_count",
    "check_deltas",
    "check_external",
    "check_pieces",
    "check_plain",
    "decode",
    "encode",
    "encode_columns",
    "holder_step",
    "is_holder_name",
    "is_sibling_name",
    "record_version",
]

FORMAT_NAME = "ckptvar"
#: (major, minor). A reader refuses a newer major version; minor additions are ignorable.
FORMAT_VERSION = (1, 2)
#: The version of a record with ``external`` values (an incremental HDF5 step).
EXTERNAL_VERSION = (1, 3)
#: The version of a record with ``pieces`` (a Zarr value stored as several chunk files).
PIECES_VERSION = (1, 4)
#: The version of a record with ``deltas`` (values stored as a base plus row patches).
DELTAS_VERSION = (1, 5)
#: The version of a record with a delta verified by its parts alone (``by_parts``).
PARTS_VERSION = (1, 6)
#: The ``layouts`` item of a value stored as a delta (a reader before 1.5 refuses it).
DELTA = "delta"
#: Largest record a reader accepts (about 5 million values).
MAX_RECORD_NBYTES = 1 << 30
_LIBRARY = "ckptvar 0.1.0"


class Extent(NamedTuple):
    """Where a value's bytes are inside its container (not where the container is: that is a
    ``locations.Location``).

    ``kind`` is ``"array"`` for a value stored as its own array at container ``path``
    (``offset``: absolute in an HDF5 file, 0 in a Zarr chunk), ``"packed"`` for a value
    inside ``_ckptvar/packed`` (``offset`` in the blob; ``path`` is None), or ``"zarr"``
    for a compressed Zarr array at ``path``, read through zarr. Only ``kind``, ``path``
    and ``offset`` are stored in the record.
    """

    kind: str
    path: str | None
    offset: int
    #: The value's size in bytes (as ``Entry.nbytes``; here for the hot loops).
    nbytes: int

    @classmethod
    def packed(cls, offset: int, nbytes: int) -> Extent:
        return cls(PACKED, None, offset, nbytes)

    @classmethod
    def array(cls, path: str, offset: int, nbytes: int) -> Extent:
        return cls(ARRAY, path, offset, nbytes)

    @classmethod
    def zarr(cls, path: str, nbytes: int) -> Extent:
        return cls(ZARR, path, 0, nbytes)


#: The kinds of :class:`Extent`.
PACKED, ARRAY, ZARR = "packed", "array", "zarr"


@dataclass(slots=True)
class Entry:
    """One value: dtype name, shape, checksum, writer attrs and where its bytes are
    (:class:`Extent`). Treat it as immutable (``dataclasses.replace`` makes a changed
    copy)."""

    dtype: str
    shape: tuple[int, ...]
    checksum: int
    attrs: Mapping[str, Any]
    loc: Extent
    #: The little-endian ``uint32`` CRC-32C of each block of the value's bytes (1.2), or
    #: None (a value of at most one block, or from an older file).
    blocks: bytes | None = None
    _nbytes: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def np_dtype(self) -> np.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        n = self._nbytes
        if n < 0:
            n = self._nbytes = math.prod(self.shape) * ITEMSIZE[self.dtype]
        return n


@dataclass(slots=True)
class ValueRows:
    """What a record says of some values, as lists in the order asked for (read-only:
    they may be the record's own): dtype names, shapes, checksums, location kinds
    (``Extent.kind``), offsets and sizes in bytes. A restore reads these and makes no
    :class:`Entry`."""

    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    checksums: list[int]
    kinds: list[str]
    offsets: list[int]
    nbytes: list[int]

    @classmethod
    def of_entries(cls, entries: list[Entry]) -> ValueRows:
        locs = list(map(_loc_of, entries))
        return cls(list(map(_dtype_of, entries)), list(map(_shape_of, entries)),
                   list(map(_checksum_of, entries)), list(map(_kind_of, locs)),
                   list(map(_offset_of, locs)), list(map(_size_of, locs)))


_dtype_of, _shape_of = operator.attrgetter("dtype"), operator.attrgetter("shape")
_checksum_of, _loc_of = operator.attrgetter("checksum"), operator.attrgetter("loc")
_kind_of, _offset_of, _size_of = (operator.itemgetter(0), operator.itemgetter(2),
                                  operator.itemgetter(3))


class RowValues(MutableMapping[str, Entry]):
    """``Record.values`` of a fully decoded record: its checked columns, each value's
    :class:`Entry` made when first asked for, and all of them at once when they are
    listed (``values()``, ``items()``) or more than ``1/64`` are asked for one by one.
    Keys, membership and :meth:`rows` need no entry at all (a restore of every value
    makes none, nor does the collector meet one per value). Changing it (as ``dict``) makes
    every entry and changes those; the columns are not read again after."""

    __slots__ = ("_at", "_attrs", "_blocks", "_cache", "_edited", "_full", "_keys", "_last",
                 "_paths", "_rows", "_switch")

    def __init__(self, keys: list[str], at: dict[str, int], rows: ValueRows, *,
                 paths: list[str | None], blocks: list[bytes | None],
                 attrs: tuple[dict[str, list[Any]], dict[str, dict[str, Any]]]) -> None:
        self._keys, self._at, self._rows = keys, at, rows
        self._paths, self._blocks, self._attrs = paths, blocks, attrs
        self._cache: dict[str, Entry] = {}
        self._full: dict[str, Entry] | None = None
        self._last: tuple[list[str], ValueRows] | None = None
        self._switch = max(256, len(keys) // 64)
        self._edited = False

    def rows(self, keys: list[str]) -> ValueRows:
        """The columns of ``keys``, in their order; ``KeyError`` for a key not stored."""
        if self._edited:
            return ValueRows.of_entries(self.entry_list(keys))
        if keys == self._keys:  # the record's own order (a restore of what was saved)
            return self._rows
        last = self._last
        if last is not None and keys == last[0]:
            return last[1]
        idx = list(map(self._at.__getitem__, keys))
        r = self._rows
        cols: tuple[list[Any], ...] = (r.dtypes, r.shapes, r.checksums, r.kinds, r.offsets,
                                       r.nbytes)
        out = ValueRows(*(list(map(col.__getitem__, idx)) for col in cols))
        self._last = (list(keys), out)
        return out

    def entry_list(self, keys: list[str]) -> list[Entry]:
        """The entry of each key (all made at once when many are asked for); ``KeyError``
        for a key not stored."""
        if self._full is not None or len(keys) >= self._switch:
            return list(map(self._all().__getitem__, keys))
        return list(map(self.__getitem__, keys))

    def _entry(self, key: str, i: int) -> Entry:
        r, n = self._rows, self._rows.nbytes[i]
        e = Entry(r.dtypes[i], r.shapes[i], r.checksums[i], row_attrs(key, i, *self._attrs),
                  Extent(r.kinds[i], self._paths[i], r.offsets[i], n), self._blocks[i])
        e._nbytes = n
        return e

    def _all(self) -> dict[str, Entry]:
        full = self._full
        if full is None:
            r, keys = self._rows, self._keys
            make = functools.partial(tuple.__new__, Extent)  # no per-value Python call
            locs = list(map(make, zip(r.kinds, self._paths, r.offsets, r.nbytes, strict=True)))
            attrs = build_attrs(keys, *self._attrs)
            entries = list(map(Entry, r.dtypes, r.shapes, r.checksums, attrs, locs,
                               self._blocks))
            for e, b in zip(entries, r.nbytes, strict=True):
                e._nbytes = b
            full = self._full = dict(zip(keys, entries, strict=True))
            self._cache = {}
        return full

    def __getitem__(self, key: str) -> Entry:
        full = self._full
        if full is not None:
            return full[key]
        e = self._cache.get(key)
        if e is None:
            i = self._at[key]  # KeyError for a key not stored
            if len(self._cache) >= self._switch:
                return self._all()[key]
            e = self._cache[key] = self._entry(key, i)
        return e

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except (KeyError, TypeError):
            return default

    def __setitem__(self, key: str, entry: Entry) -> None:
        self._edited = True
        self._all()[key] = entry

    def __delitem__(self, key: str) -> None:
        self._edited = True
        del self._all()[key]

    def __contains__(self, key: object) -> bool:
        return key in (self._full if self._edited else self._at)  # type: ignore[operator]

    def __len__(self) -> int:
        return len(self._full) if self._full is not None else len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._full if self._edited else self._at)  # type: ignore[arg-type]

    def keys(self) -> KeysView[str]:
        return self._full.keys() if self._edited else self._at.keys()  # type: ignore[union-attr]

    def values(self) -> ValuesView[Entry]:
        return self._all().values()

    def items(self) -> ItemsView[str, Entry]:
        return self._all().items()


@dataclass(slots=True)
class Columns:
    """Per-value numbers of a decoded record as arrays, in file order (for bulk checks)."""

    keys: list[str]
    packed: np.ndarray  # bool
    offsets: np.ndarray  # int64: packed offset, or the array's byte offset
    nbytes: np.ndarray  # int64


@dataclass
class Record:
    """The decoded root record."""

    container: str
    values: dict[str, Entry] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: ``(container_path, byte_offset, nbytes)`` of the packed blob, or None.
    packed: tuple[str, int, int] | None = None
    format_version: tuple[int, int] = FORMAT_VERSION
    library: str = _LIBRARY
    #: Set by :func:`decode` (bulk validation); None for a record built in memory.
    columns: Columns | None = field(default=None, repr=False, compare=False)
    #: Bytes per block of the values' ``Entry.blocks``.
    block_size: int = BLOCK_SIZE
    #: 1.3, HDF5 only: the values whose bytes another file holds (an incremental step),
    #: by key: ``(file name, container path there)``, the file a sibling of this one;
    #: the value's ``offset`` is in that file (docs/FORMAT.md).
    external: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: 1.4, Zarr only: the values stored as several chunk files along their first axis,
    #: by key: the rows per chunk (docs/FORMAT.md, "Pieces").
    pieces: dict[str, int] = field(default_factory=dict)
    #: 1.5: the values stored as a base plus row patches (layout ``delta``), by key
    #: (docs/FORMAT.md, "Row deltas").
    deltas: dict[str, Delta] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Delta:
    """A value stored as its base (a whole copy) plus row patches applied in order.

    ``base``: ``(file, container path, byte offset)`` of the whole copy; each patch
    ``(file, container path, byte offset, rows, crc)``: a ``uint8`` array of ``rows``
    little-endian ``uint64`` row indices (sorted, unique) followed by those rows' bytes,
    whose CRC-32C (seeded by the value's header) is ``crc``. ``file`` is ``""`` for this
    checkpoint itself, else the sibling file that holds the bytes (never another delta).
    ``since``: the checkpoint that wrote the base (for ``ckpt inspect``).
    ``base_checksum`` and ``base_blocks``: the base's own checksum and block checksums
    (as the base's step recorded them), by which a reader verifies the base's bytes
    alone; None in records written before them (the assembled value is verified then).
    ``by_parts`` (1.6, only with ``base_checksum``): the value's parts are all that is
    checksummed; its entry's checksum is ``base_checksum`` and it has no block
    checksums (the assembled value's were never computed: a step costs its rows).
    """

    base: tuple[str, str, int]
    patches: tuple[tuple[str, str, int, int, int], ...]
    since: str
    base_checksum: int | None = None
    base_blocks: bytes | None = None
    by_parts: bool = False

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"base": list(self.base),
                               "patches": [list(p) for p in self.patches], "since": self.since}
        if self.base_checksum is not None:
            doc["base_checksum"] = self.base_checksum
            if self.base_blocks is not None:
                doc["base_blocks"] = self.base_blocks
            if self.by_parts:
                doc["by_parts"] = True
        return doc

    def files(self) -> set[str]:
        """The other files it refers to."""
        return {f for f in (self.base[0], *(p[0] for p in self.patches)) if f}


@dataclass(slots=True)
class ValueColumns:
    """Per-value lists, in file order, of what a record says about each value."""

    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    checksums: list[int]
    locs: list[Extent]
    attrs: list[Mapping[str, Any]]
    #: Each value's block checksums (``Entry.blocks``), or None for none of them.
    blocks: list[bytes | None] | None = None


def encode(record: Record) -> bytes:
    """The msgpack bytes of ``record``."""
    entries = list(record.values.values())
    cols = ValueColumns(
        list(record.values),
        [e.dtype for e in entries],
        [e.shape for e in entries],
        [e.checksum for e in entries],
        [e.loc for e in entries],
        [e.attrs for e in entries],
        [e.blocks for e in entries],
    )
    return encode_columns(record.container, record.packed, cols, record.metadata,
                          block_size=record.block_size, external=record.external,
                          pieces=record.pieces, deltas=record.deltas)


def record_version(external: Mapping[str, Any] | None, pieces: Mapping[str, int] | None,
                   deltas: Mapping[str, Delta] | None) -> tuple[int, int]:
    """The version a record with these fields is written as: the one home of the rule
    (its root record, the HDF5 user block and root attributes, the Zarr root attributes).

    >>> record_version(None, None, None), record_version({"w": ("a.h5", "w")}, None, None)
    ((1, 2), (1, 3))
    """
    if deltas:
        return PARTS_VERSION if any(d.by_parts for d in deltas.values()) else DELTAS_VERSION
    if pieces:
        return PIECES_VERSION
    return EXTERNAL_VERSION if external else FORMAT_VERSION


def encode_columns(
    container: str,
    packed: tuple[str, int, int] | None,
    cols: ValueColumns,
    metadata: Mapping[str, Any],
    *,
    block_size: int = BLOCK_SIZE,
    external: Mapping[str, tuple[str, str]] | None = None,
    pieces: Mapping[str, int] | None = None,
    deltas: Mapping[str, Delta] | None = None,
) -> bytes:
    """The msgpack bytes of a record given as per-value lists (``cols.blocks``: blocks of
    ``block_size`` bytes; ``external``: the values another file holds, format 1.3;
    ``pieces``: rows per chunk of the values stored as several chunks, format 1.4)."""
    keys, locs = cols.keys, cols.locs
    layouts = [loc.kind for loc in locs]
    if deltas:
        layouts = [DELTA if k in deltas else lay for k, lay in zip(keys, layouts, strict=True)]
    paths = [loc.path for loc in locs]
    offsets = [loc.offset for loc in locs]
    dense, sparse = split_attrs(keys, cols.attrs)
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": list(record_version(external, pieces, deltas)),
        "library": _LIBRARY,
        "container": container,
        "packed": list(packed) if packed is not None else None,
        "keys": keys,
        "dtypes": cols.dtypes,
        "shapes": cols.shapes,
        "checksums": cols.checksums,
        "layouts": layouts,
        "paths": paths,
        "offsets": offsets,
    }
    blocks = cols.blocks if cols.blocks is not None and any(cols.blocks) else None
    if blocks is not None:
        doc["block_size"] = block_size
        doc["block_checksums"] = blocks
    if external:
        doc["external"] = {k: list(v) for k, v in external.items()}
    if pieces:
        doc["pieces"] = dict(pieces)
    if deltas:
        doc["deltas"] = {k: d.to_doc() for k, d in deltas.items()}
    doc.update({
        "attrs": dense,
        "sparse_attrs": sparse,
        "metadata": dict(metadata),
    })
    try:
        if len(keys) >= INDEX_FROM:
            nbytes = list(map(operator.mul, map(math.prod, cols.shapes),
                              map(ITEMSIZE.__getitem__, cols.dtypes)))
            doc["index"] = encode_index(keys, {
                "dtypes": cols.dtypes, "shapes": cols.shapes, "checksums": cols.checksums,
                "layouts": layouts, "paths": paths, "offsets": offsets, "attrs": cols.attrs,
                "nbytes": nbytes, "blocks": blocks,
            })
        out: bytes = msgpack.packb(doc, use_bin_type=True)
        return out
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"Checkpoint metadata or attrs must be msgpack-able (dict, list, str, bytes, "
            f"int, float, bool, None): {exc}"
        ) from None


def decode(data: bytes, path: Any, *, container: str, file_size: int | None = None) -> Record:
    """Parse and validate record bytes read from ``path`` (strict; see the module docstring)."""
    where = str(path)
    if len(data) > MAX_RECORD_NBYTES:
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: the root record is {len(data)} bytes, more than the "
            f"{MAX_RECORD_NBYTES} accepted."
        )
    with paused_gc():
        lazy = _decode_indexed(data, where, container, file_size)
        if lazy is not None:
            return lazy
        return _decode(data, where, container, file_size)


def _decode(data: bytes, where: str, container: str, file_size: int | None) -> Record:
    try:
        doc = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=unique_pairs,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - every msgpack failure means a bad record
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: the root record is not valid msgpack ({exc})."
        ) from None
    try:
        return _validate(doc, container, file_size, where)
    except BadRecord as exc:
        raise CorruptCheckpointError(f"Checkpoint {where!r}: bad root record: {exc}.") from None


def _validate(doc: Any, container: str, file_size: int | None, where: str) -> Record:
    version, library, metadata = _check_header(doc, container, where)
    packed = _check_packed_region(doc.get("packed"), file_size)
    cols = columns(doc)
    deltas = _delta_layouts(cols, check_deltas(doc.get("deltas"), container))
    keys, dtypes, shapes, checksums, layouts, paths, offsets = (cols[n] for n in COLUMNS)
    packed_nbytes = packed[2] if packed is not None else 0
    nbytes = check_dtypes_and_shapes(keys, dtypes, shapes)
    check_locations(cols, container)
    at = dict(zip(keys, range(len(keys)), strict=True))  # (the keys are unique: columns checked them)
    dense, sparse = doc.get("attrs", {}), doc.get("sparse_attrs", {})
    check_attrs(keys, dense, sparse, at)
    block_size = check_block_size(doc)
    blocks = check_blocks(keys, doc.get("block_checksums"), nbytes, block_size)
    external = check_external(doc.get("external"), container)
    pieces = check_pieces(doc.get("pieces"), container)
    if external or pieces:
        kind_at = dict(zip(keys, layouts, strict=True))
        for key in external:
            if kind_at.get(key) != ARRAY:
                raise BadRecord(f"the external value {key!r} is not a value stored as its own "
                                "array")
        dims = dict(zip(keys, shapes, strict=True))
        for key, rows in pieces.items():
            if kind_at.get(key) != ARRAY or not dims[key] or not 0 < rows < dims[key][0]:
                raise BadRecord(f"'pieces' gives {rows} rows per chunk for {key!r}, which is "
                                "not a value of more rows stored as its own array")
    is_packed = [lay == "packed" for lay in layouts]
    off = np.array(offsets, np.int64)
    nb = np.array(nbytes, np.int64)
    pk = np.array(is_packed, bool)
    check_packed(keys, pk, off, nb, packed_nbytes)
    values = RowValues(keys, at, ValueRows(dtypes, list(map(tuple, shapes)), checksums, layouts,
                                           offsets, nbytes), paths=paths, blocks=blocks,
                       attrs=(dense, sparse))
    return Record(
        container=container,
        values=values,  # type: ignore[arg-type]
        metadata=metadata,
        packed=packed,
        format_version=version,
        library=library,
        columns=Columns(keys, pk, off, nb),
        block_size=block_size,
        external=external,
        pieces=pieces,
        deltas=deltas,
    )


def _delta_layouts(cols: dict[str, Any], deltas: dict[str, Delta]) -> dict[str, Delta]:
    """Check that the values stored as deltas (layout ``delta``) are those ``deltas``
    describes, and make their layout ``array`` in ``cols`` (a delta's bytes are read as an
    array's, through its patched source); returns ``deltas``."""
    layouts = cols["layouts"]
    if not deltas and (not isinstance(layouts, list) or DELTA not in layouts):
        return deltas
    at = dict(zip(cols["keys"], layouts, strict=False))
    for key in deltas:
        if at.get(key) != DELTA:
            raise BadRecord(f"'deltas' describes {key!r}, which is not stored as a delta")
    if sum(lay == DELTA for lay in layouts) != len(deltas):
        raise BadRecord("a value stored as a delta has no entry in 'deltas'")
    cols["layouts"] = [ARRAY if lay == DELTA else lay for lay in layouts]
    return deltas


def _check_header(doc: Any, container: str, where: str,
                  ) -> tuple[tuple[int, int], str, dict[str, Any]]:
    """``(format_version, library, metadata)`` of a record map read from ``where``, checked."""
    if not isinstance(doc, dict):
        raise BadRecord("the record is not a map")
    if doc.get("format") != FORMAT_NAME:
        raise BadRecord(f"'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    version = doc.get("format_version")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(type(v) is int and 0 <= v < 1 << 16 for v in version)
    ):
        raise BadRecord(f"'format_version' is {version!r}, expected [major, minor]")
    if version[0] > FORMAT_VERSION[0]:
        raise UnsupportedFormatError(
            f"Checkpoint {where!r}: its root record has format version "
            f"{version[0]}.{version[1]}, newer than the {FORMAT_VERSION[0]}.x this ckptvar "
            "reads; upgrade ckptvar to read it."
        )
    if doc.get("container") != container:
        raise BadRecord(f"'container' is {doc.get('container')!r}, expected {container!r}")
    library = doc.get("library", "")
    if not isinstance(library, str):
        raise BadRecord("'library' is not a string")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BadRecord("'metadata' is not a map")
    check_plain(metadata, "'metadata'")
    return (version[0], version[1]), library, metadata


def _check_packed_region(packed: Any, file_size: int | None) -> tuple[str, int, int] | None:
    """The record's ``packed`` entry as ``(path, offset, nbytes)``, checked (None if absent)."""
    if packed is None:
        return None
    if (
        not isinstance(packed, list)
        or len(packed) != 3
        or not isinstance(packed[0], str)
        or not is_valid_container_path(packed[0])
        or not is_count(packed[1])
        or not is_count(packed[2])
    ):
        raise BadRecord(f"'packed' is {packed!r}, expected [path, offset, nbytes]")
    if file_size is not None and packed[1] + packed[2] > file_size:
        raise BadRecord(
            f"the packed region [{packed[1]}, {packed[1] + packed[2]}) ends past the end "
            f"of the file ({file_size} bytes; truncated?)"
        )
    return packed[0], packed[1], packed[2]


#: The fields an indexed record leaves undecoded until every value is needed.
_DEFERRED = frozenset({*COLUMNS, "attrs", "sparse_attrs", "block_checksums"})
#: Those of them a record may lack.
_OPTIONAL = frozenset({"block_checksums"})


def _decode_indexed(data: bytes, where: str, container: str,
                    file_size: int | None) -> Record | None:
    """A record with a key index, decoded lazily: the columns skipped (checked when every
    value is first needed), the index checked in bulk; None without an index."""
    head = read_head(data, _DEFERRED, _OPTIONAL)
    if head is None:
        return None
    try:
        version, library, metadata = _check_header(head, container, where)
        packed = _check_packed_region(head.get("packed"), file_size)
        block_size = check_block_size(head)
        external = check_external(head.get("external"), container)
        pieces = check_pieces(head.get("pieces"), container)
        deltas = check_deltas(head.get("deltas"), container)
        index = KeyIndex.parse(head["index"], container, block_size)
        if int((index.layouts == LAYOUT_CODES.index(DELTA)).sum()) != len(deltas):
            raise BadRecord("the values stored as deltas and 'deltas' do not agree")
        pk = index.layouts == 0
        check_packed(SortedKeys(index), pk, index.offsets, index.nbytes,
                     packed[2] if packed is not None else 0)
    except BadRecord as exc:
        raise CorruptCheckpointError(f"Checkpoint {where!r}: bad root record: {exc}.") from None
    record = Record(
        container=container,
        metadata=metadata,
        packed=packed,
        format_version=version,
        library=library,
        columns=Columns(SortedKeys(index), pk, index.offsets, index.nbytes),  # type: ignore[arg-type]
        block_size=block_size,
        external=external,
        pieces=pieces,
    )
    record.values = IndexedValues(  # type: ignore[assignment]
        index,
        functools.partial(_indexed_entry, index, where),
        functools.partial(_decode_all, index, (data, where, container, file_size)),
    )
    return record


def _indexed_entry(idx: KeyIndex, where: str, key: str, i: int) -> Entry:
    """The entry of ``key``, the ``i``-th value of the key index, checked."""
    try:
        dtype, shape, path, attrs = idx.row(i)
        nbytes = check_dtypes_and_shapes([key], [dtype], [shape])[0]
        if nbytes != int(idx.nbytes[i]):
            raise BadRecord(f"the index gives {key!r} {int(idx.nbytes[i])} bytes, its dtype "
                            f"and shape {nbytes}")
    except BadRecord as exc:
        raise CorruptCheckpointError(f"Checkpoint {where!r}: bad root record: {exc}.") from None
    kind = LAYOUT_CODES[int(idx.layouts[i])]
    loc = Extent(ARRAY if kind == DELTA else kind, path, int(idx.offsets[i]), nbytes)
    e = Entry(dtype, tuple(shape), int(idx.checksums[i]), attrs, loc, idx.blocks(i))
    e._nbytes = nbytes
    return e


def _decode_all(idx: KeyIndex, src: tuple[bytes, str, str, int | None],
                handed_out: Mapping[str, Entry]) -> dict[str, Entry]:
    """Every value of an indexed record (strict full decode of ``(data, where, container,
    file_size)``), which must agree with its key index and the entries ``handed_out``."""
    data, where, container, file_size = src
    with paused_gc():
        rec = _decode(data, where, container, file_size)
    full, cols = rec.values, rec.columns
    assert cols is not None
    if not idx.agrees(cols.packed, cols.offsets, cols.nbytes) or any(
        full.get(k) != e for k, e in handed_out.items()
    ):
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: bad root record: its key index does not agree with its "
            "columns."
        )
    return full




def is_sibling_name(name: Any) -> bool:
    """``name`` is a plain file name in the same directory (no separators, no dot file)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and not name.startswith(".")
            and "/" not in name and "\\" not in name and "\0" not in name)


def is_holder_name(name: Any) -> bool:
    """``name`` names the file holding an external value: a sibling file, or (a per-process
    file of a multi-process step) ``../<sibling step>/<its file>``."""
    if isinstance(name, str) and name.startswith("../"):
        parts = name[3:].split("/")
        return len(parts) == 2 and all(is_sibling_name(p) for p in parts)
    return is_sibling_name(name)


def holder_step(name: str) -> str:
    """The checkpoint beside this one that the holder ``name`` belongs to (the step
    directory of ``../<step>/<file>``, else the sibling file itself).

    >>> holder_step("../ckpt-1.h5/rank-00002.h5"), holder_step("ckpt-1.h5")
    ('ckpt-1.h5', 'ckpt-1.h5')
    """
    return name[3:].split("/", maxsplit=1)[0] if name.startswith("../") else name


def check_pieces(pieces: Any, container: str) -> dict[str, int]:
    """The record's ``pieces`` map (1.4) checked: key -> rows per chunk (a positive int)."""
    if pieces is None:
        return {}
    if container != "zarr" or not isinstance(pieces, dict):
        raise BadRecord("'pieces' is not a map of keys to rows per chunk (Zarr only)")
    for key, rows in pieces.items():
        if not isinstance(key, str) or type(rows) is not int or rows < 1:
            raise BadRecord(f"'pieces' gives {rows!r} for {key!r}, not a number of rows")
    return dict(pieces)


def check_deltas(deltas: Any, container: str) -> dict[str, Delta]:
    """The record's ``deltas`` map (1.5) checked: key -> :class:`Delta`."""
    if deltas is None:
        return {}
    if not isinstance(deltas, dict):
        raise BadRecord("'deltas' is not a map of keys to deltas")
    out: dict[str, Delta] = {}

    def file_ok(f: Any) -> bool:
        return f == "" or (container == "h5" and is_holder_name(f))

    for key, d in deltas.items():
        try:
            base, patches, since = d["base"], d["patches"], d["since"]
            crc, blocks = d.get("base_checksum"), d.get("base_blocks")
            parts = d.get("by_parts")
            ok = (isinstance(base, list) and len(base) == 3 and file_ok(base[0])
                  and isinstance(base[1], str) and is_valid_container_path(base[1])
                  and is_count(base[2]) and isinstance(patches, list) and 0 < len(patches) <= 64
                  and isinstance(since, str)
                  and len(d) == 3 + (crc is not None) + (blocks is not None) + (parts is not None)
                  and (parts is None or (parts is True and crc is not None))
                  and (crc is None or (is_count(crc) and crc < 1 << 32))
                  and (blocks is None or (crc is not None and isinstance(blocks, bytes)
                                          and len(blocks) % 4 == 0)))
            if ok:
                for p in patches:
                    ok = ok and (isinstance(p, list) and len(p) == 5 and file_ok(p[0])
                                 and isinstance(p[1], str) and is_valid_container_path(p[1])
                                 and is_count(p[2]) and is_count(p[3]) and p[3] > 0
                                 and is_count(p[4]) and p[4] < 1 << 32)
        except (KeyError, TypeError):
            ok = False
        if not ok or not isinstance(key, str):
            raise BadRecord(f"'deltas' gives {d!r} for {key!r}, not a base and its patches")
        out[key] = Delta((base[0], base[1], base[2]),
                         tuple((p[0], p[1], p[2], p[3], p[4]) for p in patches), since,
                         crc, blocks, parts is True)
    return out


def check_external(external: Any, container: str) -> dict[str, tuple[str, str]]:
    """The record's ``external`` map (1.3) checked: key -> ``(sibling file, path there)``."""
    if external is None:
        return {}
    if container != "h5" or not isinstance(external, dict):
        raise BadRecord("'external' is not a map of keys to [file, path] (HDF5 only)")
    out: dict[str, tuple[str, str]] = {}
    for key, where in external.items():
        if (not isinstance(where, list) or len(where) != 2 or not is_holder_name(where[0])
                or not isinstance(where[1], str) or not is_valid_container_path(where[1])):
            raise BadRecord(f"'external' gives {where!r} for {key!r}, not [sibling file "
                            "name, container path]")
        out[key] = (where[0], where[1])
    return out
