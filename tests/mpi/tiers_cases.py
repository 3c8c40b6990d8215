"""A tiered manager (a local and a persistent tier) with a coordinator of N processes.

Usage: ``tiers_cases.py DIR CASE...`` under ``mpiexec -n N python -m mpi4py``; each rank
appends one JSON line to ``$RESULT_DIR/rank<r>.jsonl``. Every rank holds its rows of
``w`` (a sharded variable); the local tier ``DIR/local`` is shared by the ranks.

- ``save``: steps 1-5 (``w`` = the step), ``persistent_every=2``, ``max_to_keep=3``,
  ``local_max_to_keep=1``, then ``wait_until_finished()``; reports what each tier holds;
- ``restore``: a fresh job restores (reports the path and its rows' values);
- ``per-rank``: each rank names its own local directory (one "node" each): steps 1-2,
  step 2 persisted; reports what its own directory holds;
- ``fail``: in ``DIR/fail``, a foreign ``ckpt-2.h5`` in the persistent directory makes
  rank 0's copy of step 2 fail: ``wait_until_finished()`` raises on every rank.

With ``$PERSISTENT`` (a URL; ``$S3_OPTIONS`` its storage options, JSON) the persistent
tier is there instead of ``DIR/persistent``; ``$FORMAT``: ``h5`` (default) or ``zarr``;
``$ASYNC=1``: ``async_save=True`` (the local saves run in the background too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import ckptvar as cv

coord = cv.distributed.from_env(timeout=60)
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"
ROWS = 12
PERSISTENT = os.environ.get("PERSISTENT")
OPTS = json.loads(os.environ.get("S3_OPTIONS", "null"))
FORMAT = os.environ.get("FORMAT", "h5")
ASYNC = os.environ.get("ASYNC") == "1"
INCREMENTAL = os.environ.get("INCREMENTAL") == "1"


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    lo, hi = RANK * ROWS // SIZE, (RANK + 1) * ROWS // SIZE
    w = cv.Variable(np.full((hi - lo, 3), value), name="w",
                    shard=cv.Shard(full_shape=(ROWS, 3), offset=(lo, 0)))
    if INCREMENTAL:  # and a value that never changes: shared by the local steps
        frozen = cv.Variable(np.arange(RANK * 50_000, (RANK + 1) * 50_000, dtype=np.float32),
                             name="frozen", shard=cv.Shard(full_shape=(SIZE * 50_000,),
                                                           offset=(RANK * 50_000,)))
        return cv.Checkpoint(w=w, frozen=frozen), w
    return cv.Checkpoint(w=w), w


def manager(ckpt: cv.Checkpoint, d: Path, local: Path) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, PERSISTENT or d / "persistent", max_to_keep=3,
                                coordinator=coord, storage_options=OPTS,
                                local_directory=local, local_max_to_keep=1,
                                persistent_every=2, format=FORMAT, async_save=ASYNC,
                                incremental=INCREMENTAL)


def steps(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("ckpt-*")) if d.exists() else []


def main(d: Path, case: str) -> None:
    ckpt, w = model(-1.0)
    if case == "per-rank":
        try:
            mgr = manager(ckpt, d / "per-rank", d / "per-rank" / f"local-rank{RANK}")
        except cv.CkptError as exc:  # incremental: not with per-node local tiers yet
            report(case, error=type(exc).__name__, message=str(exc))
            return
        for step in (1, 2):
            w.assign(np.full(w.shape, float(step)))
            mgr.save()
        mgr.wait_until_finished()
        here = d / "per-rank" / f"local-rank{RANK}"
        report(case, local=steps(here), persistent=steps(d / "per-rank" / "persistent"),
               parts=sorted(p.name for p in (here / "ckpt-2.h5").iterdir()))
        return
    if case == "fail":
        mgr = manager(ckpt, d / "fail", d / "fail" / "local")
        if RANK == 0:
            (d / "fail" / "persistent" / "ckpt-2.h5").mkdir()
            (d / "fail" / "persistent" / "ckpt-2.h5" / "mine").write_text("mine")
        for _ in range(2):
            mgr.save()
        try:
            mgr.wait_until_finished()
        except cv.CkptError as exc:
            report(case, error=type(exc).__name__, message=str(exc))
        return
    mgr = manager(ckpt, d, d / "local")
    if case == "save":
        for step in range(1, 6):
            w.assign(np.full(w.shape, float(step)))
            mgr.save()
        mgr.wait_until_finished()
        coord.barrier(tag="listed")
        shared = {}
        if INCREMENTAL:
            with cv.open(d / "local" / f"ckpt-5.{FORMAT}") as reader:
                shared = reader.shared()
        report(case, local=steps(d / "local"), persistent=steps(d / "persistent"),
               listed=[f"{Path(p).parent.name}/{Path(p).name}" for p in mgr.checkpoints],
               shared=shared)
    elif case == "restore":
        path = mgr.restore_or_initialize()
        report(case, restored=path, values=sorted(set(w.numpy().ravel().tolist())))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(Path(sys.argv[1]), name)
