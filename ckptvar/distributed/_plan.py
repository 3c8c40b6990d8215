"""The general save planner: check every rank's layout and give each box one writer.

Inputs are plain data: for every rank, its :class:`VariableLayout` per logical
key (full shape, dtype and the boxes it holds, or ``boxes=None`` for a
replicated value). :func:`plan_save` checks that the ranks agree and that the boxes
tile the full shape exactly (none outside, no overlap, no gap), and gives each box
exactly one writer; :func:`plan_save_plain` does the same for the plain layouts
ranks exchange, taking the NumPy path of ``_plan_fast`` for the common layout.
:func:`check_replicas` compares the checksums of replicated values, and
:class:`PlanCache` keeps recent plans by :func:`layout_digest`. Everything here is
deterministic, so every rank computes the same plan.

>>> layouts = [{"w": VariableLayout((4,), "<f4", (Box((2 * r,), (2,)),))} for r in range(2)]
>>> plan_save(layouts).bytes_per_rank()
[8, 8]
"""

from __future__ import annotations

import hashlib
import marshal
import math
import operator
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from ..errors import ShardLayoutError
from ._boxes import (
    Box,
    PlainLayout,
    SavePlan,
    VariableLayout,
    VariablePlan,
    WriteItem,
    itemsize,
    uncovered_example,
)
from ._plan_fast import plan_split

__all__ = [
    "PlanCache",
    "check_replicas",
    "layout_digest",
    "plan_save",
    "plan_save_plain",
]


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
        isz = itemsize(first.dtype)
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
        load[writer] += box.size * itemsize(first.dtype)
        only = (WriteItem(key, box, writer, 0),) if box.size else ()
        plans[key] = VariablePlan(
            key, first.full_shape, first.dtype, True, only, tuple(sorted(by_rank))
        )
    return SavePlan(size, {k: plans[k] for k in sorted(plans)})


def plan_save_plain(layouts: Sequence[PlainLayout]) -> SavePlan:
    """:func:`plan_save` of plain layouts (what ranks exchange): the same plan, the same errors.

    The common layout (every rank holds every key, one box each, each variable split
    along one axis) is checked with NumPy, a few array operations for all variables
    at once, and no ``VariableLayout`` is built; anything else goes to :func:`plan_save`.
    """
    fast = plan_split(layouts)
    if fast is not None:
        return fast
    return plan_save([
        {key: VariableLayout(full, dtype, None if boxes is None else
                             tuple(Box(tuple(o), tuple(s)) for o, s in boxes))
         for key, (full, dtype, boxes) in plain.items()}
        for plain in layouts
    ])


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
        gap = uncovered_example(Box.full(full_shape), [it.box for it in items])
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
                f"variable {key!r} is replicated (no shard) but its replicas differ: {detail}. "
                "A value every process holds alike is stored once; one that is each "
                "process's own (an RNG state seeded per process) needs a box of its own: "
                "cv.Variable(value, shard=cv.Shard(full_shape=(processes, ...), "
                "offset=(rank, ...)))"
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
