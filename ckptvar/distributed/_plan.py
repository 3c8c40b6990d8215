"""The planner of a multi-process save and the resharding math of a restore (no I/O).

Inputs are plain data: for every rank, its :class:`VariableLayout` per logical key
(full shape, dtype and the boxes it holds, or ``boxes=None`` for a replicated value).
:func:`plan_save` checks that the ranks agree and that the boxes tile the full shape
exactly, and gives each box exactly one writer. :func:`read_plan` maps a box a
process wants onto the stored boxes: which part of which stored box goes where,
and refuses a box that the stored boxes do not cover (a restore never fills).
Everything here is deterministic, so every rank computes the same plan.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import marshal
import math
import operator
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .._dtypes import as_dtype
from ..errors import ShardLayoutError

__all__ = [
    "Box",
    "PlanCache",
    "ReadItem",
    "SavePlan",
    "VariableLayout",
    "VariablePlan",
    "WriteItem",
    "check_replicas",
    "layout_digest",
    "plan_save",
    "plan_save_plain",
    "read_plan",
]

_T = TypeVar("_T")

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


@dataclass(frozen=True)
class VariablePlan:
    """The plan of one logical variable: its boxes (each with its writer), sorted by offset.

    Zero-size boxes are valid input but have nothing to write and are left out.
    """

    key: str
    full_shape: tuple[int, ...]
    dtype: str
    replicated: bool
    items: tuple[WriteItem, ...]
    holders: tuple[int, ...]


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
                item for vp in self.variables.values() for item in vp.items if item.writer == rank
            )
        return self._by_rank[rank]

    def bytes_per_rank(self) -> list[int]:
        """Bytes each rank writes under this plan."""
        out = [0] * self.size
        for vp in self.variables.values():
            isz = _itemsize(vp.dtype)
            for item in vp.items:
                out[item.writer] += item.box.size * isz
        return out


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    try:
        return int(as_dtype(dtype).itemsize)
    except (TypeError, ValueError):  # an unknown name still plans: weigh it as one byte
        return 1


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def _agree(key: str, what: str, values: Mapping[int, object]) -> None:
    if len(set(values.values())) <= 1:
        return
    groups: dict[object, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    if len(groups) > 1:
        detail = "; ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items())
        raise ShardLayoutError(f"variable {key!r}: the processes disagree on its {what}: {detail}")


def plan_save(layouts: Sequence[Mapping[str, VariableLayout]]) -> SavePlan:
    """Check every rank's layout (``layouts[rank]``) and give each box one writer.

    Raises :class:`~ckptvar.errors.ShardLayoutError` naming the variable and the
    ranks when the ranks disagree on a full shape or dtype, when a variable is
    sharded on some ranks and replicated on others, or when its boxes fall outside
    the full shape, overlap, or leave part of it uncovered. A replicated value's
    writer is the holder with the fewest bytes to write so far (ties: lowest rank).
    """
    size = len(layouts)
    holders: dict[str, dict[int, VariableLayout]] = {}
    for rank, layout in enumerate(layouts):
        for key, vl in layout.items():
            holders.setdefault(key, {})[rank] = vl
    load = [0] * size
    plans: dict[str, VariablePlan] = {}
    replicated: list[str] = []
    for key in sorted(holders):
        by_rank = holders[key]
        _agree(key, "full shape", {r: vl.full_shape for r, vl in by_rank.items()})
        _agree(key, "dtype", {r: vl.dtype for r, vl in by_rank.items()})
        kinds = {
            r: ("replicated (no shard)" if vl.replicated else "sharded")
            for r, vl in by_rank.items()
        }
        _agree(key, "kind", kinds)
        first = next(iter(by_rank.values()))
        if first.replicated:
            replicated.append(key)
            continue
        items = _write_items(key, first.full_shape, by_rank)
        _check_tiling(key, first.full_shape, items)
        isz = _itemsize(first.dtype)
        for it in items:
            load[it.writer] += it.box.size * isz
        plans[key] = VariablePlan(
            key, first.full_shape, first.dtype, False, tuple(items), tuple(sorted(by_rank))
        )
    for key in replicated:
        by_rank = holders[key]
        first = next(iter(by_rank.values()))
        writer = min(sorted(by_rank), key=lambda r: load[r])
        box = Box.full(first.full_shape)
        load[writer] += box.size * _itemsize(first.dtype)
        only = (WriteItem(key, box, writer, 0),) if box.size else ()
        plans[key] = VariablePlan(
            key, first.full_shape, first.dtype, True, only, tuple(sorted(by_rank))
        )
    return SavePlan(size, {k: plans[k] for k in sorted(plans)})


#: One rank's layout as plain data: key -> (full shape, dtype, [(offset, shape), ...] or None).
PlainLayout = Mapping[
    str, tuple[tuple[int, ...], str, Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None]
]


def plan_save_plain(layouts: Sequence[PlainLayout]) -> SavePlan:
    """:func:`plan_save` of plain layouts (what ranks exchange): the same plan, the same errors.

    The common layout (every rank holds every key, one box each, each variable split
    along one axis) is checked with NumPy, a few array operations for all variables
    at once, and no ``VariableLayout`` is built; anything else goes to :func:`plan_save`.
    """
    fast = _plan_split(layouts)
    if fast is not None:
        return fast
    return plan_save([
        {key: VariableLayout(full, dtype, None if boxes is None else
                             tuple(Box(tuple(o), tuple(s)) for o, s in boxes))
         for key, (full, dtype, boxes) in plain.items()}
        for plain in layouts
    ])


def _box(offset: tuple[int, ...], shape: tuple[int, ...], stop: tuple[int, ...],
         size: int) -> Box:
    """A ``Box`` of checked plain ints, without ``__post_init__`` (thousands per plan)."""
    box = object.__new__(Box)
    box.__dict__.update(offset=offset, shape=shape, _stop=stop, _size=size)
    return box


def _frozen(cls: type[_T], **fields: object) -> _T:
    """An instance of the frozen dataclass ``cls`` from checked fields, without ``__init__``."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _plan_split(layouts: Sequence[PlainLayout]) -> SavePlan | None:  # noqa: C901
    """The plan of the common layout, or ``None`` when :func:`plan_save` must decide."""
    size = len(layouts)
    if not size:
        return None
    keys = list(layouts[0])
    if any(list(lay) != keys for lay in layouts[1:]):
        return None
    rows = [list(lay.values()) for lay in layouts]
    first = rows[0]
    for other in rows[1:]:
        for (full, dtype, boxes), (f2, d2, b2) in zip(first, other, strict=True):
            if full != f2 or dtype != d2 or (boxes is None) != (b2 is None):
                return None
    load = np.zeros(size, np.int64)
    plans: dict[str, VariablePlan] = {}
    holders = tuple(range(size))
    by_ndim: dict[int, list[int]] = {}
    for i, (full, _, boxes) in enumerate(first):
        if boxes is not None:
            by_ndim.setdefault(len(full), []).append(i)
    for ndim, idx in by_ndim.items():
        group = _split_group([[row[i][2] for row in rows] for i in idx],
                             [first[i][0] for i in idx], ndim)
        if group is None:
            return None
        sizes, order, box_rows = group
        isz = np.array([_itemsize(first[i][1]) for i in idx], np.int64)
        load += (sizes * isz[:, None]).sum(axis=0)
        for i, picks in zip(idx, order, strict=True):
            key = keys[i]
            full, dtype, _ = first[i]
            items = tuple(
                _frozen(WriteItem, key=key, box=box_rows[r][i_box], writer=r, local_index=0)
                for r, i_box in picks
            )
            plans[key] = _frozen(
                VariablePlan, key=key, full_shape=tuple(int(d) for d in full), dtype=str(dtype),
                replicated=False, items=items, holders=holders,
            )
    replicated = sorted((keys[i], first[i][0], first[i][1])
                        for i in range(len(keys)) if first[i][2] is None)
    _place_replicas(replicated, [int(v) for v in load], plans)
    return SavePlan(size, {k: plans[k] for k in sorted(plans)})


def _split_group(  # noqa: PLR0911 - each early return: not the common layout
    boxes: list[list[Any]], fulls: list[Any], ndim: int
) -> tuple[Any, list[list[tuple[int, int]]], list[list[Box]]] | None:
    """Check ``ndim``-axis variables at once (``boxes[v][rank]`` is that rank's box list).

    Returns each variable's bytes per rank (elements), its ``(rank, box number)`` picks in
    offset order (non-empty boxes only) and the boxes per rank, or ``None`` when the
    layout is not the common one (or is wrong: :func:`plan_save` then says how).
    """
    n = len(boxes)
    size = len(boxes[0]) if n else 0
    try:
        if any(b is None or len(b) != 1 for per in boxes for b in per):
            return None
        off = np.array([[b[0][0] for b in per] for per in boxes], np.int64)
        shp = np.array([[b[0][1] for b in per] for per in boxes], np.int64)
        full = np.array(fulls, np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    if off.size != n * size * ndim or shp.size != off.size or full.size != n * ndim:
        return None
    off = off.reshape(n, size, ndim)
    shp = shp.reshape(n, size, ndim)
    full = full.reshape(n, 1, ndim)
    stop = off + shp
    if (off < 0).any() or (shp < 0).any() or (stop > full).any():
        return None
    sizes = shp.prod(axis=2)
    if not np.array_equal(sizes.sum(axis=1), full.reshape(n, ndim).prod(axis=1)):
        return None
    nonzero = sizes > 0
    if ndim == 0:  # a scalar: exactly one rank holds it (the sum above says so)
        order = np.argsort(~nonzero, axis=1, kind="stable")
    else:
        order = _split_order(off, shp, stop, full, nonzero)
        if order is None:
            return None
    # one Box per rank and variable, made from checked ints; a variable's picks skip empties
    o_l, s_l, e_l, z_l = off.tolist(), shp.tolist(), stop.tolist(), sizes.tolist()
    by_rank = [[_box(tuple(o_l[v][r]), tuple(s_l[v][r]), tuple(e_l[v][r]), z_l[v][r])
                for v in range(n)] for r in range(size)]
    nz = nonzero.tolist()
    picks = [[(r, v) for r in order_v if nz[v][r]] for v, order_v in enumerate(order.tolist())]
    return sizes, picks, by_rank


def _split_order(off: Any, shp: Any, stop: Any, full: Any, nonzero: Any) -> Any:
    """Per variable, its ranks sorted by offset, when its non-empty boxes are disjoint slabs
    along one axis (full on every other axis, one after another); else ``None``."""
    n, size, ndim = off.shape
    order = np.zeros((n, size), np.int64)
    done = np.zeros(n, bool)
    for axis in range(ndim):
        others = [a for a in range(ndim) if a != axis]
        whole = ((off[:, :, others] == 0) & (shp[:, :, others] == full[:, :, others])).all(axis=2)
        slab = (whole | ~nonzero).all(axis=1) & ~done
        if not slab.any():
            continue
        # empty boxes sort last; the rest by their start along ``axis``
        start = np.where(nonzero, off[:, :, axis], np.iinfo(np.int64).max)
        o = np.argsort(start, axis=1, kind="stable")
        s_start = np.take_along_axis(off[:, :, axis], o, axis=1)
        s_stop = np.take_along_axis(stop[:, :, axis], o, axis=1)
        s_nz = np.take_along_axis(nonzero, o, axis=1)
        gap_ok = (s_start[:, 1:] >= s_stop[:, :-1]) | ~s_nz[:, 1:]
        ok = slab & gap_ok.all(axis=1)
        order[ok] = o[ok]
        done |= ok
    return order if done.all() else None


def _place_replicas(
    replicated: list[tuple[str, tuple[int, ...], str]],
    loads: list[int],
    plans: dict[str, VariablePlan],
) -> None:
    """Give each replicated value (in key order) the holder with the fewest bytes so far."""
    holders = tuple(range(len(loads)))
    for key, full, dtype in replicated:
        writer = min(holders, key=lambda r: loads[r])
        box = Box.full(full)
        loads[writer] += box.size * _itemsize(dtype)
        only = (WriteItem(key, box, writer, 0),) if box.size else ()
        plans[key] = VariablePlan(key, box.shape, str(dtype), True, only, holders)


def _write_items(
    key: str, full_shape: tuple[int, ...], by_rank: Mapping[int, VariableLayout]
) -> list[WriteItem]:
    """Every non-empty box of a sharded variable, each written by its holder, by offset."""
    items = []
    ndim = len(full_shape)
    for rank, vl in by_rank.items():
        assert vl.boxes is not None
        for i, box in enumerate(vl.boxes):
            if len(box.offset) != ndim or not all(map(operator.le, box.stop, full_shape)):
                raise ShardLayoutError(
                    f"variable {key!r}: rank {rank}'s box {box} (offset {box.offset}, "
                    f"shape {box.shape}) lies outside its full shape {full_shape}"
                )
            if box.size:
                items.append(WriteItem(key, box, rank, i))
    items.sort(key=lambda it: (it.box.offset, it.writer))
    return items


def _check_tiling(key: str, full_shape: tuple[int, ...], items: Sequence[WriteItem]) -> None:
    """Boxes (sorted by offset, no zero-size ones) must not overlap and must cover everything."""
    if not _disjoint_rows(full_shape, items):
        _check_overlaps(key, items)
    covered = sum(it.box.size for it in items)
    total = math.prod(full_shape)
    if covered != total:
        gap = _uncovered_example(Box.full(full_shape), [it.box for it in items])
        where = f"; e.g. {gap} is in no box" if gap is not None else ""
        raise ShardLayoutError(
            f"variable {key!r}: the shards cover {covered} of the {total} elements of its "
            f"full shape {full_shape}{where}"
        )


def _disjoint_rows(full_shape: tuple[int, ...], items: Sequence[WriteItem]) -> bool:
    """True for the common layout, shown disjoint in one pass: whole rows, one after another.

    Each box spans every axis but the first, and (sorted by offset) each starts at or
    after the end of the one before. ``False`` means: check pair by pair.
    """
    if not full_shape:
        return len(items) <= 1
    rest = full_shape[1:]
    end = 0
    for it in items:
        box = it.box
        if box.offset[0] < end or box.shape[1:] != rest or any(box.offset[1:]):
            return False
        end = box.stop[0]
    return True


def _check_overlaps(key: str, items: Sequence[WriteItem]) -> None:
    """Raise for the first two boxes (sorted by offset) that share an element."""
    # sweep along axis 0: only boxes that start before this one ends can overlap it
    for i, a in enumerate(items):
        a_stop0 = a.box.stop[0] if a.box.ndim else 1
        for b in items[i + 1 :]:
            if b.box.ndim and b.box.offset[0] >= a_stop0:
                break
            common = a.box.intersect(b.box)
            if common is not None:
                raise ShardLayoutError(
                    f"variable {key!r}: rank {a.writer}'s box {a.box} overlaps rank "
                    f"{b.writer}'s box {b.box} (common part {common}); each element must "
                    "belong to exactly one shard"
                )


def _uncovered_example(target: Box, boxes: Sequence[Box]) -> Box | None:
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


def check_replicas(plan: SavePlan, checksums: Sequence[Mapping[str, object]]) -> None:
    """Replicas of each replicated variable must have equal checksums (``checksums[rank]``).

    Raises :class:`~ckptvar.errors.ShardLayoutError` naming the variable and the
    ranks of each differing checksum. Ranks that give no checksum for a key are
    not compared.
    """
    given = set().union(*checksums)  # usually few keys: never walk every variable
    for key in sorted(given):
        vp = plan.variables.get(key)
        if vp is None or not vp.replicated:
            continue
        seen = {r: checksums[r][key] for r in vp.holders if key in checksums[r]}
        groups: dict[object, list[int]] = {}
        for r, c in seen.items():
            groups.setdefault(c, []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"checksum {c!r} on {_ranks(rs)}" for c, rs in groups.items())
            raise ShardLayoutError(
                f"variable {key!r} is replicated (no shard) but its replicas differ: {detail}"
            )


def layout_digest(layout: Mapping[str, VariableLayout]) -> str:
    """A short hash of one rank's layout: equal layouts, equal digests (same Python)."""
    data = [
        (
            key,
            vl.full_shape,
            vl.dtype,
            None if vl.boxes is None else [(b.offset, b.shape) for b in vl.boxes],
        )
        for key, vl in sorted(layout.items())
    ]
    return hashlib.blake2b(marshal.dumps(data), digest_size=16).hexdigest()


class PlanCache:
    """The last few plans, keyed by every rank's :func:`layout_digest` (least recent dropped)."""

    def __init__(self, maxsize: int = 4) -> None:
        self.maxsize = maxsize
        self._plans: OrderedDict[tuple[str, ...], SavePlan] = OrderedDict()

    @staticmethod
    def key_of(digests: Sequence[str]) -> str:
        """One short name for a tuple of digests (what ranks exchange to agree on a hit)."""
        return hashlib.blake2b("/".join(digests).encode(), digest_size=16).hexdigest()

    def keys(self) -> frozenset[str]:
        return frozenset(self.key_of(d) for d in self._plans)

    def get(self, digests: Sequence[str]) -> SavePlan | None:
        plan = self._plans.get(tuple(digests))
        if plan is not None:
            self._plans.move_to_end(tuple(digests))
        return plan

    def put(self, digests: Sequence[str], plan: SavePlan) -> None:
        self._plans[tuple(digests)] = plan
        self._plans.move_to_end(tuple(digests))
        while len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)


@dataclass(frozen=True)
class ReadItem:
    """Copy ``stored[source][source_slices]`` into ``target_array[dest_slices]``.

    ``box`` is the copied region in the full array's coordinates.
    """

    source: int
    box: Box
    source_slices: tuple[slice, ...]
    dest_slices: tuple[slice, ...]


def read_plan(
    key: str,
    target: Box,
    stored: Sequence[Box],
    full_shape: Sequence[int],
) -> list[ReadItem]:
    """The parts of the ``stored`` boxes that make up ``target``, each read once.

    Raises :class:`~ckptvar.errors.ShardLayoutError` naming ``key`` when ``target``
    lies outside ``full_shape``, when stored boxes overlap inside it, or when part
    of it is in no stored box (a restore never fills a gap).
    """
    full = tuple(int(n) for n in full_shape)
    if not target.within(full):
        raise ShardLayoutError(
            f"variable {key!r}: the requested box {target} lies outside the stored full "
            f"shape {full}"
        )
    items = []
    for i, box in enumerate(stored):
        if box.ndim != target.ndim:
            raise ShardLayoutError(
                f"variable {key!r}: stored box {box} has {box.ndim} axes, the request {target.ndim}"
            )
        common = target.intersect(box)
        if common is None or not common.size:
            continue
        items.append(ReadItem(i, common, common.relative(box), common.relative(target)))
    for a, b in itertools.combinations(items, 2):
        if a.box.intersect(b.box) is not None:
            raise ShardLayoutError(
                f"variable {key!r}: stored boxes {stored[a.source]} and {stored[b.source]} overlap"
            )
    covered = sum(it.box.size for it in items)
    if covered != target.size:
        gap = _uncovered_example(target, [it.box for it in items])
        where = f"; e.g. {gap} is in no stored box" if gap is not None else ""
        raise ShardLayoutError(
            f"variable {key!r}: the stored slices cover {covered} of the {target.size} "
            f"elements of the requested box {target}{where}; a restore never fills a gap"
        )
    return items
