"""Row deltas (format 1.5): a changed value stored as its base plus the rows that changed.

Owns the rule that decides when a value is written as a delta instead of whole
(:func:`plan`), the patch's bytes and checksum (:func:`patch_bytes`), and the reader's
side: a patch checked and decoded (:func:`decode_patch`), the base's own checksum by which
a delta is verified by its parts (:func:`base_checksum`), and several patches folded into
one, later rows winning (:func:`fold`: for a delta verified by its assembled bytes, whose
patches a restore lays twice). The backends lay a :class:`DeltaWrite` out (HDF5:
external links and a patch dataset; Zarr: hard links and a patch array) and read it back
through :class:`.source.Patched` (docs/FORMAT.md, "Row deltas").

**The rule.** A value is a delta only when the caller says which rows changed since the
base (a ``cv.Variable``'s row log), it is an uncompressed array of at least
:data:`DELTA_FROM` bytes with two rows or more, and the base holds it whole or as a delta
of the same dtype and shape. A delta refers to the base's whole copy and to every patch
since that copy was written, each in the file that wrote it (one level: never a delta of
a delta), and adds its own patch of the rows changed since the base step. When the
patches would then hold more than a share of its rows (counted with repeats) or number
more than a count (:class:`DeltaLimits`: :data:`DELTA_LIMIT` and :data:`MAX_PATCHES` by
default; a manager's ``cv.IncrementalOptions`` sets others), the earlier patches are
**merged**: the step writes one patch of every row changed since the whole copy (their
union, taken from the value in memory) and refers to the whole copy only; when that union
is more than half of the share, the value is written whole instead. Reading a delta
reads the base and every patch, so a restore reads at most 1 + the share (1.25x by
default) the bytes of the value.

>>> rows = np.array([1, 3])
>>> data = np.arange(8, dtype=np.uint8).reshape(4, 2)
>>> raw, crc = patch_bytes(memoryview(data.tobytes()), 2, rows, 0)
>>> got_rows, got = decode_patch(raw, 2, 2, 4, crc=crc, seed=0)
>>> got_rows.tolist(), list(got.tobytes())
([1, 3], [2, 3, 6, 7])
>>> older = np.array([0, 3]), np.frombuffer(bytes([9, 9, 8, 8]), "V2")
>>> r, d = fold([older, (got_rows, got)], 4)
>>> r.tolist(), list(d.tobytes())
([0, 1, 3], [9, 9, 2, 3, 6, 7])
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import CkptError
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import Delta
from . import source as _src
from .blocks import blocks_agree

__all__ = ["DELTA_FROM", "DELTA_LIMIT", "MAX_PATCHES", "DeltaLimits", "DeltaWrite", "Patches",
           "base_checksum", "check_rows",
           "decode_patch", "fold", "in_base", "merged", "patch_bytes", "plan", "read_patches",
           "stream_patch"]

#: Values smaller than this are written whole (a delta's patch and links cost more).
DELTA_FROM = 1 << 20
#: A delta whose patches would hold more than this share of the value's rows is written
#: whole (the bound on what a restore reads beyond the value: 25%).
DELTA_LIMIT = 0.25
#: Patches a delta may refer to (its own included) before the value is written whole.
MAX_PATCHES = 16


@dataclass(frozen=True, slots=True)
class DeltaLimits:
    """The rule's two limits (the defaults: :data:`DELTA_LIMIT`, :data:`MAX_PATCHES`);
    the caller checks them (``cv.IncrementalOptions``)."""

    #: The share of a value's rows its patches may hold (with repeats) before they are
    #: merged or the value is written whole.
    rows: float = DELTA_LIMIT
    #: The patches a delta may refer to, its own included.
    patches: int = MAX_PATCHES


_DEFAULT_LIMITS = DeltaLimits()


@dataclass(slots=True)
class DeltaWrite:
    """A value to be written as a delta: what it refers to and its own patch (the rows of
    the value's bytes :meth:`take`, streamed by :meth:`write_patch`)."""

    #: ``(file, path, offset)`` of the base's whole copy, as the new checkpoint names it.
    base: tuple[str, str, int]
    #: The earlier patches ``(file, path, offset, rows, crc)``, as the new checkpoint names them.
    earlier: list[tuple[str, str, int, int, int]]
    rows: np.ndarray  # this step's rows, sorted and unique
    crc: int  # its own patch's (set once written)
    since: str  # the checkpoint that wrote the base
    #: The base's files (relative to the base checkpoint) and where the new checkpoint
    #: takes them (Zarr: hard links, so the step stands alone).
    links: list[tuple[str, str]] = field(default_factory=list)
    #: Rows per chunk of the base's whole copy (Zarr, format 1.4), or None.
    pieces: int | None = None
    #: Where the own patch is: container path and byte offset (set by the backend).
    path: str = ""
    offset: int = 0
    #: The base's own checksum and block checksums (None: unknown, an older base).
    base_checksum: int | None = None
    base_blocks: bytes | None = None
    #: Verified by its parts alone (format 1.6): no checksum of the assembled value.
    by_parts: bool = False
    #: ``(bytes of the value, bytes per row, header CRC)`` the patch is gathered from.
    source: tuple[memoryview, int, int] | None = None

    def take(self, view: memoryview, row_bytes: int, seed: int) -> None:
        """The own patch is ``rows`` of the value whose bytes are ``view`` (seeded by
        ``seed``, the value's header CRC): gathered when :meth:`write_patch` writes it."""
        check_rows(self.rows, len(view) // row_bytes)
        self.source = (view, row_bytes, seed)

    @property
    def patch_nbytes(self) -> int:
        """Bytes of the own patch: the rows' indices, then the rows."""
        return 0 if self.source is None else int(self.rows.size) * (8 + self.source[1])

    def write_patch(self, write: Callable[[memoryview, int], None], at: int) -> None:
        """Write the own patch from byte ``at`` through ``write(piece, offset)`` (on the
        I/O threads: :func:`stream_patch`), and set its CRC."""
        assert self.source is not None
        view, row_bytes, seed = self.source
        self.crc = stream_patch(view, row_bytes, self.rows, seed, write=write, at=at)

    def record(self) -> Delta:
        """Its record entry (an unchanged value's carried-over delta has no own patch)."""
        patches = tuple(self.earlier)
        if self.rows.size:
            patches += (("", self.path, self.offset, int(self.rows.size), self.crc),)
        return Delta(self.base, patches, self.since, self.base_checksum, self.base_blocks,
                     self.by_parts)


def check_rows(rows: np.ndarray, nrows: int) -> None:
    """``IndexError`` unless the sorted ``rows`` are all inside a value of ``nrows`` rows
    (its ends bound it: a patch gathers them without a check of each)."""
    if rows.size and not 0 <= rows[0] <= rows[-1] < nrows:
        raise IndexError(f"rows {int(rows[0])}..{int(rows[-1])} of a value of {nrows} rows")


def _gather(table: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    # "clip" (every row is inside, checked): the default mode buffers ``out`` (4x the time)
    np.take(table, rows, out=out, mode="clip")


def patch_bytes(view: memoryview, row_bytes: int, rows: np.ndarray, seed: int
                ) -> tuple[np.ndarray, int]:
    """The patch of ``rows`` of the value whose bytes are ``view``: ``uint64`` row indices
    (little-endian), then the rows; and its CRC-32C seeded by ``seed``."""
    n = int(rows.size)
    out = np.empty(8 * n + n * row_bytes, np.uint8)
    out[: 8 * n].view("<u8")[:] = rows
    item = np.dtype((np.void, row_bytes))
    table = np.frombuffer(view, item)
    check_rows(rows, len(table))
    _gather(table, rows, out[8 * n:].view(item))
    return out, _checksum.crc(out, seed)


#: Bytes of rows a streamed patch gathers at a time (:func:`stream_patch`).
_PIECE = 4 << 20
_buffers = threading.local()


def _two_buffers(size: int) -> list[np.ndarray]:
    """This thread's two buffers of ``size`` bytes for :func:`stream_patch` (kept: a fresh
    one's page faults cost about what gathering into it does)."""
    got: list[np.ndarray] | None = getattr(_buffers, "pair", None)
    if got is None or got[0].size < size:
        got = _buffers.pair = [np.empty(size, np.uint8) for _ in range(2)]
    return got


def stream_patch(view: memoryview, row_bytes: int, rows: np.ndarray, seed: int, *,
                 write: Callable[[memoryview, int], None], at: int) -> int:
    """Write the patch of ``rows`` (:func:`patch_bytes`' bytes) from byte ``at`` through
    ``write(piece, offset)``; returns its CRC-32C seeded by ``seed``. The rows are gathered
    :data:`_PIECE` bytes at a time, in turn into two buffers of this thread, and each
    piece is written on an I/O thread while the next is gathered and hashed (gathering
    releases the GIL), so a large patch costs about its write. Every write has ended when
    this returns or raises.

    >>> data = np.arange(8, dtype=np.uint8).reshape(4, 2)
    >>> out = bytearray(8 * 2 + 2 * 2)
    >>> def write(piece, offset):
    ...     out[offset : offset + len(piece)] = piece
    >>> crc = stream_patch(memoryview(data.tobytes()), 2, np.array([1, 3]), 0, write=write, at=0)
    >>> want, want_crc = patch_bytes(memoryview(data.tobytes()), 2, np.array([1, 3]), 0)
    >>> bytes(out) == want.tobytes() and crc == want_crc
    True
    """
    n, per = int(rows.size), max(1, _PIECE // row_bytes)
    if n <= per:  # one piece: gathered and written here
        out, crc = patch_bytes(view, row_bytes, rows, seed)
        write(_rawio.byte_view(out), at)
        return crc
    item = np.dtype((np.void, row_bytes))
    table = np.frombuffer(view, item)
    check_rows(rows, len(table))
    index = rows.astype("<u8")
    crc = _checksum.crc(index, seed)
    pair = _two_buffers(per * row_bytes)
    futures: list[Any] = [None, None]
    started: list[Any] = []
    try:
        write(_rawio.byte_view(index), at)
        at += 8 * n
        for k, lo in enumerate(range(0, n, per)):
            if futures[k % 2] is not None:
                futures[k % 2].result()  # the piece written from this buffer before
            m = min(per, n - lo)
            piece = pair[k % 2][: m * row_bytes]
            _gather(table, rows[lo : lo + m], piece.view(item))
            crc = _checksum.crc(piece, crc)
            futures[k % 2] = f = _rawio.start_all(
                [functools.partial(write, _rawio.byte_view(piece), at)], background=True)[0]
            started.append(f)
            at += m * row_bytes
    finally:
        _rawio.wait_all(started)  # nothing writes from the buffers after this
    return crc


def decode_patch(raw: bytes | bytearray | memoryview | np.ndarray, n: int, row_bytes: int,
                 nrows: int, *, crc: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, data)`` of a stored patch of ``n`` rows (``data``: one ``V<row_bytes>``
    item per row, so whole rows copy as single items); ``ValueError`` saying what is
    wrong when it fails its checksum or its rows are not sorted, unique and in range."""
    buf = np.frombuffer(raw, np.uint8)
    if buf.size != 8 * n + n * row_bytes:
        raise ValueError(f"holds {buf.size} bytes, {8 * n + n * row_bytes} expected")
    if _checksum.crc(buf, seed) != crc:
        raise ValueError("fails its checksum")
    rows = buf[: 8 * n].view("<u8").astype(np.int64)
    if n and (rows[0] < 0 or rows[-1] >= nrows or (n > 1 and not (rows[1:] > rows[:-1]).all())):
        raise ValueError("lists rows that are not sorted, unique and inside the value")
    return rows, buf[8 * n:].view(np.dtype((np.void, row_bytes)))


class Patches:
    """A delta's patches being read and checked on the I/O threads, started when made, so
    a restore reads them while it hashes the base; :meth:`result` waits for them.

    ``tasks`` each read patches in turn (:func:`read_patches`); ``then`` turns the list into
    what is laid (a fold, for a delta verified by its assembled bytes); ``fds``: the
    descriptors the reads use that this object closes once no read can run any more.
    A task not yet started when :meth:`result` is asked runs on the asking thread (its
    future cancelled), so an I/O thread that waits for the patches never waits for a
    task queued behind itself.
    """

    def __init__(self, tasks: Sequence[Callable[[], list[tuple[np.ndarray, np.ndarray]]]],
                 then: Callable[[list[tuple[np.ndarray, np.ndarray]]],
                                list[tuple[np.ndarray, np.ndarray]]] | None = None,
                 fds: list[int] | None = None) -> None:
        self._tasks, self._then, self._fds = tasks, then, fds or []
        self._lock = threading.Lock()
        self._got: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._error: BaseException | None = None
        try:
            self._futures = _rawio.start_all(tasks, background=True)
        except BaseException:
            self._close_fds()
            raise

    def result(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The patches, read and checked, in order (or as ``then`` made them); raises the
        first damaged one's error (each call)."""
        with self._lock:
            if self._got is None and self._error is None:
                try:
                    parts = [p for i in range(len(self._tasks)) for p in self._take(i)]
                    self._got = parts if self._then is None else self._then(parts)
                except (CkptError, OSError) as exc:  # a damaged patch: said at each call
                    self._error = exc
                finally:
                    self._settle()
            if self._error is not None:
                raise self._error
            assert self._got is not None
            return self._got

    def _take(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Task ``i``'s patches: run here if no thread took it yet, else its thread's."""
        if i >= len(self._futures):  # run in order here, and an earlier one failed
            return self._tasks[i]()
        f = self._futures[i]
        if f.cancel():
            return self._tasks[i]()
        got: list[tuple[np.ndarray, np.ndarray]] = f.result()
        return got

    def _settle(self) -> None:
        """No read left running (those not started are dropped); the descriptors closed."""
        for f in self._futures:
            f.cancel()
        with contextlib.suppress(BaseException):
            _rawio.wait_all([f for f in self._futures if not f.cancelled()])
        self._close_fds()

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """Let go of the reads (waiting for those running) and their descriptors."""
        with self._lock:
            self._settle()


def read_patches(key: str, reads: list[tuple[Any, int, int, int, str]], row_bytes: int,
                 nrows: int, *, seed: int, corrupt: Callable[[str, str], Exception],
                 fold_all: bool = False, fds: list[int] | None = None) -> Patches:
    """A delta's patches, read and checked on the I/O threads (in parallel), in order,
    started now (:class:`Patches`).

    ``reads`` gives per patch ``(source, offset, rows, crc, what)`` (``what`` names the
    patch and its file in messages); ``seed``: the value's header CRC;
    ``corrupt(key, text)`` makes a damaged patch's error; ``fold_all``: fold them into
    one (:func:`fold`); ``fds``: descriptors to close once the reads are over.
    """
    def one(buf: np.ndarray, read: tuple[Any, int, int, int, str]
            ) -> tuple[np.ndarray, np.ndarray]:
        fd, offset, n, crc, what = read
        got = _src.pread_into(fd, _rawio.byte_view(buf), offset)
        if got != buf.size:
            raise corrupt(key, f"has a row patch {what} that is truncated ({got} of "
                               f"{buf.size} bytes); the checkpoint is damaged")
        try:
            return decode_patch(buf, n, row_bytes, nrows, crc=crc, seed=seed)
        except ValueError as exc:
            raise corrupt(key, f"has a row patch {what} that {exc}; the checkpoint is "
                               "damaged") from None

    # one buffer for all (a large one is mapped in huge pages by NumPy: a fresh buffer's
    # page faults cost as much as reading it)
    sizes = [8 * r[2] + r[2] * row_bytes for r in reads]
    whole = np.empty(sum(sizes), np.uint8)
    at = [0, *itertools.accumulate(sizes)]
    reads_at = [functools.partial(one, whole[at[i]: at[i + 1]], r) for i, r in enumerate(reads)]
    # as many tasks as I/O threads at most, of about equal bytes (a task each costs more
    # than reading a small patch)
    share, tasks, cur, size = -(-at[-1] // _rawio.IO_THREADS), [], [], 0
    for read, n in zip(reads_at, sizes, strict=True):
        cur.append(read)
        size += n
        if size >= share:
            tasks.append(functools.partial(_in_turn, cur))
            cur, size = [], 0
    if cur:
        tasks.append(functools.partial(_in_turn, cur))
    then = (lambda parts: [fold(parts, nrows)]) if fold_all else None
    return Patches(tasks, then, fds)


def _in_turn(reads: Sequence[Callable[[], tuple[np.ndarray, np.ndarray]]]
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [read() for read in reads]


#: :func:`.blocks.blocks_agree` remembered for the last few bases (a pure function of its
#: arguments; joining a 64 MiB base's 1,024 block checksums costs about 1% of restoring it,
#: and a process restores the same step again: evaluation, a retried restore).
_blocks_agree = functools.lru_cache(maxsize=32)(blocks_agree)


def base_checksum(d: Delta, seed: int, nbytes: int, block_size: int) -> int | None:
    """The checksum a delta's base bytes (``nbytes``) must have, by which a reader verifies
    the base alone (its patches by their own CRCs), or None when the record does not
    carry it (written before 2026-11-27: the assembled value is verified). ``ValueError``
    when the base's block checksums do not join to it (a damaged record).

    >>> d = Delta(("", "t/base", 0), (("", "t/patch-0", 0, 1, 7),), "ckpt-1.zarr", 5, None)
    >>> base_checksum(d, 0, 8, 4), base_checksum(Delta(d.base, d.patches, d.since), 0, 8, 4)
    (5, None)
    """
    if d.base_checksum is None:
        return None
    if d.base_blocks is not None and not _blocks_agree(seed, d.base_blocks, nbytes, block_size,
                                                       d.base_checksum):
        raise ValueError("has base block checksums that do not join to its base checksum; "
                         "the checkpoint's record is damaged")
    return d.base_checksum


def in_base(what: str, d: Delta, here: str) -> str:
    """``what`` a damaged delta value does, saying where the damage is when a checksum of
    its assembled bytes fails (``what`` starts "fails"): its patches were read and
    checked by their own CRCs before any of its bytes were handed out, so the damage is
    in the base's bytes. ``here``: the checkpoint's own file name (the base's ``""``).

    >>> d = Delta(("ckpt-1.h5", "t", 2560), (("", "t/patch-0", 9000, 4, 7),), "ckpt-1.h5")
    >>> in_base("fails its checksum", d, "ckpt-3.h5").split(": ", 1)[1]
    "its 1 row patch passed its checksum, so the damage is in its base, 't' in 'ckpt-1.h5')"
    >>> in_base("has lost its chunk file", d, "ckpt-3.h5")
    'has lost its chunk file'
    """
    if not what.startswith("fails"):
        return what
    n = len(d.patches)
    passed = ("its 1 row patch passed its checksum" if n == 1 else
              f"its {n} row patches passed their checksums")
    return (f"{what} (a row delta: {passed}, so the damage is in its base, {d.base[1]!r} in "
            f"{d.base[0] or here!r})")


def fold(patches: list[tuple[np.ndarray, np.ndarray]], nrows: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """Patches of a value of ``nrows`` rows applied in order as one: sorted unique rows,
    each from the last patch holding it. One byte per row of the value marks the rows
    held; each patch is then laid, in order, at its rows' places in the result (a later
    patch overwrites an earlier one's row: one fancy assignment per patch, no search)."""
    if len(patches) == 1:
        return patches[0]
    held = np.zeros(nrows, np.bool_)
    for rows, _ in patches:
        held[rows] = True
    last = np.flatnonzero(held)
    where = np.empty(nrows, np.intp)  # a held row's place in ``last`` (only those set)
    where[last] = np.arange(last.size)
    out = np.empty(last.size, patches[0][1].dtype)
    for rows, data in patches:
        out[where[rows]] = data
    return last, out


def plan(rows: np.ndarray, shape: tuple[int, ...], nbytes: int,
         earlier: tuple[tuple[str, str, int, int, int], ...],
         limits: DeltaLimits = _DEFAULT_LIMITS) -> str | None:
    """How a value of ``shape`` (``nbytes``) whose ``rows`` changed since the base is
    written (the rule above, with ``limits``): ``"append"`` (a patch on top of the base's
    ``earlier`` ones), ``"merge"`` (one patch of every row changed since the base's whole
    copy, if those are few enough: the caller checks), or None (whole).

    >>> rows, shape, earlier = np.arange(10), (100, 4096), (("", "t/patch-0", 0, 10, 0),)
    >>> plan(rows, shape, 1 << 20, earlier), plan(rows, shape, 1 << 20, earlier, DeltaLimits(0.15))
    ('append', 'merge')
    >>> plan(rows, shape, 1 << 20, earlier, DeltaLimits(patches=1))
    'merge'
    """
    if len(shape) < 1 or shape[0] < 2 or nbytes < DELTA_FROM or not rows.size:
        return None
    total = int(rows.size) + sum(p[3] for p in earlier)
    if total <= limits.rows * shape[0] and len(earlier) + 1 <= limits.patches:
        return "append"
    if earlier and rows.size <= limits.rows * shape[0]:
        return "merge"
    return None


def merged(rows: np.ndarray, before: np.ndarray | None, nrows: int,
           limits: DeltaLimits = _DEFAULT_LIMITS) -> np.ndarray | None:
    """The rows of a merged patch: those changed now and those the earlier patches hold
    (``before``, repeats allowed; None: unknown), or None when they are more than half
    the share of rows ``limits`` allows (the value is then written whole: a merged patch
    that would soon outgrow the limit costs more than the whole copy saves). Where a byte
    per row of the value costs no more than the rows' own indices, the union is marked
    in such a mask (no sort).

    >>> merged(np.array([2, 5]), np.array([5, 1, 7, 1]), 40).tolist()
    [1, 2, 5, 7]
    >>> merged(np.array([2, 5]), np.array([5, 1, 7, 1]), 1000).tolist()  # sorted instead
    [1, 2, 5, 7]
    >>> merged(np.array([2, 5]), np.array([1, 7, 9, 11]), 40) is None  # 6 rows > 40 * 0.25 / 2
    True
    """
    if before is None:
        return None
    limit = limits.rows * nrows / 2
    if rows.size > limit:
        return None
    if nrows <= 8 * (rows.size + before.size) and _inside(rows, nrows) and _inside(before,
                                                                                    nrows):
        held = np.zeros(nrows, np.bool_)
        held[before] = True
        held[rows] = True
        return np.flatnonzero(held) if np.count_nonzero(held) <= limit else None
    union = np.union1d(before, rows)
    return union if union.size <= limit else None


def _inside(rows: np.ndarray, nrows: int) -> bool:
    """Whether every one of ``rows`` indexes a value of ``nrows`` rows (none wraps)."""
    return not rows.size or (int(rows.min()) >= 0 and int(rows.max()) < nrows)
