"""Checkpoint formats behind one interface, and the registry that picks one for a path.

Besides the interface (:mod:`.base`) and the registry, two helpers the layers
above use while saving and restoring: :func:`paused_gc` (no cyclic garbage
collection while many small objects are made) and :func:`snapshot` (copies of
arrays, large ones in parallel pieces).

>>> from ckptvar.storage import known_formats
>>> "h5" in known_formats() and "zarr" in known_formats()
True
"""

from __future__ import annotations

from ._gc import paused_gc
from ._rawio import snapshot
from .base import (
    ArrayInfo,
    Backend,
    LazyArray,
    Reader,
    SupportsReadIntoMany,
    SupportsShapeAndDtype,
    SupportsVerifyAll,
    SupportsVerifyMany,
    Writer,
)
from .registry import backend_for, known_formats, register_backend

# isort: split
# The built-in backends register themselves on import, so after the registry exists.
from . import _h5, _sharded, _zarr, formats  # noqa: F401

__all__ = [
    "ArrayInfo",
    "Backend",
    "LazyArray",
    "Reader",
    "SupportsReadIntoMany",
    "SupportsShapeAndDtype",
    "SupportsVerifyAll",
    "SupportsVerifyMany",
    "Writer",
    "backend_for",
    "known_formats",
    "paused_gc",
    "register_backend",
    "snapshot",
]
