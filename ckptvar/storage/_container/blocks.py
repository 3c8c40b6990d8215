"""Per-block checksums (format 1.2): hashing a value by blocks, and verified partial reads.

Owns: the CRC-32C of each block of ``block_size`` bytes of a value's bytes, with the
value's own checksum joined from them (one pass over the bytes, on the checksum
thread, as before); the check that a record's blocks agree with the value's checksum;
and :func:`read_span`, which reads a byte run of a value straight into its
destination and verifies the blocks it covers (the parts of the first and last block
outside the run are hashed from the file through a small buffer, never held beside the
result). A value without block checksums (files of format 1.1 and older, values of at
most one block) is verified whole the same way: its other bytes are hashed through
that buffer, so the memory a slice costs stays the slice's.

>>> import numpy as np
>>> data = np.arange(5000, dtype=np.uint8)
>>> whole, blocks = hash_blocks(memoryview(data), 7, 4096)
>>> whole == _checksum.crc(data, 7), len(blocks), blocks_agree(7, blocks, 5000, 4096, whole)
(True, 8, True)
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import crc32c as _crc32c
import numpy as np

from .. import checksum as _checksum
from .. import rawio as _rawio
from .._record import BLOCK_SIZE, Entry, block_count
from . import source as _src

__all__ = [
    "BLOCK_SIZE",
    "BlockHasher",
    "block_crcs",
    "blocks_agree",
    "hash_blocks",
    "hash_blocks_parallel",
    "hash_range",
    "join_blocks",
    "read_span",
    "scratch_buffer",
    "stream_units",
]

#: The buffer the parts of a span's edge blocks (or, without blocks, the rest of the
#: value) are hashed through, per thread.
_SCRATCH = 256 << 10

_crc: Callable[..., int] = _crc32c.crc32c
#: A span of a local file at least this large is read and verified in pieces of about
#: ``_PIECE`` bytes (whole blocks) on the I/O threads.
_PARALLEL_FROM = 8 << 20
_PIECE = 4 << 20


@functools.lru_cache(maxsize=8)
def _shift(n: int) -> Callable[[int], int]:
    """``crc -> combine(crc, 0, n)`` by four table look-ups (the shift is linear)."""
    t0, t1, t2, t3 = _checksum.shift_tables(n)

    def shift(c: int) -> int:
        return t0[c & 255] ^ t1[(c >> 8) & 255] ^ t2[(c >> 16) & 255] ^ t3[c >> 24]

    return shift


def hash_blocks(view: memoryview, seed: int, block_size: int = BLOCK_SIZE) -> tuple[int, bytes]:
    """``(checksum, blocks)`` of a value's bytes: the value's CRC-32C continued from
    ``seed``, and the little-endian ``uint32`` CRC-32C of each block."""
    n = len(view)
    crc = _crc
    crcs = np.array([crc(view[pos : pos + block_size], 0, 1) for pos in range(0, n, block_size)],
                    "<u4")
    return _join(seed, crcs, n, block_size), crcs.tobytes()


def block_crcs(view: memoryview, block_size: int = BLOCK_SIZE) -> bytes:
    """The blocks of :func:`hash_blocks` alone, the GIL held throughout (for another
    thread to hash a chunk while the writing one is in ``pwrite``: one hand-over of the
    GIL per call, not one per block; 4 MiB take ~0.2 ms).

    >>> data = memoryview(np.arange(50_000, dtype=np.uint8))
    >>> block_crcs(data, 4096) == hash_blocks(data, 0, 4096)[1]
    True
    """
    crc = _crc
    return np.array([crc(view[pos : pos + block_size], 0, 0)
                     for pos in range(0, len(view), block_size)], "<u4").tobytes()


class BlockHasher:
    """:func:`hash_blocks` over bytes that arrive in pieces of any length.

    >>> data = memoryview(np.arange(5000, dtype=np.uint8))
    >>> h = BlockHasher(7, 4096)
    >>> for i in range(0, 5000, 1500):
    ...     h.update(data[i : i + 1500])
    >>> h.result() == hash_blocks(data, 7, 4096)
    True
    """

    def __init__(self, seed: int, block_size: int = BLOCK_SIZE) -> None:
        self.seed = seed
        self.block_size = block_size
        self.crcs: list[int] = []
        self.n = 0
        self._cur = 0
        self._filled = 0

    def update(self, piece: memoryview) -> None:
        """Hash the next ``piece`` of the value's bytes."""
        bs = self.block_size
        pos, n = 0, len(piece)
        self.n += n
        while pos < n:
            take = min(bs - self._filled, n - pos)
            self._cur = _crc(piece[pos : pos + take], self._cur, 1)
            self._filled += take
            pos += take
            if self._filled == bs:
                self.crcs.append(self._cur)
                self._cur = self._filled = 0

    def result(self) -> tuple[int, bytes]:
        """``(checksum, blocks)`` of everything hashed, as :func:`hash_blocks` gives."""
        crcs = self.crcs + ([self._cur] if self._filled else [])
        return _join(self.seed, crcs, self.n, self.block_size), np.array(crcs, "<u4").tobytes()


def hash_blocks_parallel(view: memoryview, seed: int, block_size: int = BLOCK_SIZE
                         ) -> tuple[int, bytes]:
    """:func:`hash_blocks` with the blocks hashed on the I/O threads, in runs of about
    4 MiB (for a value hashed before it is written, not while).

    >>> data = memoryview(np.arange(50_000, dtype=np.uint8))
    >>> hash_blocks_parallel(data, 7, 4096) == hash_blocks(data, 7, 4096)
    True
    """
    n = len(view)
    crcs = np.empty(block_count(n, block_size), "<u4")
    per = max(1, _PIECE // block_size)

    def run(first: int) -> None:
        for k in range(first, min(first + per, len(crcs))):
            pos = k * block_size
            crcs[k] = _crc(view[pos : pos + block_size], 0, 1)

    _rawio.wait_all(_rawio.start_all([functools.partial(run, k) for k in range(0, len(crcs), per)]))
    return _join(seed, crcs, n, block_size), crcs.tobytes()


#: From this many blocks on, :func:`_join` combines them with NumPy, a tree of pairs.
_TREE_FROM = 64


@functools.lru_cache(maxsize=64)
def _shift_tables(n: int) -> np.ndarray:
    """``(4, 256)`` uint32: ``[k, v]`` is ``combine(v << 8 k, 0, n)`` (the shift past ``n``
    bytes is linear over GF(2): four look-ups and three XORs)."""
    return np.array(_checksum.shift_tables(n), np.uint32)


def _join(seed: int, crcs: Any, n: int, block_size: int) -> int:
    """The CRC-32C over all blocks continued from ``seed``, from the blocks' CRCs (a list
    or a uint32 array; every block ``block_size`` bytes but the last).

    Many blocks are joined as a tree of pairs, each level one vectorized step: a pair's
    CRC is its left CRC shifted past the right one's bytes, XOR the right one's (a
    1 GiB value's 16,384 blocks of 64 KiB in well under a millisecond).

    >>> data = np.arange(1_000_000, dtype=np.uint32).view(np.uint8)
    >>> crcs = [_checksum.crc(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    >>> _join(9, crcs, len(data), 4096) == _checksum.crc(data, 9)  # 977 blocks: the tree
    True
    >>> _join(9, crcs[:10], 40960, 4096) == _checksum.crc(data[:40960], 9)  # ten, one by one
    True
    """
    k = len(crcs)
    if not k:
        return seed
    last = int(crcs[-1])
    if k < _TREE_FROM:
        shift = _shift(block_size)
        value = seed
        for c in crcs[:-1]:
            value = shift(value) ^ int(c)
    else:
        # the seed leads, as the leftmost element, whose length never matters (it is
        # only ever shifted); every other element is ``size`` bytes at each level
        vals = np.empty(k, np.uint32)
        vals[0] = seed
        vals[1:] = crcs[:-1]
        size = block_size
        while len(vals) > 1:
            if len(vals) & 1:  # a zero in front: combine(0, v, _) is v
                vals = np.concatenate((np.zeros(1, np.uint32), vals))
            t = _shift_tables(size)
            left = vals[0::2]
            vals = (t[0][left & 255] ^ t[1][(left >> 8) & 255] ^ t[2][(left >> 16) & 255]
                    ^ t[3][left >> 24] ^ vals[1::2])
            size *= 2
        value = int(vals[0])
    return _checksum.combine(value, last, n - (k - 1) * block_size)


def join_blocks(seed: int, crcs: Any, n: int, block_size: int = BLOCK_SIZE) -> int:
    """The checksum of a value of ``n`` bytes continued from ``seed``, from the CRC-32C of
    each of its blocks (``crcs``: a list or a uint32 array)."""
    return _join(seed, crcs, n, block_size)


def blocks_agree(seed: int, blocks: bytes, nbytes: int, block_size: int, checksum: int) -> bool:
    """Whether a value's block checksums join to its checksum (``seed``: its header's)."""
    crcs = np.frombuffer(blocks, "<u4")
    return len(crcs) == block_count(nbytes, block_size) and _join(
        seed, crcs, nbytes, block_size) == checksum


_local = threading.local()


def scratch_buffer() -> memoryview:
    """This thread's scratch buffer (256 KiB), for hashing bytes that are not kept."""
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = memoryview(bytearray(_SCRATCH))
    return buf


def hash_range(fd: Any, offset: int, n: int, value: int = 0) -> tuple[int, int]:
    """``(bytes_read, crc)``: the CRC-32C ``value`` continued over ``n`` bytes of the
    source at ``offset``, read through this thread's scratch buffer."""
    scratch = scratch_buffer()
    done = 0
    while done < n:
        want = min(len(scratch), n - done)
        got = _src.pread_into(fd, scratch[:want], offset + done)
        value = _checksum.crc(scratch[:got], value)
        done += got
        if got < want:
            break
    return done, value


class SpanError(Exception):
    """A span failed its check: ``what`` completes "value 'key' ..."."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def read_span(fd: Any, base: int, entry: Entry, out: memoryview, start: int, *,
              verify: bool, seed: Callable[[], int], block_size: int) -> None:
    """Read ``len(out)`` bytes of the value from byte ``start`` (the value's bytes begin
    at ``base`` in ``fd``) into ``out``; with ``verify``, check the blocks that hold them
    (or, for a value without block checksums, the whole value: ``seed()`` is its
    header's CRC). Raises :class:`SpanError` for short or damaged bytes."""
    n = len(out)
    if n >= _PARALLEL_FROM and fd.__class__ is int and (entry.blocks is not None or not verify):
        # pieces that start and end on block boundaries (but the span's own ends)
        step = max(block_size, _PIECE - _PIECE % block_size)
        cuts = [start, *range((start // step + 1) * step, start + n, step), start + n]
        tasks = [functools.partial(_read_span, fd, base, entry, out[a - start : b - start], a,
                                   verify=verify, seed=seed, block_size=block_size)
                 for a, b in itertools.pairwise(cuts)]
        _rawio.wait_all(_rawio.start_all(tasks))
        return
    _read_span(fd, base, entry, out, start, verify=verify, seed=seed, block_size=block_size)


def _units(entry: Entry, start: int, end: int, seed: Callable[[], int],
           block_size: int) -> list[tuple[int, int, int, int]]:
    """``(lo, hi, seed, stored_crc)`` of each checked unit holding bytes ``[start, end)``:
    the blocks, or the whole value when it has no block checksums."""
    if entry.blocks is None:
        return [(0, entry.nbytes, seed(), entry.checksum)]
    crcs = np.frombuffer(entry.blocks, "<u4")
    first, last = start // block_size, (end - 1) // block_size
    return [(k * block_size, min((k + 1) * block_size, entry.nbytes), 0, int(crcs[k]))
            for k in range(first, last + 1)]


def stream_units(rf: _src.RemoteFile, base: int, units: list[tuple[int, int, int, int]],
                 out: memoryview, start: int) -> list[int]:
    """Stream the units (``(lo, hi, seed, _)``, adjacent, in order) of a value whose bytes
    begin at ``base`` in ``rf``, as three adjacent ranges the location fetches by one
    request: bytes ``[start, start + len(out))`` land in ``out`` as they arrive, and every
    byte is hashed into its unit's CRC (returned, in order). Raises :class:`SpanError`
    when the object is short."""
    lo, hi, end = units[0][0], units[-1][1], start + len(out)
    firsts = (lo, start, end)
    lengths = [start - lo, len(out), hi - end]
    # each range streams in order (perhaps on its own thread): a CRC per (range, unit),
    # joined in byte order afterwards
    crcs = [[0] * len(units) for _ in firsts]
    sizes = [[0] * len(units) for _ in firsts]
    got = [0, 0, 0]

    def sink(j: int, pos: int, chunk: memoryview) -> None:
        n = chunk.nbytes
        if j == 1:
            out[pos : pos + n] = chunk
        got[j] += n
        at, i, k = firsts[j] + pos, 0, 0
        row, count = crcs[j], sizes[j]
        while i < n:  # the chunk may cross a unit's end
            while at >= units[k][1]:
                k += 1
            step = min(n - i, units[k][1] - at)
            row[k] = _crc(chunk[i : i + step], row[k], 1)
            count[k] += step
            i, at = i + step, at + step

    if base + hi > rf.size:
        raise SpanError(f"is truncated: bytes {lo}..{hi} are not all present")
    rf.location.stream_ranges(rf.key, [rf.base + base + f for f in firsts], lengths, sink)
    if got != lengths:
        raise SpanError(f"is truncated: bytes {lo}..{hi} are not all present")
    values = []
    for k, unit in enumerate(units):
        value = unit[2]
        for j in range(3):
            if sizes[j][k]:
                value = _checksum.combine(value, crcs[j][k], sizes[j][k])
        values.append(value)
    return values


def _read_span(fd: Any, base: int, entry: Entry, out: memoryview, start: int, *, verify: bool,
               seed: Callable[[], int], block_size: int) -> None:
    """:func:`read_span` on this thread."""
    n, total = len(out), entry.nbytes
    end = start + n
    if verify and n and isinstance(fd, _src.RemoteFile):
        # an object store: the edge blocks and the run in one request, hashed as they arrive
        units = _units(entry, start, end, seed, block_size)
        for (lo, hi, _, want), value in zip(units, stream_units(fd, base, units, out, start),
                                            strict=True):
            _check_unit(entry, lo, hi, want, value, block_size=block_size)
        return
    if n and _src.pread_into(fd, out, base + start) != n:
        raise SpanError(f"is truncated: bytes {start}..{start + n} of {total} are not present")
    if not verify or not n:
        return
    units = _units(entry, start, end, seed, block_size)
    for lo, hi, seed_value, want in units:
        value = seed_value
        if lo < start:
            got, value = hash_range(fd, base + lo, start - lo, value)
            if got != start - lo:
                raise SpanError(f"is truncated: bytes {lo}..{start} of {total} are not present")
        value = _crc(out[max(lo, start) - start : min(hi, end) - start], value, 1)
        if hi > end:
            got, value = hash_range(fd, base + end, hi - end, value)
            if got != hi - end:
                raise SpanError(f"is truncated: bytes {end}..{hi} of {total} are not present")
        _check_unit(entry, lo, hi, want, value, block_size=block_size)


def _check_unit(entry: Entry, lo: int, hi: int, want: int, value: int, *, block_size: int) -> None:
    """Raise :class:`SpanError` unless the unit ``[lo, hi)`` hashed to its stored CRC."""
    if value != want:
        what = "fails its checksum" if entry.blocks is None else (
            f"fails the checksum of its block {lo // block_size} (bytes {lo}..{hi})")
        raise SpanError(f"{what} (stored {want:#010x}, computed {value:#010x}); the "
                        "checkpoint is damaged")
