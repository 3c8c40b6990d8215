"""Row deltas written by several processes, on real processes.

Usage: ``mpiexec -n N python -m mpi4py row_delta_cases.py MODE DIR FORMAT``; each rank
appends one JSON line per mode to ``$RESULT_DIR/rank<r>.jsonl``.

Each process holds its rows of ``table`` (boxes of different sizes, so a Zarr step
stores them in the per-process files too, not as a global array) and trains it with
``scatter_update`` at a few rows per step (:func:`touched`), as an embedding table is.
In HDF5 runs every process also holds ``part``, a partitioned variable (saved as one
value by one process), whose parts it trains at the same few rows.

- ``save`` (any number): an incremental manager (``max_to_keep=2``) saves steps 1-5;
  rank 0 reports the bytes each step added on disk and which of its files' values are
  row deltas. Then rank 1 fails while writing step 6 (its file written, then an error):
  nothing is committed, and the same save then succeeds (its patch must still hold the
  rows of step 6). Every listed step is restored on these processes.
- ``restore`` (any number): every listed step is restored into this many processes'
  boxes and compared with :func:`expected`.
- ``options`` (any number): a manager with ``IncrementalOptions(max_patches=2,
  whole_every=4)`` saves steps 1-5: each process's box merges its patches at step 4
  and step 5 is written whole; rank 0 reports which values are deltas, with their
  patches, and whether each step's files refer to other steps (:func:`refers`).
- ``first`` then ``restart`` (any number, the same in both): a job saves steps 1-3 and
  ends; new processes (a new checkpoint over new variables) call
  ``restore_or_initialize()``, train step 4 and save it, then save again with nothing
  changed: rank 0 reports the bytes each of those steps added and which values are
  row deltas; every listed step is restored and compared with ``expected(4)``.
  ``restart_first`` is ``restart`` in TensorFlow's order: each process restores the
  latest step (``ckpt.restore(cv.latest_checkpoint(DIR), coordinator=)``) before its
  manager is built.
- ``bench`` (``DIR FORMAT MIB``): the bytes and time per step of row deltas against full
  steps (:func:`bench`; the figures in docs/benchmarks.md).

:func:`expected` is the full value at a step (the test's plain ``cv.load`` compares
with it too).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 64  # float32: 256 bytes a row
#: rows per process (each box at least 1 MiB: row deltas start there; not a regular
#: grid, so a Zarr step keeps the boxes in the process files)
COUNTS = {2: (7168, 8192), 3: (6144, 5120, 4096)}  # no regular grid
ROWS = 15_360  # 3.75 MiB
TOUCHED = 150  # rows per step (about 1%)


def touched(step: int) -> np.ndarray:
    """The (global, sorted, unique) rows ``scatter_update`` writes at ``step``."""
    ids = np.random.default_rng(100 + step).zipf(1.2, 8 * TOUCHED) % ROWS  # hot ids...
    rows = np.unique(np.random.default_rng(7).permutation(ROWS)[ids])  # ...spread over rows
    if step == 4:  # the last 4,096 rows (process 2's of 3) untouched: an empty scatter
        rows = rows[rows < ROWS - COUNTS[3][2]]
    return np.sort(rows[np.random.default_rng(step).permutation(rows.size)[:TOUCHED]])


def _rows_at(step: int, rows: np.ndarray) -> np.ndarray:
    """The values ``rows`` (global indices) take at ``step`` (exact in float32)."""
    return (rows[:, None] * WIDTH + np.arange(WIDTH) + step * 1_000_000).astype(np.float32)


#: ``part`` (HDF5 runs): a partitioned variable (TF1 ``fixed_size_partitioner(2)``) that
#: every process holds whole; saved as one value, written by one process, into its file.
PART_ROWS = 4096  # 1 MiB


def part_touched(step: int) -> np.ndarray:
    """The rows of ``part`` written at ``step`` (every process writes the same)."""
    return np.unique(touched(step) % PART_ROWS)[:20]


def expected_part(step: int) -> np.ndarray:
    """``part``'s full value after ``step``."""
    value = np.random.default_rng(2).random((PART_ROWS, WIDTH), dtype=np.float32)
    for s in range(2, step + 1):
        rows = part_touched(s)
        value[rows] = _rows_at(s, rows)
    return value


def expected(step: int) -> np.ndarray:
    """The full table after ``step`` (step 1's value is the initial one)."""
    table = np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32)
    for s in range(2, step + 1):
        rows = touched(s)
        table[rows] = _rows_at(s, rows)
    return table


def _box(rank: int, size: int) -> tuple[int, int]:
    counts = COUNTS[size]
    return sum(counts[:rank]), sum(counts[: rank + 1])


def model(rank: int, size: int, fmt: str) -> tuple[Any, Any, Any]:
    """The checkpoint, this process's box of ``table`` and ``part`` (HDF5 runs; else None)."""
    import ckptvar as cv

    lo, hi = _box(rank, size)
    table = cv.Variable(np.zeros((hi - lo, WIDTH), np.float32), name="table",
                        shard=cv.Shard(full_shape=(ROWS, WIDTH), offset=(lo, 0)))
    if fmt != "h5":  # (a Zarr step stores a value every process holds as a global array)
        return cv.Checkpoint(table=table), table, None
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(2)):
        part = cv.get_variable("part", shape=(PART_ROWS, WIDTH))
    return cv.Checkpoint(table=table, part=part), table, part


def train(table: Any, part: Any, step: int) -> None:
    """What training writes at ``step``: this process's touched rows, by ``scatter_update``
    (step 1: the initial value, whole); ``part``'s rows through its parts."""
    lo = table.shard.offset[0]
    if step == 1:
        table.assign(expected(1)[lo: lo + table.shape[0]])
        if part is not None:
            for p in part:
                start = p.save_slice_info.var_offset[0]
                p.assign(expected_part(1)[start: start + p.shape[0]])
        return
    rows = touched(step)
    mine = rows[(rows >= lo) & (rows < lo + table.shape[0])]
    table.scatter_update(mine - lo, _rows_at(step, mine))
    if part is not None:
        rows = part_touched(step)
        for p in part:
            start = p.save_slice_info.var_offset[0]
            here = rows[(rows >= start) & (rows < start + p.shape[0])]
            p.scatter_update(here - start, _rows_at(step, here))


def added_bytes(step: Path) -> int:
    """Bytes a step added on disk: its files' sizes, but for files linked from elsewhere."""
    return sum(p.stat().st_size for p in step.rglob("*")
               if p.is_file() and p.stat().st_nlink == 1)


def delta_keys(step: Path) -> dict[str, dict[str, int]]:
    """Per process file of ``step``: the keys stored as row deltas there, with their
    numbers of patches."""
    import ckptvar as cv

    out = {}
    for f in sorted(step.glob("rank-*")):
        with cv.open(f) as r:
            assert isinstance(r, cv.storage.SupportsDeltas)
            out[f.name] = {k: d["patches"] for k, d in r.deltas().items()}
    return out


def refers(step: Path) -> dict[str, dict[str, list[str]]]:
    """The process files of ``step`` whose values refer to another step's bytes: file ->
    the values shared whole (their holders), or ``{}`` where only row deltas refer."""
    import ckptvar as cv

    out = {}
    for f in sorted(step.glob("rank-*")):
        with cv.open(f) as r:
            assert isinstance(r, cv.storage.SupportsShared)
            shared = r.shared()
            if shared or r.deltas():
                out[f.name] = shared
    return out


def restore_all(mgr: Any, ckpt: Any, table: Any, part: Any, coord: Any) -> dict[str, bool]:
    """Restore every listed step (collectively): whether each equals :func:`expected`."""
    import ckptvar as cv

    restored = {}
    for path in mgr.checkpoints:
        step = cv.checkpoint.parse_step_name(Path(path).name).step
        table.assign(np.full(table.shape, -1.0, np.float32))
        for p in part or ():
            p.assign(np.full(p.shape, -1.0, np.float32))
        ckpt.restore(path, coordinator=coord)
        lo = table.shard.offset[0]
        want = expected(step)[lo: lo + table.shape[0]]
        good = bool(np.array_equal(table.numpy(), want))
        if part is not None:
            good = good and bool(np.array_equal(np.asarray(part), expected_part(step)))
        restored[Path(path).name] = good
    return restored


def fail_once(mgr: Any, coord: Any, root: Path) -> dict[str, Any]:
    """Rank 1 fails while writing step 6, after its file's bytes were written: what each
    rank raised, and what is listed and on disk afterwards."""
    from _inject import save_failing_on  # tests/mpi/_inject.py (the script's folder)

    fields: dict[str, Any] = {"failed": save_failing_on(1, mgr, coord)}
    fields["after_failure"] = {
        "listed": [Path(p).name for p in mgr.checkpoints],
        "on_disk": sorted(os.listdir(root)),
    }
    return fields


def restart(mode: str, mgr: Any, ckpt: Any, table: Any, part: Any,  # noqa: PLR0917
            coord: Any, restored_first: str | None = None) -> dict[str, Any]:
    """The ``first`` mode: save steps 1-3. The ``restart`` mode: restore the latest step
    (3; ``restored_first``: restored before the manager was built), train and save step
    4, save again unchanged (step 5); what they added, their deltas, each restored
    bit-exact."""
    if mode == "first":
        for step in range(1, 4):
            train(table, part, step)
            mgr.save()
        return {}
    fields: dict[str, Any] = {
        "from": Path(restored_first or mgr.restore_or_initialize()).name}
    train(table, part, 4)
    sizes, deltas = {}, {}
    for step in (4, 5):
        path = Path(mgr.save())
        coord.barrier(tag=f"saved-{step}", timeout=60)
        if coord.rank == 0:
            sizes[path.name], deltas[path.name] = added_bytes(path), delta_keys(path)
    fields["sizes"], fields["deltas"] = sizes, deltas
    restored = {}
    for path in mgr.checkpoints:
        table.assign(np.full(table.shape, -1.0, np.float32))
        ckpt.restore(path, coordinator=coord)
        lo = table.shard.offset[0]
        good = np.array_equal(table.numpy(), expected(4)[lo: lo + table.shape[0]])
        if part is not None:
            good = good and np.array_equal(np.asarray(part), expected_part(4))
        restored[Path(path).name] = bool(good)
    fields["restored"] = restored
    return fields


def main(mode: str, root: Path, fmt: str) -> None:
    import ckptvar as cv

    coord = cv.distributed.from_env(timeout=60)
    rank, size = coord.rank, coord.size
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    fields: dict[str, Any] = {}
    ckpt, table, part = model(rank, size, fmt)
    restored_first = None
    if mode == "restart_first":  # TensorFlow's order: the restore, then the manager
        restored_first = cv.latest_checkpoint(root)
        ckpt.restore(restored_first, coordinator=coord).assert_consumed()
    incremental = (cv.IncrementalOptions(max_patches=2, whole_every=4)
                   if mode == "options" else True)
    mgr = cv.CheckpointManager(ckpt, root, max_to_keep=2, format=fmt,
                               incremental=incremental, coordinator=coord)
    if mode == "options":
        deltas, shared = {}, {}
        for step in range(1, 6):
            train(table, part, step)
            path = Path(mgr.save())
            coord.barrier(tag=f"saved-{step}", timeout=60)
            if rank == 0:
                deltas[step], shared[step] = delta_keys(path), refers(path)
        fields["deltas"], fields["shared"] = deltas, shared
        fields["listed"] = [Path(p).name for p in mgr.checkpoints]
    if mode == "save":
        sizes, deltas = {}, {}
        for step in range(1, 6):
            train(table, part, step)
            path = Path(mgr.save())
            coord.barrier(tag=f"saved-{step}", timeout=60)
            if rank == 0:
                sizes[step] = added_bytes(path)
                deltas[step] = delta_keys(path)
        fields["sizes"], fields["deltas"] = sizes, deltas
        train(table, part, 6)
        fields.update(fail_once(mgr, coord, root))
        coord.barrier(tag="looked", timeout=60)
        path = Path(mgr.save())
        coord.barrier(tag="saved-6", timeout=60)
        fields["retried"] = path.name
        if rank == 0:
            fields["retried_deltas"] = delta_keys(path)
        fields["listed"] = [Path(p).name for p in mgr.checkpoints]
    if mode in ("first", "restart", "restart_first"):
        fields.update(restart(mode, mgr, ckpt, table, part, coord, restored_first))
    else:
        fields["restored"] = restore_all(mgr, ckpt, table, part, coord)
    coord.barrier(tag="done", timeout=60)
    fields["ok"] = True
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": mode, "rank": rank, **fields}) + "\n")


def bench(root: Path, fmt: str, mib: int, steps: int = 6) -> None:
    """The ``bench`` mode (docs/benchmarks.md): each process holds about ``mib`` MiB of
    a table (boxes of different sizes) and ``scatter_update``s 1% of its rows per step
    (Zipf ids spread over the rows); an incremental manager and a full one save the same
    states in turn. Rank 0 reports per step the bytes added on disk, the bytes changed
    and each save's time (the collective save's, on rank 0)."""
    import time

    import ckptvar as cv

    coord = cv.distributed.from_env(timeout=120)
    rank, size = coord.rank, coord.size
    per = mib * (1 << 20) // (WIDTH * 4)
    counts = [per + (r - size // 2) * (per // 16) for r in range(size)]
    total = sum(counts)
    lo = sum(counts[:rank])
    table = cv.Variable(np.random.default_rng(rank).random((counts[rank], WIDTH),
                                                           dtype=np.float32),
                        name="table", shard=cv.Shard(full_shape=(total, WIDTH), offset=(lo, 0)))
    ckpt = cv.Checkpoint(table=table)
    incr = cv.CheckpointManager(ckpt, root / "incr", max_to_keep=2, format=fmt,
                                incremental=True, coordinator=coord)
    full = cv.CheckpointManager(ckpt, root / "full", max_to_keep=1, format=fmt,
                                coordinator=coord)
    perm = np.random.default_rng(7).permutation(total)
    rows: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        changed = 0
        if step > 1:
            ids = np.unique(perm[np.random.default_rng(step).zipf(1.2, total // 100) % total])
            changed = ids.size * WIDTH * 4
            mine = ids[(ids >= lo) & (ids < lo + counts[rank])]
            table.scatter_update(mine - lo, _rows_at(step, mine))
        took = {}
        for name, mgr in (("incr", incr), ("full", full)):
            coord.barrier(tag=f"{name}-{step}", timeout=120)
            t0 = time.perf_counter()
            path = Path(mgr.save())
            took[name] = time.perf_counter() - t0
            if name == "incr":
                coord.barrier(tag=f"sized-{step}", timeout=120)
                added = added_bytes(path) if rank == 0 else 0
        rows.append({"step": step, "added": added, "changed": changed,
                     "incr_s": took["incr"], "full_s": took["full"], "table": total * WIDTH * 4})
    if rank == 0:
        out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": "bench", "rank": 0, "rows": rows, "ok": True}) + "\n")


if __name__ == "__main__":
    try:
        if sys.argv[1] == "bench":
            bench(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        else:
            main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    except Exception:
        out = Path(os.environ["RESULT_DIR"]) / "error.txt"
        out.write_text(traceback.format_exc())
        raise
