"""Row deltas written by several processes on an object store, on real processes.

Usage: ``mpiexec -n N python -m mpi4py row_delta_s3_cases.py MODE URL``; ``$S3_OPTIONS``
holds the JSON storage options of the local S3 server. Each rank appends one JSON line
per mode to ``$RESULT_DIR/rank<r>.jsonl``. The model, the rows trained at each step and
the values are tests/mpi/row_delta_cases.py's (each process's box of ``table`` trained by
``scatter_update`` at a few rows per step; in HDF5 also ``part``, a partitioned
variable that one process writes). Both formats run in one job, each under
``URL/<format>``.

- ``save`` (3 processes): rank 0 starts a counting proxy (tests/cloud/_s3.py) in front
  of the server and every process talks through it, so rank 0 counts the bytes each
  step uploads (between two barriers: every process's). An incremental manager
  (``max_to_keep=2``) saves steps 1-5; rank 0 reports each step's row deltas
  (``reader.deltas()``). Then rank 1 fails while writing step 6 (its file written, then
  an error): nothing of it is committed or left, and the same save then succeeds (its
  patches must hold step 6's rows: the restores compare). Every committed step (listed,
  or held for a kept step's deltas) is restored on these processes.
- ``restore`` (any number): every committed step is restored into this many
  processes' boxes (resharding) and compared with ``expected``.
- ``bench`` (``URL FORMAT MIB``, one format): the bytes uploaded and time per step of
  row deltas against full steps, as tests/mpi/row_delta_cases.py's ``bench`` on disk
  (:func:`bench`; the figures in docs/benchmarks.md). Rank 0 makes the bucket (moto
  accepts an unsigned request).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from row_delta_cases import WIDTH, _rows_at, expected, expected_part, model, train

import ckptvar as cv
from ckptvar.locations import list_committed_steps, open_location

OPTS = json.loads(os.environ["S3_OPTIONS"])
FORMATS = ("h5", "zarr")


def committed(url: str) -> list[str]:
    return list_committed_steps(open_location(url, storage_options=OPTS))


def restore_steps(ckpt: Any, table: Any, part: Any, coord: Any, *, url: str,
                  names: list[str]) -> dict[str, bool]:
    """Restore each step of ``names`` (collectively): whether each equals ``expected``."""
    restored = {}
    for name in names:
        step = cv.checkpoint.parse_step_name(name).step
        table.assign(np.full(table.shape, -1.0, np.float32))
        for p in part or ():
            p.assign(np.full(p.shape, -1.0, np.float32))
        ckpt.restore(f"{url}/{name}", coordinator=coord, timeout=60, storage_options=OPTS)
        lo = table.shard.offset[0]
        good = bool(np.array_equal(table.numpy(), expected(step)[lo: lo + table.shape[0]]))
        if part is not None:
            good = good and bool(np.array_equal(np.asarray(part), expected_part(step)))
        restored[name] = good
    return restored


def deltas(url: str) -> dict[str, Any]:
    """The step's values with boxes stored as row deltas (``reader.deltas()``)."""
    with cv.open(url, storage_options=OPTS) as reader:
        assert isinstance(reader, cv.storage.SupportsDeltas)
        return reader.deltas()


def fail_once(mgr: Any, coord: Any, url: str) -> dict[str, Any]:
    """Rank 1 fails while writing step 6, after its file was written: what each rank
    raised, and what is listed and stored of step 6 afterwards."""
    from _inject import save_failing_on  # tests/mpi/_inject.py (the script's folder)

    fields: dict[str, Any] = {"failed": save_failing_on(1, mgr, coord, timeout=60)}
    loc = open_location(url, storage_options=OPTS)
    fields["after_failure"] = {
        "listed": [Path(p).name for p in mgr.checkpoints],
        "left": sorted(o.key for o in loc.list() if o.key.startswith("ckpt-6")),
    }
    return fields


def save(coord: Any, url: str, fmt: str, proxy: Any, endpoint: str) -> dict[str, Any]:
    rank, size = coord.rank, coord.size
    opts = {**OPTS, "endpoint": endpoint}
    ckpt, table, part = model(rank, size, fmt)
    mgr = cv.CheckpointManager(ckpt, url, max_to_keep=2, format=fmt, incremental=True,
                               coordinator=coord, storage_options=opts)
    fields: dict[str, Any] = {}
    uploaded: dict[int, int] = {}
    found: dict[int, Any] = {}

    def saved(step: int) -> str:
        coord.barrier(tag=f"before-{fmt}-{step}", timeout=60)
        if proxy is not None:
            proxy.reset_counts()
        path = str(mgr.save(timeout=60))
        coord.barrier(tag=f"after-{fmt}-{step}", timeout=60)
        if proxy is not None:
            uploaded[step] = proxy.bytes_up
        if rank == 0:
            found[step] = deltas(path)
        return path

    for step in range(1, 6):
        train(table, part, step)
        saved(step)
    train(table, part, 6)
    fields.update(fail_once(mgr, coord, url))
    coord.barrier(tag=f"looked-{fmt}", timeout=60)
    fields["retried"] = Path(saved(6)).name
    fields["uploaded"], fields["deltas"] = uploaded, found
    fields["listed"] = [Path(p).name for p in mgr.checkpoints]
    fields["committed"] = names = committed(url)
    fields["restored"] = restore_steps(ckpt, table, part, coord, url=url, names=names)
    coord.barrier(tag=f"done-{fmt}", timeout=60)
    return fields


def restore(coord: Any, url: str, fmt: str) -> dict[str, Any]:
    ckpt, table, part = model(coord.rank, coord.size, fmt)
    fields = {"restored": restore_steps(ckpt, table, part, coord, url=url,
                                         names=committed(url))}
    coord.barrier(tag=f"done-{fmt}", timeout=60)
    return fields


def bench(url: str, fmt: str, mib: int, steps: int = 6) -> None:
    """The ``bench`` mode: each process holds about ``mib`` MiB of a table (boxes of
    different sizes) and ``scatter_update``s 1% of its rows per step (Zipf ids spread
    over the rows); an incremental manager and a full one save the same states in turn,
    through rank 0's counting proxy. Rank 0 reports per step the bytes each uploaded
    (every process's, requests included), the bytes changed and each save's time."""
    import time

    from cloud._s3 import FaultProxy, make_bucket  # tests/cloud/_s3.py

    coord = cv.distributed.from_env(timeout=120)
    rank, size = coord.rank, coord.size
    proxy = None
    if rank == 0:
        bucket = url.removeprefix("s3://").partition("/")[0]
        make_bucket(OPTS["endpoint"], bucket)
        proxy = FaultProxy(OPTS["endpoint"])
    endpoint = coord.broadcast(None if proxy is None else proxy.endpoint, tag="proxy",
                               timeout=60)
    opts = {**OPTS, "endpoint": endpoint}
    per = mib * (1 << 20) // (WIDTH * 4)
    counts = [per + (r - size // 2) * (per // 16) for r in range(size)]
    total = sum(counts)
    lo = sum(counts[:rank])
    table = cv.Variable(np.random.default_rng(rank).random((counts[rank], WIDTH),
                                                           dtype=np.float32),
                        name="table", shard=cv.Shard(full_shape=(total, WIDTH), offset=(lo, 0)))
    ckpt = cv.Checkpoint(table=table)
    managers = {
        "incr": cv.CheckpointManager(ckpt, f"{url}/incr", max_to_keep=2, format=fmt,
                                     incremental=True, coordinator=coord, storage_options=opts),
        "full": cv.CheckpointManager(ckpt, f"{url}/full", max_to_keep=1, format=fmt,
                                     coordinator=coord, storage_options=opts),
    }
    perm = np.random.default_rng(7).permutation(total)
    rows: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        changed = 0
        if step > 1:
            ids = np.unique(perm[np.random.default_rng(step).zipf(1.2, total // 100) % total])
            changed = ids.size * WIDTH * 4
            mine = ids[(ids >= lo) & (ids < lo + counts[rank])]
            table.scatter_update(mine - lo, _rows_at(step, mine))
        row: dict[str, float] = {"step": step, "changed": changed, "table": total * WIDTH * 4}
        for name, mgr in managers.items():
            coord.barrier(tag=f"{name}-{step}", timeout=120)
            if proxy is not None:
                proxy.reset_counts()
            t0 = time.perf_counter()
            mgr.save(timeout=120)
            row[f"{name}_s"] = time.perf_counter() - t0
            coord.barrier(tag=f"{name}-done-{step}", timeout=120)
            if proxy is not None:
                row[f"{name}_up"] = proxy.bytes_up
        rows.append(row)
    if proxy is not None:
        proxy.close()
        out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": "bench", "rank": 0, "rows": rows, "ok": True}) + "\n")


def main(mode: str, url: str) -> None:
    coord = cv.distributed.from_env(timeout=60)
    rank = coord.rank
    fields: dict[str, Any] = {}
    if mode == "save":
        from cloud._s3 import FaultProxy  # tests/cloud/_s3.py

        proxy = FaultProxy(OPTS["endpoint"]) if rank == 0 else None
        endpoint = coord.broadcast(None if proxy is None else proxy.endpoint, tag="proxy",
                                   timeout=60)
        for fmt in FORMATS:
            fields[fmt] = save(coord, f"{url}/{fmt}", fmt, proxy, endpoint)
        if proxy is not None:
            proxy.close()
    else:
        for fmt in FORMATS:
            fields[fmt] = restore(coord, f"{url}/{fmt}", fmt)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": mode, "rank": rank, "ok": True, **fields}) + "\n")


if __name__ == "__main__":
    try:
        if sys.argv[1] == "bench":
            bench(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        else:
            main(sys.argv[1], sys.argv[2])
    except Exception:
        (Path(os.environ["RESULT_DIR"]) / "error.txt").write_text(traceback.format_exc())
        raise
