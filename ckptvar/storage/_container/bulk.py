"""Many values of one container at once: windowed read-ahead, bulk verify, scatter reads.

Owns: :func:`read_many` (values read in windows of about ``_WINDOW`` bytes on the
I/O threads, the next window read while this one is handed out; packed values
from one read of the packed blob), :func:`verify_many` (packed values hashed in
place through one read-only map) and :func:`read_into_many` (packed values
scattered into their buffers by ``preadv``). The reader's own single-value
paths (:mod:`.reader`) handle what none of these speed up.
"""

from __future__ import annotations

import functools
import mmap
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any

import crc32c as _crc32c
import numpy as np

from ..._dtypes import SUPPORTED_DTYPES
from ...errors import CorruptCheckpointError
from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import ARRAY, PACKED, Entry, ValueRows
from . import source as _src
from .access import PARALLEL_FROM, ValueAccess, compare, destination, entries, parallel
from .access import check_source as _check_source
from .stream import stream_many, streamable
from .transfer import Transfer, TransferValue, runs_by_size

__all__ = ["read_into_many", "read_many", "stage_into_many", "verify_many"]

_by_offset = operator.itemgetter(0)

#: CRC-32C straight over any C-contiguous buffer (arrays included), no wrapper per value.
_crc: Callable[[Any, int], int] = _crc32c.crc32c
#: ``read_many`` reads this many bytes ahead of what it has yielded.
_WINDOW = 256 << 20
#: ``read_into_many`` reads across gaps up to this size between packed values.
_MAX_GAP = 32 << 20


def _hold_limit() -> int:
    """How many checked chunk files ``read_many`` keeps open per window for the read: an
    eighth of the descriptor limit (two windows in flight), between 16 and 1,024."""
    try:
        import resource  # noqa: PLC0415 - POSIX only
    except ImportError:  # not POSIX
        return 128
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 8))


#: ``read_many`` keeps at most this many checked chunk files open per window for the read
#: (the rest are checked, closed, and opened again to be read).
_HOLD = _hold_limit()


@dataclass(slots=True)
class _Window:
    """A run of values read ahead together: the large ones land in ``big``."""

    items: list[tuple[str, Entry]]
    big: dict[str, np.ndarray]
    transfer: Transfer


@dataclass(slots=True)
class _PackedBlob:
    """The part of the packed blob that holds the requested packed values."""

    data: np.ndarray
    start: int  # offset of ``data[0]`` inside the blob


def _truncated(reader: ValueAccess, got: int, want: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Checkpoint {str(reader.path)!r}: the packed values are truncated "
        f"({got} of {want} bytes present)."
    )


def _windows(
    items: list[tuple[str, Entry]], blob: _PackedBlob | None
) -> list[list[tuple[str, Entry]]]:
    """Runs of values holding about ``_WINDOW`` bytes not already in ``blob``."""
    skip_packed = blob is not None

    def sized() -> Iterator[tuple[tuple[str, Entry], int]]:
        for key, e in items:
            kind, _, _, nbytes = e.loc  # unpacked: the fastest way to read a location
            yield (key, e), 0 if skip_packed and kind == PACKED else nbytes

    return runs_by_size(sized(), _WINDOW)


def read_many(
    reader: ValueAccess, keys: Iterable[str], verify: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(key, value)`` in order, each verified before it is yielded.

    Values are read in windows of about ``_WINDOW`` bytes; from the page cache the
    next window is read while this one is handed out. Packed values come from one
    read of the packed blob (when they make up most of it) and are returned as
    aligned views into that buffer. Nothing happens before the first value is asked.
    """
    reader.check_open()
    items = entries(reader, keys)
    if reader.remote:  # packed values too: in the same stream as the rest of their object
        flags = [e.loc.kind in (ARRAY, PACKED) for _, e in items]
        todo = [item for item, flag in zip(items, flags, strict=True) if flag]
        if streamable(reader, todo):
            yield from _read_streamed(reader, items, flags, todo, verify=verify)
            return
    blob = _read_packed_span(reader, [e for _, e in items])
    windows = iter(_windows(items, blob))
    queue: deque[_Window] = deque()

    def read_ahead() -> None:
        nxt = next(windows, None)
        if nxt is not None:
            queue.append(_launch(reader, nxt, blob, verify))

    try:
        read_ahead()
        while queue:
            # From the page cache, the next window is read while this one is finished
            # and handed out; from disk, one window at a time (one sequential stream),
            # the next one starting as soon as this one is in.
            if not queue[0].transfer.sequential and len(queue) < 2:
                read_ahead()
            window = queue[0]
            window.transfer.finish()
            if window.transfer.sequential and len(queue) < 2:
                read_ahead()
            yield from _hand_out(reader, window.items, window.big, blob, verify)
            queue.popleft()
            # Hold nothing of this window past here, so a consumer that drops each
            # value (a GPU load) keeps at most two windows alive, not three.
            window = None  # type: ignore[assignment]
    finally:
        for w in queue:
            w.transfer.abandon()


def _read_streamed(
    reader: ValueAccess,
    items: list[tuple[str, Entry]],
    flags: list[bool],
    todo: list[tuple[str, Entry]],
    *,
    verify: bool,
) -> Iterator[tuple[str, np.ndarray]]:
    """``read_many`` from an object store: the values of ``todo`` by :func:`.stream.stream_many`
    (one long GET per object), the rest one by one."""
    values = stream_many(reader, todo, verify, _WINDOW)
    try:
        for item, flag in zip(items, flags, strict=True):
            if flag:
                yield item[0], next(values)
            else:
                yield from _hand_out(reader, [item], {}, None, verify)
    finally:
        values.close()


def _launch(
    reader: ValueAccess, items: list[tuple[str, Entry]], blob: _PackedBlob | None, verify: bool
) -> _Window:
    """Start reading a window's large values (those not in ``blob``) on the I/O threads."""
    values: list[TransferValue] = []
    in_blob = blob is not None
    try:
        for k, e in items:
            # the small arrays too: read on the I/O threads with the rest, in file order,
            # not one by one on this thread while the disk is busy with the large ones
            kind, _, _, nbytes = e.loc
            if (kind == ARRAY and nbytes) or (parallel(e) and not (in_blob and kind == PACKED)):
                # opened (its size checked) before the buffer is allocated, and kept open
                # for the read, up to ``_HOLD`` descriptors a window
                if len(values) < _HOLD:
                    held = TransferValue(k, e, None, reader.source(k, e))
                    values.append(held)
                    dest = destination(k, e, None, held.src)
                    values[-1] = TransferValue(k, e, dest, held.src,
                                               padded=dest.base is not None)
                else:
                    _check_source(reader, k, e)
                    values.append(TransferValue(k, e, np.empty(e.shape, e.np_dtype)))
        transfer = Transfer(reader, values, verify, ahead=True)
    except BaseException:
        for v in values:
            v.release()
        raise
    return _Window(items, {v.key: v.dest for v in values if v.dest is not None}, transfer)


def _hand_out(
    reader: ValueAccess,
    items: list[tuple[str, Entry]],
    big: dict[str, np.ndarray],
    blob: _PackedBlob | None,
    verify: bool,
) -> Iterator[tuple[str, np.ndarray]]:
    """The values of a window that is in: large ones read ahead (``big``), packed ones
    from ``blob`` (verified here), the rest read one by one."""
    crc, seed_of, ndarray = _crc, _checksum.header_crc, np.ndarray
    data, lo = (blob.data, blob.start) if blob is not None else (None, 0)
    for key, e in items:
        arr = big.get(key)
        if arr is None:
            kind, _, offset, n = e.loc
            if data is not None and kind == PACKED:
                # a view of the value's bytes in the blob, made in one call
                arr = ndarray(e.shape, e.np_dtype, data, offset - lo) if n else np.empty(
                    e.shape, e.np_dtype)
                if verify:  # over the bytes (an extension dtype may export no buffer)
                    got = crc(data[offset - lo : offset - lo + n], seed_of(key, e.dtype, e.shape))
                    if got != e.checksum:
                        compare(reader, key, e, got)
            else:
                arr = reader.read(key, verify=verify)
        yield key, arr


def stage_into_many(
    reader: ValueAccess, pairs: list[tuple[str, np.ndarray]], *, checked: bool = False
) -> Callable[[], None]:
    """Read and verify every ``(key, out)`` value now, into temporaries; the function
    returned copies them into the ``out`` buffers (same shape and dtype, C-contiguous,
    writeable: checked here unless the caller says it ``checked`` every ``out``, a plain
    ``np.ndarray``). No ``out`` changes before every value has verified.

    Packed values are hashed straight from one read of their part of the packed blob
    (no array per value) and later copied from it byte for byte; the rest are read
    as :func:`read_many` reads them (one pass: what is copied is what was verified).
    The record is read as columns (:meth:`~.access.ValueAccess.value_rows`): no entry
    per value.
    """
    keys = list(map(_by_offset, pairs))  # (item 0: the key)
    outs = list(map(_second, pairs))  # (the buffers)
    r = reader.value_rows(keys)
    if not checked:
        _check_outs(reader, keys, outs, r)
    kinds, sizes = r.kinds, r.nbytes
    if set(kinds) == _ONLY_PACKED and 0 not in sizes:  # every value packed: the columns
        p = _Packed(r.offsets, sizes, keys, r.dtypes, r.shapes, r.checksums, outs)
        rest: list[tuple[str, np.ndarray]] = []
    else:
        sel = [k == PACKED and n > 0 for k, n in zip(kinds, sizes, strict=True)]
        p = _Packed(*(list(compress(col, sel)) for col in (
            r.offsets, sizes, keys, r.dtypes, r.shapes, r.checksums, outs)))
        rest = [(key, out) for key, out, s in zip(keys, outs, sel, strict=True) if not s]
    blob = None if reader.remote else _read_span(reader, p.offsets, p.sizes)
    if blob is None:  # scattered (or remote: streamed with the rest), read as values
        rest += zip(p.keys, p.outs, strict=True)
        p = _Packed([], [], [], [], [], [], [])
    temps = [(out, value) for (_, out), (_, value) in
             zip(rest, read_many(reader, [key for key, _ in rest], True), strict=True)]
    pieces = _verified_pieces(reader, blob, p) if blob is not None else []
    return functools.partial(_commit, temps, p.outs, pieces)


_second = operator.itemgetter(1)
_data_of = operator.attrgetter("data")
_as_bytes = operator.methodcaller("cast", "B")
_ALL = slice(None)
_ONLY_PACKED = frozenset({PACKED})


@dataclass(slots=True)
class _Packed:
    """The packed values of a staged restore, as columns in the order asked for."""

    offsets: list[int]
    sizes: list[int]
    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    checksums: list[int]
    outs: list[np.ndarray]


def _check_outs(reader: ValueAccess, keys: list[str], outs: list[np.ndarray],
                r: ValueRows) -> None:
    """Each ``outs[i]`` a plain, writeable C-contiguous array of its value's shape and
    dtype; else what :func:`.access.destination` makes of it (it says what is wrong)."""
    ndarray, dtypes = np.ndarray, SUPPORTED_DTYPES
    for i, (out, shape, dtype) in enumerate(zip(outs, r.shapes, r.dtypes, strict=True)):
        flags = out.flags if type(out) is ndarray else None
        if not (flags is not None and flags.c_contiguous and flags.writeable
                and out.shape == shape and out.dtype == dtypes[dtype]):
            outs[i] = destination(keys[i], reader.entry(keys[i]), out)


#: A staged packed span up to this size is copied once and cut into bytes (see below).
_COPY_SPAN_BELOW = 8 << 20


def _verified_pieces(reader: ValueAccess, blob: _PackedBlob, p: _Packed) -> list[Any]:
    """Each packed value's bytes in ``blob``, every one verified.

    A value's checksum is seeded by its header (the key, then a tail of its dtype and
    shape): when every value shares dtype and shape (the common case) every header and
    every checksum is hashed by ``map``, without a Python step per value."""
    crc, tail_of = _crc, _checksum.header_tail
    lo = blob.start
    # a small span's pieces are bytes copied from one copy of it (slicing bytes costs
    # less than half of slicing a memoryview; at most 2 * _COPY_SPAN_BELOW bytes more)
    src: Any = blob.data.tobytes() if blob.data.nbytes <= _COPY_SPAN_BELOW else blob.data.data
    starts = (np.asarray(p.offsets, np.int64) - lo).tolist()
    ends = list(map(operator.add, starts, p.sizes))
    pieces = list(map(src.__getitem__, map(slice, starts, ends)))
    if not pieces:
        return pieces
    heads = list(map(str.encode, p.keys))  # (UTF-8)
    if len(set(p.dtypes)) == 1 and len(set(p.shapes)) == 1:
        tail = tail_of(p.dtypes[0], p.shapes[0])
        seeds = list(map(crc, map(bytes.__add__, heads, repeat(tail)), repeat(0)))
    else:  # most neighbours share dtype and shape: one tail per change
        tails: dict[tuple[str, tuple[int, ...]], bytes] = {}
        seeds = []
        tail, last = b"", None
        for head, at in zip(heads, zip(p.dtypes, p.shapes, strict=True), strict=True):
            if at != last:
                last = at
                got_tail = tails.get(at)
                tail = tails[at] = tail_of(*at) if got_tail is None else got_tail
            seeds.append(crc(head + tail, 0))
    got = list(map(crc, pieces, seeds))
    if got != p.checksums:
        for key, computed, want in zip(p.keys, got, p.checksums, strict=True):
            if computed != want:
                compare(reader, key, reader.entry(key), computed)
    return pieces


def _commit(temps: list[tuple[np.ndarray, np.ndarray]], outs: list[np.ndarray],
            pieces: list[Any]) -> None:
    """Copy staged values into their buffers (:func:`stage_into_many`'s second half):
    ``temps`` as ``(out, value)``, each ``outs[i]`` from the packed bytes ``pieces[i]``."""
    copyto = np.copyto
    for out, value in temps:
        copyto(out, value)
    try:  # each out's bytes as one flat view, assigned; no Python step per value
        deque(map(operator.setitem, map(_as_bytes, map(_data_of, outs)), repeat(_ALL), pieces),
              maxlen=0)
    except (TypeError, ValueError):  # a dtype that exports no plain buffer: one by one
        for out, piece in zip(outs, pieces, strict=True):  # (again: the same verified bytes)
            try:
                out.data.cast("B")[:] = piece
            except (TypeError, ValueError):
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(piece, np.uint8)


def _read_packed_span(reader: ValueAccess, entries: list[Entry]) -> _PackedBlob | None:
    """One read of the part of the packed blob ``entries`` use, when they fill most of it."""
    locs = [(at, n) for kind, _, at, n in [e.loc for e in entries] if kind == PACKED]
    if len(locs) < 2:
        return None
    starts, sizes = zip(*locs, strict=True)  # columns, without a Python loop
    return _read_span(reader, starts, sizes)


def _read_span(reader: ValueAccess, starts: Sequence[int],
               sizes: Sequence[int]) -> _PackedBlob | None:
    """One read of the packed blob from the first of ``starts`` to the end of the last
    value, when the values (at least two) fill most of it."""
    if len(starts) < 2:
        return None
    lo = min(starts)
    hi = max(map(operator.add, starts, sizes))
    want = sum(sizes)
    if hi - lo > 2 * want + (1 << 20):
        return None
    fd, base = reader.packed_source()
    data = np.empty(hi - lo, np.uint8)
    got = _src.pread_into(fd, data.data, base + lo)
    if got != hi - lo:
        raise _truncated(reader, got, hi - lo)
    return _PackedBlob(data, lo)


def verify_many(reader: ValueAccess, keys: Iterable[str]) -> None:
    """Raise ``CorruptCheckpointError`` for the first damaged value among ``keys``.

    Packed values are hashed in place through one read-only map of the packed blob
    (no copy, no per-value system call); large values in pieces on the I/O threads;
    the rest one by one (:meth:`.access.ValueAccess.verify`).
    """
    packed: list[tuple[str, Entry]] = []
    big: list[TransferValue] = []
    for k, e in entries(reader, keys):
        kind, _, _, nbytes = e.loc
        if kind == PACKED and nbytes:
            packed.append((k, e))
        elif kind == ARRAY and nbytes >= PARALLEL_FROM:
            big.append(TransferValue(k, e, None))
        else:
            reader.verify(k)
    if big:
        Transfer(reader, big, True).finish()
    if not packed:
        return
    fd, base = reader.packed_source()
    hi = base + max(e.loc.offset + e.loc.nbytes for _, e in packed)
    crc = _crc
    seed = _checksum.header_crc
    mm = _src.map_all(fd)
    try:
        with memoryview(mm) as mv:
            if hi > len(mv):
                raise _truncated(reader, len(mv) - base, hi - base)
            for key, e in packed:
                _, _, at, n = e.loc
                start = base + at
                got = crc(mv[start : start + n], seed(key, e.dtype, e.shape))
                if got != e.checksum:
                    compare(reader, key, e, got)
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()


#: A packed value to be read into a buffer: ``(offset_in_blob, key, entry, out)``. A plain
#: tuple (one per value of a restore), always unpacked by name; sorted by offset.
_Scatter = tuple[int, str, Entry, np.ndarray]


def read_into_many(
    reader: ValueAccess, pairs: list[tuple[str, np.ndarray]], verify: bool
) -> None:
    """Read each ``(key, out)`` value into ``out`` (same shape and dtype, C-contiguous).

    Packed values are scattered straight into their buffers by ``preadv`` (one call per
    run of up to ``IOV_MAX`` buffers). With ``verify`` each value is checked after it
    is read, so on damage some buffers already hold new bytes: verify first
    (:func:`verify_many`) when that matters.
    """
    entry = reader.entry
    packed: list[_Scatter] = []
    big: list[TransferValue] = []
    for key, given in pairs:
        e = entry(key)
        out = destination(key, e, given)
        kind, _, offset, nbytes = e.loc
        if kind == PACKED and nbytes:
            packed.append((offset, key, e, out))
        elif parallel(e):
            big.append(TransferValue(key, e, out))
        else:
            reader.read(key, out=out, verify=verify)
    if big:
        Transfer(reader, big, verify).finish()
    if not packed:
        return
    packed.sort(key=_by_offset)
    fd, base = reader.packed_source()
    scratch = np.empty(_MAX_GAP, np.uint8)  # skips bytes no key asked for
    i = 0
    while i < len(packed):
        j, start, end, bufs = _next_run(packed, i, scratch)
        if j == i:  # an overlapping duplicate: read it on its own
            _, key, _, out = packed[i]
            reader.read(key, out=out, verify=verify)
            i += 1
            continue
        got = _src.preadv_all(fd, bufs, base + start)
        if got != end - start:
            raise _truncated(reader, got, end - start)
        if verify:
            _check_run(reader, packed[i:j])
        i = j


def _next_run(
    packed: list[_Scatter], i: int, scratch: np.ndarray
) -> tuple[int, int, int, list[Any]]:
    """``(j, start, end, bufs)``: values ``packed[i:j]`` filled by one ``preadv`` of
    ``[start, end)``, gaps between them read into ``scratch``."""
    start = pos = _by_offset(packed[i])
    bufs: list[Any] = []
    j = i
    while j < len(packed) and len(bufs) < _rawio.IOV_MAX - 1:
        off, _, e, out = packed[j]
        if off < pos:  # two keys on one range: read it apart
            break
        gap = off - pos
        if gap > scratch.size:
            if bufs:
                break
            start = pos = off
            gap = 0
        if gap:
            bufs.append(scratch[:gap])
        bufs.append(out)
        pos = off + e.loc.nbytes
        j += 1
    return j, start, pos, bufs


def _check_run(reader: ValueAccess, run: list[_Scatter]) -> None:
    crc = _crc
    for _, key, e, out in run:
        got = crc(out, _checksum.header_crc(key, e.dtype, e.shape))
        if got != e.checksum:
            compare(reader, key, e, got)
