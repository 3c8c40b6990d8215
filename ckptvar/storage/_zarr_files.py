"""The files of a ckptvar Zarr v3 checkpoint: JSON documents, writing, opening safely.

Owns: the ``zarr.json`` documents of groups and one-chunk arrays, where an array's
single chunk file is (:func:`chunk_key`), creating a file once (:func:`write_file`),
opening a path below the checkpoint one component at a time without following
symlinks (:func:`open_in`), reading the root ``zarr.json`` strictly
(:func:`read_root_meta`), and telling a checkpoint deleted under a reader apart
from damage (:func:`raise_if_deleted`).

>>> chunk_key(0), chunk_key(2)
('c', 'c.0.0')
>>> array_meta((3,), np.dtype("<f4"), {})["fill_value"]
0.0
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from . import rawio as _rawio
from ._record import FORMAT_VERSION, MAX_RECORD_NBYTES
from .paths import RESERVED_PREFIX

__all__ = [
    "GROUP_DOC",
    "O_DIR",
    "RECORD_PATH",
    "array_meta",
    "chunk_key",
    "fill_value",
    "open_in",
    "piece_key",
    "piece_rows",
    "raise_if_deleted",
    "read_root_meta",
    "root_record_ref",
    "write_file",
]

RECORD_PATH = f"{RESERVED_PREFIX}/record"
_MAX_JSON = 1 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def chunk_key(ndim: int) -> str:
    """The single chunk's file inside an array: ``c`` for 0-d, else ``c.0.0...``.

    The default chunk key encoding with the ``.`` separator keeps the chunk beside the
    array's ``zarr.json`` (no ``c/0/`` directories to create: one directory per array).
    """
    return ".".join(["c"] + ["0"] * ndim)


def fill_value(dt: np.dtype) -> Any:
    if dt.kind == "b":
        return False
    if dt.kind == "c":
        return [0.0, 0.0]
    if dt.kind == "f":
        return 0.0
    return 0


def piece_key(ndim: int, i: int) -> str:
    """The file of chunk ``i`` along the first axis of a value stored as several chunks
    (format 1.4): ``c.i.0...``.

    >>> piece_key(2, 3), piece_key(1, 0) == chunk_key(1)
    ('c.3.0', True)
    """
    return ".".join(["c", str(i)] + ["0"] * (ndim - 1))


def piece_rows(shape: tuple[int, ...], nbytes: int, piece_bytes: int, block_size: int) -> int | None:
    """Rows per chunk when a value of ``shape`` (``nbytes``) is stored as several chunks of
    about ``piece_bytes`` along its first axis, each a whole number of checksum blocks
    (``block_size``) so that a chunk's block checksums are its own; ``None``: one chunk
    (a value no larger than ``piece_bytes``, or one that would make one chunk anyway).

    >>> piece_rows((65536, 64), 65536 * 256, 4 << 20, 256 << 10)
    16384
    >>> piece_rows((1000, 64), 1000 * 256, 4 << 20, 256 << 10) is None
    True
    """
    if not shape or shape[0] < 2 or nbytes <= piece_bytes:
        return None
    row = nbytes // shape[0]
    unit = block_size // math.gcd(block_size, row)  # rows of a whole number of blocks
    rows = max(unit, piece_bytes // row // unit * unit)
    return rows if rows < shape[0] else None


def array_meta(shape: tuple[int, ...], dt: np.dtype, attributes: dict[str, Any],
               codecs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``zarr.json`` document of a one-chunk, uncompressed Zarr v3 array."""
    if codecs is None:
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if dt.itemsize == 1:
            codecs = [{"name": "bytes"}]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dt.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [max(1, d) for d in shape]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill_value(dt),
        "codecs": codecs,
        "attributes": attributes,
        "storage_transformers": [],
    }


GROUP_DOC = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def write_file(path: Path, data: Any, sync: list[Path] | None, *, replace: bool = False) -> None:
    mode = os.O_TRUNC if replace else os.O_EXCL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if callable(data):
            data(fd)
        elif isinstance(data, list):
            _rawio.pwritev_all(fd, data, 0)
        elif sync is not None and len(data) >= 1 << 20:  # durable: writeback starts now
            _rawio.pwrite_flushing(fd, memoryview(data), 0)
        elif len(data):
            _rawio.pwrite_pieces(fd, memoryview(data), 0)
    finally:
        os.close(fd)
    if sync is not None:
        sync.append(path)


def open_in(root_fd: int, rel: str, *, directory: bool = False) -> int:
    """Open ``rel`` under ``root_fd`` one component at a time, never following a symlink."""
    parts = rel.split("/")
    cur = root_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # a file opened without blocking: a named pipe there never waits for a writer
            flags = O_DIR if (not last or directory) else os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK
            nxt = os.open(part, flags | _O_NOFOLLOW, dir_fd=cur)
            if cur != root_fd:
                os.close(cur)
            cur = nxt
    except BaseException:
        if cur != root_fd:
            os.close(cur)
        raise
    return cur


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def read_root_meta(root_fd: int, path: Any) -> dict[str, Any] | None:
    """The root ``zarr.json`` as a dict, or None when there is none."""
    try:
        fd = open_in(root_fd, "zarr.json")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptCheckpointError(f"{str(path)!r}: cannot open zarr.json ({exc}).") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(f"{str(path)!r}: the root zarr.json is not a regular "
                                         "file (a named pipe or device?).")
        data = _rawio.pread_exact(fd, 0, min(os.fstat(fd).st_size, _MAX_JSON + 1),
                                  what="The root zarr.json", path=path)
    finally:
        os.close(fd)
    if len(data) > _MAX_JSON:
        raise CorruptCheckpointError(f"{str(path)!r}: the root zarr.json is larger than 1 MiB.")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{str(path)!r}: the root zarr.json is not valid JSON ({exc})."
        ) from None
    return doc if isinstance(doc, dict) else None


def raise_if_deleted(root_fd: int, path: Path) -> None:
    """Tell "the checkpoint was deleted (pruned) under us" apart from damage.

    A reader holds the directory open; when a manager prunes the checkpoint, the path
    vanishes or names another directory. That is a clean not-found, not corruption.
    """
    held = os.fstat(root_fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino) or not held.st_nlink:
        raise CheckpointNotFoundError(
            f"Checkpoint {str(path)!r} was deleted while it was being read "
            "(pruned by a CheckpointManager?)."
        )


def root_record_ref(doc: Any, where: str, *, not_ours: type[CkptError]) -> tuple[int, int]:
    """The root record's ``(nbytes, crc32c)`` that a root ``zarr.json`` document names.

    ``where`` names the checkpoint in messages. No ``ckptvar`` attribute raises
    ``not_ours``; a newer major format version, ``UnsupportedFormatError``; a damaged
    attribute, ``CorruptCheckpointError``.

    >>> root_record_ref({"attributes": {"ckptvar": {"record": RECORD_PATH,
    ...     "record_nbytes": 10, "record_crc32c": 7}}}, "x.zarr", not_ours=CkptError)
    (10, 7)
    """
    attrs = doc.get("attributes", {}) if isinstance(doc, dict) else {}
    info = attrs.get("ckptvar") if isinstance(attrs, dict) else None
    if not isinstance(info, dict):
        raise not_ours(
            f"{where!r} is not a ckptvar Zarr checkpoint (its root zarr.json has no "
            "'ckptvar' attribute)."
        )
    version = info.get("format_version")
    if (isinstance(version, list) and len(version) == 2 and type(version[0]) is int
            and version[0] > FORMAT_VERSION[0]):
        raise UnsupportedFormatError(
            f"Checkpoint {where!r} has format version {version[0]}.{version[1]}, newer "
            f"than the {FORMAT_VERSION[0]}.x this ckptvar reads; upgrade ckptvar to read it."
        )
    n, crc = info.get("record_nbytes"), info.get("record_crc32c")
    if (info.get("record") != RECORD_PATH or type(n) is not int or type(crc) is not int
            or not 0 <= n <= MAX_RECORD_NBYTES):
        raise CorruptCheckpointError(
            f"Checkpoint {where!r}: the root zarr.json's ckptvar attribute is damaged ({info!r})."
        )
    return n, crc
