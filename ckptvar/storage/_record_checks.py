"""Checks of the root record's per-value columns, in bulk (docs/FORMAT.md).

Owns the strict schema of the columns a full decode validates: one item per key,
unique string keys, known dtype names, shapes whose sizes can exist, 32-bit
checksums, known layouts, byte offsets, safe container paths (and, in Zarr, no two
values on one path), and the per-block checksums of format 1.2. Each check runs over
whole columns (set membership, minimum and maximum) and raises ``BadRecord`` naming
the first bad key.

>>> check_dtypes_and_shapes(["w"], ["float32"], [[2, 3]]), block_count(5000, 4096)
([24], 2)
"""

from __future__ import annotations

import math
import operator
from itertools import chain, compress, pairwise
from typing import Any

from .._dtypes import SUPPORTED_DTYPES
from ._plain import BadRecord, types_of
from .paths import is_valid_container_path

__all__ = [
    "BLOCK_SIZE", "COLUMNS", "ITEMSIZE", "MAX_NBYTES", "MAX_NDIM", "block_count",
    "check_block_size", "check_blocks", "check_dtypes_and_shapes", "check_locations",
    "columns", "is_count",
]

MAX_NDIM = 64
MAX_NBYTES = 1 << 62
#: Bytes per block of the per-block checksums (format 1.2) a writer stores: 64 KiB (256 KiB
#: before 2026-11-27; the record says which, so both read). A reader of a part verifies
#: whole blocks, so the block is what a cut between two readers costs in extra reading.
BLOCK_SIZE = 64 << 10
#: The block sizes a reader accepts: powers of two in this range.
_MIN_BLOCK, _MAX_BLOCK = 4 << 10, 1 << 30
ITEMSIZE = {name: dt.itemsize for name, dt in SUPPORTED_DTYPES.items()}
_LAYOUTS = frozenset({"packed", "array", "zarr"})
COLUMNS = ("keys", "dtypes", "shapes", "checksums", "layouts", "paths", "offsets")


def block_count(nbytes: int, block_size: int) -> int:
    """How many blocks of ``block_size`` bytes hold ``nbytes`` bytes."""
    return -(-nbytes // block_size)


def check_block_size(doc: dict[str, Any]) -> int:
    """The record's ``block_size`` (format 1.2), checked; the default when absent."""
    size = doc.get("block_size", BLOCK_SIZE)
    if not (type(size) is int and _MIN_BLOCK <= size <= _MAX_BLOCK and size & (size - 1) == 0):
        raise BadRecord(f"'block_size' is {size!r}, expected a power of two from "
                        f"{_MIN_BLOCK} to {_MAX_BLOCK}")
    if "block_checksums" in doc and "block_size" not in doc:
        raise BadRecord("'block_checksums' comes without 'block_size'")
    return size


def check_blocks(keys: list[str], col: Any, nbytes: list[int],
                  block_size: int) -> list[bytes | None]:
    """The ``block_checksums`` column (format 1.2): per value None or one little-endian
    ``uint32`` per block of its bytes; all None when the record has none."""
    n = len(keys)
    if col is None:
        return [None] * n
    if not isinstance(col, list) or len(col) != n:
        raise BadRecord(f"'block_checksums' is not a list of {n} items")
    if not types_of(col) <= {bytes, type(None)}:
        i = next(i for i, b in enumerate(col) if not isinstance(b, bytes | None))
        raise BadRecord(f"{keys[i]!r} has block checksums that are not binary")
    for i in compress(range(n), col):
        if len(col[i]) != 4 * block_count(nbytes[i], block_size):
            raise BadRecord(f"{keys[i]!r} has {len(col[i]) // 4} block checksums for "
                            f"{nbytes[i]} bytes in blocks of {block_size}")
    return col


def columns(doc: dict[str, Any]) -> dict[str, list[Any]]:
    """The per-value columns: lists of one length, with unique string keys."""
    cols = {name: doc.get(name) for name in COLUMNS}
    for name, col in cols.items():
        if not isinstance(col, list):
            raise BadRecord(f"{name!r} is not a list (the values' columns)")
    keys = cols["keys"]
    assert keys is not None
    n = len(keys)
    for name, col in cols.items():
        if len(col) != n:  # type: ignore[arg-type]
            raise BadRecord(f"{name!r} has {len(col)} items for {n} keys")  # type: ignore[arg-type]
    if n and types_of(keys) != {str}:
        bad = next(k for k in keys if type(k) is not str)
        raise BadRecord(f"'keys' holds a non-string {bad!r}")
    if len(set(keys)) != n:
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise BadRecord(f"the key {dup!r} is stored twice")
    return cols  # type: ignore[return-value]


def is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_NBYTES


def check_dtypes_and_shapes(keys: list[str], dtypes: list[Any], shapes: list[Any]) -> list[int]:
    """Validate dtype names and shapes in bulk; return each value's size in bytes."""
    if not keys:
        return []
    if types_of(dtypes) != {str} or not set(dtypes) <= ITEMSIZE.keys():
        i = next(i for i, d in enumerate(dtypes) if not (type(d) is str and d in ITEMSIZE))
        raise BadRecord(f"{keys[i]!r} has unsupported dtype {dtypes[i]!r}")
    if types_of(shapes) != {list} or max(map(len, shapes)) > MAX_NDIM:
        i = next(i for i, s in enumerate(shapes) if type(s) is not list or len(s) > MAX_NDIM)
        raise BadRecord(f"{keys[i]!r} has shape {shapes[i]!r}, expected a list of at most "
                   f"{MAX_NDIM} dims")
    dims = list(chain.from_iterable(shapes))
    if dims and (types_of(dims) != {int} or min(dims) < 0 or max(dims) >= MAX_NBYTES):
        i = next(i for i, s in enumerate(shapes) if not all(is_count(d) for d in s))
        bad = next(d for d in shapes[i] if not is_count(d))
        raise BadRecord(f"{keys[i]!r} has a bad dimension {bad!r} in shape {shapes[i]!r}")
    nbytes = list(map(operator.mul, map(math.prod, shapes), map(ITEMSIZE.__getitem__, dtypes)))
    if max(nbytes) >= MAX_NBYTES:
        i = next(i for i, b in enumerate(nbytes) if b >= MAX_NBYTES)
        raise BadRecord(f"{keys[i]!r} declares shape {shapes[i]!r}, too large to exist")
    return nbytes


def check_locations(cols: dict[str, list[Any]], container: str) -> None:
    """Validate checksums, layouts, byte offsets and container paths in bulk."""
    keys, checksums = cols["keys"], cols["checksums"]
    layouts, paths, offsets = cols["layouts"], cols["paths"], cols["offsets"]
    if not keys:
        return
    if types_of(checksums) != {int} or min(checksums) < 0 or max(checksums) >= 1 << 32:
        i = next(i for i, c in enumerate(checksums) if type(c) is not int or not 0 <= c < 1 << 32)
        raise BadRecord(
            f"{keys[i]!r} has checksum {checksums[i]!r}, expected a 32-bit unsigned int"
        )
    allowed = _LAYOUTS if container == "zarr" else _LAYOUTS - {"zarr"}
    if types_of(layouts) != {str} or not set(layouts) <= allowed:
        i = next(i for i, x in enumerate(layouts) if not (type(x) is str and x in allowed))
        raise BadRecord(f"{keys[i]!r} has an unknown location {layouts[i]!r}")
    if types_of(offsets) != {int} or min(offsets) < 0 or max(offsets) >= MAX_NBYTES:
        i = next(i for i, o in enumerate(offsets) if not is_count(o))
        raise BadRecord(f"{keys[i]!r} has a bad byte offset {offsets[i]!r}")
    own = [lay != "packed" for lay in layouts]
    in_blob = list(compress(paths, [not o for o in own]))
    if in_blob.count(None) != len(in_blob):
        i = next(i for i, p in enumerate(paths) if not own[i] and p is not None)
        raise BadRecord(f"{keys[i]!r} is packed but names a container path {paths[i]!r}")
    for i in compress(range(len(keys)), own):
        p = paths[i]
        if not isinstance(p, str) or not is_valid_container_path(p):
            raise BadRecord(f"{keys[i]!r} has an unsafe container path {p!r}")
        if offsets[i] and (container == "zarr"):
            raise BadRecord(
                f"{keys[i]!r} has byte offset {offsets[i]} in its Zarr chunk, expected 0"
            )
    if container == "zarr":
        _check_unique_paths(sorted(compress(paths, own)))


def _check_unique_paths(paths: list[str]) -> None:
    """No two values of a Zarr checkpoint share a directory, nor nest one in another's
    (``paths`` sorted)."""
    for a, b in pairwise(paths):
        if b == a or b.startswith(a + "/"):
            raise BadRecord(f"two values claim the container path {a!r}")
