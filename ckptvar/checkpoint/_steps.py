"""Numbered checkpoint names: ``prefix-N.suffix`` with the checkpoint formats' suffixes.

``Checkpoint.save``, ``Saver.save`` (with a ``global_step``) and
``CheckpointManager`` name their files ``<prefix>-<step><suffix>``
(``runs/ckpt-7.h5``, ``runs/ckpt-7.zarr``) by the one step-name grammar of
``locations``; this module splits a save prefix into base, format and
suffix, and reads steps back with the checkpoint formats' suffixes.

>>> step_name("runs/ckpt", 7, ".h5")
'runs/ckpt-7.h5'
>>> parse_step_name("ckpt-7.h5")
StepName(prefix='ckpt', step=7, suffix='.h5')
>>> parse_step_name("ckpt-7.h5", prefix="other") is None
True
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..locations import StepName, step_name
from ..locations import parse_step_name as parse_name
from ..storage import backend_for, known_formats
from ._files import NATIVE_FORMATS, native_backend

__all__ = ["StepName", "checkpoint_suffixes", "parse_step_name", "split_format", "step_name"]


def checkpoint_suffixes() -> tuple[str, ...]:
    """The suffix each checkpoint format writes (``.h5``, ``.zarr``)."""
    formats = known_formats()
    return tuple(formats[f][0] for f in NATIVE_FORMATS if f in formats)


def parse_step_name(
    name: str, *, prefix: str | None = None, suffixes: Iterable[str] | None = None
) -> StepName | None:
    """Read ``name`` (a file name, no directory) as ``prefix-N.suffix``; ``None`` if it is not.

    The grammar is :func:`ckptvar.locations.parse_step_name`'s; ``suffixes``
    defaults to the checkpoint formats' (:func:`checkpoint_suffixes`).
    """
    sufs = tuple(checkpoint_suffixes() if suffixes is None else suffixes)
    if not sufs:
        return None
    return parse_name(name, prefix=prefix, suffixes=sufs)


def split_format(prefix: str | os.PathLike[str], format: str | None) -> tuple[str, str, str]:
    """``(prefix without a known suffix, format name, suffix)`` for a save prefix."""
    prefix = os.fspath(prefix)
    formats = known_formats()
    found = None
    for name, suffixes in formats.items():
        for suffix in suffixes:
            if prefix.lower().endswith(suffix) and (found is None or len(suffix) > len(found[1])):
                found = (name, suffix)
    if found is not None:
        prefix = prefix[: -len(found[1])]
    if format is not None:
        cls = native_backend(prefix + ".x", format)
        return prefix, cls.name, cls.suffixes[0]
    if found is not None:
        cls = backend_for(prefix + found[1], found[0], mode="w")
        return prefix, cls.name, found[1]
    cls = backend_for(prefix, "h5", mode="w")
    return prefix, cls.name, cls.suffixes[0]
