"""Layout rules both containers of ckptvar's own format (HDF5, Zarr v3) follow.

Owns: where the packed blob lives and how its values are aligned, which dtypes
are stored as themselves (the others as unsigned bits of the same width), where
a value's bytes are (:class:`Source`), and the one check that byte ranges read
from a file neither overlap nor end past it (:func:`check_regions`).

>>> storage_dtype("bfloat16").str, storage_dtype("float32").str
('<u2', '<f4')
>>> check_regions([(0, 4, "a"), (8, 4, "b")], "f.h5", 12)
>>> check_regions([(0, 4, "a"), (2, 4, "b")], "f.h5", 12)
Traceback (most recent call last):
...
ckptvar.errors.CorruptCheckpointError: Checkpoint 'f.h5': b overlaps a (bytes 2..4); ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..._dtypes import SUPPORTED_DTYPES
from ...errors import CorruptCheckpointError
from ..paths import RESERVED_PREFIX

__all__ = [
    "ALIGN",
    "DEFAULT_PACK_THRESHOLD",
    "PACKED_PATH",
    "PLAIN_DTYPES",
    "PLAIN_MAX_VALUES",
    "Source",
    "ValueRanges",
    "check_regions",
    "pack_limit",
    "storage_dtype",
]

#: Values smaller than this many bytes are packed together into ``_ckptvar/packed``
#: (by default only in a checkpoint of more than ``PLAIN_MAX_VALUES`` values).
DEFAULT_PACK_THRESHOLD = 64 << 10
#: With the default ``pack_threshold`` (None), a checkpoint of at most this many values
#: stores every value as its own array, visible by its key to plain h5py/h5ls and zarr.
PLAIN_MAX_VALUES = 2048
#: Alignment of each packed value inside the packed blob.
ALIGN = 64
#: Container path of the packed blob.
PACKED_PATH = f"{RESERVED_PREFIX}/packed"
#: Dtypes stored as themselves; the others (bfloat16, float8, int4, ...) as unsigned bits.
PLAIN_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})


def pack_limit(pack_threshold: int | None, count: int) -> int:
    """The size in bytes under which a value is packed, in a checkpoint of ``count`` values.

    An explicit ``pack_threshold`` applies as given (0: nothing is packed); the default
    (None) packs nothing in a checkpoint of at most ``PLAIN_MAX_VALUES`` values and the
    values under ``DEFAULT_PACK_THRESHOLD`` bytes in a larger one.

    >>> pack_limit(None, 41), pack_limit(None, 20_000), pack_limit(0, 20_000), pack_limit(8, 3)
    (0, 65536, 0, 8)
    """
    if pack_threshold is not None:
        return int(pack_threshold)
    return DEFAULT_PACK_THRESHOLD if count > PLAIN_MAX_VALUES else 0


def storage_dtype(name: str) -> np.dtype:
    """The little-endian dtype a container declares for values of dtype ``name``."""
    dt = SUPPORTED_DTYPES[name]
    if name not in PLAIN_DTYPES:
        return np.dtype(f"<u{dt.itemsize}")
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


class Source(NamedTuple):
    """Where a value's bytes are: a descriptor (or a remote byte source,
    :class:`.source.RemoteFile`), the byte offset, and whether the caller closes it when
    done (a Zarr chunk file) or not (the reader's own file)."""

    fd: Any
    offset: int
    owned: bool


@dataclass(frozen=True, slots=True)
class ValueRanges:
    """The byte ranges of many values at once: ``keys[i]`` holds ``sizes[i]`` bytes from
    ``starts[i]``."""

    starts: np.ndarray
    sizes: np.ndarray
    keys: Sequence[str]


def check_regions(
    regions: Sequence[tuple[int, int, str]],
    path: Any,
    size: int | None,
    values: ValueRanges | None = None,
) -> None:
    """Refuse byte ranges that overlap each other or end past ``size`` (None: unknown).

    ``regions`` are ``(start, nbytes, what)``; the values' ranges may come in bulk
    (one sort over all of them). Empty ranges are ignored.
    """
    labels = [w for _, _, w in regions]
    all_starts = np.array([r[0] for r in regions], np.int64)
    all_sizes = np.array([r[1] for r in regions], np.int64)
    keys: Sequence[str] = ()
    if values is not None:
        all_starts = np.concatenate([all_starts, values.starts.astype(np.int64, copy=False)])
        all_sizes = np.concatenate([all_sizes, values.sizes.astype(np.int64, copy=False)])
        keys = values.keys
    keep = np.flatnonzero(all_sizes > 0)
    order = keep[np.argsort(all_starts[keep], kind="stable")]
    s, e = all_starts[order], all_starts[order] + all_sizes[order]

    def what(i: int) -> str:
        return labels[i] if i < len(labels) else f"value {keys[i - len(labels)]!r}"

    bad = np.flatnonzero(s[1:] < np.maximum.accumulate(e)[:-1])
    if bad.size:
        j = int(bad[0]) + 1
        prev = int(order[int(np.argmax(e[:j]))])
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: {what(int(order[j]))} overlaps {what(prev)} (bytes "
            f"{int(s[j])}..{int(e[:j].max())}); the file is damaged or hostile."
        )
    past = np.flatnonzero(e > size) if size is not None else np.zeros(0, np.intp)
    if past.size:
        j = int(past[0])
        raise CorruptCheckpointError(
            f"Checkpoint {str(path)!r}: {what(int(order[j]))} ends at byte {int(e[j])}, past the "
            f"end of the file ({size} bytes); the file is truncated."
        )
