"""Checkpoint formats behind one interface, and the registry that picks one for a path.

Besides the interface (:mod:`.base`) and the registry, two helpers the layers
above use while saving and restoring: :func:`paused_gc` (no cyclic garbage
collection while many small objects are made) and :func:`snapshot` (copies of
arrays, large ones in parallel pieces; :func:`snapshot_pieces` and :func:`copy_pieces`
are its two halves, for a caller that copies the same arrays again). For the checkpoint layer it also names the
crash-safe file helpers (``partial_path``, ``is_partial``, ``remove_path``,
``fsync_dir``, ``fsync_path``), the remote-URL entry points (``open_remote_reader``,
``save_remote``, ``remote_format``) and the sharded layout (``ShardedReader``,
``INDEX_FILE``, ``rank_file``, ``box_key``, ``pack_index``, ``grid_layout``, and
``RemoteStep``: the object-store side of a multi-process save), and for incremental
steps ``external_files`` (the files an HDF5 step's values are in), ``GridReuse``
(what a process's global Zarr chunks take from the base step), ``DeltaLimits``
(the row delta rule's limits, which a save hands its writers) and ``BaseFileLost``
(a file of the base step gone: the step is not built on it).

>>> from ckptvar.storage import known_formats
>>> "h5" in known_formats() and "zarr" in known_formats()
True
"""

from __future__ import annotations

from ._container.delta import DeltaLimits
from ._container.reuse import BaseFileLost
from ._gc import paused_gc
from .atomic import fsync_dir, fsync_path, is_partial, partial_path, remove_path
from .base import (
    ArrayInfo,
    Backend,
    LazyArray,
    Reader,
    SupportsDeltas,
    SupportsReadIntoMany,
    SupportsRuns,
    SupportsShapeAndDtype,
    SupportsShared,
    SupportsStageIntoMany,
    SupportsStoredBoxes,
    SupportsVerifyAll,
    SupportsVerifyMany,
    Writer,
)
from .chunked import Chunked, as_host, is_chunked, materialize
from .rawio import copy_pieces, snapshot, snapshot_pieces
from .registry import (
    backend_for,
    is_own_checkpoint,
    known_formats,
    register_backend,
    writable_formats,
)

# isort: split
# The built-in backends register themselves on import, so after the registry exists.
from . import _h5, _sharded, _zarr  # noqa: F401

# isort: split
# Then other tools' formats (ckptvar.formats), after ckptvar's own.
from .. import formats  # noqa: F401
from ._h5 import external_files
from ._remote import (
    open_remote_reader,
    remote_external_files,
    remote_format,
    save_remote,
    save_remote_h5_incremental,
    save_remote_incremental,
)
from ._sharded import INDEX_FILE, ShardedReader, box_key, pack_index, rank_file
from ._sharded_remote import RemoteStep
from ._sharded_zarr import GridReuse, grid_layout

__all__ = [
    "INDEX_FILE",
    "ArrayInfo",
    "Backend",
    "BaseFileLost",
    "Chunked",
    "DeltaLimits",
    "GridReuse",
    "LazyArray",
    "Reader",
    "RemoteStep",
    "ShardedReader",
    "SupportsDeltas",
    "SupportsReadIntoMany",
    "SupportsRuns",
    "SupportsShapeAndDtype",
    "SupportsShared",
    "SupportsStageIntoMany",
    "SupportsStoredBoxes",
    "SupportsVerifyAll",
    "SupportsVerifyMany",
    "Writer",
    "as_host",
    "backend_for",
    "box_key",
    "copy_pieces",
    "external_files",
    "fsync_dir",
    "fsync_path",
    "grid_layout",
    "is_chunked",
    "is_own_checkpoint",
    "is_partial",
    "known_formats",
    "materialize",
    "open_remote_reader",
    "pack_index",
    "partial_path",
    "paused_gc",
    "rank_file",
    "register_backend",
    "remote_external_files",
    "remote_format",
    "remove_path",
    "save_remote",
    "save_remote_h5_incremental",
    "save_remote_incremental",
    "snapshot",
    "snapshot_pieces",
    "writable_formats",
]
