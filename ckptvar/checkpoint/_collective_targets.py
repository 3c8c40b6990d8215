"""Where a multi-process save puts its step: a shared local directory, or an object store.

:func:`~._collective.collective_write` runs the protocol (plan, prepare, write, vote,
commit) and asks its target for the place-specific parts:

- :class:`LocalTarget`: rank 0 creates a hidden temporary directory beside the final
  path; each rank writes its file into it; rank 0 writes the index, fsyncs and renames
  the directory into place, create-only (``locations.publish``; needs a
  filesystem every process sees).
- :class:`NodeLocalTarget`: a step on per-node local disks (a local tier whose
  directory each node has its own of, :class:`Nodes`): each node's first rank makes
  the same temporary there, every rank writes its file (and its node's copies of
  replicated values, ``replica-NNNNN``) into its own node's, and each node's first
  rank writes that node's index and renames it into place.
- :class:`RemoteTarget`: rank 0 claims the step's key (create-only); each rank writes
  its file to a local temporary and uploads it below the step; rank 0 uploads the
  index and creates the commit marker (:class:`~ckptvar.storage.RemoteStep`). No
  shared filesystem is needed. In an incremental save each process's file builds on
  the same process's file in the base step: a Zarr file takes its unchanged values as
  server-side copies, an HDF5 file refers to byte ranges of the base's object; a box
  with known written rows may be a row delta on it (Zarr: its base and earlier patches
  copied on the server; HDF5: referred to in the objects that hold them).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError
from ..locations import is_committed, publish, split_url, staging_directory
from ..storage import (
    INDEX_FILE,
    DeltaLimits,
    RemoteStep,
    Writer,
    fsync_dir,
    fsync_path,
    partial_path,
    remove_path,
)
from ..storage.links import inside
from ..storage.rawio import read_regular
from ._files import make_parents, native_backend

__all__ = [
    "PERSISTENT_INDEX", "ZARR_ROOT", "LocalTarget", "NodeLocalTarget", "Nodes", "RemoteTarget",
    "Target", "nodes_of", "register_nodes", "replica_file", "target_for",
]

#: In a step on per-node disks: the index of the whole step as one directory holds it
#: (every value's one writer), which its persistent copy is committed with.
PERSISTENT_INDEX = "ckptvar-tier-index.msgpack"


@dataclass(frozen=True)
class Nodes:
    """Which processes share a node-local directory: ``groups[k]``, the ranks of node ``k``
    (sorted, nodes ordered by their first rank)."""

    groups: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        return next(k for k, group in enumerate(self.groups) if rank in group)

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's first (the one that commits there)."""
        return self.groups[self.node_of(rank)][0] == rank


#: per-node local directories (their real paths) and their nodes, registered by a tiered
#: manager: a multi-process save into one of them takes :class:`NodeLocalTarget`
_NODE_DIRECTORIES: dict[str, Nodes] = {}


def register_nodes(directory: str | os.PathLike[str], nodes: Nodes | None) -> None:
    """Saves into ``directory`` (a local tier on per-node disks) are written per node
    (``None``: it is one shared directory again)."""
    if nodes is None or len(nodes.groups) < 2:
        _NODE_DIRECTORIES.pop(os.path.realpath(directory), None)
    else:
        _NODE_DIRECTORIES[os.path.realpath(directory)] = nodes


def nodes_of(directory: str | os.PathLike[str]) -> Nodes | None:
    return _NODE_DIRECTORIES.get(os.path.realpath(directory))


def replica_file(rank: int, suffix: str) -> str:
    """A rank's file of its node's copies of replicated values (per-node steps)."""
    return f"replica-{rank:05d}{suffix}"


#: The root ``zarr.json`` of a multi-process ``.zarr`` step: a plain group naming the index.
ZARR_ROOT = (b'{"zarr_format": 3, "node_type": "group", "attributes": '
             b'{"ckptvar_sharded": {"index": "' + INDEX_FILE.encode() + b'"}}}')


class Target:
    """The place-specific steps of a multi-process save (see the module docstring)."""

    #: whether values may be stored as global Zarr arrays (needs a shared directory)
    grids = False
    #: the step is committed on every node (:class:`NodeLocalTarget`), not by rank 0 alone
    nodes: Nodes | None = None
    #: per-node steps: the whole step's index, kept beside each node's (set before commit)
    persistent_index: bytes | None = None

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        #: the writer's ``pack_threshold`` for each rank's file (None: its default)
        self.pack_threshold: int | None = None

    def prepare(self) -> str:
        """Rank 0: make the step ready for writing; returns what every rank attaches to."""
        raise NotImplementedError

    def attach(self, token: str) -> None:
        """Every rank: take what :meth:`prepare` returned on rank 0."""

    @property
    def where(self) -> Path:
        """The shared step directory being written (targets with :attr:`grids` only)."""
        raise NotImplementedError

    def write_rank(self, name: str, fill: Callable[[Writer], None], *,
                   base: str | None = None, known: Mapping[str, bool] | None = None,
                   rows: Mapping[str, Any] | None = None, pieces: bool = False,
                   limits: DeltaLimits | None = None) -> None:
        """Write this rank's file ``name``: ``fill`` adds its values and metadata.
        ``base``: an earlier step (its path or URL, from :meth:`base_index`'s caller)
        whose file ``name`` it may refer to (an incremental save; ``known``: by stored
        key, as the writers take it; ``rows``: by stored key, the rows written since
        ``base`` of changed variables, which may be stored as row deltas where the target
        writes them, by the rule's ``limits``); ``pieces``: large Zarr values as several
        chunks (an incremental manager's, local only)."""
        raise NotImplementedError

    def base_index(self, base: str) -> bytes:
        """The index of the earlier step ``base`` (an incremental save's base)."""
        raise NotImplementedError

    def commit(self, index: bytes) -> str:
        """Rank 0, after every rank wrote: store ``index`` and make the step visible."""
        raise NotImplementedError

    def abort(self) -> None:
        """Rank 0, on failure after :meth:`prepare`: remove what the save wrote."""

    def committed(self) -> str | None:
        """Any rank, after a failed last vote: the step's path if it stands committed
        (``None``: it is not, or this rank cannot tell)."""
        return None

    def begin(self) -> None:
        """Every rank, before it writes (its failure is voted on)."""

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` commits (and aborts) the step: rank 0, or each node's first."""
        return rank == 0

    def put_file(self, name: str, src: Path) -> None:
        """Store the finished file (or Zarr directory) ``src`` as this rank's ``name``."""
        raise NotImplementedError


class LocalTarget(Target):
    """A step directory on a filesystem every rank sees; committed by an atomic rename."""

    grids = True

    def __init__(self, path: str, fmt: str) -> None:
        super().__init__(fmt)
        self.final = Path(path)
        self._tmp: Path | None = None
        self._where: Path | None = None

    def prepare(self) -> str:
        make_parents(self.final)
        if os.path.lexists(self.final):
            raise CheckpointExistsError(
                f"Cannot save {str(self.final)!r}: it is committed already; a step is "
                "written once: save under a new step, or prune this one first."
            )
        tmp = partial_path(self.final)
        tmp.mkdir()
        self._tmp = tmp
        if self.fmt == "zarr":
            (tmp / "zarr.json").write_bytes(ZARR_ROOT)
        return os.fspath(tmp)

    def attach(self, token: str) -> None:
        self._where = Path(token)

    @property
    def where(self) -> Path:
        assert self._where is not None, "attach() first"
        return self._where

    def write_rank(self, name: str, fill: Callable[[Writer], None], *,
                   base: str | None = None, known: Mapping[str, bool] | None = None,
                   rows: Mapping[str, Any] | None = None, pieces: bool = False,
                   limits: DeltaLimits | None = None) -> None:
        own = None if base is None else Path(base) / name
        if own is not None and not os.path.lexists(own):
            own = None  # the rank wrote no file of its own there
        extra: dict[str, Any] = {} if own is None else {"base": own, "known": known or {}}
        if own is not None and rows:
            # row deltas on the same rank's file in the base step
            extra.update(rows=rows, limits=limits)
        if pieces and self.fmt == "zarr":
            extra["piece_bytes"] = True
        _write_file(self.where / name, self.fmt, fill, durable=True,
                    pack_threshold=self.pack_threshold, **extra)

    def base_index(self, base: str) -> bytes:
        # never waits on a pipe, nor reads an index from outside the step
        return read_regular(inside(Path(base), Path(base) / INDEX_FILE, "The step index"),
                            1 << 30)

    def put_file(self, name: str, src: Path) -> None:
        dst = self.where / name
        if src.is_dir():
            shutil.copytree(src, dst)
            for sub in sorted(dst.rglob("*")):
                if sub.is_file():
                    fsync_path(sub)
                else:
                    fsync_dir(sub)
            fsync_dir(dst)
        else:
            shutil.copyfile(src, dst)
            fsync_path(dst)

    def commit(self, index: bytes) -> str:
        tmp = self.where
        with open(tmp / INDEX_FILE, "wb") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        try:
            publish(tmp, self.final, create_only=True)  # never onto another writer's step
        except CheckpointExistsError:
            raise CheckpointExistsError(
                f"Cannot commit {str(self.final)!r}: another writer committed it while this "
                "save was writing."
            ) from None
        fsync_path(self.final)
        self._tmp = None
        return os.fspath(self.final)

    def abort(self) -> None:
        tmp, self._tmp = self._tmp, None
        if tmp is not None and tmp.exists():
            remove_path(tmp)

    def committed(self) -> str | None:
        # prepare() refused a step already there: if it is there now, this save renamed it
        return os.fspath(self.final) if os.path.lexists(self.final) else None


class RemoteTarget(Target):
    """A step at an object-store URL; committed by a create-only marker (no rename)."""

    def __init__(self, url: str, fmt: str, storage_options: Mapping[str, Any] | None) -> None:
        super().__init__(fmt)
        self.step = RemoteStep(*split_url(url, storage_options=storage_options))

    def prepare(self) -> str:
        self.step.claim()
        return self.step.name

    def write_rank(self, name: str, fill: Callable[[Writer], None], *,
                   base: str | None = None, known: Mapping[str, bool] | None = None,
                   rows: Mapping[str, Any] | None = None, pieces: bool = False,
                   limits: DeltaLimits | None = None) -> None:
        with staging_directory() as tmp:
            local = Path(tmp) / name
            extra: dict[str, Any] = {}
            copies: list[tuple[str, str]] = []
            base_name = None if base is None else base.rstrip("/").rpartition("/")[2]
            if base_name is not None and self.fmt == "zarr":
                record = self.step.base_record(base_name, name,
                                               Path(tmp) / ".base" / base_name / name)
                if record is not None:  # unchanged values: server-side copies of the base's
                    extra = {"base": record, "known": known or {}, "copies": copies}
            elif base_name is not None:
                # HDF5: the file is written as ``<step>/<name>`` beside a stand-in of the
                # base's ``<base>/<name>``, so its unchanged values are external values
                # ``../<base>/<name>`` (as in a step directory on disk), read back from the
                # base's object by ranged GETs; only the changed values are uploaded
                local = Path(tmp) / self.step.name / name
                local.parent.mkdir()
                stand_in = self.step.base_h5(base_name, name, Path(tmp) / base_name / name)
                if stand_in is not None:
                    extra = {"base": stand_in, "known": known or {}}
            if extra and rows and base_name is not None:
                # row deltas on the same rank's object in the base step; a merge reads the
                # base's patches from the store
                extra.update(rows=rows, limits=limits, base_reader=functools.partial(
                    self.step.base_reader, base_name, name), names=(
                    self.step.parent.join(f"{self.step.name}/{name}"),
                    self.step.parent.join(f"{base_name}/{name}")))
            _write_file(local, self.fmt, fill, durable=False,  # durable once uploaded
                        pack_threshold=self.pack_threshold, **extra)
            self.step.upload(local, name,
                             [(f"{base_name}/{name}/{src}", dst) for src, dst in copies])

    def base_index(self, base: str) -> bytes:
        return self.step.base_index(base.rstrip("/").rpartition("/")[2])

    def put_file(self, name: str, src: Path) -> None:
        self.step.upload(src, name)

    def commit(self, index: bytes) -> str:
        return self.step.commit(index, ZARR_ROOT if self.fmt == "zarr" else None)

    def abort(self) -> None:
        self.step.abort()

    def committed(self) -> str | None:
        # the claim kept every other writer off the step: a marker there is this save's
        return self.step.url if is_committed(self.step.parent, self.step.name) else None


class NodeLocalTarget(LocalTarget):
    """A step on per-node local disks: each node holds its processes' files, its copies of
    replicated values and its own index; committed by a rename on every node."""

    grids = False

    def __init__(self, path: str, fmt: str, nodes: Nodes) -> None:
        super().__init__(path, fmt)
        self.nodes: Nodes = nodes

    def attach(self, token: str) -> None:
        self._where = self.final.parent / Path(token).name  # the same name on every node

    def begin(self) -> None:
        """Make this node's temporary (rank 0 made its node's already); idempotent."""
        if os.path.lexists(self.final):
            raise CheckpointExistsError(
                f"Cannot save {str(self.final)!r}: it is committed already on this node; a "
                "step is written once: save under a new step, or prune this one first."
            )
        make_parents(self.final)
        self.where.mkdir(exist_ok=True)

    def leads(self, rank: int) -> bool:
        return self.nodes.leads(rank)

    def commit(self, index: bytes) -> str:
        """This node's: the whole step's index beside the node's own, then the rename."""
        assert self.persistent_index is not None, "persistent_index first"
        if self.fmt == "zarr":  # rank 0's node has it from prepare(): the same bytes
            (self.where / "zarr.json").write_bytes(ZARR_ROOT)
        with open(self.where / PERSISTENT_INDEX, "wb") as f:
            f.write(self.persistent_index)
            f.flush()
            os.fsync(f.fileno())
        return super().commit(index)

    def abort(self) -> None:
        self._tmp = None
        if self._where is not None and self._where.exists():
            remove_path(self._where)


def target_for(path: str, fmt: str, storage_options: Mapping[str, Any] | None,
               remote: bool) -> Target:
    """The target of a multi-process save to ``path`` (``remote``: a URL)."""
    if remote:
        return RemoteTarget(path, fmt, storage_options)
    nodes = nodes_of(Path(path).parent)
    if nodes is not None:
        return NodeLocalTarget(path, fmt, nodes)
    return LocalTarget(path, fmt)


def _write_file(path: Path, fmt: str, fill: Callable[[Writer], None], *, durable: bool,
                pack_threshold: int | None = None, **incremental: Any) -> None:
    writer = native_backend(path, fmt).open_writer(path, durable=durable,
                                                   pack_threshold=pack_threshold, **incremental)
    try:
        fill(writer)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
