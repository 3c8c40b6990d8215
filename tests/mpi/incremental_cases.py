"""Incremental multi-process steps, on real processes.

Usage: ``mpiexec -n N python -m mpi4py incremental_cases.py MODE DIR FORMAT``; each rank
appends one JSON line per mode to ``$RESULT_DIR/rank<r>.jsonl``.

- ``save`` (3 processes): an incremental manager saves steps 1-5 (``max_to_keep=2``):
  ``head`` changes at every step, one process's box of ``frozen`` at step 5, ``uneven``
  (boxes of different sizes: stored in the per-process files, also in Zarr) never.
  Rank 0 reports the bytes each step added on disk. Then rank 1 fails while writing
  step 6 (its file written, then an error): nothing is committed; the same save then
  succeeds. A new manager (as after a restart: it knows no versions, so values are
  compared by their checksums) saves step 7; then every listed step is restored on
  these processes.
- ``restore`` (any number): every listed step is restored into this many processes'
  shards and compared with :func:`expected`; then one incremental save with this
  layout (written whole: the layout differs from the base's) is checked.
- ``lost`` (3 processes, Zarr): steps 1-2 are saved; then files are deleted by hand from
  step 2 (rank 1: a chunk of its box of ``uneven`` in its own file, rank 0: a chunk of the
  global array ``frozen``); steps 3 and 4 are saved, and restored. Each rank reports the
  steps saved, what it logged of files written whole, and the restores.
- ``step`` (``DIR`` an ``s3://`` URL, ``$S3_OPTIONS`` its storage options, a 4th
  argument ``N``): a fresh job sets the values of step ``N`` and saves one incremental
  step (``max_to_keep=1``); a new manager knows no versions: values are compared by
  their checksums with the latest step's.

:func:`expected` is the full value of each variable at a step (the test's plain
``cv.load`` compares with it too).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROWS = 3 * 40_000  # frozen: (ROWS, 4) float32, 1.92 MB, a global array in Zarr
HEAD = 3 * 30_000  # head: float32, 360 KB, changed at every step
UNEVEN = (50_000, 30_000, 40_000)  # uneven: rows per process of the 3-process save


def expected(step: int) -> dict[str, np.ndarray]:
    """The full value of every variable at ``step``."""
    frozen = np.random.default_rng(0).random((ROWS, 4), dtype=np.float32)
    if step >= 5:  # the middle process's rows of the 3-process layout
        frozen[ROWS // 3: 2 * ROWS // 3] += 1.0
    return {
        "frozen": frozen,
        "uneven": np.random.default_rng(1).random((sum(UNEVEN), 2), dtype=np.float32),
        "head": np.full(HEAD, float(step), np.float32),
        "bias": np.arange(5, dtype=np.float64),
    }


def _rows(n: int, rank: int, size: int, counts: tuple[int, ...] | None = None) -> tuple[int, int]:
    if counts is not None and size == len(counts):
        return sum(counts[:rank]), sum(counts[:rank + 1])
    return rank * n // size, (rank + 1) * n // size


def model(rank: int, size: int) -> tuple[Any, dict[str, Any]]:
    import ckptvar as cv

    made: dict[str, Any] = {}
    for key, full in expected(0).items():
        if key == "bias":  # replicated: written by one process
            made[key] = cv.Variable(full.copy(), name=key)
            continue
        lo, hi = _rows(full.shape[0], rank, size, UNEVEN if key == "uneven" else None)
        made[key] = cv.Variable(np.zeros((hi - lo, *full.shape[1:]), full.dtype), name=key,
                                shard=cv.Shard(full_shape=full.shape,
                                               offset=(lo,) + (0,) * (full.ndim - 1)))
    return cv.Checkpoint(**made), made


def set_step(made: dict[str, Any], step: int, rank: int, size: int, *,
             first: bool = False) -> None:
    """Assign the values of ``step`` (only what changed since ``step - 1``, as training
    does; everything when ``first``)."""
    want = expected(step)
    for key, var in made.items():
        if key == "bias":
            if first:
                var.assign(want[key])
            continue
        if not first and key == "uneven":
            continue
        if not first and key == "frozen" and (step != 5 or rank != size // 2):
            continue  # at step 5, only the middle process's box changes
        lo = var.shard.offset[0]
        var.assign(want[key][lo: lo + var.shape[0]])


def added_bytes(step: Path) -> int:
    """Bytes a step added on disk: its files' sizes, but for files linked from elsewhere
    (an HDF5 value an external link refers to is not in the file)."""
    return sum(p.stat().st_size for p in step.rglob("*")
               if p.is_file() and p.stat().st_nlink == 1)


def restore_all(mgr: Any, ckpt: Any, made: dict[str, Any], coord: Any) -> dict[str, bool]:
    """Restore every listed step (collectively): whether each equals :func:`expected`."""
    import ckptvar as cv

    restored = {}
    for path in mgr.checkpoints:
        step = cv.checkpoint.parse_step_name(Path(path).name).step
        ckpt.restore(path, coordinator=coord)
        want = expected(step)
        good = True
        for key, var in made.items():
            lo = var.shard.offset[0] if var.shard is not None else 0
            part = want[key][lo: lo + var.shape[0]]
            good = good and bool(np.array_equal(var.numpy(), part))
        restored[Path(path).name] = good
    return restored


def one_step(url: str, fmt: str, step: int) -> None:
    """The ``step`` mode (see the module docstring)."""
    import ckptvar as cv

    coord = cv.distributed.from_env(timeout=60)
    rank, size = coord.rank, coord.size
    opts = json.loads(os.environ["S3_OPTIONS"])
    ckpt, made = model(rank, size)
    set_step(made, step, rank, size, first=True)
    mgr = cv.CheckpointManager(ckpt, url, max_to_keep=1, format=fmt, incremental=True,
                               coordinator=coord, storage_options=opts)
    path = mgr.save(checkpoint_number=step)
    coord.barrier(tag="done", timeout=60)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": "step", "rank": rank, "path": path, "ok": True}) + "\n")


def fail_once(mgr: Any, made: dict[str, Any], coord: Any, root: Path) -> dict[str, Any]:
    """Rank 1 fails while writing step 6, after its file's bytes were written: what each
    rank raised, and what is listed and on disk afterwards."""
    from _inject import save_failing_on  # tests/mpi/_inject.py (the script's folder)

    set_step(made, 6, coord.rank, coord.size)
    fields: dict[str, Any] = {"failed": save_failing_on(1, mgr, coord)}
    fields["after_failure"] = {
        "listed": [Path(p).name for p in mgr.checkpoints],
        "on_disk": sorted(os.listdir(root)),
    }
    return fields


#: ``lost``: the file each rank deletes from step 2 (a rank missing here deletes nothing).
LOST = {0: "frozen/c.0.0", 1: "rank-00001.zarr/uneven/%2Ebox/1/c.0.0"}


def lost_files(mgr: Any, made: dict[str, Any], coord: Any, root: Path,
               said: list[str]) -> dict[str, Any]:
    """The ``lost`` mode (see the module docstring)."""
    rank, size = coord.rank, coord.size
    for step in (1, 2):
        set_step(made, step, rank, size, first=step == 1)
        mgr.save()
    coord.barrier(tag="saved", timeout=60)
    if rank in LOST:
        (root / "ckpt-2.zarr" / LOST[rank]).unlink()
    coord.barrier(tag="deleted", timeout=60)
    del said[:]
    saved = []
    for step in (3, 4):
        set_step(made, step, rank, size)
        saved.append(Path(mgr.save()).name)
    return {"saved": saved, "said": [m for m in said if "written whole" in m],
            "restored": restore_all(mgr, mgr.checkpoint, made, coord)}


def main(mode: str, root: Path, fmt: str) -> None:
    import ckptvar as cv

    coord = cv.distributed.from_env(timeout=60)
    rank, size = coord.rank, coord.size
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("ckptvar").addHandler(Keep(logging.WARNING))
    fields: dict[str, Any] = {}
    ckpt, made = model(rank, size)
    mgr = cv.CheckpointManager(ckpt, root, max_to_keep=2, format=fmt, incremental=True,
                               coordinator=coord)
    if mode == "lost":
        fields.update(lost_files(mgr, made, coord, root, said))
    elif mode == "save":
        sizes = {}
        for step in range(1, 6):
            set_step(made, step, rank, size, first=step == 1)
            path = Path(mgr.save())
            coord.barrier(tag=f"saved-{step}", timeout=60)
            if rank == 0:
                sizes[step] = added_bytes(path)
        fields["sizes"] = sizes
        fields["listed"] = [Path(p).name for p in mgr.checkpoints]
        fields.update(fail_once(mgr, made, coord, root))
        coord.barrier(tag="looked", timeout=60)
        fields["retried"] = Path(mgr.save()).name
        set_step(made, 7, rank, size)
        mgr = cv.CheckpointManager(ckpt, root, max_to_keep=2, format=fmt, incremental=True,
                                   coordinator=coord)
        path = Path(mgr.save(checkpoint_number=7))
        coord.barrier(tag="saved-7", timeout=60)
        if rank == 0:
            fields["fresh_size"] = added_bytes(path)
        fields["restored"] = restore_all(mgr, ckpt, made, coord)
    else:
        fields["restored"] = restore_all(mgr, ckpt, made, coord)
        set_step(made, 8, rank, size, first=True)
        del said[:]
        fields["full_save"] = Path(mgr.save(checkpoint_number=8)).name
        fields["said"] = [m for m in said if "writing every value" in m]
    coord.barrier(tag="done", timeout=60)
    fields["ok"] = True
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": mode, "rank": rank, **fields}) + "\n")


if __name__ == "__main__":
    try:
        if sys.argv[1] == "step":
            one_step(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        else:
            main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    except Exception:
        out = Path(os.environ["RESULT_DIR"]) / "error.txt"
        out.write_text(traceback.format_exc())
        raise
