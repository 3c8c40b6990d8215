"""The ``Location`` interface: where a checkpoint's bytes live, local or in an object store.

A location is a root (a directory, or a bucket plus prefix) holding *keys*:
``/``-separated relative names such as ``"run/ckpt-3.h5"``. Everything above
this layer (readers, writers, the manager, the commit protocol) speaks keys and
never touches a filesystem or a network client directly.

URLs are ``str`` throughout (``"s3://b/run/ckpt-3.h5"``), never ``pathlib.Path``,
which would turn ``//`` into ``/``.
"""

from __future__ import annotations

import builtins
import io
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Self

import crc32c as _crc32c

from ..errors import CkptError
from .positional import PositionalRaw

__all__ = [
    "Buffers",
    "Location",
    "ObjectInfo",
    "ObjectWriter",
    "OnRange",
    "PositionalRaw",
    "Sink",
    "StorageError",
]

#: Buffers to fill, one per range; a callback told the index of a range once it is done;
#: a consumer of streamed bytes: ``sink(range_index, position_in_range, chunk)``.
Buffers = Sequence[memoryview | bytearray]
OnRange = Callable[[int], None] | None
Sink = Callable[[int, int, memoryview], None]

#: Default size of one ranged GET and of one multipart part.
DEFAULT_PART_SIZE = 8 * 1024 * 1024
#: Default number of requests one call keeps in flight.
DEFAULT_CONCURRENCY = 8
_STREAM_SCRATCH = 8 * 1024 * 1024


class StorageError(CkptError, OSError):
    """A storage operation failed (network, server, permissions) after any safe retries."""


class InvalidKeyError(CkptError, ValueError):
    """A key or URL path that names no object: an empty, ``.`` or ``..`` part, or none."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the location) and its size in bytes."""

    key: str
    size: int
    etag: str | None = None


class ObjectWriter(ABC):
    """A write-only, streaming file: ``write()`` bytes in order, ``close()`` to publish.

    Nothing is visible at the key until ``close()`` returns; ``abort()`` (or leaving
    a ``with`` block by an exception) discards everything written. ``crc32c`` is the
    running CRC-32C of the bytes written, so a caller can bind them in an index
    without reading them back.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.bytes_written = 0
        self.crc32c = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; may block while earlier parts upload (bounded memory)."""
        if self.closed:
            raise ValueError(f"write to a closed writer for {self.url}")
        view = memoryview(data).cast("B")
        self._write(view)
        self.bytes_written += view.nbytes
        self.crc32c = _crc32c.crc32c(view, self.crc32c)
        return view.nbytes

    def close(self) -> None:
        """Finish the upload; the object becomes visible atomically."""
        if not self.closed:
            self.closed = True
            self._close()

    def abort(self) -> None:
        """Discard the upload; nothing appears at the key."""
        if not self.closed:
            self.closed = True
            self._abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def writable(self) -> bool:
        return True

    @abstractmethod
    def _write(self, view: memoryview) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    @abstractmethod
    def _abort(self) -> None: ...


class Location(ABC):
    """A root holding keys. Subclasses: :class:`LocalLocation`, :class:`ObjectStoreLocation`."""

    #: ``True`` for object stores (no rename; commit by marker).
    is_remote: bool = False
    #: bytes in one part of a streaming upload, and parts in flight at once
    part_size: int = DEFAULT_PART_SIZE
    max_concurrency: int = DEFAULT_CONCURRENCY

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") if "://" in url else url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def join(self, key: str) -> str:
        """The URL (or path) of ``key``, spelled as a ``str``."""
        key = clean_key(key)
        if not key:
            return self.url
        sep = "" if self.url.endswith("/") else "/"
        return f"{self.url}{sep}{key}"

    @abstractmethod
    def child(self, key: str) -> Location:
        """A location rooted at ``key`` (sharing this one's client and options)."""

    # --- metadata -------------------------------------------------------------------------
    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size (and etag) of one object; ``CheckpointNotFoundError`` if it does not exist."""

    def size(self, key: str) -> int:
        """Size in bytes of one object."""
        return self.stat(key).size

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key`` exactly."""

    def check_bucket(self) -> None:
        """Raise ``StorageError`` naming the bucket when it does not exist (as a save
        does); for a caller about to say that an object is missing. Nothing else is
        raised: a location with no bucket (a directory) has nothing to check."""
        return

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object below the "directory" ``prefix`` (recursive), sorted by key.

        ``list("a")`` and ``list("a/")`` both mean ``a/...``: never ``ab`` or ``a`` itself.
        """

    @abstractmethod
    def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[ObjectInfo]]:
        """One level below ``prefix`` (a "directory" key or ``""``): child prefixes and objects.

        Child prefixes and object keys are full keys (including ``prefix``), without a
        trailing ``/``.
        """

    # --- reads ----------------------------------------------------------------------------
    @abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object (small objects: records, markers)."""

    @abstractmethod
    def read_ranges_into(
        self, key: str, offsets: Sequence[int], outs: Buffers, *, on_filled: OnRange = None
    ) -> None:
        """Fill each ``outs[i]`` with the bytes at ``offsets[i]``; ranges are read in parallel.

        ``on_filled(i)`` is called as soon as ``outs[i]`` is complete (on the thread that
        completed it). A range that runs past the end of the object raises
        ``CorruptCheckpointError`` naming the key and the range: a reader never sees a
        short buffer.
        """

    def stream_ranges(
        self, key: str, offsets: Sequence[int], lengths: Sequence[int], sink: Sink, *,
        on_done: OnRange = None,
    ) -> None:
        """Hand the bytes of each range to ``sink(i, position_in_range, chunk)``, in order
        within each range; ``on_done(i)`` once range ``i`` is complete.

        This default reads each range through a scratch buffer; an object store
        streams its responses instead. A short range raises ``CorruptCheckpointError``.
        """
        scratch = memoryview(bytearray(_STREAM_SCRATCH))
        for j, (offset, n) in enumerate(zip(offsets, lengths, strict=True)):
            for pos in range(0, n, _STREAM_SCRATCH):
                m = min(_STREAM_SCRATCH, n - pos)
                self.read_into(key, offset + pos, scratch[:m])
                sink(j, pos, scratch[:m])
            if on_done is not None:
                on_done(j)

    def read_into(self, key: str, offset: int, out: memoryview | bytearray) -> None:
        """``pread``: fill ``out`` with the bytes of ``key`` starting at ``offset``."""
        self.read_ranges_into(key, [offset], [out])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> builtins.list[bytearray]:
        """The bytes of each ``(offset, length)`` range, read in parallel."""
        outs = [bytearray(length) for _, length in ranges]
        self.read_ranges_into(key, [off for off, _ in ranges], outs)
        return outs

    def open_file(self, key: str, *, buffer_size: int = 1024 * 1024) -> io.BufferedReader:
        """A read-only, seekable binary file over ``key`` (e.g. for ``h5py.File(f)``).

        Each buffer refill is one ranged read; nothing else of the object is fetched.
        """
        raw = _RangedRaw(self, key, self.size(key))
        return io.BufferedReader(raw, buffer_size=buffer_size)

    # --- writes ---------------------------------------------------------------------------
    @abstractmethod
    def put(
        self, key: str, data: bytes | bytearray | memoryview, *, create_only: bool = False
    ) -> None:
        """Store ``data`` at ``key`` atomically.

        With ``create_only=True`` the write is conditional (``If-None-Match: *`` on S3,
        ``link`` on a filesystem): if an object already exists at ``key``, nothing is
        written and ``CheckpointExistsError`` names the key.
        """

    def open_writer(
        self, key: str, *, part_size: int | None = None, max_concurrency: int | None = None
    ) -> ObjectWriter:
        """A streaming writer for ``key``: parts upload in the background.

        Memory stays bounded by about ``(max_concurrency + 1) * part_size``, whatever
        the object's size (both default to the location's own settings). The object
        appears only when the writer is closed.
        """
        return self._open_writer(
            key, part_size or self.part_size, max_concurrency or self.max_concurrency
        )

    @abstractmethod
    def _open_writer(self, key: str, part_size: int, max_concurrency: int) -> ObjectWriter:
        """:meth:`open_writer` with its limits resolved."""

    def upload_file(self, local_path: str, key: str, *, part_size: int | None = None) -> int:
        """Stream a local file to ``key`` through :meth:`open_writer`; returns its CRC-32C."""
        buf = bytearray(part_size or self.part_size)
        view = memoryview(buf)
        with open(local_path, "rb") as src, self.open_writer(key, part_size=part_size) as dst:
            while n := src.readinto(buf):
                dst.write(view[:n])
        return dst.crc32c

    def copy(self, source: str, key: str) -> None:
        """Store at ``key`` a copy of the object at ``source`` (both in this location).

        An object store copies on the server (no byte through this process); this default
        reads and writes it. A missing ``source`` raises ``CheckpointNotFoundError``.
        """
        self.put(key, self.read(source))

    # --- deletes --------------------------------------------------------------------------
    @abstractmethod
    def delete(self, keys: str | Iterable[str]) -> None:
        """Delete objects; a key that does not exist is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (a "directory"); returns how many."""
        prefix = clean_key(prefix)
        if not prefix:
            raise ValueError("delete_prefix refuses to delete a whole location")
        keys = [o.key for o in self.list(prefix + "/")]
        self.delete(keys)
        return len(keys)


def clean_key(key: str) -> str:
    """A key without leading/trailing ``/``; refuses ``..`` and empty components."""
    key = key.strip("/")
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKeyError(f"invalid storage key {key!r}: empty, '.' or '..' component "
                              "(object stores resolve none: write the path without them)")
    return key


class _RangedRaw(PositionalRaw):
    """A raw, seekable reader whose every ``readinto`` is one ranged read."""

    def __init__(self, location: Location, key: str, size: int) -> None:
        super().__init__(size)
        self._location, self._key = location, key
        self.name = location.join(key)

    def read_at(self, pos: int, view: memoryview) -> int:
        self._location.read_into(self._key, pos, view)
        return view.nbytes
