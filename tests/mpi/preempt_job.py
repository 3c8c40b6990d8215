"""A training job that saves on SIGTERM: ``python preempt_job.py DIR MODE`` (one process),
or under ``mpiexec -n N`` (one collective job).

It restores what ``DIR/run`` holds, then trains: each step adds 1 to ``w`` and to
``step`` (the state is consistent only between steps). Every step ends at a step
boundary: ``mgr.save()`` every ``SAVE_EVERY`` steps (``MODE=async``: in the
background, so a save is often in flight when the signal comes), else
``mgr.reached_preemption()``. Each rank writes ``DIR/pid<rank>`` and, after every
step, ``DIR/step<rank>``; with ``MODE=report`` it only restores and writes
``DIR/restored<rank>.json``. ``MODE=tiered`` (``tiered-report``): the same with a
local tier ``DIR/local`` and ``persistent_every=1000`` (only the preemption save
reaches ``DIR/run``); ``MODE=tiered-nodes``: the local tier on per-node disks, ranks
0-1 in ``DIR/local/node0``, ranks 2-3 in ``DIR/local/node1``. It never ends by itself
before 100000 steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.distributed import from_env

SAVE_EVERY = 7


def main(out: Path, mode: str) -> None:
    if any(os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")):
        from mpi4py import MPI  # noqa: F401 - initialises MPI under a plain mpiexec
    coord = from_env(timeout=60)
    rank = coord.rank
    w = cv.Variable(np.zeros((4, 3)), name="w")
    step = cv.Variable(np.int64(0), name="step")
    ckpt = cv.Checkpoint(w=w, step=step)
    tiers = {}
    if mode.startswith("tiered"):  # persisted only by the preemption save
        mode = mode.removeprefix("tiered").lstrip("-") or "sync"
        local = out / "local"
        if mode.startswith("nodes"):  # per-node local disks: ranks 0-1 and 2-3
            mode = mode.removeprefix("nodes").lstrip("-") or "sync"
            local = local / f"node{rank // 2}"
        tiers = {"local_directory": local, "local_max_to_keep": 2,
                 "persistent_every": 1000}
    mgr = cv.CheckpointManager(ckpt, out / "run", coordinator=coord, max_to_keep=3,
                               async_save=mode == "async",
                               save_on_signal=(signal.SIGTERM,), **tiers)
    restored = mgr.restore_or_initialize()
    if mode == "report":
        (out / f"restored{rank}.json").write_text(json.dumps({
            "path": restored, "step": int(step.numpy()), "w": w.numpy().tolist()}))
        return
    (out / f"pid{rank}").write_text(str(os.getpid()))
    while int(step.numpy()) < 100000:
        w.assign_add(np.ones((4, 3)))
        time.sleep(0.005)  # a signal may come mid-step: nothing is saved from there
        step.assign_add(1)
        n = int(step.numpy())
        if n % SAVE_EVERY == 0:
            mgr.save(checkpoint_number=n)
        else:
            mgr.reached_preemption(checkpoint_number=n)
        (out / f"step{rank}").write_text(str(n))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
