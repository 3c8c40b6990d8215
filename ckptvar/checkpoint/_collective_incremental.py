"""Incremental multi-process saves: whether a base step's layout lets a new step reuse it.

A multi-process step (:mod:`._collective`) reuses its base step's bytes per process: each
rank's own file ``rank-NNNNN.<suffix>`` takes the base's file of the same rank as its
base (HDF5 external links ``../<base step>/rank-NNNNN.h5``, on disk and on an object
store alike; hard-linked Zarr chunk files, server-side copies on an object store), and
each chunk of a global Zarr array is hard-linked by its writer from the
base's chunk file when unchanged. That is exact only when the base was written with the
same layout: the same number of processes and, for every value in both, the same boxes
with the same writers and the same grid. :func:`check_base` (rank 0) says why not;
the step is then written whole and the reason logged (docs/checkpoints.md,
"Incremental checkpoints"). A changed ``cv.Variable`` that a rank writes into its own
file, with the rows written since the base known (:func:`stored_rows`), may be stored
there as a row delta on the same rank's file in the base step, by the one-process rule
(docs/FORMAT.md, "Row deltas").

>>> check_base(None, bytes, "h5", 2, b"\\x80")
'there is no earlier step'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack

from ..storage import INDEX_FILE
from ..storage.links import inside
from ..storage.rawio import NotRegularFile, read_regular

__all__ = ["check_base", "read_sums", "stored_known", "stored_rows"]

logger = logging.getLogger("ckptvar")

#: A base index larger than this is not read to decide (the step is written whole).
_MAX_INDEX = 1 << 30


def _decode(raw: bytes) -> dict[str, Any]:
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if not isinstance(doc, dict) or not isinstance(doc.get("variables"), dict):
        raise ValueError("its index is malformed")
    return doc


def _index(base: Path) -> dict[str, Any]:
    try:  # a named pipe or device there: refused at once (a ValueError), never waited on
        return _decode(read_regular(inside(base, base / INDEX_FILE, "The step index"),
                                    _MAX_INDEX))
    except NotRegularFile as exc:
        raise ValueError(f"its index cannot be read: {exc}") from None


def check_base(base: str | None, index: Callable[[str], bytes], fmt: str, size: int,
               variables: bytes) -> str | None:
    """Why the multi-process step ``base`` (its path or URL; ``index(base)`` reads its
    index) cannot be the base of a step of ``size`` processes whose index ``variables``
    map (msgpack-packed) is given; ``None``: it can.
    """
    if base is None:
        return "there is no earlier step"
    name = base.rstrip("/").rpartition("/")[2]
    try:
        doc = _decode(index(base))
        new = msgpack.unpackb(variables, raw=False, strict_map_key=False)
    except FileNotFoundError:
        return f"the earlier step {name} is not a multi-process step"
    except (OSError, ValueError) as exc:  # CkptError subclasses one of them
        return f"the earlier step {name} cannot be read ({exc})"
    if doc.get("container") != fmt:
        return f"the earlier step {name} is {doc.get('container')!r}, not {fmt!r}"
    if doc.get("processes") != size:
        was = doc.get("processes")
        return (f"the earlier step {name} was written by {was} "
                f"process{'' if was == 1 else 'es'}, this one by {size}")
    return _layout_differs(doc["variables"], new, name)


def _layout_differs(old: dict[str, Any], new: dict[str, Any], name: str) -> str | None:
    """How a value in both index ``variables`` maps is laid out otherwise; ``None``: none."""
    for key, rec in new.items():
        was = old.get(key)
        if not isinstance(was, dict):
            continue  # a new value: written
        for part in ("shape", "dtype", "boxes", "grid"):
            if was.get(part) != rec.get(part):
                return f"the layout of {key!r} ({part}) differs from the earlier step {name}'s"
    return None


def read_sums(base: Path) -> dict[str, list[int]]:
    """The checksums of the base step's global Zarr arrays' chunks, per key."""
    sums = _index(base).get("checksums") or {}
    return {str(k): [int(c) for c in v] for k, v in sums.items()}


def stored_known(known: Mapping[str, bool],
                 mine: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, bool]:
    """``known`` (by logical key) for the keys a rank stores its boxes under in its file.

    >>> stored_known({"w": True}, [("w", "w/.box/1", (4, 0)), ("b", "b/.box/0", (0,))])
    {'w/.box/1': True}
    """
    return {stored: known[key] for key, stored, _ in mine if key in known}


def stored_rows(rows: Mapping[str, Any],
                mine: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, Any]:
    """The rows written since the base (by logical key: a changed ``cv.Variable``'s, which
    is this rank's whole box of it, or a partitioned variable's, held whole) for the keys a
    rank stores its boxes under in its file; a key this rank writes several boxes of has no
    rows (its boxes are not one variable).

    >>> stored_rows({"w": [3]}, [("w", "w/.box/1", (4, 0)), ("b", "b/.box/0", (0,))])
    {'w/.box/1': [3]}
    """
    count: dict[str, int] = {}
    for key, _, _ in mine:
        count[key] = count.get(key, 0) + 1
    return {stored: rows[key] for key, stored, _ in mine if key in rows and count[key] == 1}
