"""The fast save planner of the common layout: NumPy over every variable at once.

The common layout of a sharded save: every rank holds every key, one box each, and
each variable is split along one axis into disjoint slabs (full on every other
axis). :func:`plan_split` checks such layouts with a few array operations for all
variables together and builds the plan without a ``VariableLayout`` per rank; it
returns ``None`` for any other layout (or a wrong one), and
:func:`~ckptvar.distributed._plan.plan_save_plain` then asks the general planner,
which gives the same plan and says what is wrong.

>>> plan = plan_split([{"w": ((4,), "<f4", [((2 * r,), (2,))])} for r in range(2)])
>>> [(str(it.box), it.writer) for it in plan.variables["w"].items]
[('[0:2]', 0), ('[2:4]', 1)]
>>> overlapping = [{"w": ((4,), "<f4", [((0,), (3,))])}, {"w": ((4,), "<f4", [((2,), (2,))])}]
>>> plan_split(overlapping) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from ._boxes import Box, PlainLayout, SavePlan, VariablePlan, WriteItem, itemsize

__all__ = ["plan_split"]

_T = TypeVar("_T")


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


def plan_split(layouts: Sequence[PlainLayout]) -> SavePlan | None:  # noqa: C901
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
        isz = np.array([itemsize(first[i][1]) for i in idx], np.int64)
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
        loads[writer] += box.size * itemsize(dtype)
        only = (WriteItem(key, box, writer, 0),) if box.size else ()
        plans[key] = VariablePlan(key, box.shape, str(dtype), True, only, holders)
