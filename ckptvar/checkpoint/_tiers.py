"""Tiers on per-node local disks: the nodes, a spread step's persistent copy, restore order.

Which processes share a node's directory, the persistent copy of a step whose parts
lie on several nodes, and the order a restore tries the steps in.

A tiered manager's local tier (``local_directory=``) may be one directory every
process sees, or one per node that only that node's processes see. Which it is, is
found by looking (:func:`discover_nodes`), never by a setting: every process leaves a
probe file in its local directory, and the processes that see each other's probes
share a node. On per-node disks a local step is written per node
(:class:`~._collective_targets.NodeLocalTarget`): each node holds its processes'
files, its own copies of replicated values and its own index. Its persistent copy
(:func:`persist_parts`) is collective: each process copies its own file, then rank 0
commits the step with the whole step's index, all or nothing. A local step counts
only where every node committed it (:func:`restore_order`).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

from ..errors import CkptError
from ..locations import is_url
from ..storage import rank_file
from ._collective_targets import PERSISTENT_INDEX, Nodes, target_for
from ._files import native_backend

__all__ = ["discover_nodes", "persist_parts", "restore_order"]

_PROBE = ".tier-probe-"


def discover_nodes(coord: Any, local: Path, timeout: float | None = None) -> Nodes:
    """Which processes share ``local`` (collective): those that see each other's probe.

    Raises ``CkptError`` on every process when what the processes see is not a
    partition into nodes (rank A sees B's probe but B does not see A's)."""
    local.mkdir(parents=True, exist_ok=True)
    token = coord.broadcast(uuid.uuid4().hex, tag="tiers-probe", timeout=timeout)
    prefix = f"{_PROBE}{token}-"
    probe = local / f"{prefix}{coord.rank}"
    probe.touch()
    try:
        coord.barrier(tag="tiers-probe-made", timeout=timeout)
        seen = sorted(int(e.name[len(prefix):]) for e in os.scandir(local)
                      if e.name.startswith(prefix) and e.name[len(prefix):].isdigit())
        views: list[list[int]] = coord.allgather(seen, tag="tiers-probe-seen", timeout=timeout)
        coord.barrier(tag="tiers-probe-read", timeout=timeout)
    finally:
        probe.unlink(missing_ok=True)
    _reclaim_probes(local)
    groups = sorted({tuple(v) for v in views})
    if any(rank not in view or tuple(views[other]) != tuple(view)
           for rank, view in enumerate(views) for other in view):
        detail = "; ".join(f"rank {r} sees {v}" for r, v in enumerate(views))
        raise CkptError(
            f"local_directory {os.fspath(local)!r}: the processes do not split into nodes "
            f"that each see one directory ({detail}); every process of a node must see the "
            "same directory, and no other node's."
        )
    return Nodes(tuple(groups))


#: a probe older than this was left by a process that died while it looked
_PROBE_STALE_S = 3600.0


def _reclaim_probes(local: Path) -> None:
    """Remove the probes dead processes left in ``local``."""
    now = time.time()
    for entry in os.scandir(local):
        if entry.name.startswith(_PROBE):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > _PROBE_STALE_S:
                    os.unlink(entry.path)


def _writers(index: bytes) -> set[int]:
    """The files (by rank) a step's index reads values from."""
    doc = msgpack.unpackb(index, raw=False, strict_map_key=False)
    return {int(box[2]) for rec in doc["variables"].values() for box in rec["boxes"]}


def persist_parts(  # noqa: PLR0917 - the persistent copy's protocol, step by step
    coord: Any,
    local_step: Path,
    dest: str,
    fmt: str,
    storage_options: Mapping[str, Any] | None,
    on_commit: Callable[[str], None],
    timeout: float | None = None,
) -> str:
    """Copy the per-node step ``local_step`` to ``dest`` (a path or URL) as one step
    (collective): each process copies its own file of its node's step; once every copy
    is there, rank 0 commits with the whole step's index and calls ``on_commit``.

    Any failure (a process's copy, the commit) raises ``DistributedError`` on every
    process naming the failed ones, and rank 0 removes what the copy wrote: nothing is
    committed, and the local steps are not touched."""
    tag = f"persist:{os.path.basename(dest.rstrip('/'))}"
    suffix = native_backend(dest, fmt).suffixes[0]
    target = target_for(dest, fmt, storage_options, is_url(dest))
    token: str | None = None
    failure: BaseException | None = None
    if coord.is_primary:
        try:
            token = target.prepare()
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
    shared = coord.broadcast(token, tag=f"{tag}:prepare", timeout=timeout)
    try:
        coord.vote(failure, tag=f"{tag}:prepare", timeout=timeout)
        target.attach(shared)
        failure = None
        index = b""
        try:
            index = (local_step / PERSISTENT_INDEX).read_bytes()
            if coord.rank in _writers(index):
                name = rank_file(coord.rank, suffix)
                target.put_file(name, local_step / name)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
        coord.vote(failure, tag=f"{tag}:copy", timeout=timeout)
        failure = None
        if coord.is_primary:
            try:
                on_commit(target.commit(index))
            except BaseException as exc:  # noqa: BLE001 - reported through the vote
                failure = exc
        coord.vote(failure, tag=f"{tag}:commit", timeout=timeout)
    except BaseException:
        if coord.is_primary and shared is not None:
            target.abort()
        raise
    return dest


def restore_order(local: Sequence[Sequence[int]], persistent: Sequence[int]
                  ) -> list[tuple[int, str]]:
    """``(number, "local" | "persistent")`` to try, newest first, the local copy first.

    ``local[r]``: the steps process ``r``'s node committed locally; a local step counts
    only where every process's node holds it.

    >>> restore_order([[4, 5], [4]], [2, 4])
    [(4, 'local'), (4, 'persistent'), (2, 'persistent')]
    """
    everywhere = set(local[0]).intersection(*map(set, local[1:])) if local else set()
    order = [(n, "local") for n in everywhere] + [(n, "persistent") for n in set(persistent)]
    return sorted(order, key=lambda e: (-e[0], e[1] != "local"))
