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
    "SUB_BLOCK",
    "BlockHasher",
    "SubBlocks",
    "block_crcs",
    "blocks_agree",
    "hash_blocks",
    "hash_blocks_parallel",
    "hash_range",
    "join_blocks",
    "read_span",
    "rehash_rows",
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


#: The sub-block of :class:`SubBlocks`: a block's CRC is joined from its sub-blocks'.
SUB_BLOCK = 4 << 10


class SubBlocks:
    """The CRC-32C of each :data:`SUB_BLOCK` of a value's blocks, as far as known, beside
    the block checksums they join to: what :func:`rehash_rows` gives to keep between steps so
    that a block with a changed row is hashed again only in the sub-blocks its rows touch
    (a row delta's step then hashes about its rows' bytes, not their blocks').

    ``crcs[k, j]`` is sub-block ``j`` of block ``k``; ``known[k]``: all of block ``k``'s
    are (hashed at a step that touched it); ``blocks``: the block checksums (the record's
    bytes) of the value they describe, by which a later step checks it has the same value.
    """

    __slots__ = ("blocks", "crcs", "known")

    def __init__(self, blocks: bytes, crcs: np.ndarray, known: np.ndarray) -> None:
        self.blocks, self.crcs, self.known = blocks, crcs, known


def _join_subs(crcs: np.ndarray, sub: int) -> np.ndarray:
    """The CRC of each row of ``crcs`` (``(k, 2**m)`` uint32: CRCs of ``sub``-byte pieces)
    joined, all rows at once: a tree of pairs, one vectorized step per level."""
    size = sub
    while crcs.shape[1] > 1:
        t = _shift_tables(size)
        left = crcs[:, 0::2]
        crcs = (t[0][left & 255] ^ t[1][(left >> 8) & 255] ^ t[2][(left >> 16) & 255]
                ^ t[3][left >> 24] ^ crcs[:, 1::2])
        size *= 2
    return crcs[:, 0]


#: Blocks a step learns the sub-blocks of, at most (hashing a block by sub-blocks costs
#: 16 calls instead of one, ~1.5 ms more for 256 blocks: a first step that touches
#: thousands of blocks of a large table does not pay that for each; a hot block is
#: known within a few steps).
_LEARN = 256


def _touched(rows: np.ndarray, row_bytes: int, unit: int, count: int) -> np.ndarray:
    """The indices (sorted, unique) of the ``unit``-byte pieces (``count`` of them) that
    hold a byte of one of ``rows``. Where every row lies in one piece (``row_bytes``
    divides ``unit``) they are the rows' pieces; else +1 at each row's first piece, -1
    past its last, over every piece (a pass over ``count``, not over the rows).

    >>> _touched(np.array([0, 5, 6, 40]), 256, 4096, 4).tolist()  # 16 rows a piece
    [0, 2]
    >>> _touched(np.array([4, 9]), 1000, 4096, 3).tolist()  # rows across pieces
    [0, 1, 2]
    """
    if unit % row_bytes == 0:
        return _unique_sorted(rows * row_bytes // unit)
    edges = (np.bincount(rows * row_bytes // unit, minlength=count + 1)
             - np.bincount(((rows + 1) * row_bytes - 1) // unit + 1, minlength=count + 1))
    return np.flatnonzero(np.cumsum(edges[:count]) > 0)


def _unique_sorted(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` for ``x`` that is sorted already (the rows a variable gives are):
    one comparison of neighbours instead of a sort; ``np.unique`` if it is not.

    >>> _unique_sorted(np.array([1, 1, 4, 9, 9])).tolist(), _unique_sorted(np.array([3, 1])).tolist()
    ([1, 4, 9], [1, 3])
    """
    if x.size < 2:
        return x
    step = x[1:] != x[:-1]
    if (x[1:][step] < x[:-1][step]).any():  # not sorted: never from a variable's rows
        return np.unique(x)
    return np.concatenate((x[:1], x[1:][step]))


def rehash_rows(view: memoryview, seed: int, blocks: bytes, row_bytes: int, rows: Any, *,
                     subs: SubBlocks | None, most: float = 1.0
                     ) -> tuple[int, bytes, SubBlocks] | None:
    """:func:`hash_blocks` (blocks of :data:`BLOCK_SIZE`) of a value of which only ``rows``
    (first-axis indices, each ``row_bytes`` long) may differ from the bytes whose block
    checksums are ``blocks``: the other blocks' CRCs are taken as they are (a row
    delta's logical value: its rows since the base are known); a touched block whose
    sub-blocks ``subs`` knows is hashed again only in the sub-blocks ``rows`` touch, then
    joined from its sub-blocks; a touched block they do not know is hashed whole: by
    sub-blocks (known from then on) for up to :data:`_LEARN` blocks a call, the others
    in one piece. ``subs`` is taken only if it describes the value
    whose block checksums are ``blocks`` (else none is known). Returns ``(checksum,
    blocks, subs)`` of the value now; ``None`` when ``blocks`` does not fit the value
    (another count of blocks) or the rows touch more than ``most`` of the blocks (then
    hashing the value whole costs about as much).

    >>> data = np.arange(300_000, dtype=np.uint8).reshape(1000, 300)
    >>> _, before = hash_blocks(memoryview(data).cast("B"), 7)
    >>> data[[3, 700]] += 1
    >>> c, b, subs = rehash_rows(memoryview(data).cast("B"), 7, before, 300,
    ...                               np.array([3, 700]), subs=None)
    >>> (c, b) == hash_blocks(memoryview(data).cast("B"), 7), subs.known.tolist()
    (True, [True, False, False, True])
    >>> data[[4, 999]] += 1  # block 0 again: only sub-block 0 is hashed now
    >>> got = rehash_rows(memoryview(data).cast("B"), 7, b, 300, np.array([4, 999]),
    ...                        subs=subs)
    >>> got[:2] == hash_blocks(memoryview(data).cast("B"), 7)
    True
    """
    n, bs, sub = len(view), BLOCK_SIZE, SUB_BLOCK
    count, per, full = block_count(n, bs), bs // sub, n // bs
    if len(blocks) != 4 * count:
        return None
    crcs = np.frombuffer(blocks, "<u4").copy()
    if subs is None or subs.blocks != blocks or subs.crcs.shape != (full, per):
        sub_crcs, known = np.zeros((full, per), np.uint32), np.zeros(full, bool)
    else:
        sub_crcs, known = subs.crcs.copy(), subs.known.copy()
    rows = np.asarray(rows, np.int64)
    if rows.size:
        touched_subs = _touched(rows, row_bytes, sub, -(-n // sub))
        touched = _unique_sorted(touched_subs // per)
        if len(touched) > most * count:
            return None
        in_full = touched[touched < full]
        owner = touched_subs // per
        fresh = in_full[~known[in_full]]
        if len(fresh) > _LEARN:  # learn the blocks with the most touched sub-blocks first
            fresh = fresh[np.argsort(-np.bincount(owner, minlength=count)[fresh],
                                     kind="stable")]
        learn, whole = np.sort(fresh[:_LEARN]), fresh[_LEARN:]
        again = touched_subs[(owner < full) & known[np.minimum(owner, max(full - 1, 0))]]
        todo = np.concatenate((again, (learn[:, None] * per + np.arange(per)).ravel()))
        flat = sub_crcs.reshape(-1)
        crc = _crc

        def run(ks: list[int], release: int = 1) -> None:
            flat[ks] = [crc(view[k * sub : (k + 1) * sub], 0, release) for k in ks]

        def run_whole(ks: list[int], release: int = 1) -> None:
            crcs[ks] = [crc(view[k * bs : min(n, (k + 1) * bs)], 0, release) for k in ks]

        # the rest of the touched blocks hashed whole: unknown, or the last, shorter one
        rest = np.concatenate((whole, touched[touched >= full])).tolist()
        if (len(todo) * sub + len(rest) * bs) < _PARALLEL_FROM:
            # 4 KiB a call, on this thread (handing the GIL over would cost more)
            flat[todo] = [crc(view[at : at + sub], 0, 0) for at in (todo * sub).tolist()]
            run_whole(rest, 0)
        else:  # on the I/O threads, about 4 MiB each
            order = todo.tolist()
            step, big = max(1, _PIECE // sub), max(1, _PIECE // bs)
            _rawio.wait_all(_rawio.start_all(
                [functools.partial(run, order[i : i + step]) for i in range(0, len(order), step)]
                + [functools.partial(run_whole, rest[i : i + big])
                   for i in range(0, len(rest), big)]))
        known[learn] = True
        joined = in_full[known[in_full]]
        crcs[joined] = _join_subs(sub_crcs[joined], sub)
    out = crcs.tobytes()
    return _join(seed, crcs, n, bs), out, SubBlocks(out, sub_crcs, known)


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
