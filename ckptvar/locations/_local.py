"""``LocalLocation``: the :class:`Location` interface on a local directory.

Writes are atomic and durable, by the rename strategy of :mod:`._publish`
(temporary sibling, ``fsync``, rename); a create-only put renames without
replacing (``RENAME_NOREPLACE``, or ``os.link``), which fails if the name exists,
so the conditional write has the same meaning as ``If-None-Match: *`` on an
object store.
"""

from __future__ import annotations

import builtins
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError
from ._base import Buffers, Location, ObjectInfo, ObjectWriter, OnRange, clean_key
from ._names import is_partial, partial_path
from ._publish import publish, write_atomically

__all__ = ["LocalLocation"]


class LocalLocation(Location):
    """Keys are files below a root directory (created on the first write)."""

    is_remote = False

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(os.fspath(root))
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        key = clean_key(key)
        return self.root / key if key else self.root

    def join(self, key: str) -> str:
        return os.fspath(self._path(key))

    def child(self, key: str) -> LocalLocation:
        return LocalLocation(self._path(key))

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path}: not a file")
        return ObjectInfo(clean_key(key), st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}")

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = clean_key(prefix) + "/" if clean_key(prefix) else ""
        found: list[ObjectInfo] = []
        for dirpath, _, files in os.walk(self._path(base)):
            for name in files:
                full = Path(dirpath, name)
                key = full.relative_to(self.root).as_posix()
                if key.startswith(base) and not is_partial(name):
                    found.append(ObjectInfo(key, full.stat().st_size))
        return sorted(found, key=lambda o: o.key)

    def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[ObjectInfo]]:
        base = clean_key(prefix)
        path = self._path(base)
        dirs: list[str] = []
        objs: list[ObjectInfo] = []
        if not path.is_dir():
            return dirs, objs
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            key = f"{base}/{entry.name}" if base else entry.name
            if entry.is_dir():
                dirs.append(key)
            elif not is_partial(entry.name):
                objs.append(ObjectInfo(key, entry.stat().st_size))
        return dirs, objs

    def read(self, key: str) -> bytes:
        from ..storage.rawio import NotRegularFile, read_regular  # noqa: PLC0415 - a cycle

        try:  # a named pipe or device there: refused at once, never waited on or read forever
            return read_regular(self._path(key), sys.maxsize)
        except NotRegularFile as exc:
            raise CorruptCheckpointError(f"{self.join(key)}: {exc}.") from None
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.join(key)}: no such file") from None

    def read_ranges_into(
        self, key: str, offsets: Sequence[int], outs: Buffers, *, on_filled: OnRange = None
    ) -> None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        try:
            for i, (offset, out) in enumerate(zip(offsets, outs, strict=True)):
                view = memoryview(out).cast("B")
                done = 0
                while done < view.nbytes:
                    n = os.preadv(fd, [view[done:]], offset + done)
                    if n == 0:
                        raise CorruptCheckpointError(
                            f"{path}: bytes {offset}..{offset + view.nbytes} asked for, "
                            f"but the file ends at {offset + done}"
                        )
                    done += n
                if on_filled is not None:
                    on_filled(i)
        finally:
            os.close(fd)

    def put(
        self, key: str, data: bytes | bytearray | memoryview, *, create_only: bool = False
    ) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(path, data, create_only=create_only)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{path} already exists") from None

    def _open_writer(self, key: str, part_size: int, max_concurrency: int) -> ObjectWriter:
        return _LocalWriter(self._path(key))

    def delete(self, keys: str | Iterable[str]) -> None:
        for key in [keys] if isinstance(keys, str) else keys:
            path = self._path(key)
            if not path.is_dir() or path.is_symlink():  # a "directory" is a prefix, not an object
                path.unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        n = super().delete_prefix(prefix)
        path = self._path(prefix)
        if path.is_dir():
            shutil.rmtree(path)
        return n


class _LocalWriter(ObjectWriter):
    """Writes a temporary sibling; ``close`` fsyncs and renames it into place."""

    def __init__(self, path: Path) -> None:
        super().__init__(os.fspath(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path, self._tmp = path, partial_path(path)
        self._f = open(self._tmp, "wb")  # noqa: SIM115 (closed in _close/_abort)

    def _write(self, view: memoryview) -> None:
        self._f.write(view)

    def _close(self) -> None:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            publish(self._tmp, self._path)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)
