"""Atomic publication of a checkpoint file or directory.

Every write goes to a temporary sibling named ``.<final name>.<32 hex>.partial``;
files are fsynced, then the temporary is renamed onto the final name and the
parent directory is fsynced. A directory that already exists is swapped
atomically (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere it is renamed aside
first) and the old one deleted after the new one is in place. Any exception
deletes the temporary and leaves the final path untouched.

Only what ckptvar wrote is ever replaced: a file checkpoint may replace a file
(as ``open(path, "w")``, ``np.save`` and h5py do), a directory checkpoint only a
directory its writer recognises as a checkpoint of its own kind. Anything else
in the way (a directory of the user's files, a file where a directory should go)
is refused before a byte is written, and again at the rename
(:func:`check_destination`).

>>> is_partial(".ckpt-3.h5.0123456789abcdef0123456789abcdef.partial")
True
>>> is_partial("ckpt-3.h5")
False
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import DestinationExistsError, DestinationIsDirectoryError
from .location import is_partial, partial_path

__all__ = [
    "check_destination",
    "fsync_all",
    "fsync_dir",
    "fsync_path",
    "is_partial",
    "partial_path",
    "publish",
    "remove_path",
    "temporary_sibling",
]

def fsync_dir(path: Path) -> None:
    """fsync a directory so renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync directories
        if exc.errno not in (22, 95):  # EINVAL, EOPNOTSUPP
            raise
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync one regular file by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(files: Iterable[Path], dirs: Iterable[Path]) -> None:
    """fsync many files and directories at once (a store of many files).

    The calls run concurrently: the file system then commits them in fewer journal
    transactions than one after another (about 1.5-2x faster for ~170 files here).
    Every call has finished, and the first error is raised, before this returns.
    """
    jobs = [(fsync_path, f) for f in files] + [(fsync_dir, d) for d in dirs]
    if len(jobs) <= 2:
        for fn, path in jobs:
            fn(path)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        for future in [pool.submit(fn, path) for fn, path in jobs]:
            future.result()


def remove_path(path: Path) -> None:
    """Delete a file or directory tree if it exists (never follows a symlink)."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


@contextlib.contextmanager
def temporary_sibling(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; delete it if the block raises.

    The caller creates the file or directory there and calls :func:`publish`.
    """
    tmp = partial_path(final)
    try:
        yield tmp
    except BaseException:
        remove_path(tmp)
        raise


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux); False when not supported."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
            return False
        raise OSError(err, os.strerror(err), str(a), None, str(b))
    return True


def check_destination(
    final: Path, *, directory: bool, replaceable: Callable[[Path], bool] | None = None
) -> None:
    """Raise unless a new checkpoint may be published at ``final``.

    ``directory`` says what the new checkpoint is. A file may replace a file; a
    directory may replace only a directory for which ``replaceable`` is true (its
    writer's "this is one of mine" test). A missing path is always fine, and so is
    a symbolic link: the link itself is replaced, never what it points to.
    """
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if not directory:
            raise DestinationIsDirectoryError(
                f"Cannot save to {str(final)!r}: it is a directory. A checkpoint file never "
                "replaces a directory; choose another path (or a directory format such as "
                "'.zarr' onto a Zarr checkpoint)."
            )
        if replaceable is None or not replaceable(final):
            raise DestinationIsDirectoryError(
                f"Cannot save to {str(final)!r}: it is a directory that is not a ckptvar "
                "checkpoint of this format, so it is left as it is. Choose another path, or "
                "remove the directory yourself."
            )
    elif directory and not stat.S_ISLNK(st.st_mode):
        raise DestinationExistsError(
            f"Cannot save a directory checkpoint to {str(final)!r}: a file is there, and "
            "it is left as it is. Choose another path, or remove it yourself."
        )


def publish(
    tmp: Path,
    final: Path,
    *,
    durable: bool = True,
    replaceable: Callable[[Path], bool] | None = None,
) -> Path:
    """Move the complete ``tmp`` onto ``final`` atomically and make it durable.

    Files inside ``tmp`` must already be fsynced (when ``durable``). What is at
    ``final`` is checked first (:func:`check_destination`). On failure ``tmp``
    is deleted and ``final`` is unchanged.
    """
    parent = final.parent
    try:
        check_destination(final, directory=tmp.is_dir(), replaceable=replaceable)
        if durable and tmp.is_dir():
            fsync_dir(tmp)
        if final.is_dir() and not final.is_symlink():
            if not _exchange(tmp, final):
                aside = partial_path(final)
                os.rename(final, aside)
                try:
                    os.rename(tmp, final)
                except BaseException:
                    os.rename(aside, final)
                    raise
                tmp = aside
            # tmp now holds the previous checkpoint
            if durable:
                fsync_dir(parent)
            remove_path(tmp)
        elif tmp.is_dir() and final.is_symlink():  # the link goes, never its target
            aside = partial_path(final)
            os.rename(final, aside)
            os.rename(tmp, final)
            tmp = aside
            if durable:
                fsync_dir(parent)
            remove_path(tmp)
        else:
            os.replace(tmp, final)
        if durable:
            fsync_dir(parent)
    except BaseException:
        remove_path(tmp)
        raise
    return final
