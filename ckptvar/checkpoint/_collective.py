"""One checkpoint written by many processes, and restored by any number of them.

The save protocol (every step bounded by the coordinator's timeout):

1. plan: :func:`~ckptvar.distributed.gather_plan` (cached per coordinator, so a
   repeated save with the same layout skips the gather of the layouts);
2. prepare: rank 0 creates the temporary step directory and tells the others;
3. write: each rank writes the boxes the plan gives it into its own ordinary
   ckptvar file ``rank-NNNNN.<suffix>`` (each box has exactly one writer; a
   replicated value is written once); in a ``.zarr`` step, a variable whose boxes
   form a regular grid is instead one global Zarr array whose chunks its writers
   write (:func:`~ckptvar.storage.grid_layout`);
4. vote: any failure makes every rank raise ``DistributedError`` naming the failing
   ranks; rank 0 removes the temporary, nothing is committed;
5. commit: rank 0 writes the global index, fsyncs, renames the directory into place
   and records it; a last vote tells every rank the outcome.

A rank that times out in a vote tells the others it gave up on it; a rank stopped past
that timeout that then completes the vote finds the notice and raises the same
``DistributedTimeoutError`` (so it never commits, nor goes on alone to the next step),
and rank 0 looks once more just before it commits.

On per-node local disks (:class:`~._collective_targets.NodeLocalTarget`, a tiered
manager's local tier) every node's first rank does what rank 0 does for its node's
directory; a replicated value is also written once per node that holds it (into its
writer's ``replica-NNNNN`` file), each node's index points at its own copies, and the
whole step's index (one writer per value) is kept beside it for the persistent copy.

The restore is :mod:`._collective_restore`'s; the layout is
:mod:`ckptvar.storage._sharded`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import marshal
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .._dtypes import dtype_to_str
from ..distributed import (
    Box,
    Coordinator,
    PlanCache,
    SavePlan,
    SupportsPlain,
    VariableLayout,
    VariablePlan,
    gather_plan,
)
from ..errors import CkptError
from ..locations import is_url
from ..storage import (
    INDEX_FILE,
    BaseFileLost,
    GridReuse,
    as_host,
    box_key,
    grid_layout,
    pack_index,
    rank_file,
)
from ..variables import Variable
from ._collective_incremental import check_base, read_sums, stored_known, stored_rows
from ._collective_targets import Nodes, Target, replica_file, target_for
from ._files import native_backend
from ._incremental import IncrementalSave
from ._logical import Logical

__all__ = [
    "collective_write", "last_timings", "needs_collective", "plan_cache", "rank_variables",
]

logger = logging.getLogger("ckptvar")

#: Seconds each step of this process's last collective save took (plan, prepare, write,
#: vote, commit): what the ``scale`` benchmark reports as the protocol's overhead.
last_timings: dict[str, float] = {}

_CACHES: weakref.WeakKeyDictionary[Coordinator, PlanCache] = weakref.WeakKeyDictionary()


def plan_cache(coord: Coordinator) -> PlanCache:
    """The plan cache kept for ``coord`` (a repeated layout skips the layout gather)."""
    cache = _CACHES.get(coord)
    if cache is None:
        cache = _CACHES[coord] = PlanCache()
    return cache


_Raw = tuple[str, tuple[int, ...], str, tuple[int, ...] | None, tuple[int, ...]]


class _LazyLayout(Mapping[str, VariableLayout], SupportsPlain):
    """This rank's layouts, built only when the plan is not cached (a miss)."""

    def __init__(self, raw: list[_Raw]) -> None:
        self._raw = raw
        self._built: dict[str, VariableLayout] | None = None

    def _get(self) -> dict[str, VariableLayout]:
        if self._built is None:
            self._built = {
                key: VariableLayout(full, dtype, None if boxes is None else tuple(
                    Box(offset, shape) for offset, shape in boxes))
                for key, (full, dtype, boxes) in self.plain().items()
            }
        return self._built

    def plain(self) -> dict[str, Any]:
        """What ``gather_plan`` exchanges: ``key -> (full shape, dtype, boxes or None)``;
        the rows of a key this rank holds several boxes of are merged."""
        out: dict[str, Any] = {}
        for key, full, dtype, offset, shape in self._raw:
            had = out.get(key)
            if had is not None and offset is not None and had[2] is not None:
                had[2].append((offset, shape))
            else:
                out[key] = (full, dtype, None if offset is None else [(offset, shape)])
        return out

    def __getitem__(self, key: str) -> VariableLayout:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._raw)


def _raw_layouts(
    arrays: Sequence[tuple[str, np.ndarray, dict[str, Any]]],
    variables: Mapping[str, Variable | Logical],
) -> tuple[list[_Raw], dict[str, int]]:
    """This rank's layout rows (sorted) and the checksums of its small replicated values.

    A key may have several rows (boxes): its variable is then a :class:`Logical` whose
    parts hold those boxes, in the rows' order. One pass, no per-variable objects: this runs on every save, cached plan or not.
    """
    raw: list[_Raw] = []
    add = raw.append
    checks: dict[str, int] = {}
    names: dict[np.dtype, str] = {}  # one name per dtype, not one call per value
    seen: dict[str, int] = {}
    for key, array, _ in arrays:
        var = variables[key]
        if isinstance(var, Logical):  # several boxes of ``key`` here: one row each, in order
            n = seen[key] = seen.get(key, -1) + 1
            var = var.parts[n]
        shard = var.shard if isinstance(var, Variable) else None
        dtype = array.dtype
        name = names.get(dtype)
        if name is None:
            name = names[dtype] = dtype_to_str(dtype)  # a name: bfloat16 is no bare V2
        shape = array.shape
        if shard is None:
            add((key, shape, name, None, shape))
            if array.nbytes <= (1 << 20):  # large replicas: not compared
                checks[key] = zlib.crc32(np.ascontiguousarray(as_host(array)).tobytes())
        else:
            add((key, shard.full_shape, name, shard.offset, shape))
    raw.sort()
    return raw, checks


class _RowsCache:
    """The last save's layout rows and digest, for the same variables saved again.

    A variable's dtype, shape and shard are fixed when it is made, so the same keys
    naming the same variable objects (checked through weak references: the cache
    keeps no model alive) with arrays of the same shapes have the same rows; only the
    checksums of small replicated values are computed again.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.refs: list[weakref.ref[Variable]] = []
        self.shapes: list[tuple[int, ...]] = []
        self.raw: list[_Raw] = []
        self.digest = ""
        #: positions in ``arrays`` of the small replicated values (checksummed each save)
        self.replicated: list[int] = []

    def hit(self, keys: list[str], vals: list[Any], shapes: list[tuple[int, ...]]) -> bool:
        return (keys == self.keys and shapes == self.shapes
                and all(r() is v for r, v in zip(self.refs, vals, strict=True)))


_ROWS = _RowsCache()


def _layout_rows(
    arrays: Sequence[tuple[str, np.ndarray, dict[str, Any]]],
    variables: Mapping[str, Variable | Logical],
) -> tuple[list[_Raw], dict[str, int], str]:
    """This rank's layout rows, replica checksums and the rows' digest (:class:`_RowsCache`)."""
    keys = [key for key, _, _ in arrays]
    vals = [variables[key] for key in keys]
    shapes = [array.shape for _, array, _ in arrays]
    cache = _ROWS
    if cache.hit(keys, vals, shapes):
        checks = {}
        for i in cache.replicated:
            key, array, _ = arrays[i]
            checks[key] = zlib.crc32(np.ascontiguousarray(as_host(array)).tobytes())
        return cache.raw, checks, cache.digest
    raw, checks = _raw_layouts(arrays, variables)
    # marshal version 2 (no reference table) is the fastest stable serialisation of the rows
    digest = hashlib.blake2b(marshal.dumps(raw, 2), digest_size=16).hexdigest()
    if all(type(v) is Variable for v in vals):
        cache.keys, cache.shapes, cache.raw, cache.digest = keys, shapes, raw, digest
        cache.refs = [weakref.ref(v) for v in vals]  # type: ignore[arg-type]
        cache.replicated = [i for i, key in enumerate(keys) if key in checks]
    else:
        cache.keys, cache.refs = [], []
    return raw, checks, digest


def collective_write(  # noqa: PLR0917 - the protocol, step by step
    path: str | os.PathLike[str],
    fmt: str,
    arrays: Sequence[tuple[str, np.ndarray, dict[str, Any]]],
    meta: dict[str, Any],
    variables: Mapping[str, Variable | Logical],
    coord: Coordinator,
    *,
    timeout: float | None = None,
    on_commit: Callable[[str], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    pack_threshold: int | None = None,
    incremental: IncrementalSave | None = None,
) -> str:
    """Write one checkpoint at ``path`` (a shared directory's path, or an object-store
    URL) from every rank's ``arrays`` (collective). Returns the path or URL.
    ``pack_threshold`` goes to the writer of each rank's file. ``incremental`` (each
    rank's): the step may refer to its base's bytes (:mod:`._collective_incremental`)."""
    path = os.fspath(path)
    target = target_for(path, fmt, storage_options, is_url(path))
    target.pack_threshold = pack_threshold
    # A URL is the same for every rank: in the tag, ranks that name different URLs (or
    # one a URL, another a local path) meet at different collectives, an error on every
    # rank, never rank 0's step committed without the others' files.
    tag = f"save:{path.rstrip('/') if is_url(path) else os.path.basename(path.rstrip('/'))}"
    clock = _Clock()
    raw, checks, digest = _layout_rows(arrays, variables)
    values = {key: (array, attrs) for key, array, attrs in arrays}
    boxed = _boxed(arrays, variables)
    plan = gather_plan(
        coord, _LazyLayout(raw), checksums=checks, cache=plan_cache(coord),
        digest=digest, tag=f"{tag}:plan", timeout=timeout,
    )
    clock.lap("plan")
    suffix = native_backend(path, fmt).suffixes[0]
    # prepare: rank 0 makes the step ready (a temporary directory, or a claim on the URL)
    grid = _grid(plan, fmt, suffix, coord.size) if target.grids else None
    token, base, failure = _prepare(coord, path, target, fmt, plan, values, grid, incremental)
    shared, base, where = _announce(coord, target, [token, base, _directory(path)],
                                    tag=f"{tag}:prepare", timeout=timeout)
    if target.nodes is None:  # (per-node local directories differ by design)
        failure = failure or _elsewhere(path, where, coord.rank)
    leads = target.leads(coord.rank)
    try:
        coord.vote(failure, tag=f"{tag}:prepare", timeout=timeout)
        clock.lap("prepare")
        target.attach(shared)
        # write: this rank's boxes into its own file
        failure = None
        mine = _mine(plan, coord.rank, grid)
        try:
            target.begin()
            _write_mine(target, grid, mine, values, boxed, coord.rank, suffix,
                        None if incremental is None else incremental.on(base),
                        step=path.rstrip("/").rpartition("/")[2])
            if target.nodes is not None:
                _write_replicas(target, target.nodes, plan, values, coord.rank, suffix)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
        clock.lap("write")
        coord.vote(failure, tag=f"{tag}:write", timeout=timeout)
        clock.lap("vote")
        # commit: rank 0 (per node: each node's first rank) writes the index and makes
        # the step visible
        failure, final = _commit(target, coord, tag, timeout, on_commit,
                                 lambda: _index(target, fmt, suffix, plan, values, meta,
                                                coord.size, grid),
                                 lambda: _node_indexes(target, fmt, suffix, plan, values, meta,
                                                       coord.size))
        _last_vote(coord, failure, final, target, tag=f"{tag}:commit",
                   timeout=timeout)
        clock.lap("commit")
        if incremental is not None:
            incremental.committed(path)
    except BaseException:
        if leads and shared is not None:
            target.abort()
        raise
    last_timings.clear()
    last_timings.update(clock.laps)
    return path if is_url(path) else os.fspath(Path(path))


def _announce(coord: Coordinator, target: Target, prepared: list[Any], *, tag: str,
              timeout: float | None) -> list[Any]:
    """Rank 0's ``prepared`` ``[token, base, directory]`` on every rank. Where rank 0 came
    late (the others gave up on this broadcast), it removes the step it made ready."""
    try:
        got: list[Any] = coord.broadcast(prepared, tag=tag, timeout=timeout)
    except BaseException:
        if prepared[0] is not None:
            target.attach(prepared[0])
            target.abort()
        raise
    return got


def _commit(  # noqa: PLR0917
    target: Target,
    coord: Coordinator,
    tag: str,
    timeout: float | None,
    on_commit: Callable[[str], None] | None,
    index: Callable[[], bytes],
    node_indexes: Callable[[], list[bytes]],
) -> tuple[BaseException | None, str | None]:
    """The commit step: rank 0 builds the index (per node: every node's, sent to each
    node's first rank), the committing ranks store it; returns this rank's failure and
    what it committed (``None``: nothing)."""
    failure: BaseException | None = None
    final: str | None = None
    mine: Any = None
    if coord.is_primary:
        try:
            mine = index() if target.nodes is None else (index(), node_indexes())
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
    if target.nodes is not None:
        mine = coord.broadcast(mine, tag=f"{tag}:index", timeout=timeout)
        if mine is not None:
            target.persistent_index = mine[0]
            mine = mine[1][target.nodes.node_of(coord.rank)]
    if target.leads(coord.rank) and mine is not None:
        # a process that gave up on the write vote just as this one passed it: raise as
        # it did (the step is aborted, never committed); checked last, before the commit
        coord.raise_if_given_up()
        try:
            final = target.commit(mine)
            if on_commit is not None:
                on_commit(final)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
    return failure, final


def _last_vote(coord: Coordinator, failure: BaseException | None, final: str | None,
               target: Target, *, tag: str, timeout: float | None) -> None:
    """The vote after the commit. Where it fails (a process stopped in it) after this rank
    committed ``final``, or after rank 0 did (a shared directory or the step's commit
    marker shows it), the error says that the step is committed and whole."""
    try:
        coord.vote(failure, tag=tag, timeout=timeout)
    except BaseException as exc:
        if final is None and failure is None:
            with contextlib.suppress(OSError, CkptError):  # (a store that does not answer)
                final = target.committed()
        if final is not None:
            exc.add_note(f"{final} was committed before this last vote (every process's "
                         "write had passed the vote before it): it is whole, and it is the "
                         "latest step")
        raise


def _directory(path: str) -> str | None:
    """The absolute directory of a local ``path`` (``None`` for a URL: the tag holds it)."""
    return None if is_url(path) else os.path.dirname(os.path.abspath(path))


def _elsewhere(path: str, where: str | None, rank: int) -> CkptError | None:
    """The error of a rank whose local ``path`` is not in rank 0's directory ``where``
    (each rank would be told its own path, and only rank 0's would hold the step)."""
    mine = _directory(path)
    if mine is None or where is None or mine == where:
        return None
    with contextlib.suppress(OSError):
        if os.path.samefile(mine, where):
            return None
    return CkptError(
        f"rank {rank} saves to {path!r}, rank 0 into {where!r}: every process of a "
        "collective save names the same checkpoint"
    )


def _prepare(  # noqa: PLR0917
    coord: Coordinator,
    path: str,
    target: Target,
    fmt: str,
    plan: Any,
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]],
    grid: Any,
    incremental: IncrementalSave | None,
) -> tuple[str | None, str | None, BaseException | None]:
    """Rank 0 makes the step ready (a temporary directory, or a claim on the URL) and
    picks an incremental save's base: ``(token, base, failure)``; others: nothing."""
    if not coord.is_primary:
        return None, None, None
    token = base = None
    try:
        token = target.prepare()
        if incremental is not None:
            base = _base(path, target, fmt, plan, values, coord.size, grid, incremental)
    except BaseException as exc:  # noqa: BLE001 - reported through the vote
        return token, None, exc
    return token, base, None


def _base(  # noqa: PLR0917
    path: str,
    target: Target,
    fmt: str,
    plan: Any,
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]],
    size: int,
    grid: Any,
    incremental: IncrementalSave,
) -> str | None:
    """Rank 0: the base step of an incremental save, or ``None`` (the step is written
    whole, and the log says why)."""
    if incremental.base is None:
        return None
    base = os.fspath(incremental.base)
    why = check_base(base, target.base_index, fmt, size, _packed_variables(plan, values, grid))
    if why is not None:
        logger.warning("Incremental save of %s: writing every value: %s.", path, why)
        return None
    return base


def _write_mine(  # noqa: PLR0917
    target: Target,
    grid: Any,
    mine: list[tuple[str, str, tuple[int, ...]]],
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]],
    boxed: Mapping[tuple[str, tuple[int, ...]], np.ndarray],
    rank: int,
    suffix: str,
    incremental: IncrementalSave | None = None,
    *,
    step: str = "",
) -> None:
    """The write step on one rank: its chunks of global arrays, then its own file
    (with ``incremental``, referring to its base's bytes where they are unchanged, and
    storing a changed variable whose written rows are known as a row delta). A file
    gone from the base's file of this rank (deleted by hand) makes this rank's file of
    ``step`` (its name) written whole, logged."""
    base = None if incremental is None or incremental.base is None else os.fspath(
        incremental.base)
    if grid is not None:  # a local step directory
        reuse = None
        if base is not None and incremental is not None and rank in grid.writers():
            reuse = GridReuse(Path(base), read_sums(Path(base)), incremental.known)
        grid.write(target.where, rank, values, boxed=boxed, reuse=reuse)
    if not mine:
        return

    def fill(writer: Any) -> None:
        for key, stored, offset in mine:
            array, attrs = values[key]
            if boxed:
                array = boxed.get((key, offset), array)
            writer.add(stored, array, attrs)
        writer.set_metadata({"sharded": {"rank": rank}})

    known = rows = None
    if base is not None and incremental is not None:  # the values are read: ask the rows
        known = stored_known(incremental.known, mine)
        rows = stored_rows(incremental.changed_rows(), mine)
    name = rank_file(rank, suffix)
    limits = None if incremental is None else incremental.limits
    try:
        target.write_rank(name, fill, base=base, known=known, rows=rows,
                          pieces=incremental is not None, limits=limits)
    except BaseFileLost as exc:  # only this rank's file: the others' bases are whole
        if base is None:
            raise
        logger.warning("Step %s: process %d's file %s is written whole: %s", step, rank,
                       name, exc)
        target.write_rank(name, fill, pieces=True, limits=limits)


def _replicas(nodes: Nodes, plan: SavePlan, node: int) -> dict[str, int]:
    """``key -> rank`` of the replicated values ``node`` keeps a copy of itself: those
    whose writer is on another node, each written by the node's first holder."""
    group = nodes.groups[node]
    out: dict[str, int] = {}
    for key, vp in plan.variables.items():
        if vp.replicated and vp.items and vp.items[0].writer not in group:
            here = [r for r in vp.holders if r in group]
            if here:
                out[key] = here[0]
    return out


def _write_replicas(  # noqa: PLR0917
    target: Target, nodes: Nodes, plan: SavePlan,
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]], rank: int, suffix: str,
) -> None:
    """A per-node step: this rank's copies of the replicated values its node keeps."""
    mine = [key for key, writer in _replicas(nodes, plan, nodes.node_of(rank)).items()
            if writer == rank]
    if not mine:
        return

    def fill(writer: Any) -> None:
        for key in mine:
            array, attrs = values[key]
            writer.add(box_key(key, 0), array, attrs)
        writer.set_metadata({"sharded": {"rank": rank, "replicas": True}})

    target.write_rank(replica_file(rank, suffix), fill)


def _node_indexes(  # noqa: PLR0917
    target: Target, fmt: str, suffix: str, plan: SavePlan,
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]], meta: dict[str, Any], size: int,
) -> list[bytes]:
    """Each node's index: the step's, with the replicated values it keeps read from its
    own copies (``replica-NNNNN`` files, listed after the ranks' files)."""
    nodes = target.nodes
    assert nodes is not None
    out = []
    for node, group in enumerate(nodes.groups):
        copies = _replicas(nodes, plan, node)
        files = [rank_file(r, suffix) for r in range(size)] + [
            replica_file(r, suffix) for r in group]
        variables = {
            key: VariablePlan(vp.key, vp.full_shape, vp.dtype, vp.replicated, tuple(
                dataclasses.replace(it, writer=size + group.index(copies[key]))
                for it in vp.items), vp.holders) if key in copies else vp
            for key, vp in plan.variables.items()
        }
        packed = _packed_variables(SavePlan(plan.size, variables), values)
        out.append(pack_index(fmt, size, files, packed, meta))
    return out


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


def rank_variables(variables: Mapping[str, Any]) -> dict[str, Any]:
    """What this rank writes or reads for each key of a multi-process save/restore.

    A logical value made of one variable that holds a shard (how a one-process save
    sees a shard) is that variable: each rank then writes or reads its own box. Other
    values (plain variables, partitioned variables assembled on this rank) are as given.
    """
    out: dict[str, Any] = {}
    for key, var in variables.items():
        if isinstance(var, Logical) and len(var.parts) == 1 and var.parts[0].shard is not None:
            out[key] = var.parts[0]
        else:
            out[key] = var
    return out


def needs_collective(coord: Any, variables: Iterable[Any]) -> bool:
    """Whether a save/restore with ``coord`` takes the multi-process path.

    More than one process, or a coordinator given with a variable that holds a shard.
    """
    if coord is None:
        return False
    if coord.size > 1:
        return True
    for var in variables:
        parts = var.parts if isinstance(var, Logical) else (var,)
        if any(isinstance(p, Variable) and p.shard is not None for p in parts):
            return True
    return False


# One entry each: a repeated save with the same (cached) plan reuses them.
_MINE: dict[int, tuple[Any, int, Any, list[tuple[str, str, tuple[int, ...]]]]] = {}
_PACKED: dict[int, tuple[Any, tuple[Any, ...], Any, bytes]] = {}


def _grid(plan: Any, fmt: str, suffix: str, size: int) -> Any:
    """The variables a ``.zarr`` step stores as global arrays (``None``: none, or HDF5)."""
    if fmt != "zarr":
        return None
    reserved = [INDEX_FILE, "zarr.json"] + [rank_file(r, suffix) for r in range(size)]
    return grid_layout(plan, size, reserved)


def _boxed(
    arrays: Sequence[tuple[str, np.ndarray, dict[str, Any]]],
    variables: Mapping[str, Variable | Logical],
) -> dict[tuple[str, tuple[int, ...]], np.ndarray]:
    """``(key, offset) -> value`` of the keys this rank holds several boxes of."""
    out: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    seen: dict[str, int] = {}
    for key, array, _ in arrays:
        var = variables[key]
        if isinstance(var, Logical):
            n = seen[key] = seen.get(key, -1) + 1
            shard = var.parts[n].shard
            if shard is not None:
                out[key, tuple(int(o) for o in shard.offset)] = array
    return out


def _mine(plan: Any, rank: int, grid: Any = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(key, stored key, box offset)`` of each box ``rank`` writes under ``plan`` into its
    own file."""
    hit = _MINE.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] == rank and hit[2] is grid:
        return hit[3]
    mine = [(key, box_key(key, j), tuple(int(o) for o in item.box.offset))
            for key, vp in plan.variables.items()
            if grid is None or key not in grid
            for j, item in vp.written_by(rank)]
    _MINE.clear()
    _MINE[id(plan)] = (plan, rank, grid, mine)
    return mine


def _packed_variables(
    plan: Any, values: Mapping[str, tuple[np.ndarray, dict[str, Any]]], grid: Any = None
) -> bytes:
    """The index's ``variables`` map, msgpack-packed (reused while plan and attributes agree)."""
    sig = tuple(tuple(attrs.items()) for _, attrs in values.values())
    hit = _PACKED.get(id(plan))
    if hit is not None and hit[0] is plan and hit[1] == sig and hit[2] is grid:
        return hit[3]
    variables: dict[str, dict[str, Any]] = {}
    for key, vp in plan.variables.items():
        gv = grid.variables.get(key) if grid is not None else None
        if gv is None:  # from the plan's arrays: no object per box
            offsets, shapes, writers = vp.plain_boxes()
            boxes = [[o, s, w, box_key(key, j)]
                     for j, (o, s, w) in enumerate(zip(offsets, shapes, writers, strict=True))]
        else:
            boxes = [[list(item.box.offset), list(item.box.shape), item.writer,
                      gv.chunk_rel(item.box)] for item in vp.items]
        attrs = values[key][1] if key in values else {}
        variables[key] = {"shape": list(vp.full_shape), "dtype": vp.dtype, "attrs": attrs,
                          "boxes": boxes}
        if gv is not None:
            variables[key]["grid"] = gv.index_entry()
    packed: bytes = msgpack.packb(variables, use_bin_type=True)
    _PACKED.clear()
    _PACKED[id(plan)] = (plan, sig, grid, packed)
    return packed


def _index(  # noqa: PLR0917
    target: Target,
    fmt: str,
    suffix: str,
    plan: Any,
    values: Mapping[str, tuple[np.ndarray, dict[str, Any]]],
    meta: dict[str, Any],
    size: int,
    grid: Any = None,
) -> bytes:
    """The step's global index (the chunks' checksums of global arrays collected first)."""
    files = [rank_file(r, suffix) for r in range(size)]
    packed = _packed_variables(plan, values, grid)
    sums = None if grid is None else grid.collect(target.where)
    return pack_index(fmt, size, files, packed, meta, checksums=sums)
