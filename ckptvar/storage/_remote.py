"""Checkpoints at object-store URLs: open a committed one lazily, save one as a committed step.

A URL names a step below its parent location (``s3://b/run/ckpt-3.h5``: step
``ckpt-3.h5`` of ``s3://b/run``). :func:`open_remote_reader` reads only committed
steps (its marker says where the data is) through the same container readers as
local files, over a :class:`._container.source.RemoteFile`; :func:`save_remote`
writes the checkpoint to a local temporary first, then streams it up
(data, then the root record, then the commit marker). A Zarr checkpoint is uploaded
at the step's own key (a plain Zarr group at its URL) under a create-only claim
``<step>.claim``; an HDF5 file under its writer's own key ``<step>.<writer>.data``,
which the marker names. Either way, of two writers racing for one step exactly
one commits, and the committed step holds only its bytes.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError, CheckpointNotFoundError, UnsupportedFormatError
from ._container.source import RemoteFile
from ._h5 import H5Reader
from ._zarr_remote import RemoteZarrReader
from .base import Reader
from .location import commit, read_commit, split_url, upload_step

__all__ = ["open_remote_reader", "remote_format", "save_remote"]

_SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".zarr": "zarr"}


def remote_format(name: str, format: str | None) -> str | None:
    """``"h5"``/``"zarr"`` from ``format`` or the name's suffix; None when neither says."""
    if format is not None:
        fmt = format.lower().lstrip(".")
        fmt = "h5" if fmt == "hdf5" else fmt
        if fmt not in ("h5", "zarr"):
            raise UnsupportedFormatError(
                f"Format {format!r} cannot be used on an object store; ckptvar's own h5 and "
                "zarr checkpoints can."
            )
        return fmt
    return _SUFFIXES.get(Path(name).suffix.lower())


def open_remote_reader(
    url: str, format: str | None = None, storage_options: Mapping[str, Any] | None = None
) -> Reader:
    """A lazy reader of the committed checkpoint at ``url``."""
    parent, name = split_url(url, storage_options=storage_options)
    record = read_commit(parent, name)
    if record is None:
        raise CheckpointNotFoundError(
            f"No committed checkpoint at {url!r}: there is no commit marker {url}.commit "
            "(a save that failed or is still running is never read)."
        )
    fmt = remote_format(name, format)
    if fmt is None:
        fmt = "h5" if parent.exists(record.data) else "zarr"
    if fmt == "h5":
        source = RemoteFile(parent, record.data, parent.size(record.data))
        return H5Reader(parent.join(name), source=source)
    return RemoteZarrReader(parent.join(name), parent, record.data)


def _upload_claimed(parent: Any, local: Path, name: str) -> None:
    """Upload a directory at the step's own key under a create-only claim ``<step>.claim``:
    of two writers racing for the step, the second stops before writing any byte."""
    claim = f"{name}.claim"
    try:
        parent.put(claim, uuid.uuid4().hex.encode(), create_only=True)
    except CheckpointExistsError:
        raise CheckpointExistsError(
            f"step {parent.join(name)} is being written by another writer (claim "
            f"{parent.join(claim)}); if no writer is running, delete the claim and save again"
        ) from None
    try:
        upload_step(parent, local, name)
    finally:
        parent.delete(claim)


def save_remote(
    url: str,
    write_local: Callable[[Path], Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write a checkpoint with ``write_local(tmp_path)``, upload and commit it at ``url``.

    Returns the URL. ``CheckpointExistsError`` names the step if it is committed already
    (before anything is written, and again by the create-only marker).
    """
    parent, name = split_url(url, storage_options=storage_options)
    if read_commit(parent, name) is not None:
        raise CheckpointExistsError(
            f"step {parent.join(name)} is already committed; a step is written once: save "
            "under a new step, or prune this one first"
        )
    with tempfile.TemporaryDirectory(prefix="ckptvar-upload-") as tmp:
        local = Path(tmp) / name
        write_local(local)
        if local.is_dir():  # Zarr: a plain Zarr group at the step's own URL
            _upload_claimed(parent, local, name)
            return parent.join(name)
        # One file: uploaded under this writer's own key, which the marker names, so that
        # of two writers racing for the step the committed one holds only the winner's bytes.
        writer = uuid.uuid4().hex
        data = f"{name}.{writer[:12]}.data"
        crc = parent.upload_file(str(local), data)
        try:
            commit(parent, name, f"crc32c:{crc:08x}", data=data, writer=writer)
        except BaseException:
            parent.delete(data)
            raise
    return parent.join(name)
