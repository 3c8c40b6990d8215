"""Per-rank host memory and blocking of multi-process saves, under
``mpiexec -n N python -m mpi4py save_memory_cases.py DIR``.

Each rank holds a 16 MiB row shard of one value (plus a small replicated one) and
saves it through a ``CheckpointManager`` (one save in flight per manager):

- ``blocking``: a blocking save; ``tracemalloc``'s peak of what was allocated
  during it (NumPy registers its arrays with tracemalloc);
- ``background``: two background saves in a row, the first shard changed after its
  snapshot. The caller is blocked only for the snapshot (the second call waits for
  the first save, then snapshots); the peak stays at one snapshot; the first save
  holds the old values, the second the new ones;
- ``bgfail``: a background save that fails on rank 1: its error surfaces on every
  rank at the next ``save`` (which writes nothing), and the manager goes on, the failed
  step's number given back (the save after it takes that number).

``ru_maxrss`` growth during each case is reported too (a figure, not asserted: it
also counts HDF5's own buffers and the allocator's).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
import tracemalloc
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.storage import _h5

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"
ROWS, COLS = 4096 * SIZE, 1024  # 16 MiB of float32 per rank


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(d: Path) -> None:
    lo = RANK * 4096
    shard = np.arange(lo * COLS, (lo + 4096) * COLS, dtype=np.float32).reshape(4096, COLS)
    w = cv.Variable(shard, name="w", shard=cv.Shard(full_shape=(ROWS, COLS), offset=(lo, 0)))
    ckpt = cv.Checkpoint(w=w, b=cv.Variable(np.ones(8, "float32"), name="b"))
    nbytes = w.numpy().nbytes
    mgr = cv.CheckpointManager(ckpt, d / "blocking", coordinator=coord)
    mgr.save(timeout=30)  # warm: imports, the plan cache, HDF5's first file
    tracemalloc.start()

    tracemalloc.reset_peak()
    rss0, base = maxrss(), tracemalloc.get_traced_memory()[0]
    mgr.save(timeout=30)
    peak = tracemalloc.get_traced_memory()[1] - base
    report("blocking", ok=True, shard=nbytes, peak=peak, rss=maxrss() - rss0)

    bg = cv.CheckpointManager(ckpt, d / "bg", coordinator=coord, async_save=True)
    coord.barrier(tag="bg", timeout=30)
    tracemalloc.reset_peak()
    rss0, base = maxrss(), tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    first = bg.save(timeout=30)
    call1 = time.perf_counter() - t0
    buf = w.value()  # after the snapshot: not in the first save (in place: no allocation)
    np.add(buf, 1, out=buf)
    t0 = time.perf_counter()
    second = bg.save(timeout=30)  # waits for the first, then snapshots
    call2 = time.perf_counter() - t0
    ckpt.wait()
    total = time.perf_counter() - t0
    peak, rss = tracemalloc.get_traced_memory()[1] - base, maxrss() - rss0
    values = []
    for p in (first, second):
        with cv.open(p) as reader:
            values.append(reader["w"][lo:lo + 4096])
    same = np.array_equal(values[0], shard) and np.array_equal(values[1], shard + 1)
    report("background", ok=bool(same), shard=nbytes, peak=peak, rss=rss,
           call1=call1, call2=call2, total=total)
    tracemalloc.stop()

    original = _h5.H5Writer.add
    if RANK == 1:  # the next write fails, once
        def add(self, key, array, attrs=None):  # type: ignore[no-untyped-def]
            _h5.H5Writer.add = original  # type: ignore[method-assign]
            raise OSError(28, "No space left on device (injected)")

        _h5.H5Writer.add = add  # type: ignore[method-assign]
    bad = bg.save(timeout=30)  # returns at once; fails in the background on every rank
    try:
        bg.save(timeout=30)
        report("bgfail", ok=False, error="no error")
    except (cv.DistributedError, OSError) as exc:  # rank 1 raises its own OSError, as alone
        after = bg.save(timeout=30)
        ckpt.wait()
        report("bgfail", ok=True, error=" ".join([str(exc), *getattr(exc, "__notes__", [])]),
               bad=bad, after=after,
               kept=sorted(p.name for p in (d / "bg").iterdir() if p.name.startswith("ckpt")))


try:
    main(Path(sys.argv[1]))
except Exception:
    report("crash", ok=False, error=traceback.format_exc())
    raise
