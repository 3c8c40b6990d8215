"""A restarted manager whose state file lost touch with the directory, on 1 or N processes.

Usage: ``restart_cases.py DIR CASE...`` (plain ``python`` for one process, or under
``mpiexec -n N python -m mpi4py``); each rank appends one JSON line per case to
``$RESULT_DIR/rank<r>.jsonl``.

For each case a job saves steps 1-3 (``max_to_keep=2``) into ``DIR/<case>``, then
rank 0 does to the state file what the case says, then a restarted job (fresh
objects, a fresh manager) reports what it lists, restores, and saves the next step:

- ``deleted``: the state file is gone;
- ``stale``: it is the one written after step 2 (a crash before step 3 was recorded);
- ``damaged``: it holds garbage;
- ``disagree``: it lists a pruned step and not the newest one;
- ``again``: nothing is changed, and the restarted job saves step 3 again (refused), and
  then, without restoring, from a save counter behind the directory (continues past).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np

import ckptvar as cv

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"
ROWS = 12
STATE = "checkpoint_state.json"


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    lo, hi = RANK * ROWS // SIZE, (RANK + 1) * ROWS // SIZE
    w = cv.Variable(np.full((hi - lo, 3), value), name="w",
                    shard=cv.Shard(full_shape=(ROWS, 3), offset=(lo, 0)))
    return cv.Checkpoint(w=w), w


def manager(ckpt: cv.Checkpoint, d: Path) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, d, max_to_keep=2, coordinator=coord if SIZE > 1 else None)


def tamper(case: str, d: Path) -> None:
    state = d / STATE
    if case == "deleted":
        state.unlink()
    elif case == "stale":
        shutil.copy(d / "state-after-2.json", state)
    elif case == "damaged":
        state.write_bytes(b"\x00garbage{")
    elif case == "disagree":
        doc = json.loads(state.read_text())
        section = doc["sections"]["ckpt"]
        section["checkpoints"] = [{"path": "ckpt-1.h5", "step": 1, "time": 1.0},
                                  {"path": "ckpt-2.h5", "step": 2, "time": 2.0}]
        doc["latest"] = "ckpt-2.h5"
        state.write_text(json.dumps(doc))


def run(case: str, root: Path) -> None:
    d = root / case
    ckpt, w = model(0.0)
    mgr = manager(ckpt, d)
    for step in (1, 2, 3):
        w.assign(np.full(w.shape, float(step)))
        mgr.save()
        if step == 2 and RANK == 0:
            shutil.copy(d / STATE, d / "state-after-2.json")
    coord.barrier(tag=f"{case}:saved", timeout=60)
    if RANK == 0:
        tamper(case, d)
    coord.barrier(tag=f"{case}:tampered", timeout=60)
    # the restarted job
    ckpt, w = model(-1.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        again = manager(ckpt, d)
        listed = [Path(p).name for p in again.checkpoints]
        latest = again.latest_checkpoint
    restored = again.restore_or_initialize()
    fields: dict[str, object] = {
        "listed": listed,
        "latest": Path(latest).name if latest else None,
        "dir_latest": Path(cv.latest_checkpoint(d) or "-").name,
        "restored": Path(restored).name if restored else None,
        "values": float(w.numpy().min()) if w.numpy().size else 3.0,
        "values_max": float(w.numpy().max()) if w.numpy().size else 3.0,
        "warned": [str(x.message)[:300] for x in said],
    }
    if case == "again":
        try:
            again.save(checkpoint_number=3)
            fields["error"] = None
        except cv.CkptError as exc:
            fields["error"] = type(exc).__name__
            fields["message"] = str(exc)
    w.assign(np.full(w.shape, 4.0))
    if case == "again":  # a counter behind the directory: the save continues past step 3
        ckpt.save_counter.assign(1)
    fields["next"] = Path(again.save() or "-").name
    fields["after"] = [Path(p).name for p in again.checkpoints]
    coord.barrier(tag=f"{case}:done", timeout=60)
    fields["on_disk"] = sorted(n for n in os.listdir(d) if n.startswith("ckpt-"))
    fields["ok"] = True
    report(case, **fields)


def main() -> None:
    root = Path(sys.argv[1])
    for case in sys.argv[2:]:
        try:
            run(case, root)
        except Exception:
            report(case, ok=False, error=traceback.format_exc())
            raise


main()
