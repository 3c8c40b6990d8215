"""The read planner of a restore: which part of which stored box fills a wanted box.

:func:`read_plan` maps a box a process wants onto the stored boxes of one variable
(pure math, no I/O): each overlapping part is read once, as a :class:`ReadItem`.
It refuses a box that lies outside the full shape, stored boxes that overlap inside
it, and a box the stored boxes do not cover (a restore never fills a gap).

>>> [(it.source, str(it.box)) for it in read_plan("w", Box((1,), (4,)), [Box((0,), (3,)), Box((3,), (3,))], (6,))]
[(0, '[1:3]'), (1, '[3:5]')]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ShardLayoutError
from ._boxes import Box, uncovered_example

__all__ = ["ReadItem", "read_plan"]


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
        gap = uncovered_example(target, [it.box for it in items])
        where = f"; e.g. {gap} is in no stored box" if gap is not None else ""
        raise ShardLayoutError(
            f"variable {key!r}: the stored slices cover {covered} of the {target.size} "
            f"elements of the requested box {target}{where}; a restore never fills a gap"
        )
    return items
