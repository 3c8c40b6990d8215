"""Boxes of a logical variable: what part of a larger variable one variable holds.

Owns :class:`Shard` (a multi-process variable's box: ``Variable(..., shard=Shard(...))``),
:class:`SaveSliceInfo` (a TF1 partition's place in its partitioned variable) and
:class:`LogicalBox`, the one answer every variable gives to "which logical variable, what
full shape, which box ``(offset, shape)`` do you hold?" (``Variable.logical_box``).

>>> s = Shard(full_shape=(1000, 64), offset=(250, 0))
>>> check_shard(s, (250, 64), "w").shape
(250, 64)
>>> SaveSliceInfo("emb/table", (1000, 64), (250, 0), (250, 64)).spec
'1000 64 250,250:0,64'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._dims import as_dims
from ._shapes import Shape, VariableArgumentError, defined_dims, fully_defined

__all__ = ["LogicalBox", "SaveSliceInfo", "Shard", "check_shard"]


def _dims(value: Any, what: str) -> tuple[int, ...]:
    return as_dims(value, what, VariableArgumentError)


@dataclass(frozen=True)
class Shard:
    """The box of a logical variable that one process holds.

    ``full_shape`` is the logical variable's shape, ``offset`` where this box starts in
    it; the box's shape is the variable's own (set when the variable is made: ``shape``).
    """

    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", _dims(self.full_shape, "Shard full_shape"))
        object.__setattr__(self, "offset", _dims(self.offset, "Shard offset"))
        if len(self.offset) != len(self.full_shape):
            raise VariableArgumentError(
                f"Shard offset {self.offset} has {len(self.offset)} dimensions; full_shape "
                f"{self.full_shape} has {len(self.full_shape)}."
            )
        if self.shape is not None:
            object.__setattr__(self, "shape", _dims(self.shape, "Shard shape"))


def check_shard(shard: Any, shape: Shape, name: str) -> Shard:
    """``shard`` with its box shape set to ``shape``, after checking that the box fits."""
    if not isinstance(shard, Shard):
        raise VariableArgumentError(
            f"shard= for variable {name!r} is a cv.Shard(full_shape, offset), not {shard!r}."
        )
    if not fully_defined(shape):
        raise VariableArgumentError(
            f"Variable {name!r} holds a shard, so its shape must be fully defined; got "
            f"{shape}."
        )
    box = defined_dims(shape)
    if len(box) != len(shard.full_shape):
        raise VariableArgumentError(
            f"Variable {name!r} has shape {box} ({len(box)} dimensions) but its shard's "
            f"full_shape {shard.full_shape} has {len(shard.full_shape)}."
        )
    if shard.shape is not None and shard.shape != box:
        raise VariableArgumentError(
            f"Variable {name!r} has shape {box}, but its shard says {shard.shape}."
        )
    for axis, (off, size, full) in enumerate(zip(shard.offset, box, shard.full_shape,
                                                 strict=True)):
        if off + size > full:
            raise VariableArgumentError(
                f"The shard of variable {name!r} does not fit: along axis {axis} it covers "
                f"[{off}, {off + size}) but full_shape is {shard.full_shape} (offset "
                f"{shard.offset}, shape {box})."
            )
    return Shard(shard.full_shape, shard.offset, box)


@dataclass(frozen=True)
class SaveSliceInfo:
    """Where a partition sits in its partitioned variable (TensorFlow's ``SaveSliceInfo``)."""

    full_name: str
    full_shape: tuple[int, ...]
    var_offset: tuple[int, ...]
    var_shape: tuple[int, ...]

    @property
    def spec(self) -> str:
        """TensorFlow's slice spec string: ``"1000 64 250,250:0,64"``."""
        full = " ".join(str(d) for d in self.full_shape)
        box = ":".join(f"{o},{s}" for o, s in zip(self.var_offset, self.var_shape, strict=True))
        return f"{full} {box}"


@dataclass(frozen=True)
class LogicalBox:
    """What a variable holds: the box ``offset``/``shape`` of the logical variable ``name``
    of shape ``full_shape``. ``sliced`` is False for a variable that is its whole self."""

    name: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    sliced: bool
