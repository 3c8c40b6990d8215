"""``gather_plan``: the collective planning step of a multi-process save.

Every rank calls it with its own layout. One small allgather carries each rank's
layout digest, its replica checksums and the keys of the plans it has cached; when
every rank has the plan of this exact set of layouts cached, that plan is reused
and the gather of the layouts themselves is skipped. Otherwise the layouts travel
as ``_wire`` messages (one array of numbers a rank; the keys, shapes and dtypes
once, from rank 0, and again only from a rank whose differ) and are planned from
the stacked arrays. Planning is deterministic,
so a layout error raises the same :class:`~ckptvar.errors.ShardLayoutError` on
every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ._boxes import SavePlan, VariableLayout
from ._coordinator import Coordinator
from ._plan import PlanCache, check_replicas, layout_digest
from ._wire import encode, layout_message, plan_messages, spec_senders

__all__ = ["SupportsPlain", "gather_plan"]


@runtime_checkable
class SupportsPlain(Protocol):
    """A layout that keeps its plain form (what :func:`gather_plan` exchanges) at hand:
    ``{key: (full shape, dtype, [(offset, shape), ...] or None)}``."""

    def plain(self) -> dict[str, Any]:
        """The layout as plain tuples."""
        ...


def gather_plan(
    coord: Coordinator,
    layout: Mapping[str, VariableLayout],
    *,
    checksums: Mapping[str, object] | None = None,
    cache: PlanCache | None = None,
    digest: str | None = None,
    tag: str = "plan",
    timeout: float | None = None,
) -> SavePlan:
    """The save plan of every rank's ``layout``, the same on every rank (collective).

    ``checksums`` maps this rank's replicated keys to a checksum of their value;
    replicas that differ raise :class:`~ckptvar.errors.ShardLayoutError` on every
    rank. With ``cache``, a layout seen before (on every rank) skips the second
    gather (and the third, which only a rank whose keys, shapes or dtypes differ from
    rank 0's needs). ``digest`` is ``layout_digest(layout)`` if the caller kept it (it costs
    a pass over the layout). ``timeout`` bounds each of the (one to three) collectives.
    """
    if digest is None:
        digest = layout_digest(layout)
    known = cache.keys() if cache is not None else frozenset()
    first = coord.allgather(
        (digest, dict(checksums or {}), known), tag=f"{tag}:digests", timeout=timeout
    )
    digests = tuple(d for d, _, _ in first)
    hit_key = PlanCache.key_of(digests)
    plan = None
    if cache is not None and all(hit_key in k for _, _, k in first):
        plan = cache.get(digests)
    if plan is None:
        mine = layout_message(_to_plain(layout), coord.rank)
        msgs = coord.allgather(mine, tag=f"{tag}:layouts", timeout=timeout)
        senders = spec_senders(msgs)
        specs: list[Any] = []
        if senders:  # some rank's keys, shapes or dtypes differ from rank 0's
            got = encode(_to_plain(layout)) if coord.rank in senders else None
            specs = coord.allgather(None if got is None else got[0], tag=f"{tag}:specs",
                                    timeout=timeout)
        plan = plan_messages(msgs, specs)
        if cache is not None:
            cache.put(digests, plan)
    check_replicas(plan, [c for _, c, _ in first])
    return plan


_Plain = dict[
    str, tuple[tuple[int, ...], str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]
]


def _to_plain(layout: Mapping[str, VariableLayout]) -> _Plain:
    """Tuples instead of dataclasses: several times smaller and faster to pickle.

    A layout that keeps its plain form (:class:`SupportsPlain`) hands it over as is.
    """
    if isinstance(layout, SupportsPlain):
        return layout.plain()
    return {
        key: (
            vl.full_shape,
            vl.dtype,
            None if vl.boxes is None else [(b.offset, b.shape) for b in vl.boxes],
        )
        for key, vl in layout.items()
    }

