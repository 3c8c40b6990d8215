"""Checkpoints at object-store URLs: open a committed one lazily, save one as a committed step.

A URL names a step below its parent location (``s3://b/run/ckpt-3.h5``: step
``ckpt-3.h5`` of ``s3://b/run``). :func:`open_remote_reader` reads only committed
steps (its marker says where the data is) through the same container readers as
local files, over a :class:`._container.source.RemoteFile`; :func:`save_remote`
writes the checkpoint to a local temporary first, then streams it up
(data, then the root record, then the commit marker). A Zarr checkpoint is uploaded
at the step's own key (a plain Zarr group at its URL) under a create-only claim
``<step>.claim``; an HDF5 file under its writer's own key ``<step>.<writer>.data``,
which the marker names. Either way, of two writers racing for one step exactly
one commits, and the committed step holds only its bytes.

The marker binds the checkpoint's index: ``record-crc32c:<hex>`` (a
``location.Binding``), the CRC-32C of its root record (which binds every value's checksum). An HDF5 save also stores its index
as an object of its own, ``<step>.<writer>.index`` (the file's user block, then the
root record: the bytes a reader needs before any value), which the marker names, so
opening reads two small objects and never the data until a value is read. A reader checks it against the
record it opens, so a data object or record replaced or damaged after the commit is
a ``CorruptCheckpointError`` naming the step, the marker and the object. (A marker
binding ``bytes-crc32c:<hex>``, the checksum of every byte uploaded, as
:func:`~.location.upload_step` writes by default, can only be checked by reading
everything, so opening does not check it.)
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from ..locations import (
    Binding,
    CommitRecord,
    Location,
    claim,
    commit,
    marker_key,
    read_commit,
    refuse_committed,
    split_url,
    staging_directory,
    upload_step,
    upload_tree,
)
from . import checksum as _checksum
from ._container.source import RemoteFile
from ._h5 import (
    USERBLOCK_SIZE,
    H5Reader,
    index_regions,
    read_index,
    read_userblock,
    record_crc,
    write_stand_in,
)
from ._record import holder_step
from ._sharded import INDEX_FILE, ShardedReader
from ._sharded_remote import index_binding, is_sharded_record, lost_copy, open_sharded_remote
from ._zarr_files import RECORD_PATH, chunk_key
from ._zarr_remote import RemoteZarrReader
from .base import Reader

__all__ = ["RECORD_CHECKSUM", "open_remote_reader", "record_checksum", "remote_external_files",
           "remote_format", "save_remote", "save_remote_h5_incremental",
           "save_remote_incremental"]

logger = logging.getLogger("ckptvar")

#: How a marker spells the checksum of a checkpoint's root record (a ``Binding``'s prefix).
RECORD_CHECKSUM = "record-crc32c:"


def _record_binding(crc: int) -> Binding:
    return Binding("record", crc)

_SUFFIXES = {".h5": "h5", ".hdf5": "h5", ".zarr": "zarr"}


def remote_format(name: str, format: str | None) -> str | None:
    """``"h5"``/``"zarr"`` from ``format`` or the name's suffix; None when neither says."""
    if format is not None:
        fmt = format.lower().lstrip(".")
        fmt = "h5" if fmt == "hdf5" else fmt
        if fmt not in ("h5", "zarr"):
            raise UnsupportedFormatError(
                f"Format {format!r} cannot be used on an object store; ckptvar's own h5 and "
                "zarr checkpoints can."
            )
        return fmt
    return _SUFFIXES.get(Path(name).suffix.lower())


def open_remote_reader(
    url: str, format: str | None = None, storage_options: Mapping[str, Any] | None = None
) -> Reader:
    """A lazy reader of the committed checkpoint at ``url``."""
    parent, name = split_url(url, storage_options=storage_options)
    record = read_commit(parent, name)
    if record is None:
        parent.check_bucket()  # a missing bucket is said as such, as a save says it
        raise CheckpointNotFoundError(
            f"No committed checkpoint at {url!r}: there is no commit marker {url}.commit "
            "(a save that failed or is still running is never read)."
        )
    if is_sharded_record(record):  # written by several processes
        return open_sharded_remote(parent, name, record)
    fmt = remote_format(name, format)
    if fmt is None:
        fmt = "h5" if parent.exists(record.data) else "zarr"
    if fmt == "h5":
        source = _h5_source(parent, name, record)
        return H5Reader(parent.join(name), source=source,
                        holders=functools.partial(_holder_object, parent))
    reader = RemoteZarrReader(parent.join(name), parent, record.data)
    try:
        _check_bound(parent, name, record, reader.record_crc)
    except BaseException:
        reader.close()
        raise
    return reader


def _h5_source(parent: Location, name: str, record: CommitRecord) -> RemoteFile:
    """The committed HDF5 step ``name``'s data object, its index known, its root record
    checked against the marker's binding."""
    size = parent.size(record.data)
    known = _h5_index(parent, name, record, size)
    source = RemoteFile(parent, record.data, size, known=known)
    *_, record_crc = read_userblock(source, parent.join(name))
    _check_bound(parent, name, record, record_crc)
    return source


def _holder_object(parent: Location, step: str) -> RemoteFile:
    """The data object of ``step`` beside an incremental HDF5 step, which holds bytes of
    its values (found by ``step``'s commit marker; ``FileNotFoundError`` naming what is
    gone; ``ValueError`` for a name that is no step beside it)."""
    if "/" in step:
        raise ValueError(f"{step!r} is not a step beside it")
    record = read_commit(parent, step)
    if record is None:
        raise FileNotFoundError(f"its commit marker {parent.join(marker_key(step))} is gone")
    try:
        size = parent.size(record.data)
    except FileNotFoundError:
        raise FileNotFoundError(f"its data object {parent.join(record.data)} is gone") from None
    return RemoteFile(parent, record.data, size)


def remote_external_files(url: str, storage_options: Mapping[str, Any] | None = None
                          ) -> set[str]:
    """The steps beside the committed step at ``url`` whose objects hold bytes of its values
    (an incremental HDF5 step on an object store, of one process or several: its process
    files'); empty for any other step. ``CheckpointNotFoundError`` when it is not
    committed."""
    reader = open_remote_reader(url, storage_options=storage_options)
    try:
        if not isinstance(reader, H5Reader | ShardedReader):
            return set()
        return {holder_step(file) for files in reader.shared().values() for file in files}
    finally:
        reader.close()


def _h5_index(
    parent: Location, name: str, record: CommitRecord, size: int
) -> list[tuple[int, bytes]]:
    """The regions of the HDF5 data object a reader needs first (user block, root record),
    from the step's index object when the marker names one, else the user block alone."""
    if not record.index:
        first = bytearray(min(size, USERBLOCK_SIZE))
        parent.read_into(record.data, 0, first)  # read once, used twice
        return [(0, bytes(first))]
    raw = parent.read(record.index)
    head, body = raw[:USERBLOCK_SIZE], raw[USERBLOCK_SIZE:]
    bound = record.binding
    found = _record_binding(_checksum.crc(body))
    if len(head) < USERBLOCK_SIZE or (bound is not None and bound.what == "record"
                                      and found != bound):
        raise CorruptCheckpointError(
            f"Checkpoint {parent.join(name)!r}: its index object {parent.join(record.index)} "
            f"is damaged (its root record has {found}; the commit marker "
            f"{parent.join(marker_key(name))} binds index checksum {record.index_checksum})."
        )
    index = RemoteFile(parent, record.index, len(raw), known=[(0, raw[:USERBLOCK_SIZE])])
    return index_regions(raw, index, parent.join(name))


def _check_bound(parent: Location, name: str, record: CommitRecord, record_crc: int) -> None:
    """Refuse a checkpoint whose root record is not the one its commit marker binds."""
    bound = record.binding
    if bound is None or bound.what != "record":
        return  # the checksum of the uploaded bytes: only a full read could check it
    found = _record_binding(record_crc)
    if bound != found:
        raise CorruptCheckpointError(
            f"Checkpoint {parent.join(name)!r}: its commit marker "
            f"{parent.join(marker_key(name))} binds index checksum {bound}, but the root "
            f"record in {parent.join(record.data)} has {found}; the checkpoint was damaged "
            "or replaced after its commit."
        )


def record_checksum(local: Path) -> str:
    """What a marker binds for the local ckptvar checkpoint ``local``: its root record's
    CRC-32C (from the HDF5 user block, or the Zarr root ``zarr.json``)."""
    if local.is_dir():
        doc = json.loads((local / "zarr.json").read_text("utf-8"))
        crc = int(doc["attributes"]["ckptvar"]["record_crc32c"])
    else:
        crc = record_crc(local)
    return str(_record_binding(crc))


def _upload_claimed(parent: Any, local: Path, name: str,
                    copies: list[tuple[str, str]] | None = None) -> None:
    """Upload a directory at the step's own key under a create-only claim ``<step>.claim``:
    of two writers racing for the step, the second stops before writing any byte. A
    server-side copy (``copies``) whose source is gone from the base is
    :class:`BaseFileLost`, nothing of the step left."""
    held = claim(parent, name)
    try:
        refuse_committed(parent, name)
        index = local / INDEX_FILE
        if index.is_file():  # a multi-process step (a copy of one): the marker binds its index
            index_bytes = index.read_bytes()
            upload_tree(parent, local, name)
            held.check()
            commit(parent, name, index_binding(index_bytes), index=f"{name}/{INDEX_FILE}")
            return
        try:
            upload_step(parent, local, name, index_checksum=record_checksum(local),
                        before_commit=held.check, copies=copies or ())
        except CheckpointNotFoundError as exc:
            lost = lost_copy(exc, parent, copies or ())
            if lost is None:
                raise
            parent.delete_prefix(f"{name}/")  # the step is written again whole
            raise lost from None
    finally:
        held.release()


def save_remote(
    url: str,
    write_local: Callable[[Path], Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write a checkpoint with ``write_local(tmp_path)``, upload and commit it at ``url``.

    Returns the URL. ``CheckpointExistsError`` names the step if it is committed already
    (before anything is written, and again by the create-only marker).
    """
    parent, name = split_url(url, storage_options=storage_options)
    refuse_committed(parent, name)
    with staging_directory() as tmp:
        local = Path(tmp) / name
        write_local(local)
        if local.is_dir():  # Zarr: a plain Zarr group at the step's own URL
            _upload_claimed(parent, local, name)
            return parent.join(name)
        # One file: uploaded under this writer's own key, which the marker names, so that
        # of two writers racing for the step the committed one holds only the winner's bytes.
        writer = uuid.uuid4().hex
        data = f"{name}.{writer[:12]}.data"
        index = f"{name}.{writer[:12]}.index"
        bound = record_checksum(local)
        index_bytes = read_index(local)
        parent.upload_file(str(local), data)
        try:
            parent.put(index, index_bytes)
            commit(parent, name, bound, data=data, writer=writer, index=index)
        except BaseException as exc:
            _remove_uploaded(parent, [data, index], exc)
            raise
    return parent.join(name)


def _remove_uploaded(parent: Location, keys: list[str], failure: BaseException) -> None:
    """After a save failed with ``failure``: remove what it uploaded (``keys``). A removal
    that fails too is noted on ``failure``, which the caller raises: why the save failed
    is never hidden by its clean-up (what is left, ``ckpt gc`` reclaims)."""
    try:
        parent.delete(keys)
    except Exception as cleanup:  # noqa: BLE001 - noted on the save's own error
        failure.add_note(
            f"Removing what the failed save uploaded ({', '.join(parent.join(k) for k in keys)})"
            f" failed as well ({type(cleanup).__name__}: {cleanup}); `ckpt gc "
            f"{parent.url}` reclaims it."
        )


def save_remote_h5_incremental(
    url: str,
    base: str,
    write_local: Callable[[Path, Path | None], Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """:func:`save_remote` of an HDF5 step whose unchanged values stay in the objects of
    the committed step ``base`` (beside it) that hold them (docs/FORMAT.md, "Incremental
    steps"): its object holds only the other values, and its record names the holder of
    each unchanged one (HDF5 external links to that step's name).

    ``write_local(tmp_path, base_copy)`` writes the step locally; ``base_copy`` is a local
    sparse file beside it, of the base object's size, holding only the base's user
    block and root record (what the writer reads of a base; None when the base cannot
    be read: every value is then written, and the log says why).
    """
    parent, _ = split_url(url, storage_options=storage_options)
    base_parent, base_name = split_url(base, storage_options=storage_options)
    if base_parent.url != parent.url:
        raise ValueError(f"The base {base!r} of an incremental step is not beside {url!r}.")

    def write(local: Path) -> None:
        stub: Path | None = local.parent / base_name
        try:
            _h5_base_copy(parent, base_name, local.parent / base_name)
        except (OSError, ValueError) as exc:  # CkptError subclasses one of them
            logger.warning("Incremental save of %s: cannot read the base %s (%s); writing "
                           "every value.", url, base, exc)
            stub = None
        write_local(local, stub)

    return save_remote(url, write, storage_options)


def _h5_base_copy(parent: Location, name: str, stub: Path) -> None:
    """A local sparse stand-in of the committed HDF5 step ``name``'s object at ``stub``:
    its size, user block and root record (checked against the marker), nothing else."""
    record = read_commit(parent, name)
    if record is None:
        raise CheckpointNotFoundError(f"{parent.join(name)!r} is not committed")
    if is_sharded_record(record):
        raise UnsupportedFormatError(f"{parent.join(name)!r} was written by several processes")
    write_stand_in(_h5_source(parent, name, record), parent.join(name), stub)


def save_remote_incremental(
    url: str,
    base: str,
    write_local: Callable[[Path, Path | None, list[tuple[str, str]]], Any],
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """:func:`save_remote` of a Zarr step that takes the values the committed step ``base``
    (beside it) holds unchanged as server-side copies of its chunk objects.

    ``write_local(tmp_path, base_record, copies)`` writes the step locally with
    ``base_record`` (a local directory holding only the base's record, None when it
    cannot be read: every value is then written) as its base, listing the files it
    takes from the base in ``copies`` instead of writing them; they are copied on the
    server before the marker. The new step stands alone: pruning ``base`` never breaks it.
    """
    parent, name = split_url(url, storage_options=storage_options)
    base_parent, base_name = split_url(base, storage_options=storage_options)
    if base_parent.url != parent.url:
        raise ValueError(f"The base {base!r} of an incremental step is not beside {url!r}.")
    refuse_committed(parent, name)
    with staging_directory() as tmp:
        record: Path | None = Path(tmp) / ".base" / base_name
        record_key = f"{RECORD_PATH}/{chunk_key(1)}"
        try:
            root_doc = parent.read(f"{base_name}/zarr.json")
            record_bytes = parent.read(f"{base_name}/{record_key}")
        except (OSError, ValueError) as exc:  # CkptError subclasses one of them
            logger.warning("Incremental save of %s: cannot read the base %s (%s); writing "
                           "every value.", url, base, exc)
            record = None
        else:
            assert record is not None
            (record / record_key).parent.mkdir(parents=True)
            (record / "zarr.json").write_bytes(root_doc)
            (record / record_key).write_bytes(record_bytes)
        copies: list[tuple[str, str]] = []
        local = Path(tmp) / name
        write_local(local, record, copies)
        _upload_claimed(parent, local, name, [(f"{base_name}/{src}", dst) for src, dst in copies])
    return parent.join(name)
