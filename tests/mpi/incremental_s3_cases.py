"""Incremental multi-process HDF5 steps on an object store, on real processes.

Usage: ``mpiexec -n N python -m mpi4py incremental_s3_cases.py MODE URL``;
``$S3_OPTIONS`` holds the JSON storage options of the local S3 server. Each rank
appends one JSON line per mode to ``$RESULT_DIR/rank<r>.jsonl``. The model and the
values of each step are tests/mpi/incremental_cases.py's.

- ``save`` (3 processes): rank 0 starts a counting proxy (tests/cloud/_s3.py) in front
  of the server, and every process talks to the server through it, so rank 0 counts
  the bytes each step uploads (between two barriers: every process's). An incremental
  HDF5 manager (``max_to_keep=2``) saves steps 1-5: ``head`` changes at every step, the
  middle process's box of ``frozen`` at step 5, ``uneven`` never. Then rank 1 fails
  while writing step 6 (its file written, then an error): nothing of it is committed
  or left; the same save then succeeds. A new manager (as after a restart: no versions
  known, so values are compared by their checksums) saves step 7; then every committed
  step (listed or held) is restored on these processes.
- ``restore`` (any number): every committed step is restored into this many processes'
  shards and compared with ``expected``.
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
from incremental_cases import expected, model, set_step

import ckptvar as cv
from ckptvar.locations import list_committed_steps, open_location

OPTS = json.loads(os.environ["S3_OPTIONS"])


def committed(url: str) -> list[str]:
    return list_committed_steps(open_location(url, storage_options=OPTS))


def restore_steps(ckpt: Any, made: dict[str, Any], coord: Any, url: str,
                  names: list[str]) -> dict[str, bool]:
    """Restore each step of ``names`` (collectively): whether each equals ``expected``."""
    restored = {}
    for name in names:
        step = cv.checkpoint.parse_step_name(name).step
        ckpt.restore(f"{url}/{name}", coordinator=coord, timeout=60, storage_options=OPTS)
        want = expected(step)
        good = True
        for key, var in made.items():
            lo = var.shard.offset[0] if var.shard is not None else 0
            good = good and bool(np.array_equal(var.numpy(), want[key][lo: lo + var.shape[0]]))
        restored[name] = good
    return restored


def fail_once(mgr: Any, made: dict[str, Any], coord: Any, url: str) -> dict[str, Any]:
    """Rank 1 fails while writing step 6, after its file was written: what each rank
    raised, and what is committed and stored of step 6 afterwards."""
    set_step(made, 6, coord.rank, coord.size)
    from _inject import save_failing_on  # tests/mpi/_inject.py (the script's folder)

    fields: dict[str, Any] = {"failed": save_failing_on(1, mgr, coord, timeout=60)}
    loc = open_location(url, storage_options=OPTS)
    fields["after_failure"] = {
        "listed": [Path(p).name for p in mgr.checkpoints],
        "left": sorted(o.key for o in loc.list() if o.key.startswith("ckpt-6")),
    }
    return fields


def save(coord: Any, url: str) -> dict[str, Any]:
    from cloud._s3 import FaultProxy  # tests/cloud/_s3.py

    rank, size = coord.rank, coord.size
    proxy = FaultProxy(OPTS["endpoint"]) if rank == 0 else None
    endpoint = coord.broadcast(None if proxy is None else proxy.endpoint, tag="proxy",
                               timeout=60)
    opts = {**OPTS, "endpoint": endpoint}
    ckpt, made = model(rank, size)
    mgr = cv.CheckpointManager(ckpt, url, max_to_keep=2, format="h5", incremental=True,
                               coordinator=coord, storage_options=opts)
    fields: dict[str, Any] = {}
    uploaded: dict[int, int] = {}

    def saved(step: int, manager: Any, **kw: Any) -> str:
        coord.barrier(tag=f"before-{step}", timeout=60)
        if proxy is not None:
            proxy.reset_counts()
        path = manager.save(timeout=60, **kw)
        coord.barrier(tag=f"after-{step}", timeout=60)
        if proxy is not None:
            uploaded[step] = proxy.bytes_up
        return str(path)

    for step in range(1, 6):
        set_step(made, step, rank, size, first=step == 1)
        saved(step, mgr)
    fields["listed"] = [Path(p).name for p in mgr.checkpoints]
    fields["committed_after_5"] = committed(url)
    fields.update(fail_once(mgr, made, coord, url))
    coord.barrier(tag="looked", timeout=60)
    fields["retried"] = Path(saved(6, mgr)).name
    set_step(made, 7, rank, size)
    mgr = cv.CheckpointManager(ckpt, url, max_to_keep=2, format="h5", incremental=True,
                               coordinator=coord, storage_options=opts)
    saved(7, mgr, checkpoint_number=7)
    fields["uploaded"] = uploaded
    fields["listed_after_7"] = [Path(p).name for p in mgr.checkpoints]
    fields["committed"] = names = committed(url)
    fields["restored"] = restore_steps(ckpt, made, coord, url, names)
    coord.barrier(tag="done", timeout=60)
    if proxy is not None:
        proxy.close()
    return fields


def restore(coord: Any, url: str) -> dict[str, Any]:
    ckpt, made = model(coord.rank, coord.size)
    names = committed(url)
    fields = {"restored": restore_steps(ckpt, made, coord, url, names)}
    coord.barrier(tag="done", timeout=60)
    return fields


def main(mode: str, url: str) -> None:
    coord = cv.distributed.from_env(timeout=60)
    rank = coord.rank
    fields = save(coord, url) if mode == "save" else restore(coord, url)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": mode, "rank": rank, "ok": True, **fields}) + "\n")


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        (Path(os.environ["RESULT_DIR"]) / "error.txt").write_text(traceback.format_exc())
        raise
