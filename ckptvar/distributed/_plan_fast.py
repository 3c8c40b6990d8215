"""The fast save planner of the common layout: NumPy over every variable at once.

The common layout of a sharded save: every rank holds every key, one box each, and
each variable is split along one axis into disjoint slabs (full on every other
axis). :func:`plan_columns` checks such layouts, given as arrays of every rank's
offsets and shapes, with a few array operations for all variables together, and
builds a plan whose variables keep their boxes as arrays (no object per box);
:func:`plan_split` does the same from plain layouts. Both return ``None`` for any
other layout (or a wrong one), and
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
from typing import Any, cast

import numpy as np

from ._boxes import Box, PlainLayout, SavePlan, VariablePlan, WriteItem, itemsize

__all__ = ["plan_columns", "plan_split"]


def plan_split(layouts: Sequence[PlainLayout]) -> SavePlan | None:
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
    groups: dict[int, list[int]] = {}
    for i, (full, _, boxes) in enumerate(first):
        if boxes is not None:
            groups.setdefault(len(full), []).append(i)
    arrays: dict[int, tuple[Any, Any, Any]] = {}
    for ndim, idx in groups.items():
        got = _group_arrays([[row[i][2] for row in rows] for i in idx],
                            [first[i][0] for i in idx], ndim)
        if got is None:
            return None
        arrays[ndim] = got
    return plan_columns(size, keys, [full for full, _, _ in first],
                        [dtype for _, dtype, _ in first],
                        [boxes is None for _, _, boxes in first], groups, arrays)


def plan_columns(  # noqa: PLR0917
    size: int,
    keys: Sequence[str],
    fulls: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    replicated: Sequence[bool],
    groups: dict[int, list[int]],
    arrays: dict[int, tuple[Any, Any, Any]],
) -> SavePlan | None:
    """The plan of the common layout from arrays, or ``None`` when :func:`plan_save` must
    decide: every rank holds every key (``keys[i]``, of full shape ``fulls[i]`` and dtype
    ``dtypes[i]``); a sharded key (``replicated[i]`` false) is one box per rank. For each
    number of axes ``ndim``, ``groups[ndim]`` lists the sharded keys' positions and
    ``arrays[ndim]`` is ``(offsets, shapes, fulls)``: ``(variables, ranks, ndim)``,
    ``(variables, ranks, ndim)`` and ``(variables, ndim)`` int64 arrays in that order.
    No object per box is made: each variable's plan keeps its boxes as arrays.
    """
    load = np.zeros(size, np.int64)
    plans: dict[str, VariablePlan] = {}
    holders = tuple(range(size))
    for ndim, idx in groups.items():
        off, shp, full = arrays[ndim]
        checked = _check_split(off, shp, full)
        if checked is None:
            return None
        sizes, order, nonzero = checked
        isz = np.array([itemsize(dtypes[i]) for i in idx], np.int64)
        load += (sizes * isz[:, None]).sum(axis=0)
        s_off = np.take_along_axis(off, order[:, :, None], axis=1)
        s_shp = np.take_along_axis(shp, order[:, :, None], axis=1)
        s_nz = np.take_along_axis(nonzero, order, axis=1)
        every = cast("list[bool]", s_nz.all(axis=1).tolist())
        for v, i in enumerate(idx):
            key = keys[i]
            o, sh, w = s_off[v], s_shp[v], order[v]
            if not every[v]:  # empty boxes sort last: keep the non-empty ones
                n = int(s_nz[v].sum())
                o, sh, w = o[:n], sh[:n], w[:n]
            plans[key] = VariablePlan.from_columns(
                key, tuple(int(d) for d in fulls[i]), str(dtypes[i]), holders, o, sh, w)
    reps = sorted((keys[i], tuple(fulls[i]), dtypes[i])
                  for i in range(len(keys)) if replicated[i])
    _place_replicas(reps, [int(v) for v in load], plans)
    return SavePlan(size, {k: plans[k] for k in sorted(plans)})


def _group_arrays(
    boxes: list[list[Any]], fulls: list[Any], ndim: int
) -> tuple[Any, Any, Any] | None:
    """``(offsets, shapes, fulls)`` arrays of ``ndim``-axis variables (``boxes[v][rank]``
    is that rank's box list), or ``None`` unless every rank holds one box of each."""
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
    return off.reshape(n, size, ndim), shp.reshape(n, size, ndim), full.reshape(n, ndim)


def _check_split(off: Any, shp: Any, fulls: Any) -> tuple[Any, Any, Any] | None:
    """Each variable's elements per rank, its ranks in offset order (empty boxes last)
    and which boxes are non-empty, when every variable is split into disjoint slabs
    that tile it; else ``None`` (not the common layout, or wrong: :func:`plan_save`
    then says how)."""
    n, _, ndim = off.shape
    full = fulls.reshape(n, 1, ndim)
    stop = off + shp
    if (off < 0).any() or (shp < 0).any() or (stop > full).any():
        return None
    sizes = shp.prod(axis=2)
    if not np.array_equal(sizes.sum(axis=1), fulls.prod(axis=1)):
        return None
    nonzero = sizes > 0
    if ndim == 0:  # a scalar: exactly one rank holds it (the sum above says so)
        order = np.argsort(~nonzero, axis=1, kind="stable")
    else:
        order = _split_order(off, shp, stop, full, nonzero)
        if order is None:
            return None
    return sizes, order, nonzero


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
