"""The protocol at scale, simulated small (benchmarks/simulate.py): the real planners on
hundreds of simulated ranks. Asserts the properties that must hold at any scale (no
timing: the machine is shared): the index grows with the boxes, not boxes x ranks;
what a rank sends to plan is its own layout whatever the number of ranks; a cached
plan costs each rank only the digests; every N -> M restore with ragged slabs puts at
most 5% more than it needs into memory, and reads from storage at most one checksum
block more per reader's cut (the edge blocks that verify its runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckptvar.distributed import Box, read_plan
from ckptvar.storage._record import BLOCK_SIZE

# benchmarks/ is a package of the repository, not of ckptvar: import it from there
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import simulate  # noqa: E402


@pytest.fixture(scope="module")
def saves() -> dict[int, simulate.SaveFigures]:
    return {r: simulate.simulate_save(r, 40, repeats=1) for r in (64, 256)}


def test_every_box_planned_once(saves) -> None:
    for ranks, s in saves.items():
        assert s.boxes == ranks * 40  # every rank's ragged slab of every variable


def test_index_grows_with_boxes_not_boxes_times_ranks(saves) -> None:
    small, big = saves[64], saves[256]
    per_box = small.index_bytes / small.boxes, big.index_bytes / big.boxes
    assert per_box[1] <= 1.2 * per_box[0], per_box  # 4x the boxes, about 4x the bytes
    assert per_box[1] < 64


def test_bytes_each_rank_sends_and_receives(saves) -> None:
    small, big = saves[64], saves[256]
    # uncached: a rank sends its own layout, the same size at any scale, and receives
    # everyone else's (rank 0, the simulated rank, sends the keys, shapes and dtypes
    # with its numbers; every other rank its numbers only); cached: only a digest (and
    # the cache's keys) each way
    assert small.sent_uncached == big.sent_uncached
    numbers = small.received_uncached / 63
    assert big.received_uncached == pytest.approx(255 * numbers, rel=0.02)
    assert numbers < big.sent_uncached
    assert numbers < 40 * 4 * 4 + 300  # 40 boxes of 2 axes: 4 int32 a box; digest, header
    assert big.sent_cached < 200
    assert big.received_cached <= 255 * big.sent_cached
    assert big.received_cached * 5 < big.received_uncached  # 40 variables; more: wider gap


def test_read_amplification_of_every_reshard() -> None:
    top = 12
    storage, memory = simulate.amplification_matrix(top)
    assert storage.shape == memory.shape == (top, top)
    assert (memory >= 1.0).all() and (storage >= memory).all()
    # into memory: the runs a rank needs (a stored box of one block or less read whole)
    assert memory.max() <= 1.05, memory.max()
    # from storage: the runs and the edge blocks hashed to verify them, at most one block
    # per reader's cut per variable
    for m in range(1, top + 1):
        assert storage[:, m - 1].max() <= simulate.edge_bound(m), m
    assert storage[0, 0] == memory[0, 0] == 1.0  # one writer, one reader: the value, nothing more
    # with 64 KiB checksum blocks, the edge blocks add at most 5% (round three's goal)
    assert storage.max() <= 1.05, storage.max()


def test_fetched_charges_what_the_sharded_reader_reads() -> None:
    blk = 256 << 10  # any block size: these are 256 KiB blocks
    cols = 1024  # 4 KiB rows: a 256 KiB block holds 64 rows
    small = Box((0, 0), (60, cols))  # 240 KiB: one block, read (and verified) whole
    assert simulate.fetched(Box((10, 0), (5, cols)), small, cols, blk) == small.size * 4
    assert simulate.delivered(Box((10, 0), (5, cols)), small, cols, blk) == small.size * 4
    mid = Box((0, 0), (200, cols))  # 800 KiB: four blocks, a run and its edge blocks
    assert simulate.fetched(Box((10, 0), (5, cols)), mid, cols, blk) == blk
    assert simulate.delivered(Box((10, 0), (5, cols)), mid, cols, blk) == 5 * 4096
    # the box's last block is partial: charged up to the box's end only
    assert simulate.fetched(Box((150, 0), (50, cols)), mid, cols, blk) == 200 * 4096 - 2 * blk
    big = Box((0, 0), (4096, cols))  # 16 MiB
    part = Box((100, 0), (64, cols))  # 256 KiB straddling two 256 KiB blocks
    assert simulate.fetched(part, big, cols, blk) == 2 * blk
    assert simulate.delivered(part, big, cols, blk) == part.size * 4
    assert simulate.fetched(big, big, cols, blk) == big.size * 4
    # with the writer's blocks (64 KiB: 16 rows), the same part's run costs less
    assert simulate.BLOCK == BLOCK_SIZE
    assert simulate.fetched(part, big, cols) == part.size * 4 + simulate.BLOCK
    items = read_plan("w", Box((0, 0), (4096, cols)), [big], (4096, cols))
    assert [simulate.fetched(it.box, big, cols) for it in items] == [big.size * 4]
