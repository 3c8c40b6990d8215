"""Raw positional I/O, the checksum thread and the I/O threads shared by the container backends.

Writes go straight from the arrays' buffers (``os.pwrite``/``os.pwritev``, no
copy); reads go straight into the destination buffer (``os.preadv``). Checksums
of values being written run on one background thread (:func:`submit`; CRC-32C
releases the GIL on large buffers), so hashing overlaps with the writes. Large
reads, snapshots and a Zarr writer's directory tree run as tasks on a small pool
of I/O threads (:func:`start_all`, :func:`wait_all`): system calls, copies and
CRC-32C release the GIL, so pieces move in parallel. Set ``CKPTVAR_IO_THREADS``
(default: the CPU count, at least 4, at most 8) to change the pool's size; ``1``
does everything on the calling thread.

Bytes not in the page cache can be read with ``O_DIRECT`` (:func:`open_direct`,
:func:`pread_direct`): straight from the disk into the destination, no page-cache
copy and no per-file readahead ramp. The buffer's address must match the file
offset modulo :data:`DIRECT_ALIGN` (:func:`aligned_empty` allocates such arrays);
the unaligned head and tail go through the ordinary descriptor. Where a file system
refuses ``O_DIRECT`` the reads stay buffered and :data:`direct_stats` counts the
refusal. ``CKPTVAR_DIRECT_READS=0`` turns direct reads off.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_READS",
    "IOV_MAX",
    "IO_THREADS",
    "DirectStats",
    "NotRegularFile",
    "aligned_empty",
    "byte_view",
    "cached",
    "copy_pieces",
    "direct_stats",
    "open_direct",
    "pread_direct",
    "pread_exact",
    "pread_into",
    "pread_into_exact",
    "preadv_all",
    "pwrite_all",
    "pwrite_flushing",
    "pwrite_pieces",
    "pwritev_all",
    "read_regular",
    "run_here",
    "snapshot",
    "snapshot_pieces",
    "start_all",
    "start_writeback",
    "submit",
    "wait_all",
]

_MAX_IO = 1 << 30  # Linux moves at most ~2 GiB per call; stay well below
#: Most buffers handed to one ``pwritev``/``preadv``.
IOV_MAX = min(getattr(os, "IOV_MAX", 1024) if hasattr(os, "IOV_MAX") else 1024, 1024)


def _io_threads() -> int:
    env = os.environ.get("CKPTVAR_IO_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(
                f"CKPTVAR_IO_THREADS must be a whole number of threads, got {env!r}."
            ) from None
    return min(8, max(4, os.cpu_count() or 1))


#: Threads that read and hash pieces of large values at once.
IO_THREADS = _io_threads()

class _Pools:
    """The checksum thread and the I/O threads, started on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checksum: ThreadPoolExecutor | None = None
        self.io: ThreadPoolExecutor | None = None

    def forget(self) -> None:  # a forked child has the pools' objects but not their threads
        self.checksum = self.io = None

    def io_pool(self) -> ThreadPoolExecutor:
        if self.io is None:
            with self.lock:
                if self.io is None:
                    self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ckptvar-io")
        return self.io

    def checksum_pool(self) -> ThreadPoolExecutor:
        if self.checksum is None:
            with self.lock:
                if self.checksum is None:
                    self.checksum = ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="ckptvar-crc")
        return self.checksum


_pools = _Pools()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pools.forget)

#: Set when the interpreter begins to exit: thread pools then refuse new work, so what
#: would go to a thread runs on the caller's (a save asked for by an ``atexit`` handler).
_exiting = threading.Event()
# Hooks run in reverse order of registration: this one, registered after
# concurrent.futures' (imported above), runs before the pools stop taking work.
threading._register_atexit(_exiting.set)  # type: ignore[attr-defined]


def run_here(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` run on this thread, its result or error in a finished future."""
    f: Future[Any] = Future()
    try:
        f.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed over through the future
        f.set_exception(exc)
    return f


_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` is in the page cache (False where that cannot be told).

    A ``preadv2(RWF_NOWAIT)`` of one byte: it fails rather than wait for the disk.
    """
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, _NOWAIT) == 1
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False


#: File offsets and buffer addresses of ``O_DIRECT`` reads are multiples of this (the
#: largest logical block size in common use; ext4 and XFS accept any multiple of theirs).
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


#: Launchers' variables for the number of a job's processes on this node (torchrun,
#: MPICH/Hydra, Open MPI, Slurm, PMIx): in such a job, reads stay in the page cache.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE", "PMIX_LOCAL_SIZE", "PALS_LOCAL_SIZE")


def _local_processes(environ: Mapping[str, str]) -> int:
    """How many processes of this job run on this node, as the launcher says (1: none said).

    >>> _local_processes({"LOCAL_WORLD_SIZE": "8"}), _local_processes({})
    (8, 1)
    """
    for name in _LOCAL_SIZE_VARS:
        value = environ.get(name, "").split("(")[0].split(",")[0].strip()
        if value.isdigit():
            return int(value)
    return 1


def _direct_reads(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether cold reads use ``O_DIRECT``: on Linux, unless ``CKPTVAR_DIRECT_READS`` is
    ``0`` (never) or ``1`` (always), and not in a job with several processes on this
    node, whose processes often read the same bytes (every rank loading one model): the
    page cache then reads them from the disk once, direct reads once per process.

    >>> _direct_reads({"CKPTVAR_DIRECT_READS": "0"})
    False
    >>> _direct_reads({"LOCAL_WORLD_SIZE": "4"})
    False
    >>> _direct_reads({"LOCAL_WORLD_SIZE": "4", "CKPTVAR_DIRECT_READS": "1"}) == bool(_O_DIRECT)
    True
    """
    env = environ.get("CKPTVAR_DIRECT_READS", "").strip().lower()
    if not _O_DIRECT or not sys.platform.startswith("linux") or env in ("0", "false", "no",
                                                                          "off"):
        return False
    return env in ("1", "true", "yes", "on") or _local_processes(environ) <= 1


#: Whether cold reads may use ``O_DIRECT`` (Linux, one process of its job on this node;
#: ``CKPTVAR_DIRECT_READS=0``: never, ``=1``: also in a job of several processes).
DIRECT_READS = _direct_reads()


class DirectStats:
    """What this process read with ``O_DIRECT`` (counters only ever grow)."""

    __slots__ = ("_lock", "bytes", "refused")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Bytes that went straight from the disk into a destination.
        self.bytes = 0
        #: Times a file system refused ``O_DIRECT`` and the read stayed buffered.
        self.refused = 0

    def add(self, nbytes: int = 0, refused: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.refused += refused


#: The process's ``O_DIRECT`` counters (``direct_stats.bytes``, ``direct_stats.refused``).
direct_stats = DirectStats()


def aligned_empty(shape: tuple[int, ...], dtype: Any, phase: int = 0) -> np.ndarray:
    """An uninitialised C-ordered array whose first byte's address is ``phase`` modulo
    :data:`DIRECT_ALIGN`, so that a file's bytes at an offset of that phase can be read
    into it with ``O_DIRECT``. A view into a buffer (its ``base``) that also holds the
    whole blocks the array's first and last bytes fall in, so that a direct read may
    cover them (``room`` of :func:`pread_direct`).

    >>> a = aligned_empty((3, 5), np.float32, 512)
    >>> a.ctypes.data % DIRECT_ALIGN, a.shape, a.flags.c_contiguous
    (512, (3, 5), True)
    >>> a.ctypes.data - a.base.ctypes.data >= 512
    True
    """
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + 3 * DIRECT_ALIGN, np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN + phase % DIRECT_ALIGN
    out: np.ndarray = raw[skip : skip + nbytes].view(dt).reshape(shape)
    return out


def open_direct(fd: int) -> int | None:
    """A second descriptor of ``fd``'s file opened with ``O_DIRECT``, or None where that
    is refused (a file system without it, no ``/proc``; counted in :data:`direct_stats`)."""
    if not DIRECT_READS:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | os.O_CLOEXEC)
    except OSError:
        direct_stats.add(refused=1)
        return None


def pread_direct(fd: int, dfd: int | None, buf: memoryview, offset: int, address: int, *,
                 room: memoryview | None = None, at: int = 0) -> int:
    """:func:`pread_into`, the part of ``buf`` between :data:`DIRECT_ALIGN` boundaries
    of the file read through ``dfd`` (``O_DIRECT``, from :func:`open_direct`) when
    ``address`` (of ``buf[0]``) has the offset's phase; the rest through ``fd``.

    ``room``: a buffer holding ``buf`` at ``at`` whose other bytes may be overwritten;
    the direct read then also covers the blocks ``buf``'s ends fall in, as far as
    ``room`` reaches, instead of reading those ends through ``fd``.

    Direct reads are coherent with the page cache on Linux (the kernel writes back dirty
    pages of the range first). A direct read the file system refuses is read again
    through ``fd``.
    """
    n = len(buf)
    if room is not None and dfd is not None and n:
        grow = min(offset % DIRECT_ALIGN, at)
        end = offset + n
        more = min(-end % DIRECT_ALIGN, len(room) - at - n)
        if grow or more:
            wide = room[at - grow : at + n + more]
            got = _pread_direct(fd, dfd, wide, offset - grow, address - grow)
            return max(0, min(n, got - grow))
    return _pread_direct(fd, dfd, buf, offset, address)


def _pread_direct(fd: int, dfd: int | None, buf: memoryview, offset: int, address: int) -> int:
    n = len(buf)
    lo = -offset % DIRECT_ALIGN
    hi = (offset + n) // DIRECT_ALIGN * DIRECT_ALIGN - offset
    if dfd is None or (address - offset) % DIRECT_ALIGN or hi - lo < DIRECT_ALIGN:
        return pread_into(fd, buf, offset)
    got = lo and pread_into(fd, buf[:lo], offset)
    if got < lo:
        return got
    done = lo
    try:
        while done < hi:
            k = os.preadv(dfd, [buf[done : min(hi, done + _MAX_IO)]], offset + done)
            if k == 0:
                break
            done += k
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct_stats.add(refused=1)
    direct_stats.add(done - lo)
    if done < hi and done % DIRECT_ALIGN:  # a short read ends at the end of the file
        return done
    return done + pread_into(fd, buf[done:], offset + done)


def start_all(tasks: Sequence[Callable[[], Any]], *, background: bool = False) -> list[Future[Any]]:
    """Start ``tasks`` on the I/O threads.

    With one thread, or one task and not ``background``, they run here, in order.
    """
    if IO_THREADS == 1 or (len(tasks) <= 1 and not background) or _exiting.is_set():
        done: list[Future[Any]] = []
        for task in tasks:
            f = run_here(task)
            done.append(f)
            if f.exception() is not None:
                break
        return done
    pool = _pools.io_pool()
    return [pool.submit(task) for task in tasks]


def wait_all(futures: Sequence[Future[Any]]) -> list[Any]:
    """Wait for every task, then raise the first one's error (in task order) or return results.

    Nothing is left running when this returns or raises, so no thread still reads into a
    buffer or through a descriptor the caller is about to release.
    """
    try:
        _wait(futures)
    except BaseException:  # interrupted: drop what has not started, let the rest finish
        for f in futures:
            f.cancel()
        _wait(futures)
        raise
    for f in futures:
        exc = f.exception()
        if exc is not None:
            raise exc
    return [f.result() for f in futures]


def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on the shared checksum thread (tasks run in submission order)."""
    if _exiting.is_set():
        return run_here(fn, *args)
    return _pools.checksum_pool().submit(fn, *args)


_COPY_PIECE = 8 << 20


_SNAPSHOT_PIECE = 2 << 20  # what one thread takes at a time when a snapshot is shared


def snapshot(arrays: Sequence[np.ndarray],
             into: Sequence[np.ndarray | None] | None = None, *,
             processes: int = 1) -> list[np.ndarray]:
    """A C-ordered copy of each array; from 16 MiB in all, I/O threads help copy it.

    ``into`` gives a destination for each array (a C-contiguous array of its shape and
    dtype, e.g. a reused buffer's view) or ``None`` (new memory). The copy is cut into
    2 MiB pieces whatever the arrays' sizes; this thread copies them in turn, and I/O
    threads take pieces too: one per CPU beyond this process's share when ``processes``
    (at most) copy on this machine at once (none when they have a CPU each or less: 4
    ranks on 2 CPUs were 2-4 ms slower with a helper). A helper the system does not
    run soon leaves its share to this thread: it holds up at most the piece it took.
    Filling fresh memory is mostly page faults, which run in parallel too (1 GiB: 171 ms
    on one thread, 94 ms on four, on a 2-CPU VM); memory written before has none.

    >>> a = np.arange(6).reshape(2, 3)
    >>> b, = snapshot([a])
    >>> bool((a == b).all()) and not np.shares_memory(a, b)
    True
    >>> dest = np.empty((2, 3), a.dtype)
    >>> snapshot([a], into=[dest])[0] is dest and bool((dest == a).all())
    True
    """
    out, pieces, total = snapshot_pieces(arrays, into)
    copy_pieces(pieces, total, processes=processes)
    return out


def snapshot_pieces(arrays: Sequence[np.ndarray],
                    into: Sequence[np.ndarray | None] | None = None,
                    ) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]], int]:
    """What :func:`snapshot` copies, not copied yet: ``(destinations, pieces, nbytes)``.

    ``pieces`` are ``(destination, source)`` pairs (2 MiB at most, a non-contiguous
    array whole) that :func:`copy_pieces` copies; a caller that snapshots the very same
    arrays again may keep them and copy them again.

    >>> a = np.arange(6).reshape(2, 3)
    >>> (d,), pieces, n = snapshot_pieces([a])
    >>> copy_pieces(pieces, n)
    >>> bool((d == a).all()), n
    (True, 48)
    """
    out: list[np.ndarray] = []
    pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (destination, source), flat
    total = 0
    for i, a in enumerate(arrays):
        d = None if into is None else into[i]
        if d is None:
            d = np.empty(a.shape, a.dtype)
        out.append(d)
        if not a.flags.c_contiguous:  # copied whole, from its strides
            pieces.append((d, a))
            continue
        total += a.nbytes
        if a.nbytes <= _SNAPSHOT_PIECE:  # one piece: the arrays as they are
            pieces.append((d, a))
            continue
        src, dst = a.reshape(-1), d.reshape(-1)
        step = max(1, _SNAPSHOT_PIECE // max(1, a.itemsize))
        for s in range(0, src.size, step):
            pieces.append((dst[s : s + step], src[s : s + step]))
    return out, pieces, total


def copy_pieces(pieces: Sequence[tuple[np.ndarray, np.ndarray]], nbytes: int, *,
                processes: int = 1) -> None:
    """Copy :func:`snapshot_pieces`'s ``pieces`` (``nbytes`` of contiguous ones in all),
    helped by I/O threads as :func:`snapshot` says."""
    helpers = min(IO_THREADS, _cpus() // max(1, processes)) - 1
    _copy_pieces(pieces, helpers if nbytes >= 2 * _COPY_PIECE else 0)


def _copy_pieces(pieces: Sequence[tuple[np.ndarray, np.ndarray]], helpers: int) -> None:
    """Copy each ``(destination, source)``, here and on up to ``helpers`` I/O threads."""
    if helpers < 1:
        for dst, src in pieces:
            np.copyto(dst, src, casting="no")
        return
    turn = itertools.count()  # next() on it is atomic: each piece is taken once

    def copy_turns() -> None:
        for i in turn:
            if i >= len(pieces):
                return
            dst, src = pieces[i]
            np.copyto(dst, src, casting="no")

    pool = _pools.io_pool()
    helping = [pool.submit(copy_turns) for _ in range(0 if _exiting.is_set() else helpers)]
    copy_turns()
    # a helper not started yet (the pool busy, or the thread not run yet) is not waited for
    wait_all([f for f in helping if not f.cancel()])


_CPUS: list[tuple[float, int]] = []  # (when asked, the answer): asked again after 1 s


def _cpus() -> int:
    """The CPUs this process may run on (asked of the system at most once a second: a
    background save's blocking part asks at every save)."""
    now = time.monotonic()
    if _CPUS and now - _CPUS[0][0] < 1.0:
        return _CPUS[0][1]
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    _CPUS[:] = [(now, n)]
    return n


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat ``uint8`` memoryview of a C-contiguous array's bytes (no copy)."""
    if arr.size == 0:
        return memoryview(b"")
    return arr.reshape(-1).view(np.uint8).data


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (loops over short writes)."""
    done, n = 0, len(buf)
    while done < n:
        done += os.pwrite(fd, buf[done : done + _MAX_IO], offset + done)


#: :func:`pwrite_pieces` writes this many bytes a call.
WRITE_PIECE = 1 << 20


def pwrite_pieces(fd: int, buf: memoryview, offset: int) -> None:
    """:func:`pwrite_all` in 1 MiB pieces. On Linux 6.18 (ext4, 2 shared CPUs) a
    ``pwrite`` of each whole array of a 1 GiB model cost 0.2 to 1.9 s of CPU, erratically,
    1 MiB pieces 0.21 to 0.28 s (docs/benchmarks.md, "Goal 3"); elsewhere the extra calls
    cost about 1 ms a GiB."""
    for pos in range(0, len(buf), WRITE_PIECE):
        pwrite_all(fd, buf[pos : pos + WRITE_PIECE], offset + pos)


def _sync_file_range() -> Callable[[int, int, int, int], Any] | None:
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()
_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the range back, do not wait
_FLUSH_PIECE = 8 << 20


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` to disk now.

    Only a head start for the ``fsync`` that follows (which reports any error): the disk
    writes the first pieces while later ones are still being copied.
    """
    if _SFR is not None and nbytes > 0:
        _SFR(fd, offset, nbytes, _SFR_WRITE)


def pwrite_flushing(fd: int, buf: memoryview, offset: int) -> None:
    """:func:`pwrite_all` in 8 MiB pieces, starting each piece's writeback once written.

    For durable writes: measured on a 1 GiB file, write + fsync 0.52-0.58 s, with the
    writeback started piece by piece 0.32-0.44 s.
    """
    for pos in range(0, len(buf), _FLUSH_PIECE):
        piece = buf[pos : pos + _FLUSH_PIECE]
        pwrite_all(fd, piece, offset + pos)
        start_writeback(fd, offset + pos, len(piece))


def _bytes_of(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        return byte_view(buf)
    mv = memoryview(buf)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def _after(batch: Sequence[Any], pos: int) -> Iterator[memoryview]:
    """The bytes of the buffers laid back to back, from byte ``pos`` on, buffer by buffer."""
    for buf in batch:
        b = _bytes_of(buf)
        if pos >= len(b):
            pos -= len(b)
            continue
        yield b[pos:]
        pos = 0


def _iov_batches(bufs: Sequence[Any]) -> Iterator[tuple[list[Any], int]]:
    """The buffers in runs of at most ``IOV_MAX``, each with its total byte count."""
    for i in range(0, len(bufs), IOV_MAX):
        batch = list(bufs[i : i + IOV_MAX])
        yield batch, sum(b.nbytes for b in batch)


def pwritev_all(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Write the buffers (memoryviews or C-contiguous arrays) back to back from ``offset``.

    Returns the bytes written; at most ``IOV_MAX`` buffers go to one ``pwritev``.
    """
    total = 0
    for batch, want in _iov_batches(bufs):
        got = os.pwritev(fd, batch, offset + total)
        if got < want:  # short write: finish this batch piece by piece
            for rest in _after(batch, got):
                pwrite_all(fd, rest, offset + total + got)
                got += len(rest)
        total += want
    return total


def preadv_all(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill the buffers back to back from ``offset``; returns the bytes read (short at EOF).

    ``IOV_MAX`` buffers go to one ``preadv`` (a scatter read straight into them).
    """
    total = 0
    for batch, want in _iov_batches(bufs):
        got = os.preadv(fd, batch, offset + total)
        if got < want:  # short read: finish this batch piece by piece
            for rest in _after(batch, got):
                n = pread_into(fd, rest, offset + total + got)
                got += n
                if n < len(rest):
                    return total + got
        total += got
    return total


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done : done + _MAX_IO]], offset + done)
        if got == 0:
            break
        done += got
    return done


class NotRegularFile(ValueError):
    """A named pipe, device, socket or directory where a file is read, or a file over its
    limit."""


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    Opened without blocking, so a named pipe there is refused at once instead of waiting
    for a writer, and a device (``/dev/zero`` reads forever) is refused before a read:
    both, and a file over ``limit`` bytes, raise :class:`NotRegularFile` (a
    ``ValueError``); ``FileNotFoundError`` and other ``OSError`` pass through.

    >>> read_regular("/dev/zero", 10)
    Traceback (most recent call last):
    ckptvar.storage.rawio.NotRegularFile: '/dev/zero' is a device, not a regular file
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a named pipe" if stat.S_ISFIFO(st.st_mode) else "a directory"
                    if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "a device")
            raise NotRegularFile(f"{os.fspath(path)!r} is {kind}, not a regular file")
        if st.st_size > limit:
            raise NotRegularFile(f"{os.fspath(path)!r} is {st.st_size} bytes (at most {limit} "
                                 "are read)")
        return pread_exact(fd, 0, st.st_size, what="file", path=path)
    finally:
        os.close(fd)


def pread_exact(fd: int, offset: int, size: int, *, what: str, path: Any) -> bytes:
    """Exactly ``size`` bytes at ``offset``; a short read means ``what`` in ``path`` is
    truncated (``CorruptCheckpointError``, as is a negative range).

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"hello"); f.flush()
    ...     pread_exact(f.fileno(), 1, 3, what="the data", path="f")
    b'ell'
    """
    if offset < 0 or size < 0:
        raise CorruptCheckpointError(f"{what} in {str(path)!r}: invalid byte range "
                                     f"({size} bytes at offset {offset}).")
    chunks = []
    got = 0
    while got < size:
        chunk = os.pread(fd, min(size - got, _MAX_IO), offset + got)
        if not chunk:
            raise _truncated(what, path, size, offset, got)
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def pread_into_exact(fd: int, buf: memoryview, offset: int, *, what: str, path: Any) -> None:
    """Fill all of ``buf`` from ``offset`` (no intermediate copy); a short read means
    ``what`` in ``path`` is truncated (``CorruptCheckpointError``)."""
    if offset < 0:
        raise CorruptCheckpointError(f"{what} in {str(path)!r}: negative offset {offset}.")
    got = pread_into(fd, buf, offset)
    if got != len(buf):
        raise _truncated(what, path, len(buf), offset, got)


def _truncated(what: str, path: Any, size: int, offset: int, got: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{what} in {str(path)!r} is truncated: wanted {size} bytes at offset {offset}, "
        f"the file ended after {got}."
    )
