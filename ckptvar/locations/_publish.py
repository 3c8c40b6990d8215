"""How a save becomes visible: one module, two strategies.

**Rename a temporary** (a local file system: a checkpoint file or directory, a
multi-process step directory, the manager's state file, a local location's
objects). Everything is written to a temporary sibling named
``.<final name>.<32 hex>.partial`` (:func:`~._names.partial_path`, which the
clean-up recognises), files are fsynced, then the temporary is renamed onto the
final name and the parent directory is fsynced. :func:`publish` replaces what is
there (as ``open(path, "w")`` does): a directory that already exists is swapped
atomically (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere it is renamed aside
first) and the old one deleted after the new one is in place. With
``create_only`` the rename never replaces anything (``renameat2(RENAME_NOREPLACE)``
where the kernel has it): of two writers publishing one name, one wins and the
other gets ``CheckpointExistsError``. Any exception deletes the temporary and
leaves the final path untouched. :func:`write_atomically` does all of it for a few
bytes.

Only what ckptvar wrote is ever replaced: a file checkpoint may replace a file,
a directory checkpoint only a directory its writer recognises as a checkpoint of
its own kind. Anything else in the way is refused before a byte is written, and
again at the rename (:func:`check_destination`).

**Create a marker** (object stores, which have no rename): the data objects are
written in any order, then ``<step>.commit`` with a create-only conditional
write (:func:`~._commit.commit`). What the marker binds is one :class:`Binding`,
spelled ``<what>-crc32c:<8 hex>``: ``bytes`` (every byte uploaded), ``record`` (a
checkpoint's root record) or ``index`` (a multi-process step's index). Markers
written before this spelling say ``crc32c:<hex>`` for ``bytes``; they still read.

>>> Binding.parse("record-crc32c:0000002a")
Binding(what='record', crc32c=42)
>>> str(Binding.parse("crc32c:0000002a"))
'bytes-crc32c:0000002a'
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointExistsError, DestinationExistsError, DestinationIsDirectoryError
from ._lockwait import LockTimeoutError, wait_for_lock
from ._names import partial_path

__all__ = [
    "Binding",
    "check_destination",
    "fsync_all",
    "fsync_dir",
    "fsync_path",
    "no_writer_in",
    "publish",
    "remove_path",
    "temporary_sibling",
    "write_atomically",
]

_BINDING_RE = re.compile(r"(?:(?P<what>bytes|record|index)-)?crc32c:(?P<crc>[0-9a-f]{1,8})")


@dataclass(frozen=True)
class Binding:
    """What a commit marker binds: the CRC-32C of the step's bytes, root record or index."""

    what: str
    crc32c: int

    def __str__(self) -> str:
        return f"{self.what}-crc32c:{self.crc32c:08x}"

    @classmethod
    def parse(cls, text: str) -> Binding | None:
        """Read a binding (``crc32c:<hex>``, as older markers spell ``bytes``, included);
        ``None`` for a spelling no ckptvar writes (nothing that can be checked)."""
        m = _BINDING_RE.fullmatch(text)
        if m is None:
            return None
        return cls(m["what"] or "bytes", int(m["crc"], 16))


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
    pool = _fsync_pool()
    futures = []
    for fn, path in jobs:
        try:
            futures.append(pool.submit(fn, path))
        except RuntimeError:  # the interpreter is exiting: pools take no new work
            fn(path)
    for future in futures:
        future.result()


#: pid -> the threads :func:`fsync_all` runs on, kept between calls (starting 16 threads
#: per save cost more than a small step's fsyncs); a forked child makes its own.
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        pool = _POOLS.get(os.getpid())
        if pool is None:
            _POOLS.clear()  # a parent's, in a forked child: its threads are not here
            pool = _POOLS[os.getpid()] = ThreadPoolExecutor(
                max_workers=16, thread_name_prefix="ckptvar-fsync")
        return pool


def remove_path(path: Path) -> None:
    """Delete a file or directory tree if it exists (never follows a symlink).

    A tree's subdirectories (a Zarr checkpoint's arrays) are removed concurrently: on a
    busy journaling file system each ``rmdir`` may wait for a journal commit, and
    concurrent ones wait for the same commit (a 24-directory Zarr step: ~80 ms one
    after another on this VM's loaded disk). At the interpreter's exit, once its thread
    pools take no new work, they are removed on this thread.
    """
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            subdirs = [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
            if len(subdirs) > 2:
                pool = _fsync_pool()
                futures = []
                for d in subdirs:
                    try:
                        futures.append(pool.submit(shutil.rmtree, d, ignore_errors=True))
                    except RuntimeError:  # the interpreter is exiting: removed below
                        break
                for future in futures:
                    future.result()
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


@contextlib.contextmanager
def temporary_sibling(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; delete it if the block raises.

    The caller creates the file or directory there and calls :func:`publish`. For the
    block the writer holds a shared lock on the directory (:func:`no_writer_in`), so a
    clean-up in any process of this host leaves the temporary alone.
    """
    tmp = partial_path(final)
    held = _lock_directory(final.parent, fcntl.LOCK_SH)
    try:
        yield tmp
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        if held is not None:
            os.close(held)


def _lock_directory(directory: Path, how: int) -> int | None:
    """A descriptor of ``directory`` holding ``flock(how)``, or ``None`` where the
    directory cannot be opened or its file system has no such lock (some network file
    systems); raises ``BlockingIOError`` for a non-blocking lock that is taken."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if how & fcntl.LOCK_NB:
            fcntl.flock(fd, how)
        else:  # a clean-up holding it that is stopped or hung: not forever
            wait_for_lock(fd, how, os.fspath(directory))
    except (BlockingIOError, LockTimeoutError):
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def no_writer_in(directory: Path) -> Iterator[bool]:
    """Yield whether no temporary in ``directory`` is being written (holding that for the
    block): every writer of one (:func:`temporary_sibling`) holds a shared lock on the
    directory until it publishes or gives up, released by the kernel if it is killed.
    Where the lock cannot be taken at all (no such directory, a file system without
    locks) it yields ``True``."""
    try:
        held = _lock_directory(directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        yield False
        return
    try:
        yield True
    finally:
        if held is not None:
            os.close(held)


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


def _rename_noreplace(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` unless something is there (atomically where Linux can)."""
    fn = getattr(_libc(), "renameat2", None) if os.uname().sysname == "Linux" else None
    if fn is not None:
        at_fdcwd, rename_noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(final), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err == 17:  # EEXIST
            raise CheckpointExistsError(f"{str(final)!r} exists already")
        if err not in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
            raise OSError(err, os.strerror(err), str(tmp), None, str(final))
    if tmp.is_dir():  # no atomic test: a directory rename fails only onto a non-empty one
        if os.path.lexists(final):
            raise CheckpointExistsError(f"{str(final)!r} exists already")
        os.rename(tmp, final)
        return
    try:
        os.link(tmp, final)  # fails if the name exists
    except FileExistsError:
        raise CheckpointExistsError(f"{str(final)!r} exists already") from None
    tmp.unlink()


def publish(
    tmp: Path,
    final: Path,
    *,
    durable: bool = True,
    replaceable: Callable[[Path], bool] | None = None,
    create_only: bool = False,
) -> Path:
    """Move the complete ``tmp`` onto ``final`` atomically and make it durable.

    Files inside ``tmp`` must already be fsynced (when ``durable``). What is at
    ``final`` is checked first (:func:`check_destination`); with ``create_only``
    anything there is ``CheckpointExistsError``. On failure ``tmp`` is deleted and
    ``final`` is unchanged.
    """
    try:
        if durable and tmp.is_dir():
            fsync_dir(tmp)
        if create_only:
            _rename_noreplace(tmp, final)
        else:
            check_destination(final, directory=tmp.is_dir(), replaceable=replaceable)
            _replace(tmp, final, durable=durable)
        if durable:
            fsync_dir(final.parent)
    except BaseException:
        remove_path(tmp)
        raise
    return final


def _replace(tmp: Path, final: Path, *, durable: bool) -> None:
    """Rename ``tmp`` onto ``final``; a directory (or a link a directory replaces) is swapped
    out whole and deleted once the new one is in place."""
    real_dir = final.is_dir() and not final.is_symlink()
    if not real_dir and not (tmp.is_dir() and final.is_symlink()):
        os.replace(tmp, final)
        return
    if real_dir and _exchange(tmp, final):
        aside = tmp  # now holds the previous checkpoint
    else:  # the link goes, never its target; or no atomic exchange here
        aside = partial_path(final)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
    if durable:
        fsync_dir(final.parent)
    remove_path(aside)


def write_atomically(
    final: Path, data: bytes | bytearray | memoryview, *, durable: bool = True,
    create_only: bool = False,
) -> None:
    """Write ``data`` as the file ``final`` by :func:`publish` (fsynced when ``durable``)."""
    with temporary_sibling(final) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        publish(tmp, final, durable=durable, create_only=create_only)
