"""Shapes and offsets given as arguments: any sequence of non-negative ints, as a tuple.

>>> as_dims([2, np.int64(3)], "A shape")
(2, 3)
>>> as_dims((2.5, 3), "A shape")
Traceback (most recent call last):
ValueError: A shape is a tuple of ints, not (2.5, 3).
>>> as_dims((2, -1), "Shard offset")
Traceback (most recent call last):
ValueError: Shard offset has a negative entry: (2, -1).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np  # noqa: F401 - used by the doctest

__all__ = ["as_dims"]


def as_dims(value: Any, what: str, error: type[Exception] = ValueError) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints; ``error`` naming ``what`` otherwise."""
    try:  # operator.index: 2.5 or "3" is refused, never truncated or parsed
        dims = tuple(operator.index(d) for d in value)
    except (TypeError, ValueError):
        raise error(f"{what} is a tuple of ints, not {value!r}.") from None
    if any(d < 0 for d in dims):
        raise error(f"{what} has a negative entry: {dims}.")
    return dims
