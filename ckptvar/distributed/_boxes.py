"""The plain data of planning: boxes of a logical array, layouts and save plans.

:class:`Box` (an offset and a shape, with the geometry a planner needs: stop, size,
intersection, slices), :class:`VariableLayout` (what one rank holds of one variable)
and its plain form :data:`PlainLayout` (what ranks exchange), :class:`WriteItem`,
:class:`VariablePlan` and :class:`SavePlan` (who writes which box); and
:func:`uncovered_example`, the geometry behind "part of it is in no box" errors.
No planning happens here: the save planners are in ``_plan`` and ``_plan_fast``,
the read planner in ``_read_plan``.

>>> Box((2, 0), (3, 4)).intersect(Box((0, 1), (4, 2)))
Box(offset=(2, 1), shape=(2, 2))
>>> print(uncovered_example(Box.full((4,)), [Box((0,), (1,)), Box((2,), (2,))]))
[1:2]
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._dtypes import as_dtype
from ..errors import ShardLayoutError

__all__ = [
    "Box",
    "PlainLayout",
    "SavePlan",
    "VariableLayout",
    "VariablePlan",
    "WriteItem",
    "itemsize",
    "uncovered_example",
]

#: Cells examined at most when looking for an example of an uncovered region.
_MAX_GRID_CELLS = 1_000_000


@dataclass(frozen=True)
class Box:
    """A box of a logical array: ``offset`` (first index per axis) and ``shape``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        offset, shape = self.offset, self.shape
        # planning makes one Box per shard per rank: tuples of ints skip the conversion
        if not (type(offset) is tuple and type(shape) is tuple
                and all(type(v) is int for v in offset + shape)):
            offset = tuple(int(o) for o in offset)
            shape = tuple(int(s) for s in shape)
            object.__setattr__(self, "offset", offset)
            object.__setattr__(self, "shape", shape)
        if len(offset) != len(shape):
            raise ShardLayoutError(
                f"box offset {offset} and shape {shape} have different numbers of axes"
            )
        if offset and min(*offset, *shape) < 0:
            raise ShardLayoutError(f"box offset {offset} / shape {shape} has a negative entry")
        # derived once: planning touches them for every box of every variable
        object.__setattr__(self, "_stop", tuple(map(operator.add, offset, shape)))
        object.__setattr__(self, "_size", math.prod(shape))

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box of a whole array of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        """The first index past the box, per axis."""
        return self._stop  # type: ignore[attr-defined,no-any-return]

    @property
    def size(self) -> int:
        """Number of elements (0 for a zero-size box)."""
        return self._size  # type: ignore[attr-defined,no-any-return]

    def slices(self) -> tuple[slice, ...]:
        """The box as slices of the full array."""
        return tuple(slice(o, e) for o, e in zip(self.offset, self.stop, strict=True))

    def relative(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of ``outer``'s own array (``outer`` must contain it)."""
        return tuple(
            slice(o - oo, o - oo + s)
            for o, s, oo in zip(self.offset, self.shape, outer.offset, strict=True)
        )

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= n for e, n in zip(self.stop, shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or ``None`` when it has no elements."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{e}" for o, e in zip(self.offset, self.stop, strict=True)) + "]"


@dataclass(frozen=True)
class VariableLayout:
    """What one rank holds of one logical variable.

    ``boxes=None`` means a replicated value: this rank holds all of it, and some
    rank holding it writes it once.
    """

    full_shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...] | None = None

    def __post_init__(self) -> None:
        full = self.full_shape
        if not (type(full) is tuple and all(type(n) is int for n in full)):
            object.__setattr__(self, "full_shape", tuple(int(n) for n in full))
        if type(self.dtype) is not str:
            object.__setattr__(self, "dtype", str(self.dtype))
        boxes = self.boxes
        if boxes is not None and not (
            type(boxes) is tuple and all(type(b) is Box for b in boxes)
        ):
            object.__setattr__(
                self,
                "boxes",
                tuple(b if isinstance(b, Box) else Box(*b) for b in boxes),
            )

    @property
    def replicated(self) -> bool:
        return self.boxes is None


@dataclass(frozen=True)
class WriteItem:
    """One box of one variable and the one rank that writes it.

    ``local_index`` is the box's position in the writer's ``VariableLayout.boxes``
    (0 for a replicated value).
    """

    key: str
    box: Box
    writer: int
    local_index: int


class VariablePlan:
    """The plan of one logical variable: its boxes (each with its writer), sorted by offset.

    Zero-size boxes are valid input but have nothing to write and are left out. A plan
    the NumPy planner made keeps its boxes as arrays (:meth:`from_columns`: offsets,
    shapes and writers, one row per box) and builds the :class:`WriteItem` objects
    only when ``items`` is asked for; :meth:`written_by` and :meth:`plain_boxes`
    answer from the arrays. Equal plans compare equal whatever their form; immutable.
    """

    __slots__ = ("_cols", "_items", "dtype", "full_shape", "holders", "key", "replicated")

    key: str
    full_shape: tuple[int, ...]
    dtype: str
    replicated: bool
    holders: tuple[int, ...]
    _items: tuple[WriteItem, ...] | None
    _cols: tuple[np.ndarray, np.ndarray, np.ndarray] | None

    def __init__(  # noqa: PLR0917 - the fields, in the order they always had
        self, key: str, full_shape: tuple[int, ...], dtype: str, replicated: bool,
        items: tuple[WriteItem, ...], holders: tuple[int, ...],
    ) -> None:
        for name, value in (("key", key), ("full_shape", full_shape), ("dtype", dtype),
                            ("replicated", replicated), ("holders", holders)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_items", tuple(items))
        object.__setattr__(self, "_cols", None)

    @classmethod
    def from_columns(  # noqa: PLR0917
        cls, key: str, full_shape: tuple[int, ...], dtype: str, holders: tuple[int, ...],
        offsets: np.ndarray, shapes: np.ndarray, writers: np.ndarray,
    ) -> VariablePlan:
        """A sharded variable's plan from checked arrays, one row per non-empty box in
        offset order (``offsets``/``shapes``: ``(boxes, ndim)``; ``writers``: ``(boxes,)``;
        each writer's box is the first of its layout)."""
        plan = cls.__new__(cls)
        for name, value in (("key", key), ("full_shape", full_shape), ("dtype", dtype),
                            ("replicated", False), ("holders", holders),
                            ("_items", None), ("_cols", (offsets, shapes, writers))):
            object.__setattr__(plan, name, value)
        return plan

    @property
    def items(self) -> tuple[WriteItem, ...]:
        """Every box and its writer, by offset (built from the arrays on first use)."""
        items = self._items
        if items is None:
            assert self._cols is not None
            offsets, shapes, writers = self._cols
            key = self.key
            items = tuple(
                _item(key, _box(tuple(o), tuple(s)), w, 0)
                for o, s, w in zip(offsets.tolist(), shapes.tolist(), writers.tolist(),
                                   strict=True))
            object.__setattr__(self, "_items", items)
        return items

    @property
    def n_boxes(self) -> int:
        """How many boxes it writes (``len(items)``, without building them)."""
        return len(self.items) if self._cols is None else len(self._cols[2])

    def written_by(self, rank: int) -> list[tuple[int, WriteItem]]:
        """``(position in items, item)`` of each box ``rank`` writes."""
        if self._cols is None:
            return [(j, it) for j, it in enumerate(self.items) if it.writer == rank]
        offsets, shapes, writers = self._cols
        return [(j, _item(self.key, _box(tuple(offsets[j].tolist()),
                                         tuple(shapes[j].tolist())), rank, 0))
                for j in np.flatnonzero(writers == rank).tolist()]

    def plain_boxes(self) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Every box's offset, shape and writer, by offset, as plain lists."""
        if self._cols is None:
            return ([list(it.box.offset) for it in self.items],
                    [list(it.box.shape) for it in self.items],
                    [it.writer for it in self.items])
        offsets, shapes, writers = self._cols
        return offsets.tolist(), shapes.tolist(), writers.tolist()

    def bytes_by_writer(self, size: int) -> np.ndarray:
        """Bytes each of ``size`` ranks writes of this variable."""
        out = np.zeros(size, np.int64)
        isz = itemsize(self.dtype)
        if self._cols is None:
            for it in self.items:
                out[it.writer] += it.box.size * isz
        else:
            _, shapes, writers = self._cols
            np.add.at(out, writers, shapes.prod(axis=1, dtype=np.int64) * isz)
        return out

    def _key(self) -> tuple[object, ...]:
        return (self.key, self.full_shape, self.dtype, self.replicated, self.items, self.holders)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VariablePlan):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.key, self.full_shape, self.dtype, self.replicated, self.holders))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"VariablePlan is immutable: cannot set {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        return (VariablePlan, (self.key, self.full_shape, self.dtype, self.replicated,
                               self.items, self.holders))

    def __repr__(self) -> str:
        return (f"VariablePlan(key={self.key!r}, full_shape={self.full_shape!r}, "
                f"dtype={self.dtype!r}, replicated={self.replicated!r}, items={self.items!r}, "
                f"holders={self.holders!r})")


def _box(offset: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """A ``Box`` of checked plain ints, without ``__post_init__`` (planning makes millions)."""
    box = object.__new__(Box)
    box.__dict__.update(offset=offset, shape=shape,
                        _stop=tuple(map(operator.add, offset, shape)), _size=math.prod(shape))
    return box


def _item(key: str, box: Box, writer: int, local_index: int) -> WriteItem:
    """A ``WriteItem`` of checked fields, without ``__init__``."""
    item = object.__new__(WriteItem)
    item.__dict__.update(key=key, box=box, writer=writer, local_index=local_index)
    return item


@dataclass(frozen=True)
class SavePlan:
    """Every variable's plan, for ``size`` ranks."""

    size: int
    variables: Mapping[str, VariablePlan]
    _by_rank: dict[int, tuple[WriteItem, ...]] = field(default_factory=dict, repr=False)

    def writes_for(self, rank: int) -> tuple[WriteItem, ...]:
        """The boxes ``rank`` writes, in key order."""
        if rank not in self._by_rank:
            self._by_rank[rank] = tuple(
                item for vp in self.variables.values() for _, item in vp.written_by(rank)
            )
        return self._by_rank[rank]

    def bytes_per_rank(self) -> list[int]:
        """Bytes each rank writes under this plan."""
        out = np.zeros(self.size, np.int64)
        for vp in self.variables.values():
            out += vp.bytes_by_writer(self.size)
        return [int(v) for v in out]


@functools.lru_cache(maxsize=256)
def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (1 for a name NumPy does not know)."""
    try:
        return int(as_dtype(dtype).itemsize)
    except (TypeError, ValueError):  # an unknown name still plans: weigh it as one byte
        return 1


#: One rank's layout as plain data: key -> (full shape, dtype, [(offset, shape), ...] or None).
PlainLayout = Mapping[
    str, tuple[tuple[int, ...], str, Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None]
]


def uncovered_example(target: Box, boxes: Sequence[Box]) -> Box | None:
    """A cell of ``target`` that no box touches (on the grid of all box edges), if small enough."""
    edges = []
    for axis in range(target.ndim):
        cuts = {target.offset[axis], target.stop[axis]}
        for b in boxes:
            for c in (b.offset[axis], b.stop[axis]):
                if target.offset[axis] < c < target.stop[axis]:
                    cuts.add(c)
        edges.append(sorted(cuts))
    if math.prod(max(len(e) - 1, 0) for e in edges) > _MAX_GRID_CELLS:
        return None
    for cell in itertools.product(*[list(itertools.pairwise(e)) for e in edges]):
        box = Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
        if box.size and not any(box.intersect(b) for b in boxes):
            return box
    return None
