"""A checkpoint's file on disk: which formats hold one, writing it, retiring it.

:func:`write_file` writes one checkpoint atomically (temporary sibling, fsync,
rename); :func:`discard` removes one without ever leaving it half-deleted. Used
by ``Checkpoint``, ``Saver`` and ``CheckpointManager`` alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import UnsupportedFormatError
from ..storage import backend_for
from ..storage._atomic import partial_path, remove_path

__all__ = ["NATIVE_FORMATS", "discard", "native_backend", "write_file"]

#: The formats that keep everything a checkpoint holds (attributes, object graph, state).
NATIVE_FORMATS = ("h5", "zarr")


def native_backend(path: str | os.PathLike[str], format: str | None) -> Any:
    """The writer backend for ``path``; only the native formats can hold a checkpoint."""
    backend = backend_for(path, format, mode="w")
    if backend.name not in NATIVE_FORMATS:
        raise UnsupportedFormatError(
            f"Cannot write a checkpoint to {os.fspath(path)!r} in the {backend.name} format: "
            f"checkpoints are written as {' or '.join(NATIVE_FORMATS)} "
            "(cv.save writes plain arrays to other formats)."
        )
    return backend


def write_file(
    path: str | Path,
    format: str | None,
    arrays: list[tuple[str, Any, dict[str, Any]]],
    meta: dict[str, Any],
) -> str:
    """Write one checkpoint atomically (temporary sibling, fsync, rename); returns its path."""
    path = Path(path)
    backend = native_backend(path, format)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    writer = backend.open_writer(path, durable=True)
    try:
        for key, array, attrs in arrays:
            writer.add(key, array, attrs)
        writer.set_metadata(meta)
        return os.fspath(writer.commit())
    except BaseException:
        writer.abort()
        raise


def discard(path: Path) -> None:
    """Delete a checkpoint file or directory without ever leaving it half-deleted.

    It is first renamed to a temporary name (atomic), so a crash during the
    deletion of a directory leaves a recognisable temporary, not a damaged checkpoint.
    """
    tmp = partial_path(path)
    try:
        os.rename(path, tmp)
    except FileNotFoundError:
        return
    remove_path(tmp)
