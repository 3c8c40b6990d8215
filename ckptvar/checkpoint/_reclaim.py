"""Reclaiming what dead saves left: ``cv.checkpoint.gc``, ``ckpt gc`` and a manager's next save.

In a checkpoint directory a dead save leaves temporaries (``.<name>.<hex>.partial``);
a manager's save holds a shared lock on ``.checkpoint_saving.lock`` while it writes,
and any save a shared lock on the directory while its temporary is there
(``locations.no_writer_in``), so temporaries are removed only while nothing, in any
process of this host, saves there (the lock of a killed process is released by the
kernel). At an object-store URL
it leaves claims of dead writers and objects below uncommitted steps
(``locations.uncommitted``); on this host, staging directories in ``TMPDIR``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, CkptError
from ..locations import (
    Leftover,
    LocalLocation,
    is_url,
    no_writer_in,
    open_location,
    remove_local,
    staging_leftovers,
    temporaries,
    uncommitted,
    wait_for_lock,
)
from ._state import LOCK_FILE, STATE_FILE

__all__ = ["SAVING_LOCK_FILE", "Leftover", "gc", "idle", "open_saving_lock", "reclaim_staging"]

#: A save holds a shared lock on this file while it writes; crash leftovers are only cleaned
#: by whoever can take it exclusively, so a temporary still being written is never removed.
SAVING_LOCK_FILE = ".checkpoint_saving.lock"


def open_saving_lock(directory: Path) -> int:
    """Open (creating) the directory's saving lock file; the caller closes the descriptor."""
    return os.open(directory / SAVING_LOCK_FILE,
                   os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)


def share_saving_lock(fd: int, directory: Path) -> None:
    """Take the shared lock of a save in flight on ``fd`` (:func:`open_saving_lock`),
    waiting at most ``LOCK_TIMEOUT`` for a clean-up that holds it."""
    wait_for_lock(fd, fcntl.LOCK_SH, os.fspath(directory / SAVING_LOCK_FILE))


@contextlib.contextmanager
def idle(directory: Path) -> Iterator[bool]:
    """Yield whether nothing saves into ``directory`` (holding that for the block): no
    manager, and no other save writing a temporary there (``Checkpoint.save``,
    ``cv.save``, a ``Saver``), in any process of this host."""
    with no_writer_in(directory) as nobody_writing:
        if not nobody_writing:
            yield False
            return
        if not (directory / SAVING_LOCK_FILE).exists():
            yield True  # no manager ever saved here
            return
        with _untaken(open_saving_lock(directory)) as untaken:
            yield untaken


class _LastLook:
    """When this process last looked for dead staging directories (``time.monotonic``)."""

    at: float | None = None


def reclaim_staging(*, dry_run: bool = False, every: float | None = None) -> list[Leftover]:
    """Staging directories of this host's dead processes (removed unless ``dry_run``).

    ``every``: look only if this process has not looked for that many seconds (a
    manager's saves: a shared ``TMPDIR`` changes all the time and holds thousands of
    names, about a millisecond to list at every step); ``None``: look now.
    """
    now = time.monotonic()
    if every is not None and _LastLook.at is not None and now - _LastLook.at < every:
        return []
    _LastLook.at = now
    found = staging_leftovers()
    if not dry_run:
        remove_local(found)
    return found


def gc(
    path: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Leftover]:
    """Remove what dead saves left at ``path`` and in this host's ``TMPDIR``.

    ``path`` is a checkpoint directory or an object-store (or ``file://``) URL. What
    is removed: temporaries (while nothing saves into the directory), staging
    directories of dead processes, claims of dead writers and objects below steps
    no save can commit any more. A save in flight is never touched. Returns what was
    removed (with ``dry_run``: what would be), each with the bytes removing it frees.

    >>> import pathlib, tempfile
    >>> scratch = tempfile.TemporaryDirectory()
    >>> d = pathlib.Path(scratch.name)
    >>> _ = (d / ".ckpt-1.h5.0123456789abcdef0123456789abcdef.partial").write_bytes(b"xx")
    >>> [(x.nbytes, x.what) for x in gc(d) if x.path.startswith(str(d))]
    [(2, 'temporary')]
    >>> list(d.iterdir())
    []
    >>> scratch.cleanup()
    """
    found: list[Leftover] = []
    if is_url(path):
        location = open_location(path, storage_options=storage_options)
        found += uncommitted(location, dry_run=dry_run)
        if isinstance(location, LocalLocation):
            found += _local(location.root, dry_run=dry_run)
    else:
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointNotFoundError(f"{os.fspath(directory)!r} is not a directory.")
        found += _local(directory, dry_run=dry_run)
    return found + reclaim_staging(dry_run=dry_run)


def _local(directory: Path, *, dry_run: bool) -> list[Leftover]:
    if not dry_run and not os.access(directory, os.W_OK | os.X_OK):
        raise CkptError(f"Cannot remove leftovers in {os.fspath(directory)!r}: it is read-only.")
    with idle(directory) as nobody_saving:
        if nobody_saving:
            found = temporaries(directory)
            if not dry_run:
                remove_local(found)
            return found
    # a save in flight: the state file's temporaries are dead while nobody holds the
    # state lock (a manager writes the state file under it)
    with _state_unlocked(directory) as nobody_writing:
        found = temporaries(directory, (f".{STATE_FILE}.",)) if nobody_writing else []
        if not dry_run:
            remove_local(found)
    return found


@contextlib.contextmanager
def _state_unlocked(directory: Path) -> Iterator[bool]:
    """Yield whether nobody writes the directory's state file (holding that for the block)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        yield True  # no manager ever wrote a state here
        return
    except OSError:  # cannot tell (a read-only directory): nothing is taken for dead
        yield False
        return
    with _untaken(fd) as untaken:
        yield untaken


@contextlib.contextmanager
def _untaken(fd: int) -> Iterator[bool]:
    """Yield whether nobody holds the lock file open as ``fd`` (taking it exclusively for
    the block, never waiting); ``fd`` is closed after."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
