"""Logical variables: one stored value held as boxes by one or more variables.

A checkpoint always stores the logical variable (its key, full shape and dtype). Owns
:class:`Logical` (a logical variable and the variables holding its boxes), the ways to
make one (:func:`logical_of` for a ``PartitionedVariable`` or a variable holding a
``Shard``; :func:`group_by_name` for a ``Saver``'s variables, whose parts are grouped
under their full name), :func:`assemble` (the full host value a one-process save writes:
one host copy of the logical value) and :func:`read_boxes`, the one place a restore reads
boxes of stored values ("read these boxes of these keys into these buffers"), which a
multi-process coordinator can replace.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import check_castable, dtype_name, narrows
from ..distributed import Box
from ..errors import CheckpointMismatchError, DTypeLockError, ShapeLockError
from ..storage import Reader
from ..variables import PartitionedVariable, Variable, host_buffer, read_buffer
from ._apply import (
    TEMPORARY_BUDGET,
    apply_values,
    check_cast_fits,
    check_matches,
    give_value,
    reader_abilities,
)

__all__ = [
    "BoxRead",
    "BoxReader",
    "Logical",
    "apply_targets",
    "as_target",
    "assemble",
    "check_logical",
    "group_by_name",
    "is_logical",
    "logical_of",
    "mismatch_error",
    "read_boxes",
]

_second = operator.itemgetter(1)
_PLAIN = frozenset({Variable})


@dataclass(frozen=True)
class Logical:
    """A logical variable ``name`` of ``full_shape``/``dtype`` whose boxes ``parts`` hold."""

    name: str
    full_shape: tuple[int, ...]
    dtype: np.dtype
    parts: tuple[Variable, ...]

    @property
    def trainable(self) -> bool:
        return all(bool(p.trainable) for p in self.parts)

    def boxes(self) -> list[tuple[Variable, tuple[int, ...], tuple[int, ...]]]:
        """``(part, offset, shape)`` for every part."""
        out = []
        for part in self.parts:
            box = part.logical_box
            out.append((part, tuple(box.offset), tuple(box.shape)))
        return out

    def check_covers(self, key: str) -> None:
        """Raise unless the parts' boxes tile the full shape exactly (a one-process save)."""
        boxes = [(o, s) for _, o, s in self.boxes()]
        total = sum(math.prod(s) for _, s in boxes)
        overlap = next(((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                        if Box(*a).intersect(Box(*b)) is not None), None)
        if overlap is not None or total != math.prod(self.full_shape):
            what = (f"boxes {overlap[0]} and {overlap[1]} (offset, shape) overlap"
                    if overlap is not None else
                    f"its boxes cover {total} of {math.prod(self.full_shape)} elements")
            raise ShapeLockError(
                f"Cannot save {key!r} (logical variable {self.name!r}, full shape "
                f"{self.full_shape}) from this process: {what}. One process saves a logical "
                "variable only when it holds all of it (all the parts of a partitioned "
                "variable; a shard needs the multi-process save)."
            )


def is_logical(obj: Any) -> bool:
    """True for what is stored as a logical variable: a partitioned variable or a shard."""
    return isinstance(obj, PartitionedVariable) or (
        isinstance(obj, Variable) and obj.shard is not None)


def as_target(obj: PartitionedVariable | Variable) -> Variable | Logical:
    """What is saved or restored for ``obj``: a :class:`Logical`, or the plain variable."""
    if isinstance(obj, Variable) and obj.shard is None:
        return obj
    return logical_of(obj)


def logical_of(obj: PartitionedVariable | Variable) -> Logical:
    """``obj`` (a ``PartitionedVariable`` or a variable with a ``Shard``) as a :class:`Logical`."""
    if isinstance(obj, PartitionedVariable):
        return Logical(obj.name, tuple(obj.shape), np.dtype(obj.dtype), tuple(obj))
    box = obj.logical_box
    return Logical(box.name, tuple(box.full_shape), np.dtype(obj.dtype), (obj,))


def group_by_name(items: Iterable[tuple[str, Any]]) -> dict[str, Variable | Logical]:
    """A ``Saver``'s ``{key: variable}``: partitions and shards grouped under their full name.

    A ``PartitionedVariable`` becomes its logical variable under its key; variables that
    are boxes of a logical variable (``save_slice_info`` or ``shard``) keyed by their own
    names are grouped under the logical name. Their full shapes and dtypes must agree.
    """
    out: dict[str, Variable | Logical] = {}
    groups: dict[str, list[Variable]] = {}
    for key, var in items:
        if isinstance(var, PartitionedVariable):
            logical = logical_of(var)
            _put(out, key, logical)
            continue
        if var.save_slice_info is None and var.shard is None:
            _put(out, key, var)  # a plain variable: no box to compute
            continue
        if key == var.name:
            groups.setdefault(var.logical_box.name, []).append(var)
        else:
            _put(out, key, var)
    for name, parts in groups.items():
        shapes = {tuple(p.logical_box.full_shape) for p in parts}
        dtypes = {np.dtype(p.dtype) for p in parts}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ShapeLockError(
                f"The parts of {name!r} disagree on the full shape or dtype: "
                + ", ".join(f"{p.name!r} {tuple(p.logical_box.full_shape)} {p.dtype}"
                            for p in parts) + "."
            )
        existing = out.get(name)
        if isinstance(existing, Logical) and {id(p) for p in existing.parts} == {
                id(p) for p in parts}:
            continue  # the PartitionedVariable and its parts both listed
        _put(out, name, Logical(name, shapes.pop(), dtypes.pop(), tuple(parts)))
    return out


def _put(out: dict[str, Variable | Logical], key: str, value: Variable | Logical) -> None:
    if key in out and out[key] is not value:
        raise ValueError(f"Two different variables would be saved under {key!r}.")
    out[key] = value


def assemble(logical: Logical, key: str) -> np.ndarray:
    """The full host value of ``logical`` (one new host array; the parts are copied in)."""
    logical.check_covers(key)
    boxes = logical.boxes()
    if len(boxes) == 1:
        return np.asarray(boxes[0][0].numpy(), order="C")
    full = np.empty(logical.full_shape, logical.dtype)
    for part, offset, shape in boxes:
        value = read_buffer(part)
        full[Box(offset, shape).slices()] = value if isinstance(value, np.ndarray) else part.numpy()
    return full


@dataclass(frozen=True)
class BoxRead:
    """Read the box ``offset``/``shape`` of the stored value ``key`` into ``out``."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    out: np.ndarray


#: ``reader_fn(reader, requests, verify=)``: fills every request's ``out`` (all or raise).
BoxReader = Callable[..., None]


def read_boxes(reader: Reader, requests: Sequence[BoxRead], *, verify: bool = True) -> None:
    """Fill each ``request.out`` with its box of a stored value; reads only the box's rows.

    With ``verify``, each stored value's checksum is verified first (once per key). A
    dtype differing from ``out``'s is converted (the caller checked the cast).
    """
    if verify:
        keys = list(dict.fromkeys(r.key for r in requests))
        able = reader_abilities(reader)
        if able.verify_many is not None:
            able.verify_many(keys)
        else:
            for key in keys:
                reader.verify(key)
    for r in requests:
        if r.out.size == 0:
            continue
        np.copyto(r.out, reader[r.key][Box(r.offset, r.shape).slices()], casting="unsafe")


def check_logical(
    items: Sequence[tuple[str, Logical]], stored: Callable[[str], tuple[tuple[int, ...], np.dtype]],
    path: Any, *, cast: bool,
) -> list[str]:
    """Problems (one line each) of restoring ``items``: logical full shape and dtype."""
    problems = []
    for key, logical in items:
        shape, dtype = stored(key)
        ok_shape = tuple(shape) == logical.full_shape
        ok_dtype = np.dtype(dtype) == logical.dtype
        if not ok_dtype and cast:
            try:
                check_castable(dtype, logical.dtype)
                ok_dtype = True
            except DTypeLockError:
                pass
        if not (ok_shape and ok_dtype):
            problems.append(
                f"{key!r} (logical variable {logical.name!r}): expected full shape "
                f"{logical.full_shape} dtype {dtype_name(logical.dtype)}, found shape "
                f"{tuple(shape)} dtype {dtype_name(dtype)}"
            )
    return problems


def mismatch_error(path: Any, problems: list[str]) -> CheckpointMismatchError:
    """The error for :func:`check_logical`'s problems: nothing was restored."""
    return CheckpointMismatchError(
        f"Cannot restore from {str(path)!r}: {len(problems)} stored value(s) do not match "
        "their variables; nothing was restored. " + "; ".join(problems) + "."
    )


def apply_targets(  # noqa: C901, PLR0912 - the all-or-nothing protocol over plain and logical values
    reader: Reader,
    pairs: Sequence[tuple[str, Variable | Logical]],
    infos: Any,
    *,
    verify: bool = True,
    cast: bool = False,
    budget: int | None = None,
    box_reader: BoxReader = read_boxes,
) -> None:
    """Restore plain variables and logical variables from ``reader``, all or nothing.

    Plain variables go through :func:`~._apply.apply_values`. Each part of a logical
    variable reads only its own box of the stored logical value, whatever the stored
    value's layout was (partitioned into any count, or not at all). Every logical full
    shape and dtype is checked first (``CheckpointMismatchError`` naming the keys); values
    are read and verified before any variable changes, into temporaries up to ``budget``
    bytes (above it, into the parts' own buffers after every value is verified).
    """
    logicals = [] if set(map(type, map(_second, pairs))) <= _PLAIN else [
        (k, v) for k, v in pairs if isinstance(v, Logical)]  # (no step per plain value)
    if not logicals:  # every target a plain Variable
        apply_values(reader, list(pairs), infos, verify=verify, cast=cast,  # type: ignore[arg-type]
                     budget=budget)
        return
    plain = [(k, v) for k, v in pairs if isinstance(v, Variable)]
    able = reader_abilities(reader)

    def stored(key: str) -> tuple[tuple[int, ...], np.dtype]:
        if able.shape_and_dtype is not None:
            return able.shape_and_dtype(key)
        info = infos[key]
        return tuple(info.shape), np.dtype(info.dtype)

    problems = check_logical(logicals, stored, reader.path, cast=cast)
    if problems:
        raise mismatch_error(reader.path, problems)
    for key, logical in logicals if cast else ():  # a narrowing cast: no number changes class
        if narrows(stored(key)[1], logical.dtype):
            check_cast_fits(reader, key, reader.read(key, verify=False), logical.dtype)
    check_matches(plain, infos, reader.path, fast=able.shape_and_dtype, cast=cast)
    budget = TEMPORARY_BUDGET if budget is None else budget
    fresh: list[tuple[Variable, BoxRead]] = []
    in_place: list[tuple[Variable, BoxRead]] = []
    in_place_bytes = 0
    for key, logical in logicals:
        for part, offset, shape in logical.boxes():
            buf = host_buffer(part)
            if buf is not None and buf.shape == shape:
                in_place.append((part, BoxRead(key, offset, shape, buf)))
                in_place_bytes += buf.nbytes
            else:
                fresh.append((part, BoxRead(key, offset, shape, np.empty(shape, part.dtype))))
    if in_place_bytes <= budget:  # small: read into temporaries too (one pass)
        fresh += [(part, BoxRead(r.key, r.offset, r.shape, np.empty_like(r.out)))
                  for part, r in in_place]
        in_place = []
    # Phase 1: everything that can fail.
    box_reader(reader, [r for _, r in fresh], verify=verify)
    if verify and in_place:
        keys = list(dict.fromkeys(r.key for _, r in in_place))
        if able.verify_many is not None:
            able.verify_many(keys)
        else:
            for key in keys:
                reader.verify(key)
    casts = [f"{k!r} ({dtype_name(stored(k)[1])} -> {dtype_name(lg.dtype)})" for k, lg in logicals
             if np.dtype(stored(k)[1]) != lg.dtype]
    if casts:
        warnings.warn(
            f"Restore from {str(reader.path)!r} cast {len(casts)} stored value(s) to their "
            f"variables' dtypes (cast=True): {', '.join(casts)}.", UserWarning, stacklevel=4)
    apply_values(reader, plain, infos, verify=verify, cast=cast, budget=budget)
    # Phase 2: change the variables.
    for part, r in fresh:
        give_value(part, r.out)
    if in_place:
        box_reader(reader, [r for _, r in in_place], verify=False)

