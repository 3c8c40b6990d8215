"""Key -> container path escaping, shared by the HDF5 and Zarr backends.

A key is a ``/``-separated path (``model/dense/kernel``). Each segment becomes a
container name that is safe as an HDF5 link name, a Zarr v3 node name and a
directory name on every common file system:

- bytes of the UTF-8 encoding outside ``[A-Za-z0-9_.-]`` become ``%XX``
  (uppercase hex), ``%`` itself included;
- a leading ``.`` becomes ``%2E`` (so ``.``, ``..``, ``.zattrs`` are harmless) and a
  leading ``_`` becomes ``%5F`` (so no user key reaches ``_ckptvar/`` or the
  ``__`` names Zarr v3 reserves);
- the name ``zarr.json`` becomes ``zarr%2Ejson``;
- an empty segment becomes ``%z``;
- a segment longer than 200 bytes keeps its first 180 bytes and ends in
  ``%h`` + 16 hex digits of its SHA-256;
- a path that would clash with another one (equal ignoring ASCII case, or a
  value whose path is another value's group) gets ``%t1``, ``%t2``, ... on its
  last segment.

The markers ``%z``, ``%h`` and ``%t`` can never come out of the ``%XX`` encoding,
so escaping is injective. Readers never re-derive paths: the root record maps
each key to its exact container path.

>>> escape_segment("kernel"), escape_segment("a/b"), escape_segment(".."), escape_segment("")
('kernel', 'a%2Fb', '%2E.', '%z')
>>> container_paths(["model/dense/kernel", "_ckptvar", "x/../y", "A", "a"])
['model/dense/kernel', '%5Fckptvar', 'x/%2E./y', 'A', 'a%t1']
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "MAX_SEGMENT",
    "RESERVED_PREFIX",
    "container_paths",
    "escape_key",
    "escape_segment",
    "is_valid_container_path",
]

#: Longest escaped segment kept as is, in bytes.
MAX_SEGMENT = 200
_KEEP = 180
#: The container group that holds ckptvar's own objects (no escaped key starts with ``_``).
RESERVED_PREFIX = "_ckptvar"
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_TABLE = [chr(b) if b in _SAFE else f"%{b:02X}" for b in range(256)]
_RESERVED_NAMES = {"zarr.json": "zarr%2Ejson"}
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9%-][A-Za-z0-9_.%-]{0,254}$")


def escape_segment(segment: str) -> str:
    """Escape one key segment (see the module docstring)."""
    if segment == "":
        return "%z"
    try:
        raw = segment.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"Key segment {segment!r} is not valid Unicode text.") from None
    out = "".join([_TABLE[b] for b in raw])
    if out[0] == ".":
        out = "%2E" + out[1:]
    elif out[0] == "_":
        out = "%5F" + out[1:]
    out = _RESERVED_NAMES.get(out, out)
    if len(out) > MAX_SEGMENT:
        cut = out[:_KEEP]
        pct = cut.rfind("%", len(cut) - 2)  # never cut a %XX in half
        if pct != -1:
            cut = cut[:pct]
        out = cut + "%h" + hashlib.sha256(raw).hexdigest()[:16]
    return out


def escape_key(key: str) -> str:
    """Escape every segment of ``key``; the result has the same number of segments."""
    return "/".join([escape_segment(s) for s in key.split("/")])


def container_paths(keys: Sequence[str], reserved: Iterable[str] = ()) -> list[str]:
    """Unique, clash-free container paths for ``keys`` (in the same order).

    Two paths clash when they are equal ignoring ASCII case (case-insensitive file
    systems) or when one value's path is a group on another value's path. The
    later key gets a ``%tN`` suffix on its last segment.
    """
    paths = [escape_key(k) for k in keys]
    taken: set[str] = {p.lower() for p in reserved}
    groups: set[str] = set()
    for p in paths:
        parts = p.lower().split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    out: list[str] = []
    for p in paths:
        candidate = p
        n = 0
        while candidate.lower() in taken or candidate.lower() in groups:
            n += 1
            candidate = f"{p}%t{n}"
        taken.add(candidate.lower())
        out.append(candidate)
    return out


def is_valid_container_path(path: str) -> bool:
    """True for a path a ckptvar writer can produce (used to vet paths read from files)."""
    if not isinstance(path, str) or not path or len(path) > 65536:
        return False
    segments = path.split("/")
    if segments[0] == RESERVED_PREFIX:
        segments = segments[1:]
        if not segments:
            return False
    return all(_SEGMENT_RE.match(s) and s != "zarr.json" for s in segments)
