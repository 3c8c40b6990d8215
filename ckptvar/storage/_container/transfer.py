"""The parallel read-and-hash engine of the container readers.

Owns: splitting whole values into pieces, reading them into their buffers (or
only hashing them) on the I/O threads, choosing how to read bytes that are on disk
rather than in the page cache (``O_DIRECT`` straight into buffers allocated for it,
pieces on every I/O thread; else one sequential stream per file), and checking
sizes and checksums once every piece is in. The pieces' CRCs are joined with
:func:`.._checksum.combine`, so hashing runs where the bytes are read.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np

from ...errors import CorruptCheckpointError
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import Entry
from . import source as _src
from .access import ValueAccess, compare
from .blocks import hash_range
from .layout import Source

__all__ = ["COLD_STREAMS", "Transfer", "TransferValue", "runs_by_size"]

#: Values at least ``PARALLEL_FROM`` large are read on the I/O threads, in pieces of this.
_SPLIT = 8 << 20
#: Each I/O task moves about this many bytes (small values are grouped).
_TASK = 8 << 20
#: From disk, values in files of their own are read by this many threads at once, each
#: streaming whole files (measured on a 1 GiB Zarr checkpoint of 149 chunks: 4 streams
#: 0.69-0.72x the time of one).
COLD_STREAMS = 4

_T = TypeVar("_T")


def runs_by_size(sized: Iterable[tuple[_T, int]], limit: int) -> list[list[_T]]:
    """The items in order, cut into runs each closed once its sizes reach ``limit``."""
    runs: list[list[_T]] = []
    cur: list[_T] = []
    size = 0
    for item, n in sized:
        cur.append(item)
        size += n
        if size >= limit:
            runs.append(cur)
            cur, size = [], 0
    if cur:
        runs.append(cur)
    return runs


class TransferValue:
    """One value moved by a :class:`Transfer`: read into ``dest``, or only hashed.

    ``src``: the value's source when the caller already opened it (its size checked
    before ``dest`` was allocated); the transfer reads through it and closes it once the
    value's last piece is in, so a chunk file is opened once, not once to check and once
    to read.
    """

    __slots__ = ("address", "crcs", "dest", "entry", "expect", "got", "key", "lay", "left",
                 "patched", "pieces", "room", "room_at", "src", "view")

    def __init__(
        self, key: str, entry: Entry, dest: np.ndarray | None, src: Source | None = None,
        *, padded: bool = False,
    ) -> None:
        self.key, self.entry, self.dest, self.src = key, entry, dest, src
        self.view = _rawio.byte_view(dest) if dest is not None else None
        #: Where ``dest``'s bytes start in memory (0: no buffer).
        self.address = dest.ctypes.data if dest is not None and dest.size else 0
        #: ``padded``: ``dest`` came from :func:`.rawio.aligned_empty`; its buffer's bytes
        #: around it (``room``, ``dest`` at ``room_at``) may take whole blocks' bytes.
        self.room: memoryview | None = None
        self.room_at = 0
        if padded and dest is not None and isinstance(dest.base, np.ndarray) and dest.size:
            self.room = _rawio.byte_view(dest.base)
            self.room_at = self.address - dest.base.ctypes.data
        n = entry.nbytes
        # Pieces start where the file is at a DIRECT_ALIGN boundary (when the caller knows
        # the offset), so that only the value's first and last bytes are not read direct.
        first = -src.offset % _rawio.DIRECT_ALIGN if src is not None else 0
        cuts = [0, *range(first + _SPLIT, n, _SPLIT)] if first else range(0, n, _SPLIT)
        #: ``(position, nbytes)`` of each piece inside the value.
        self.pieces = [(pos, min(_SPLIT + first, n) - pos if i == 0 else min(_SPLIT, n - pos))
                       for i, pos in enumerate(cuts)]
        self.got = [0] * len(self.pieces)
        self.crcs = [0] * len(self.pieces)
        #: Pieces not yet read; the one that reads the last closes ``src``.
        self.left = len(self.pieces)
        #: Set when a row delta is verified by its parts: what its base's bytes must hash to,
        #: and its source, whose patches (read meanwhile) :meth:`Transfer.finish` checks.
        self.expect: int | None = None
        #: Its row delta's source when verified by its parts or read from an object store
        #: (there its rows are laid as its base's bytes arrive).
        self.patched: _src.Patched | None = None
        #: A row delta read into ``dest`` as its base's bytes: its rows are laid over them
        #: once every piece is in (:meth:`Transfer.finish`), each patch in one step.
        self.lay: _src.Patched | None = None

    def release(self) -> None:
        """Close ``src`` if the value owns it (idempotent)."""
        src, self.src = self.src, None
        if src is not None and src.owned:
            _src.close(src.fd)


def _piece(v: TransferValue, i: int, use: Source, verify: bool, dfd: int | None = None) -> None:
    """Read piece ``i`` of ``v`` from ``use`` into its buffer (hashed when ``verify``), or
    only hash it. A row delta whose record carries its base's checksum is verified by its
    parts: the base's bytes are hashed as read (they must hash to ``fd.expect``; the
    patches, read on other threads meanwhile, are checked by their CRCs in
    :meth:`Transfer.finish`). Into a buffer, a row delta's pieces are its base's bytes
    (as stored), and :meth:`Transfer.finish` lays the patched rows over them once all are
    in: one step per patch, not one per patch and piece (unless its assembled bytes are
    to be hashed: a 1.5 record without its base's checksum, laid piece by piece).
    ``dfd``: ``use``'s file opened with ``O_DIRECT``, for a plain file's bytes from disk."""
    pos, n = v.pieces[i]
    at = use.offset + pos
    fd = use.fd
    parts = isinstance(fd, _src.Patched) and fd.expect is not None and (verify or v.view is None)
    if parts or (v.view is not None and not verify and isinstance(fd, _src.Patched)):
        assert isinstance(fd, _src.Patched)
        if parts:
            v.expect, v.patched = fd.expect, fd
        if v.view is not None:
            v.lay = fd
        fd, at = fd.base, fd.offset + at  # the base's bytes, as stored
    if v.view is None:
        v.got[i], v.crcs[i] = hash_range(fd, at, n)
        return
    buf = v.view[pos : pos + n]
    if dfd is not None and not parts:
        room, lo = v.room, v.room_at + pos  # the value's own ends may reach past it
        if room is not None:
            room = room[0 if pos == 0 else lo : None if pos + n == len(v.view) else lo + n]
            lo = lo if pos == 0 else 0
        got = _rawio.pread_direct(fd, dfd, buf, at, v.address + pos, room=room, at=lo)
    else:
        got = _src.pread_into(fd, buf, at)
    if verify and got == n:
        v.crcs[i] = _checksum.crc(buf)
    v.got[i] = got


def _patched_chunk(v: TransferValue, i: int, at: int, chunk: memoryview, verify: bool) -> None:
    """Bytes of a row delta's base at ``at`` in the value (piece ``i``), from an object
    store: hashed as stored when verified by its parts (``v.expect``), the patched rows
    laid over them in the buffer; else hashed once the rows are laid (the assembled
    value's checksum)."""
    p = v.patched
    assert p is not None
    n = chunk.nbytes
    if v.expect is not None:
        v.crcs[i] = _checksum.crc(chunk, v.crcs[i])
    if v.view is not None:
        out = np.frombuffer(v.view[at : at + n], np.uint8)
        out[...] = np.frombuffer(chunk, np.uint8)
    elif v.expect is None:
        out = np.frombuffer(chunk, np.uint8).copy()  # only hashed: the rows laid on a copy
    else:
        out = None
    if out is not None:
        p.lay(out, at)
        if v.expect is None and (verify or v.view is None):
            v.crcs[i] = _checksum.crc(out, v.crcs[i])
    v.got[i] += n


class _DirectFds:
    """The ``O_DIRECT`` descriptor of the source one task reads from now (the source kept
    alive here, so that no other takes its id), closed when the task moves on to another
    source and when it ends: a task of many chunk files holds one at a time."""

    __slots__ = ("dfd", "src")

    def __init__(self) -> None:
        self.src: Source | None = None
        self.dfd: int | None = None

    def of(self, use: Source) -> int | None:
        """``use``'s file opened with ``O_DIRECT`` (None: not a local file, or refused)."""
        if use is not self.src:
            self.close()
            fd = use.fd
            self.src = use
            self.dfd = _rawio.open_direct(fd) if fd.__class__ is int else None
        return self.dfd

    def close(self) -> None:
        dfd, self.src, self.dfd = self.dfd, None, None
        if dfd is not None:
            _src.close(dfd)


#: A piece of a remote read: ``(offset_in_object, nbytes, value, piece_index)``.
_Piece = tuple[int, int, TransferValue, int]

class Transfer:
    """Whole values read into their buffers (or hashed) in pieces on the I/O threads.

    :meth:`finish` waits for every piece, then checks sizes and checksums in the
    values' order, so the first damaged value is the one reported.
    """

    def __init__(
        self,
        reader: ValueAccess,
        values: list[TransferValue],
        verify: bool,
        *,
        ahead: bool = False,
    ) -> None:
        self.reader, self.values, self.verify = reader, values, verify
        self._lock = threading.Lock()
        #: True when the bytes are on disk and read as streams (one file in order on one
        #: thread, or a few file streams): the next transfer had best wait for this one.
        self.sequential = False
        #: True when the bytes are on disk and read with ``O_DIRECT`` where the
        #: buffers allow it.
        self.direct = False
        try:
            self._start(ahead)
        except BaseException:
            self._release()  # the sources the values came with
            raise

    def _start(self, ahead: bool) -> None:
        reader, values = self.reader, self.values
        if reader.remote and values:
            # An object store: one streamed scatter read per object, its requests
            # planned by the location (adjacent pieces: one request), hashed as they arrive.
            tasks = [functools.partial(self._run_remote, *g) for g in self._by_object()]
            self.futures = _rawio.start_all(tasks, background=ahead)
            return
        groups = runs_by_size(
            (((v, i), n) for v in values for i, (_, n) in enumerate(v.pieces)), _TASK
        )
        if len(groups) > 1 and not self._cached():
            if _rawio.DIRECT_READS and any(v.view is not None for v in values):
                # From disk into buffers: O_DIRECT, straight into them, the pieces on
                # every I/O thread so that several requests are in flight (1 GiB in 149
                # chunk files: 0.39 s against 0.59 s for four buffered file streams);
                # the next transfer's pieces may queue behind these.
                self.direct = True
                tasks = [functools.partial(self._run, g) for g in groups]
                self.futures = _rawio.start_all(tasks, background=ahead)
                return
            self.sequential = True
            streams = min(COLD_STREAMS, _rawio.IO_THREADS, self._own_files())
            if streams > 1:
                # Values in files of their own (Zarr chunks), from disk: a few threads
                # each stream whole files, taking the next in order when one is done, so
                # the disk always has a file's readahead going while a thread hashes.
                todo = iter(values)
                tasks = [functools.partial(self._run_files, todo) for _ in range(streams)]
                self.futures = _rawio.start_all(tasks, background=ahead)
                return
            # From disk, one file: one reader in file order is fastest, the kernel's
            # readahead sees one sequential stream (measured: 1 thread 0.36 s/GiB,
            # 4 threads taking pieces in turn 0.55 s/GiB).
            groups = [[piece for g in groups for piece in g]]
        tasks = [functools.partial(self._run, g) for g in groups]
        self.futures = _rawio.start_all(tasks, background=ahead)

    def _own_files(self) -> int:
        """How many of the values are in files of their own (0 or 1: read as one stream)."""
        values = self.values
        owned = sum(1 for v in values if v.src is not None and v.src.owned)
        if owned or values[0].src is not None:
            return owned
        try:  # opened by each read, not held: ask where the first one is
            src = self.reader.source(values[0].key, values[0].entry)
        except (OSError, CorruptCheckpointError):
            return 0  # the read itself reports it
        if not src.owned:
            return 0
        _src.close(src.fd)
        return len(values)

    def _run_files(self, todo: Iterator[TransferValue]) -> None:
        """Read values in turn from the shared ``todo``, each whole, in file order."""
        while True:
            with self._lock:
                v = next(todo, None)
            if v is None:
                return
            self._run([(v, i) for i in range(len(v.pieces))])

    def _cached(self) -> bool:
        """Whether the values' bytes are in the page cache (probed at a few pages)."""
        values = self.values
        probe = [values[0], values[len(values) // 2], values[-1]]
        for v in dict.fromkeys(probe):
            src = v.src
            if src is None:
                try:
                    src = self.reader.source(v.key, v.entry)
                except (OSError, CorruptCheckpointError):
                    return False  # the read itself reports it
            try:
                last = v.entry.nbytes - 1
                if not (_src.cached(src.fd, src.offset)
                        and _src.cached(src.fd, src.offset + last)):
                    return False
            finally:
                if src is not v.src and src.owned:
                    _src.close(src.fd)
        return True

    def _done(self, v: TransferValue) -> None:
        """One piece of ``v`` is in: the last one closes its source."""
        with self._lock:
            v.left -= 1
            last = v.left == 0
        if last:
            v.release()

    def _run(self, group: list[tuple[TransferValue, int]]) -> None:
        reader, verify = self.reader, self.verify
        src: Source | None = None  # opened here (for a value that came without one)
        last: TransferValue | None = None
        direct = _DirectFds() if self.direct else None
        try:
            for v, i in group:
                if v.src is not None:
                    use = v.src
                else:
                    if v is not last or src is None:
                        if src is not None and src.owned:
                            _src.close(src.fd)
                        src, last = None, v
                        src = reader.source(v.key, v.entry)
                    use = src
                dfd = direct.of(use) if direct is not None and v.view is not None else None
                try:
                    _piece(v, i, use, verify, dfd)
                finally:
                    if use is not src:
                        self._done(v)
        finally:
            if direct is not None:
                direct.close()
            if src is not None and src.owned:
                _src.close(src.fd)

    def _by_object(self) -> list[tuple[_src.RemoteFile, list[_Piece]]]:
        """The pieces grouped by the remote object holding them (a row delta's: its base's
        object, its rows laid as they arrive)."""
        groups: dict[tuple[int, str], tuple[_src.RemoteFile, list[_Piece]]] = {}
        for v in self.values:
            src = v.src if v.src is not None else self.reader.source(v.key, v.entry)
            rf, at = src.fd, src.offset
            if isinstance(rf, _src.Patched):
                v.patched = rf
                if rf.expect is not None and (self.verify or v.view is None):
                    v.expect = rf.expect  # verified by its parts: the base's bytes hashed
                rf, at = rf.base, rf.offset + at
            assert isinstance(rf, _src.RemoteFile)
            at += rf.base
            _, pieces = groups.setdefault((id(rf.location), rf.key), (rf, []))
            pieces.extend((at + pos, n, v, i) for i, (pos, n) in enumerate(v.pieces))
        return list(groups.values())

    def _run_remote(self, rf: _src.RemoteFile, group: list[_Piece]) -> None:
        hash_all = self.verify

        def sink(j: int, pos: int, chunk: memoryview) -> None:
            _, _, v, i = group[j]
            at = v.pieces[i][0] + pos
            if v.patched is not None:
                _patched_chunk(v, i, at, chunk, hash_all)
                return
            if v.view is not None:
                v.view[at : at + chunk.nbytes] = chunk
            if hash_all or v.view is None:
                v.crcs[i] = _checksum.crc(chunk, v.crcs[i])
            v.got[i] += chunk.nbytes

        # A short object: finish() names the first value short of bytes.
        with contextlib.suppress(CorruptCheckpointError):
            rf.location.stream_ranges(rf.key, [g[0] for g in group], [g[1] for g in group], sink)

    def finish(self) -> None:
        """Wait for every piece; raise for the first value short of bytes or damaged."""
        try:
            _rawio.wait_all(self.futures)
        finally:
            self._release()
        reader = self.reader
        for v in self.values:
            e = v.entry
            if v.patched is not None:  # a row delta verified by its parts: its patches
                v.patched.check()
            got = sum(v.got)
            if got != e.nbytes:
                raise reader.corrupt(v.key, f"is truncated: {got} of {e.nbytes} bytes present")
            if self.verify or v.dest is None:
                value = _checksum.header_crc(v.key, e.dtype, e.shape)
                for (_, n), part in zip(v.pieces, v.crcs, strict=True):
                    value = _checksum.combine(value, part, n)
                if v.expect is None:
                    compare(reader, v.key, e, value)
                elif value != v.expect:  # a row delta's base (its patches passed)
                    raise reader.corrupt(v.key, f"fails its base's checksum (stored "
                                                f"{v.expect:#010x}, computed {value:#010x}); "
                                                "the checkpoint is damaged")
            if v.lay is not None:  # the base's bytes are in: its rows laid over them
                assert v.view is not None
                v.lay.lay(np.frombuffer(v.view, np.uint8), 0)

    def abandon(self) -> None:
        """Wait for the pieces still running; their errors no longer matter."""
        with contextlib.suppress(BaseException):
            _rawio.wait_all(self.futures)
        self._release()

    def _release(self) -> None:
        """Close the sources the values came with that no piece closed (a failed read)."""
        for v in self.values:
            v.release()
