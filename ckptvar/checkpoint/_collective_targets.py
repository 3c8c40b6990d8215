"""Where a multi-process save puts its step: a shared local directory, or an object store.

:func:`~._collective.collective_write` runs the protocol (plan, prepare, write, vote,
commit) and asks its target for the place-specific parts:

- :class:`LocalTarget`: rank 0 creates a hidden temporary directory beside the final
  path; each rank writes its file into it; rank 0 writes the index, fsyncs and renames
  the directory into place, create-only (``locations.publish``; needs a
  filesystem every process sees).
- :class:`RemoteTarget`: rank 0 claims the step's key (create-only); each rank writes
  its file to a local temporary and uploads it below the step; rank 0 uploads the
  index and creates the commit marker (:class:`~ckptvar.storage.RemoteStep`). No
  shared filesystem is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError
from ..locations import publish, split_url, staging_directory
from ..storage import (
    INDEX_FILE,
    RemoteStep,
    Writer,
    fsync_dir,
    fsync_path,
    partial_path,
    remove_path,
)
from ._files import make_parents, native_backend

__all__ = ["ZARR_ROOT", "LocalTarget", "RemoteTarget", "Target"]

#: The root ``zarr.json`` of a multi-process ``.zarr`` step: a plain group naming the index.
ZARR_ROOT = (b'{"zarr_format": 3, "node_type": "group", "attributes": '
             b'{"ckptvar_sharded": {"index": "' + INDEX_FILE.encode() + b'"}}}')


class Target:
    """The place-specific steps of a multi-process save (see the module docstring)."""

    #: whether values may be stored as global Zarr arrays (needs a shared directory)
    grids = False
    #: whether a rank's file may refer to an earlier step's (an incremental save)
    reuses = False

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
                   pieces: bool = False) -> None:
        """Write this rank's file ``name``: ``fill`` adds its values and metadata.
        ``base``: an earlier step (its path or URL, from :meth:`base_index`'s caller)
        whose file ``name`` it may refer to (an incremental save; ``known``: by stored
        key, as the writers take it); ``pieces``: large Zarr values as several chunks
        (an incremental manager's, local only)."""
        raise NotImplementedError

    def base_index(self, base: str) -> bytes:
        """The index of the earlier step ``base`` (an incremental save's base)."""
        raise NotImplementedError

    def commit(self, index: bytes) -> str:
        """Rank 0, after every rank wrote: store ``index`` and make the step visible."""
        raise NotImplementedError

    def abort(self) -> None:
        """Rank 0, on failure after :meth:`prepare`: remove what the save wrote."""


class LocalTarget(Target):
    """A step directory on a filesystem every rank sees; committed by an atomic rename."""

    grids = True
    reuses = True

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
                   pieces: bool = False) -> None:
        own = None if base is None else Path(base) / name
        if own is not None and not os.path.lexists(own):
            own = None  # the rank wrote no file of its own there
        extra: dict[str, Any] = {} if own is None else {"base": own, "known": known or {}}
        if pieces and self.fmt == "zarr":
            extra["piece_bytes"] = True
        _write_file(self.where / name, self.fmt, fill, durable=True,
                    pack_threshold=self.pack_threshold, **extra)

    def base_index(self, base: str) -> bytes:
        where = Path(base) / INDEX_FILE
        if where.stat().st_size > 1 << 30:
            raise ValueError(f"{str(where)!r} is larger than 1 GiB")
        return where.read_bytes()

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


class RemoteTarget(Target):
    """A step at an object-store URL; committed by a create-only marker (no rename)."""

    def __init__(self, url: str, fmt: str, storage_options: Mapping[str, Any] | None) -> None:
        super().__init__(fmt)
        self.step = RemoteStep(*split_url(url, storage_options=storage_options))
        #: a process's Zarr tree takes unchanged values as server-side copies of its base's
        self.reuses = fmt == "zarr"

    def prepare(self) -> str:
        self.step.claim()
        return self.step.name

    def write_rank(self, name: str, fill: Callable[[Writer], None], *,
                   base: str | None = None, known: Mapping[str, bool] | None = None,
                   pieces: bool = False) -> None:
        with staging_directory() as tmp:
            local = Path(tmp) / name
            extra: dict[str, Any] = {}
            copies: list[tuple[str, str]] = []
            base_name = None if base is None else base.rstrip("/").rpartition("/")[2]
            record = (None if base_name is None or self.fmt != "zarr" else
                      self.step.base_record(base_name, name, Path(tmp) / ".base" / name))
            if record is not None:  # unchanged values: server-side copies of the base's
                extra = {"base": record, "known": known or {}, "copies": copies}
            _write_file(local, self.fmt, fill, durable=False,  # durable once uploaded
                        pack_threshold=self.pack_threshold, **extra)
            self.step.upload(local, name,
                             [(f"{base_name}/{name}/{src}", dst) for src, dst in copies])

    def base_index(self, base: str) -> bytes:
        return self.step.base_index(base.rstrip("/").rpartition("/")[2])

    def commit(self, index: bytes) -> str:
        return self.step.commit(index, ZARR_ROOT if self.fmt == "zarr" else None)

    def abort(self) -> None:
        self.step.abort()


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
