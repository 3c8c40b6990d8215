"""Numbered checkpoint names: ``prefix-N.suffix``, built and parsed in this one place.

``Checkpoint.save``, ``Saver.save`` (with a ``global_step``) and
``CheckpointManager`` name their files ``<prefix>-<step><suffix>``
(``runs/ckpt-7.h5``, ``runs/ckpt-7.zarr``); this module splits a save prefix into
base, format and suffix, builds such names, and reads the step back.

>>> step_name("runs/ckpt", 7, ".h5")
'runs/ckpt-7.h5'
>>> parse_step_name("ckpt-7.h5")
StepName(prefix='ckpt', step=7, suffix='.h5')
>>> parse_step_name("ckpt-7.h5", prefix="other") is None
True
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import NamedTuple

from ..storage import backend_for, known_formats
from ._files import NATIVE_FORMATS, native_backend

__all__ = ["StepName", "checkpoint_suffixes", "parse_step_name", "split_format", "step_name"]


class StepName(NamedTuple):
    """A parsed ``prefix-N.suffix`` file name."""

    prefix: str
    step: int
    suffix: str


def checkpoint_suffixes() -> tuple[str, ...]:
    """The suffix each checkpoint format writes (``.h5``, ``.zarr``)."""
    formats = known_formats()
    return tuple(formats[f][0] for f in NATIVE_FORMATS if f in formats)


def step_name(prefix: str, step: int, suffix: str) -> str:
    """``prefix-step`` + ``suffix``."""
    return f"{prefix}-{int(step)}{suffix}"


def parse_step_name(
    name: str, *, prefix: str | None = None, suffixes: Iterable[str] | None = None
) -> StepName | None:
    """Read ``name`` (a file name, no directory) as ``prefix-N.suffix``; ``None`` if it is not.

    ``prefix`` requires that prefix; ``suffixes`` are the accepted suffixes
    (default: :func:`checkpoint_suffixes`).
    """
    sufs = tuple(checkpoint_suffixes() if suffixes is None else suffixes)
    if not sufs:
        return None
    head = re.escape(prefix) if prefix is not None else r"[^/]+"
    alts = "|".join(re.escape(s) for s in sorted(sufs, key=len, reverse=True))
    m = re.fullmatch(rf"(?P<prefix>{head})-(?P<step>\d+)(?P<suffix>{alts})", name)
    if m is None:
        return None
    return StepName(m["prefix"], int(m["step"]), m["suffix"])


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
