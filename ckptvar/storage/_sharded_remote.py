"""Multi-process checkpoints at object-store URLs: the layout of disk, committed by marker.

A step ``s3://b/run/ckpt-3.h5`` written by N processes holds, below its own key,
``rank-00000.h5`` ... (or ``rank-00000.zarr/...``: each process's ordinary ckptvar
checkpoint, uploaded by that process), ``ckptvar-index.msgpack`` (the global index,
uploaded by rank 0 after every process reported success) and, for ``.zarr``, a root
``zarr.json``. Then rank 0 creates the commit marker ``ckpt-3.h5.commit`` with a
create-only write; it binds ``index-crc32c:<hex>``, the CRC-32C of the index's bytes
(which list every box and, through each process file's own record, every checksum).

Before any byte is written rank 0 takes the step with a create-only claim object
``<step>.claim``: of two jobs racing for one step the second stops at once, and the
step's key holds only the claimant's objects. A failed save deletes what it wrote and
its claim. The claim names its holder (host, process, job) and is renewed while the
step is written; a claim left by a job that died stops blocking (``location._claim``):
the next save of the step takes it over, and ``CheckpointManager``'s clean-up and
``ckpt gc`` remove it with what it left.

Readers (:func:`open_sharded_remote`) read the marker, then the index (checked against
the marker), then only the per-process objects and byte ranges a read needs. In an
incremental HDF5 step a process's object refers to byte ranges of the same process's
object in an older step, ``../<step>/rank-NNNNN.h5`` (docs/FORMAT.md, "Incremental
steps"): found by that step's marker and read by ranged GETs. Global
Zarr arrays (one array per variable across processes) are a local-disk layout; on an
object store each box is stored in its writer's file.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..locations import (
    Binding,
    Claim,
    CommitRecord,
    Location,
    StorageError,
    claim,
    commit,
    marker_key,
    read_commit,
    refuse_committed,
    upload_tree,
)
from . import checksum as _checksum
from ._container.reuse import BaseFileLost
from ._container.source import RemoteFile
from ._h5 import H5Reader, write_stand_in
from ._sharded import INDEX_FILE, ShardedReader
from ._step_files import RemoteStepFiles
from ._zarr import RECORD_PATH, chunk_key
from ._zarr_remote import RemoteZarrReader
from .base import Reader

__all__ = ["INDEX_CHECKSUM", "RemoteStep", "is_sharded_record", "lost_copy",
           "open_sharded_remote"]

logger = logging.getLogger("ckptvar")

#: How a commit marker spells the checksum of a multi-process step's index.
INDEX_CHECKSUM = "index-crc32c:"


def index_binding(index: bytes) -> str:
    """What a marker binds for a multi-process step whose index is ``index``."""
    return str(Binding("index", _checksum.crc(index)))


def is_sharded_record(record: CommitRecord) -> bool:
    """Whether a commit marker commits a multi-process step (its index is the step's)."""
    return record.index == f"{record.data}/{INDEX_FILE}"


def lost_copy(exc: CheckpointNotFoundError, parent: Location,
              copies: Sequence[tuple[str, str]]) -> BaseFileLost | None:
    """What an upload's ``exc`` means when it names the source of one of ``copies``
    (``(key below parent, path)``, server-side copies from an incremental step's base):
    that object is gone from the base (deleted by hand), a :class:`BaseFileLost` naming
    the base step and the object; ``None`` for any other missing object."""
    said = str(exc)
    for src, _ in copies:
        if said.startswith(f"{parent.join(src)}: "):
            base, _, rel = src.partition("/")
            return BaseFileLost(parent.join(base), rel)
    return None


class RemoteStep:
    """The object-store side of one multi-process save (every rank makes one).

    Rank 0 calls :meth:`claim` before anything is written, :meth:`commit` after the
    write vote, :meth:`abort` on failure; every rank calls :meth:`upload` for its file.
    """

    def __init__(self, parent: Location, name: str) -> None:
        self.parent = parent
        self.name = name
        self.url = parent.join(name)
        self._claim: Claim | None = None  # while this save holds the step

    def claim(self) -> None:
        """Refuse a committed step; take the step with a create-only claim object."""
        refuse_committed(self.parent, self.name)
        self._claim = claim(self.parent, self.name)

    def upload(self, local: Path, name: str,
               copies: list[tuple[str, str]] | None = None) -> None:
        """Upload one process's local checkpoint (a file or a Zarr directory) as ``name``;
        ``copies``: ``(key below the step's parent, path below name)`` objects of a Zarr
        directory taken by server-side copy (an incremental step). A copy's source gone
        from the base is :class:`BaseFileLost`, what was uploaded of ``name`` removed."""
        key = f"{self.name}/{name}"
        if local.is_dir():
            try:
                upload_tree(self.parent, local, key, copies=copies or ())
            except CheckpointNotFoundError as exc:
                lost = lost_copy(exc, self.parent, copies or ())
                if lost is None:
                    raise
                self.parent.delete_prefix(f"{key}/")  # written again whole, by the caller
                raise lost from None
        else:
            self.parent.upload_file(os.fspath(local), key)

    def base_index(self, base: str) -> bytes:
        """The index of the committed multi-process step ``base`` beside this one."""
        return self.parent.read(f"{base}/{INDEX_FILE}")

    def base_record(self, base: str, name: str, dest: Path) -> Path | None:
        """Fetch the root ``zarr.json`` and record of the Zarr file ``name`` of the step
        ``base`` beside this one into the new directory ``dest`` (what an incremental
        write needs of its base); ``None`` when they cannot be read (the process wrote no
        file there)."""
        record_key = f"{RECORD_PATH}/{chunk_key(1)}"
        try:
            root_doc = self.parent.read(f"{base}/{name}/zarr.json")
            record = self.parent.read(f"{base}/{name}/{record_key}")
        except (OSError, ValueError):  # CkptError subclasses one of them
            return None
        (dest / record_key).parent.mkdir(parents=True)
        (dest / "zarr.json").write_bytes(root_doc)
        (dest / record_key).write_bytes(record)
        return dest

    def base_h5(self, base: str, name: str, dest: Path) -> Path | None:
        """A local sparse stand-in at ``dest`` of the HDF5 file ``name`` of the step ``base``
        beside this one: its size, user block and root record (what an incremental write
        reads of its base, ``_h5.write_stand_in``); ``None`` when the process wrote no
        file there (a file that cannot be read is logged: the process writes every value)."""
        key = f"{base}/{name}"
        try:
            size = self.parent.size(key)
        except FileNotFoundError:
            return None
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_stand_in(RemoteFile(self.parent, key, size), self.parent.join(key), dest)
        except (OSError, ValueError) as exc:  # CkptError subclasses one of them
            logger.warning("Incremental save of %s: cannot read %s (%s); writing every value "
                           "of this process.", self.url, self.parent.join(key), exc)
            return None
        return dest

    def base_reader(self, base: str, name: str) -> Reader:
        """A lazy reader of the file ``name`` of the committed step ``base`` beside this one
        (what a row delta's merge reads the base's patches with)."""
        key = f"{base}/{name}"
        return _open_file(self.parent, key, self.parent.join(key))

    def commit(self, index: bytes, zarr_root: bytes | None = None) -> str:
        """Upload the root ``zarr.json`` (if any) and the index, then the marker; release the
        claim. ``CheckpointExistsError`` if another writer committed the step."""
        if zarr_root is not None:
            self.parent.put(f"{self.name}/zarr.json", zarr_root)
        index_key = f"{self.name}/{INDEX_FILE}"
        self.parent.put(index_key, index)
        if self._claim is not None:
            self._claim.check()
        commit(self.parent, self.name, index_binding(index), index=index_key)
        self._release()
        return self.url

    def abort(self) -> None:
        """Delete what this save wrote below the step, and its claim (rank 0, on failure).

        A delete that fails (the store unreachable: often why the save failed) is logged,
        not raised over the save's own error; the claim is released all the same, and
        what is left is reclaimed by the next save of the step or the clean-up."""
        if self._claim is not None:
            try:
                self.parent.delete_prefix(f"{self.name}/")
            except StorageError as exc:
                logger.warning("Could not delete what the failed save of %s wrote (the next "
                               "save or ckpt gc reclaims it): %s", self.parent.join(self.name),
                               exc)
            finally:
                self._release()

    def _release(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None


def _open_file(location: Any, key: str, display: str) -> Reader:
    """A lazy reader of one process's file (HDF5 object or Zarr prefix) at ``key``."""
    if key.endswith(".zarr"):
        return RemoteZarrReader(display, location, key)
    return H5Reader(display, source=RemoteFile(location, key, location.size(key)),
                    holders=functools.partial(_holder_file, location))


def _holder_file(location: Location, name: str) -> RemoteFile:
    """The object of ``name`` (``../<step>/<file>``: a process's file of the committed
    multi-process step ``<step>`` beside this one), which holds bytes of an incremental
    step's values (found by the step's commit marker; ``FileNotFoundError`` naming what
    is gone, ``ValueError`` for a name of another shape)."""
    step, _, file = name[3:].partition("/") if name.startswith("../") else ("", "", "")
    if not step or step.startswith(".") or not file or "/" in file:
        raise ValueError(f"{name!r} is not a process's file of a step beside it")
    record = read_commit(location, step)
    if record is None:
        raise FileNotFoundError(f"its commit marker {location.join(marker_key(step))} is gone")
    if not is_sharded_record(record):
        raise ValueError(f"{location.join(step)} is not a multi-process step")
    key = f"{record.data}/{file}"
    try:
        size = location.size(key)
    except FileNotFoundError:
        raise FileNotFoundError(f"its object {location.join(key)} is gone") from None
    return RemoteFile(location, key, size)


class _BoundStepFiles(RemoteStepFiles):
    """The step's objects; the index is refused unless the marker binds its checksum."""

    def __init__(self, location: Any, record: CommitRecord) -> None:
        super().__init__(location, record.data, _open_file)
        self._record = record

    def read_index(self, name: str) -> bytes:
        raw = super().read_index(name)
        found = index_binding(raw)
        if Binding.parse(found) != self._record.binding:
            raise CorruptCheckpointError(
                f"Checkpoint {self.display}: its commit marker "
                f"{self.location.join(marker_key(self._record.step))} binds index checksum "
                f"{self._record.index_checksum}, but {self.where(name)} has {found}; the "
                "checkpoint was damaged or replaced after its commit."
            )
        return raw


def open_sharded_remote(parent: Location, name: str, record: CommitRecord) -> ShardedReader:
    """A lazy reader of the committed multi-process step ``name`` below ``parent``."""
    return ShardedReader(parent.join(name), files=_BoundStepFiles(parent, record))
