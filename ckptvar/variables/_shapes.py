"""Shape locks: normalising ``shape=`` arguments and checking values against a lock.

A shape lock is ``None`` (every dimension free) or a tuple whose ``None`` entries free one
dimension. Also owns :class:`VariableArgumentError`, raised for arguments that do not
describe a variable.

>>> normalize_shape(3), normalize_shape([2, None])
((3,), (2, None))
>>> compatible((2, None), (2, 5)), compatible((2, None), (3, 5)), shape_str(None)
(True, False, '<unknown>')
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..errors import CkptError

__all__ = [
    "Shape",
    "VariableArgumentError",
    "compatible",
    "defined_dims",
    "fully_defined",
    "normalize_shape",
    "shape_str",
]

Shape = tuple[int | None, ...] | None


class VariableArgumentError(CkptError, ValueError):
    """The arguments given to ``Variable`` or ``get_variable`` do not describe a variable."""


def shape_str(shape: Shape) -> str:
    """``(2, 3)``, ``(2, None)`` or ``<unknown>``."""
    if shape is None:
        return "<unknown>"
    return str(tuple(shape))


def compatible(lock: Shape, shape: tuple[int, ...]) -> bool:
    """Whether a value of ``shape`` fits the lock ``lock``."""
    if lock is None:
        return True
    return len(lock) == len(shape) and all(
        a is None or a == b for a, b in zip(lock, shape, strict=True)
    )


def normalize_shape(shape: Any) -> Shape:
    """``shape`` as a tuple of ints and ``None``; :class:`VariableArgumentError` otherwise."""
    if shape is None:
        return None
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    try:  # operator.index: 2.5 or "3" is refused, never truncated or parsed
        dims = tuple(None if d is None else operator.index(d) for d in shape)
    except TypeError:
        raise VariableArgumentError(
            f"A shape is a tuple of ints (or None), not {shape!r}."
        ) from None
    if any(d is not None and d < 0 for d in dims):
        raise VariableArgumentError(f"Negative dimension in shape {dims}.")
    return dims


def fully_defined(shape: Shape) -> bool:
    """Whether ``shape`` is known in every dimension."""
    return shape is not None and all(d is not None for d in shape)


def defined_dims(shape: Shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints; it must be fully defined (the caller checked)."""
    if shape is None or any(d is None for d in shape):
        raise VariableArgumentError(f"Shape {shape_str(shape)} is not fully defined.")
    return tuple(int(d) for d in shape if d is not None)
