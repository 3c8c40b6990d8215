"""A checkpoint's file on disk: which formats hold one, writing it, retiring it.

:func:`write_values` is the one save path of a local file: parents created, a
writer from the backend, every value added, committed atomically (temporary
sibling, fsync, rename) or aborted. :func:`write_file` (``Checkpoint``,
``Saver``, ``CheckpointManager``) and ``cv.save`` both go through it; they differ
only in which formats they accept and how a URL is written. :func:`discard`
removes a checkpoint without ever leaving it half-deleted (:func:`retire` renames it
away, the one step a manager does before its save returns); :func:`set_aside` retires a
directory step as the next save's spare (an incremental Zarr manager's, :func:`cut_down`). An ``OSError`` from writing names the
user's path, never the hidden temporary (:func:`destination_error`).
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CkptError, UnsupportedFormatError
from ..locations import is_url, prune, split_url
from ..storage import (
    DeltaLimits,
    backend_for,
    open_remote_reader,
    partial_path,
    remove_path,
    save_remote,
    save_remote_h5_incremental,
    save_remote_incremental,
)

__all__ = [
    "NATIVE_FORMATS",
    "cut_down",
    "destination_error",
    "discard",
    "make_parents",
    "native_backend",
    "retire",
    "set_aside",
    "write_file",
    "write_values",
]

#: The formats that keep everything a checkpoint holds (attributes, object graph, state).
NATIVE_FORMATS = ("h5", "zarr")


def native_backend(path: str | os.PathLike[str], format: str | None) -> Any:
    """The writer backend for ``path``; only the native formats can hold a checkpoint."""
    backend = backend_for(os.fspath(path), format, mode="w")
    if backend.name not in NATIVE_FORMATS:
        raise UnsupportedFormatError(
            f"Cannot write a checkpoint to {os.fspath(path)!r} in the {backend.name} format: "
            f"checkpoints are written as {' or '.join(NATIVE_FORMATS)} "
            "(cv.save writes plain arrays to other formats)."
        )
    return backend


def checkpoint_location(path: str | os.PathLike[str]) -> Any:
    """``path`` as a ``Path``, or a URL kept as a ``str`` (``Path`` would mangle ``s3://``)."""
    return os.fspath(path) if is_url(path) else Path(path)


def open_checkpoint_reader(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Any:
    """A reader of the checkpoint at ``path``: a local file or a committed step at a URL."""
    if is_url(path):
        return open_remote_reader(os.fspath(path), None, storage_options)
    return backend_for(Path(path)).open_reader(Path(path))


def make_parents(path: Path) -> None:
    """Create the missing parent directories of ``path`` (errors name ``path``)."""
    parent = path.parent
    if parent.is_dir():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise destination_error(exc, path) from exc


def destination_error(exc: OSError, path: Path) -> OSError:
    """``exc`` as an error of the same kind about ``path``, the user's destination.

    A writer works on a hidden temporary sibling (``.name.<hex>.partial``); the
    user never asked for that name, so it is replaced by ``path`` in the message.
    ckptvar's own errors (they name the destination already) are returned as they are.
    """
    if isinstance(exc, CkptError):
        return exc
    def unhide(text: str) -> str:
        full = re.escape(os.fspath(path.parent / f".{path.name}")) + r"\.[0-9a-f]+\.partial"
        text = re.sub(full, os.fspath(path), text)
        return re.sub(re.escape(f".{path.name}") + r"\.[0-9a-f]+\.partial", path.name, text)

    if exc.errno is not None and exc.strerror:
        detail = unhide(exc.strerror)
        named = None if exc.filename is None else unhide(os.fspath(exc.filename))
        if named is not None and named != os.fspath(path):
            detail += f": {named!r}"
        args: tuple[Any, ...] = (exc.errno, f"Cannot write {os.fspath(path)!r}: {detail}")
    else:
        args = (f"Cannot write {os.fspath(path)!r}: {unhide(str(exc))}",)
    try:
        new = type(exc)(*args)
    except Exception:  # noqa: BLE001 - an OSError subclass with another signature
        new = OSError(*args)
    return new


def write_file(
    path: str | Path,
    format: str | None,
    arrays: list[tuple[str, Any, dict[str, Any]]],
    meta: dict[str, Any],
    storage_options: Mapping[str, Any] | None = None,
    *,
    pack_threshold: int | None = None,
    base: Path | str | None = None,
    known: Mapping[str, bool] | None = None,
    copies: list[tuple[str, str]] | None = None,
    pieces: bool = False,
    rows: Mapping[str, Any] | None = None,
    spare: Path | None = None,
    limits: DeltaLimits | None = None,
) -> str:
    """Write one checkpoint atomically (temporary sibling, fsync, rename); returns its path.

    ``base``: a committed checkpoint whose stored bytes the new one may refer to instead
    of writing the unchanged values again (an incremental step; ``known``: what the caller
    knows unchanged or changed, by key).

    At an object-store URL: written to a local temporary, streamed up and committed by
    marker (:func:`ckptvar.storage._remote.save_remote`); returns the URL. There an
    incremental Zarr step (``base``: the URL of a committed step beside it) takes its
    unchanged values as server-side copies of the base's chunk objects; an incremental
    HDF5 step's object holds only the other values, its record referring to the objects
    of the steps that hold the unchanged ones (read back with ranged GETs).
    ``copies`` (a local Zarr write): reused files are listed there, not linked.
    ``pieces`` (a local Zarr write): large values are stored as several chunks, so that
    an incremental step shares the unchanged ones (docs/FORMAT.md, "Pieces").
    ``rows`` (a write with ``base``): key -> the rows written since ``base``, of changed
    values; such a value may be stored as a row delta (docs/FORMAT.md, "Row deltas"): at
    a URL, a Zarr delta's base and earlier patches are server-side copies of the base
    step's objects, an HDF5 delta refers to them in the objects that hold them.
    ``pack_threshold``: the writer's (docs/FORMAT.md, "Writer options"; None: its default).
    ``spare`` (a local incremental Zarr write): a step set aside by :func:`set_aside`,
    which the writer takes as its staging directory; removed when not of use.
    """
    if spare is not None and (is_url(path) or base is None or copies is not None
                              or native_backend(path, format).name != "zarr"):
        remove_path(spare)
        spare = None
    if is_url(path):
        fmt = native_backend(os.fspath(path), format).name
        # a delta's merge reads the base's patches from the store (docs/FORMAT.md)
        base_reader = None if base is None else functools.partial(
            open_remote_reader, os.fspath(base), fmt, storage_options)
        # the log names the step and its base by their URLs, not the staging copies
        names = None if base is None else (os.fspath(path), os.fspath(base))
        if base is not None and fmt == "zarr":
            return save_remote_incremental(
                os.fspath(path), os.fspath(base),
                lambda tmp, record, listed: write_values(
                    Path(tmp), native_backend(tmp, fmt), arrays, meta, durable=True,
                    pack_threshold=pack_threshold, base=record, known=known or {},
                    copies=listed, rows=rows or None, base_reader=base_reader,
                    limits=limits, names=names),
                storage_options,
            )
        if base is not None and fmt == "h5":
            return save_remote_h5_incremental(
                os.fspath(path), os.fspath(base),
                lambda tmp, copy: write_values(
                    Path(tmp), native_backend(tmp, fmt), arrays, meta, durable=True,
                    pack_threshold=pack_threshold, base=copy, known=known or {},
                    rows=rows or None, base_reader=base_reader, limits=limits,
                    names=names),
                storage_options,
            )
        return str(save_remote(
            os.fspath(path),
            lambda tmp: write_file(tmp, fmt, arrays, meta, pack_threshold=pack_threshold),
            storage_options,
        ))
    options: dict[str, Any] = {"durable": True, "pack_threshold": pack_threshold}
    if base is not None:
        options.update(base=Path(base), known=known or {})
        if rows and copies is None:
            options.update(rows=rows, limits=limits)
    if copies is not None:
        options.update(copies=copies)
    backend = native_backend(path, format)
    if pieces and backend.name == "zarr":
        options.update(piece_bytes=True)
    if spare is not None:
        options.update(spare=spare)
    written: str | Path = write_values(Path(path), backend, arrays, meta, **options)
    return os.fspath(written)


def write_values(
    path: Path,
    backend: Any,
    arrays: Iterable[tuple[str, Any, dict[str, Any]]],
    meta: Mapping[str, Any] | None,
    **options: Any,
) -> Any:
    """Write ``(key, host array, attrs)`` values and ``meta`` to the local ``path`` with
    ``backend``'s writer (``options`` go to it), atomically; returns what its commit
    returns. Missing parents are created; on any error the writer is aborted and an
    ``OSError`` names ``path``, never the temporary (:func:`destination_error`).
    ``arrays`` may be a generator: each value is made as it is added.
    """
    make_parents(path)
    try:
        writer = backend.open_writer(path, **options)
        try:
            for key, array, attrs in arrays:
                writer.add(key, array, attrs)
            if meta is not None:
                writer.set_metadata(meta)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise
    except OSError as exc:
        raise destination_error(exc, path) from exc


def retire(path: str | os.PathLike[str]) -> Path | None:
    """Rename the local step ``path`` to a fresh temporary sibling (atomic: from then on
    a temporary, reclaimed as any other after a crash); returns it, or ``None`` when
    there is nothing at ``path``. Its bytes are freed later (:func:`remove_path`, in a
    manager's background, or :func:`set_aside`)."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        os.rename(path, tmp)
    except FileNotFoundError:
        return None
    return tmp


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Retire the local directory step ``path`` as :func:`discard` does, but keep what a
    next incremental step may take over: returns the spare (a temporary sibling), or
    ``None`` when there is nothing at ``path``.

    First renamed (:func:`retire`), then cut down (:func:`cut_down`).
    """
    tmp = retire(path)
    return None if tmp is None else cut_down(tmp)


def cut_down(tmp: Path) -> Path | None:
    """Cut the retired directory step ``tmp`` (:func:`retire`) down to the directories
    whose files all have other names (hard links an incremental Zarr step shares with
    other steps: no byte on disk is held by the spare alone); a directory holding a file
    of its own is removed whole, so that a directory left in the spare is exactly as the
    step committed it. Returns ``tmp``, or ``None`` when nothing is worth keeping (then
    removed)."""
    try:
        doomed: list[Path] = []
        if _cut_down(tmp, doomed):
            raise IsADirectoryError(f"{tmp} holds files of its own")  # nothing to keep
        if doomed:  # removed together, as discard() removes a step's directories
            trash = tmp / ".removed"
            trash.mkdir()
            for i, d in enumerate(doomed):
                os.rename(d, trash / str(i))
            remove_path(trash)
    except OSError:
        remove_path(tmp)
        return None
    return tmp


def _cut_down(d: Path, doomed: list[Path]) -> bool:
    """Note in ``doomed`` the directories below ``d`` that have no subdirectory and hold a
    file no other name links; ``True`` when ``d`` is such a directory (its caller notes
    it)."""
    own, subdirs = False, []
    with os.scandir(d) as entries:
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(Path(e.path))
            elif st.st_nlink < 2:
                own = True
    for sub in subdirs:
        if _cut_down(sub, doomed):
            doomed.append(sub)
    return own and not subdirs


def discard(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> None:
    """Delete a checkpoint file or directory without ever leaving it half-deleted.

    It is first renamed to a temporary name (atomic), so a crash during the
    deletion of a directory leaves a recognisable temporary, not a damaged checkpoint.
    At an object-store URL the step's commit marker goes first, then its data.
    """
    if is_url(path):
        parent, name = split_url(os.fspath(path), storage_options=storage_options)
        prune(parent, name)
        return
    tmp = retire(path)
    if tmp is not None:
        remove_path(tmp)
