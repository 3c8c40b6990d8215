"""The root record's key index (format 1.1): one value found without decoding the others.

A record of many values also carries ``index``: the keys sorted (UTF-8 byte order)
and concatenated, with their end offsets, the fixed-size fields of each value as
little-endian binary columns in that order, and each value's variable fields
(dtype, shape, container path, attrs) as one small msgpack row. Opening a
checkpoint then decodes a handful of ``bin`` fields, checks them with a few
vectorized passes, and finds a key by binary search over the key bytes; the
per-value columns of format 1.0 stay in the record for every other reader and
for whole-checkpoint work (docs/FORMAT.md, *The key index*). Also here: the bulk
check that packed values lie inside the blob without overlapping (both decoders).

>>> idx = encode_index(["b", "a"], {"dtypes": ["int8", "float32"], "shapes": [[3], [2]],
...     "checksums": [7, 9], "layouts": ["packed", "packed"], "paths": [None, None],
...     "offsets": [0, 64], "attrs": [{}, {"t": 1}], "nbytes": [3, 8]})
>>> ki = KeyIndex.parse(idx, "h5", 4096)
>>> ki.find("a"), ki.find("b"), ki.find("c"), ki.row(ki.find("a"))
(0, 1, -1, ('float32', [2], None, {'t': 1}))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from ._plain import MAX_DEPTH, BadRecord, check_plain, unique_pairs
from .paths import is_valid_container_path

__all__ = [
    "INDEX_FROM", "LAYOUT_CODES", "IndexedValues", "KeyIndex", "SortedKeys", "check_packed",
    "encode_index",
    "read_head",
]

#: Records of at least this many values carry the key index (smaller ones decode in ~1 ms).
INDEX_FROM = 1024
#: The ``layouts`` column's codes: packed, array, zarr, delta (1.5: an array stored as
#: a base plus row patches).
LAYOUT_CODES = ("packed", "array", "zarr", "delta")
_CODE = {name: i for i, name in enumerate(LAYOUT_CODES)}
_MAX_NBYTES = 1 << 62
#: ``name: (dtype, bytes per value)`` of the index's binary columns.
_BIN = {
    "key_ends": ("<u8", 8),
    "offsets": ("<u8", 8),
    "nbytes": ("<u8", 8),
    "checksums": ("<u4", 4),
    "layouts": ("u1", 1),
    "row_ends": ("<u8", 8),
}


def encode_index(keys: Sequence[str], cols: Mapping[str, Sequence[Any] | None]) -> dict[str, bytes]:
    """The ``index`` map of a record whose columns (file order) are given: ``dtypes``,
    ``shapes``, ``checksums``, ``layouts``, ``paths``, ``offsets``, ``attrs``, ``nbytes``,
    and optionally ``blocks`` (each value's block checksums or None; format 1.2)."""
    dtypes, shapes, paths, attrs = cols["dtypes"], cols["shapes"], cols["paths"], cols["attrs"]
    layouts = cols["layouts"]
    assert dtypes is not None and shapes is not None and paths is not None and attrs is not None
    assert layouts is not None
    order = sorted(range(len(keys)), key=keys.__getitem__)  # code point = UTF-8 byte order
    kb = [keys[i].encode("utf-8") for i in order]
    pack = msgpack.Packer(use_bin_type=True).pack
    rows = [pack((dtypes[i], list(shapes[i]), paths[i], attrs[i])) for i in order]
    take = np.array(order, np.intp)

    def col(values: Sequence[int] | None, name: str) -> bytes:
        return np.asarray(values, np.uint64)[take].astype(_BIN[name][0]).tobytes()

    out = {
        "keys": b"".join(kb),
        "key_ends": np.cumsum(np.fromiter(map(len, kb), np.uint64, len(kb))).astype("<u8").tobytes(),
        "offsets": col(cols["offsets"], "offsets"),
        "nbytes": col(cols["nbytes"], "nbytes"),
        "checksums": col(cols["checksums"], "checksums"),
        "layouts": col([_CODE[x] for x in layouts], "layouts"),
        "rows": b"".join(rows),
        "row_ends": np.cumsum(np.fromiter(map(len, rows), np.uint64, len(rows))).astype("<u8").tobytes(),
    }
    blocks = cols.get("blocks")
    if blocks:
        sorted_blocks = [blocks[i] or b"" for i in order]
        counts = np.fromiter((len(b) // 4 for b in sorted_blocks), np.uint64, len(order))
        out["block_ends"] = np.cumsum(counts).astype("<u8").tobytes()
        out["block_crcs"] = b"".join(sorted_blocks)
    return out


def read_head(data: bytes, deferred: frozenset[str],
              optional: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The top-level fields of a record of format >= 1.1 that carries an index, those in
    ``deferred`` skipped undecoded (``None`` stands in; all present but the ``optional``
    ones); None for an older record or one that does not parse (the strict full decode
    then names the problem)."""
    u = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                         object_pairs_hook=unique_pairs, max_buffer_size=max(len(data), 1))
    head: dict[str, Any] = {}
    try:
        u.feed(data)
        for _ in range(u.read_map_header()):
            name = u.unpack()
            if type(name) is not str or name in head:
                return None
            if name in deferred:
                u.skip()
                head[name] = None
                continue
            head[name] = u.unpack()
            if name == "format_version" and not (
                isinstance(head[name], list) and head[name][:2] >= [1, 1]
            ):
                return None  # no index before 1.1: decode it all at once
        if u.tell() != len(data) or "index" not in head or not deferred - optional <= head.keys():
            return None
    except Exception:  # noqa: BLE001 (any failure: the strict decode names the problem)
        return None
    return head


class KeyIndex:
    """A parsed, checked key index: ``find`` a key, then its ``row`` and numbers."""

    __slots__ = ("_bends", "_kends", "_rends", "blockblob", "checksums", "keyblob", "layouts",
                 "n", "nbytes", "offsets", "rowblob")

    def __init__(self, keyblob: bytes, rowblob: bytes, cols: dict[str, np.ndarray],
                 blockblob: bytes = b"") -> None:
        self.keyblob, self.rowblob, self.blockblob = keyblob, rowblob, blockblob
        self._bends: np.ndarray | None = cols.get("block_ends")
        self._kends, self._rends = cols["key_ends"], cols["row_ends"]
        self.offsets, self.nbytes = cols["offsets"], cols["nbytes"]
        self.checksums, self.layouts = cols["checksums"], cols["layouts"]
        self.n = len(self._kends)

    @classmethod
    def parse(cls, doc: Any, container: str, block_size: int) -> KeyIndex:
        """Check the ``index`` map's shape and numbers in bulk (``BadRecord`` if broken);
        block checksums are of blocks of ``block_size`` bytes."""
        if not isinstance(doc, dict):
            raise BadRecord("'index' is not a map")
        blobs = {}
        for name in ("keys", "rows", *_BIN):
            b = doc.get(name)
            if not isinstance(b, bytes):
                raise BadRecord(f"'index' field {name!r} is not binary")
            blobs[name] = b
        n = len(blobs["key_ends"]) // 8
        cols: dict[str, np.ndarray] = {}
        for name, (dt, size) in _BIN.items():
            if len(blobs[name]) != n * size:
                raise BadRecord(f"'index' field {name!r} has {len(blobs[name])} bytes for "
                                f"{n} values")
            cols[name] = np.frombuffer(blobs[name], dt).astype(np.int64 if size == 8 else dt)
        if n:
            _check_columns(blobs, cols, container)
        elif blobs["keys"] or blobs["rows"]:
            raise BadRecord("'index' holds keys or rows for no values")
        blockblob = _parse_blocks(doc, cols, n, block_size)
        return cls(blobs["keys"], blobs["rows"], cols, blockblob)

    def blocks(self, i: int) -> bytes | None:
        """The block checksums of the ``i``-th value (format 1.2), or None."""
        ends = self._bends
        if ends is None:
            return None
        lo, hi = int(ends[i - 1]) if i else 0, int(ends[i])
        return self.blockblob[4 * lo : 4 * hi] if hi > lo else None

    def key(self, i: int) -> str:
        """The ``i``-th key in sorted order."""
        lo = int(self._kends[i - 1]) if i else 0
        try:
            return self.keyblob[lo : int(self._kends[i])].decode("utf-8")
        except UnicodeDecodeError:
            raise BadRecord(f"'index' key #{i} is not valid UTF-8") from None

    def find(self, key: str) -> int:
        """The sorted position of ``key``, or -1 (binary search over the key bytes)."""
        try:
            want = key.encode("utf-8")
        except UnicodeEncodeError:
            return -1
        blob, ends = self.keyblob, self._kends
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(ends[mid - 1]) if mid else 0
            got = blob[start : int(ends[mid])]
            if got < want:
                lo = mid + 1
            elif got > want:
                hi = mid
            else:
                return mid
        return -1

    def agrees(self, packed: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray) -> bool:
        """Whether the index describes as many values as the file-order columns, and the
        same values stored as their own arrays (offset and size), so the byte ranges checked
        at open are the ones read (the full decode checks the packed ones itself)."""
        if len(packed) != self.n:
            return False
        own = self.layouts != 0
        mine = np.stack([self.offsets[own], self.nbytes[own]])
        theirs = np.stack([offsets[~packed], nbytes[~packed]])
        return mine.shape == theirs.shape and bool(
            (mine[:, np.lexsort(mine)] == theirs[:, np.lexsort(theirs)]).all()
        )

    def row(self, i: int) -> tuple[str, list[int], str | None, dict[str, Any]]:
        """``(dtype, shape, path, attrs)`` of the ``i``-th value, checked for form; the
        caller checks the dtype name and the size against ``nbytes``."""
        lo = int(self._rends[i - 1]) if i else 0
        try:
            row = msgpack.unpackb(self.rowblob[lo : int(self._rends[i])], raw=False,
                                  strict_map_key=True, use_list=True,
                                  object_pairs_hook=unique_pairs, max_ext_len=0)
        except BadRecord:
            raise
        except Exception as exc:  # noqa: BLE001 (every msgpack failure means a bad row)
            raise BadRecord(f"'index' row #{i} is not valid msgpack ({exc})") from None
        if not isinstance(row, list) or len(row) != 4:
            raise BadRecord(f"'index' row #{i} is not [dtype, shape, path, attrs]")
        dtype, shape, path, attrs = row
        if type(dtype) is not str or type(shape) is not list:
            raise BadRecord(f"'index' row #{i} has a bad dtype or shape")
        packed = int(self.layouts[i]) == 0
        if packed and path is not None:
            raise BadRecord(f"'index' row #{i} is packed but names a container path {path!r}")
        if not packed and not (isinstance(path, str) and is_valid_container_path(path)):
            raise BadRecord(f"'index' row #{i} has an unsafe container path {path!r}")
        if not isinstance(attrs, dict):
            raise BadRecord(f"'index' row #{i} has attrs that are not a map")
        check_plain(attrs, f"the attrs of index row #{i}", max_depth=MAX_DEPTH - 2)
        return dtype, shape, path, attrs


def _parse_blocks(doc: dict[str, Any], cols: dict[str, np.ndarray], n: int,
                  block_size: int) -> bytes:
    """The index's block checksums (format 1.2, optional): ``block_ends`` (``uint64[n]``,
    sorted order) cutting ``block_crcs`` (``uint32`` each); every value has none or one
    per block of its bytes. Adds ``block_ends`` to ``cols``."""
    ends_blob, crcs = doc.get("block_ends"), doc.get("block_crcs")
    if ends_blob is None and crcs is None:
        return b""
    if not isinstance(ends_blob, bytes) or not isinstance(crcs, bytes):
        raise BadRecord("'index' fields 'block_ends' and 'block_crcs' are not binary")
    if len(ends_blob) != 8 * n:
        raise BadRecord(f"'index' field 'block_ends' has {len(ends_blob)} bytes for {n} values")
    ends = np.frombuffer(ends_blob, "<u8").astype(np.int64)
    counts = np.diff(ends, prepend=0)
    if (counts < 0).any() or (n and 4 * int(ends[-1]) != len(crcs)) or (not n and crcs):
        raise BadRecord("'index' field 'block_ends' does not cut 'block_crcs' in order")
    want = -(-cols["nbytes"] // block_size)
    if ((counts != 0) & (counts != want)).any():
        raise BadRecord("'index' gives a value a number of block checksums other than its "
                        "number of blocks")
    cols["block_ends"] = ends
    return crcs


def _check_columns(blobs: dict[str, bytes], cols: dict[str, np.ndarray], container: str) -> None:
    """The binary columns of a non-empty index: ends that cut their blobs in order, sizes
    and offsets that can exist, known layouts (``BadRecord`` if not)."""
    for name, blob in (("key_ends", blobs["keys"]), ("row_ends", blobs["rows"])):
        ends = cols[name]
        steps = np.diff(ends, prepend=0)
        if ends[-1] != len(blob) or (steps < 0).any() or (name == "row_ends" and (steps == 0).any()):
            raise BadRecord(f"'index' field {name!r} does not cut its blob in order")
    for name in ("offsets", "nbytes"):
        if (cols[name] < 0).any() or cols[name].max() >= _MAX_NBYTES:
            raise BadRecord(f"'index' field {name!r} holds a number too large to exist")
    lay = cols["layouts"]
    if (lay >= 4).any() or (container != "zarr" and (lay == 2).any()):
        raise BadRecord("'index' field 'layouts' holds an unknown location")
    if container == "zarr" and (cols["offsets"][cols["layouts"] != 0] != 0).any():
        raise BadRecord("'index' gives a Zarr chunk a byte offset other than 0")


def check_packed(keys: Sequence[str], packed: np.ndarray, offsets: np.ndarray,
                  nbytes: np.ndarray, blob_nbytes: int) -> None:
    """Packed values lie inside the blob and never overlap each other."""
    if not packed.any():
        return
    idx = np.flatnonzero(packed)
    start, size = offsets[idx], nbytes[idx]
    end = start + size
    outside = np.flatnonzero(end > blob_nbytes)
    if outside.size:
        key = keys[int(idx[outside[0]])]
        raise BadRecord(f"{key!r} lies outside the packed blob ({blob_nbytes} bytes)")
    nonempty = size > 0
    idx, start, end = idx[nonempty], start[nonempty], end[nonempty]
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    bad = np.flatnonzero(s[1:] < e[:-1])
    if bad.size:
        j = int(bad[0])
        a, b = keys[int(idx[order[j]])], keys[int(idx[order[j + 1]])]
        raise BadRecord(f"packed value {b!r} overlaps {a!r}")


class SortedKeys(Sequence[str]):
    """The index's keys in sorted order, decoded one at a time."""

    def __init__(self, index: KeyIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return self._index.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._index.key(i % len(self))


class IndexedValues(Mapping[str, Any]):
    """``Record.values`` of a record read through its key index: one value is found by
    binary search and decoded alone; listing or iterating decodes (and checks) the whole
    record once, and the entries already handed out must agree with it. So does asking
    for more than ``1/64`` of the values one by one (a restore of them all): a key found
    alone costs about twenty times its share of the whole decode."""

    def __init__(self, index: KeyIndex, entry: Callable[[str, int], Any],
                 load_all: Callable[[Mapping[str, Any]], dict[str, Any]]) -> None:
        self._index = index
        self._make, self._load_all = entry, load_all
        self._cache: dict[str, Any] = {}
        self._full: dict[str, Any] | None = None
        self._switch = max(256, index.n // 64)

    @property
    def decoded_all(self) -> bool:
        """Whether the whole record has been decoded (for tests and diagnostics)."""
        return self._full is not None

    def decoded(self) -> dict[str, Any] | None:
        """Every value by key once the whole record is decoded (the full decode's
        mapping, whose keys and columns need no entry per value), else None."""
        return self._full

    def __getitem__(self, key: str) -> Any:
        full = self._full
        if full is not None:
            return full[key]
        e = self._cache.get(key)
        if e is None:
            if type(key) is not str:
                raise KeyError(key)
            if len(self._cache) >= self._switch:
                return self._all()[key]
            i = self._index.find(key)
            if i < 0:
                raise KeyError(key)
            e = self._cache[key] = self._make(key, i)
        return e

    def __contains__(self, key: object) -> bool:
        if self._full is not None:
            return key in self._full
        return key in self._cache or (type(key) is str and self._index.find(key) >= 0)

    def __len__(self) -> int:
        return len(self._full) if self._full is not None else self._index.n

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def keys(self) -> Any:
        return self._all().keys()

    def values(self) -> Any:
        return self._all().values()

    def items(self) -> Any:
        return self._all().items()

    def _all(self) -> dict[str, Any]:
        full = self._full
        if full is None:
            full = self._full = self._load_all(self._cache)
            self._cache = {}
        return full
