"""Where a multi-process checkpoint's files are: a local directory or a committed URL step.

A :class:`~._sharded.ShardedReader` asks its :class:`StepFiles` for the index bytes and
for a reader of each per-process file, so one reader serves both places.
:class:`LocalStepFiles` opens files below a directory (global Zarr arrays' chunks are
read through its directory descriptor, never through a symlink);
:class:`RemoteStepFiles` opens the per-process objects below the step's key with ranged
GETs (:mod:`._remote` makes them).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ._zarr_files import O_DIR, raise_if_deleted
from .base import Reader
from .links import inside
from .rawio import NotRegularFile, read_regular
from .registry import backend_for

__all__ = ["LocalStepFiles", "RemoteStepFiles", "StepFiles"]

#: An index larger than this is refused as damage (it lists boxes, not values).
MAX_INDEX = 1 << 30


class StepFiles(ABC):
    """The files of one multi-process step, by their names in its index."""

    #: how the step is named in messages (a path or a URL)
    display: str

    @abstractmethod
    def where(self, name: str) -> str:
        """The path or URL of the file ``name``, for messages."""

    @abstractmethod
    def read_index(self, name: str) -> bytes:
        """The bytes of the index file ``name``; ``CorruptCheckpointError`` if it is
        missing or larger than 1 GiB."""

    @abstractmethod
    def open_reader(self, name: str) -> Reader:
        """A reader of the per-process file ``name``; ``FileNotFoundError`` if it is gone."""

    def root_fd(self) -> int:
        """A descriptor of the step directory (global Zarr arrays' chunks are read below it)."""
        raise CorruptCheckpointError(
            f"{self.display}: global Zarr arrays of a multi-process checkpoint are read from "
            "a local directory only (object-store saves store each box in its writer's file)."
        )

    def close(self) -> None:  # noqa: B027 - most places hold nothing open
        """Release what the files hold open."""

    def raise_if_gone(self) -> None:  # noqa: B027 - a committed URL step is not pruned under us
        """``CheckpointNotFoundError`` when the step was deleted (pruned) since it was
        opened: a file missing then is no damage."""


class LocalStepFiles(StepFiles):
    """The files of a step directory on a local filesystem."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.display = str(self.path)
        self._fd: int | None = None
        try:  # held, so that a deletion of the step is told apart from damage
            self._fd = os.open(self.path, O_DIR)
        except OSError:
            self._fd = None

    def where(self, name: str) -> str:
        return str(self.path / name)

    def read_index(self, name: str) -> bytes:
        where = inside(self.path, self.path / name, "The step index")
        try:  # a named pipe or device there: refused at once, never waited on
            return read_regular(where, MAX_INDEX)
        except NotRegularFile as exc:
            raise CorruptCheckpointError(f"{exc}.") from None
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self.display!r} has no {name}: it is not a complete multi-process checkpoint."
            ) from None

    def open_reader(self, name: str) -> Reader:
        where = self.path / name
        if where.is_symlink():  # a step's files are its own: never followed out of it
            raise CorruptCheckpointError(
                f"{str(where)!r} is a symbolic link; a multi-process step's files are read "
                "only as regular files and directories inside it."
            )
        if not where.exists():
            raise FileNotFoundError(where)
        return backend_for(where).open_reader(where)

    def root_fd(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, O_DIR)
            except OSError as exc:
                raise CorruptCheckpointError(f"{self.display!r} cannot be opened: {exc}.") from None
        return self._fd

    def raise_if_gone(self) -> None:
        if self._fd is not None:
            raise_if_deleted(self._fd, self.path)
        elif not self.path.exists():
            raise CheckpointNotFoundError(
                f"Checkpoint {self.display!r} was deleted while it was being read "
                "(pruned by a CheckpointManager?)."
            )

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class RemoteStepFiles(StepFiles):
    """The objects of a committed multi-process step below ``prefix`` of a location."""

    def __init__(
        self, location: Any, prefix: str, open_file: Callable[[Any, str, str], Reader]
    ) -> None:
        #: the location the step lies below
        self.location = location
        self._prefix = prefix
        self._open_file = open_file
        self.display = location.join(prefix)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def where(self, name: str) -> str:
        return str(self.location.join(self._key(name)))

    def read_index(self, name: str) -> bytes:
        key = self._key(name)
        try:
            if self.location.size(key) > MAX_INDEX:
                raise CorruptCheckpointError(f"{self.where(name)} is larger than 1 GiB.")
            return bytes(self.location.read(key))
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"{self.display} has no {name}: it is not a complete multi-process checkpoint."
            ) from None

    def open_reader(self, name: str) -> Reader:
        try:
            return self._open_file(self.location, self._key(name), self.where(name))
        except CheckpointNotFoundError as exc:
            raise FileNotFoundError(self.where(name)) from exc
