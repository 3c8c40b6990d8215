"""A tiered manager whose local tier is on per-node disks: 4 processes as 2 nodes.

Usage: ``node_tiers_cases.py DIR CASE...`` under ``mpiexec -n 4 python -m mpi4py``; each
rank appends one JSON line to ``$RESULT_DIR/rank<r>.jsonl``. Ranks 0-1 are node 0, whose
local directory is ``DIR/nodes/node0``; ranks 2-3 node 1 (``DIR/nodes/node1``): each
process sees only its own node's. Every rank holds its rows of ``w`` (sharded) and the
same ``b`` (replicated); each value is a function of the step.

- ``save``: steps 1-5, ``persistent_every=2``, ``max_to_keep=3``, ``local_max_to_keep=2``,
  then ``wait_until_finished()``; reports what this node's tier and the persistent one hold;
- ``restore``: a fresh job restores (the path, whether its values are the step's bit for
  bit, the save counter);
- ``next``: a fresh job restores, then saves step ``restored + 10`` (persisted: even);
- ``hold``: in ``DIR/hold`` (``local_max_to_keep=1``): writes ``DIR/hold/ready-<rank>``,
  waits for ``DIR/hold/locked``, then steps 1-5 while the test holds the persistent
  tier's state lock (no copy can be recorded); reports this node's steps and
  writes ``DIR/hold/saved-<rank>``; then ``wait_until_finished()`` (the test lets go)
  and reports them again;
- ``kill``: in ``DIR/kill``: saves step 1 (local only) and step 2, whose persistent copy
  rank 2 does not survive: it SIGKILLs itself once the copy's temporary appears.
- ``preempt``: in ``DIR/preempt``, with ``save_on_signal(SIGUSR1)``: saves step 2 and
  step 3 by number (step 3 is due no persistent copy), each process signals itself as if
  during step 3's save, then ``reached_preemption(3)``; reports what it returned, the
  error it raised if any, the calls of this process's own handler and what this node's
  tier and the persistent one hold.

With ``$PERSISTENT`` (a URL; ``$S3_OPTIONS`` its storage options, JSON) the persistent
tier is there instead of ``DIR/persistent``; ``$FORMAT``: ``h5`` (default) or ``zarr``;
``$ASYNC=1``: ``async_save=True`` (the local saves run in the background too).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.locations import open_location

coord = cv.distributed.from_env(timeout=60)
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"
ROWS = 4096
PERSISTENT = os.environ.get("PERSISTENT")
OPTS = json.loads(os.environ.get("S3_OPTIONS", "null"))
FORMAT = os.environ.get("FORMAT", "h5")
ASYNC = os.environ.get("ASYNC") == "1"


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def model(value: float) -> tuple[cv.Checkpoint, cv.Variable, cv.Variable]:
    lo, hi = RANK * ROWS // SIZE, (RANK + 1) * ROWS // SIZE
    w = cv.Variable(np.full((hi - lo, 64), value), name="w",
                    shard=cv.Shard(full_shape=(ROWS, 64), offset=(lo, 0)))
    b = cv.Variable(np.full(7, value * 10), name="b")
    return cv.Checkpoint(w=w, b=b), w, b


def set_step(w: cv.Variable, b: cv.Variable, step: int) -> None:
    lo = RANK * ROWS // SIZE
    rows = np.arange(lo, lo + w.shape[0], dtype=np.float64)[:, None]
    w.assign(step + rows / ROWS + np.zeros((1, 64)))
    b.assign(np.full(7, step * 10.0))


def exact(w: cv.Variable, b: cv.Variable, step: int) -> bool:
    lo = RANK * ROWS // SIZE
    rows = np.arange(lo, lo + w.shape[0], dtype=np.float64)[:, None]
    return bool(np.array_equal(w.numpy(), step + rows / ROWS + np.zeros((1, 64)))
                and np.array_equal(b.numpy(), np.full(7, step * 10.0)))


def node_dir(d: Path) -> Path:
    return d / "nodes" / f"node{RANK // 2}"


def manager(ckpt: cv.Checkpoint, d: Path, keep: int = 2) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, PERSISTENT or d / "persistent", max_to_keep=3,
                                coordinator=coord, storage_options=OPTS,
                                local_directory=node_dir(d), local_max_to_keep=keep,
                                persistent_every=2, format=FORMAT, async_save=ASYNC)


def number(path: str | None) -> int:
    return int(Path(path).name.split("-")[1].split(".")[0]) if path else -1


def steps(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("ckpt-*")) if d.exists() else []


def kill_when_copying(persistent: Path) -> None:
    """Rank 2: SIGKILL this process once the persistent copy of step 2 has begun (its
    temporary directory, or on an object store its claim, is there): before its own
    part is copied, so rank 0 can never commit it."""
    loc = open_location(PERSISTENT, storage_options=OPTS) if PERSISTENT else None

    def begun() -> bool:
        if loc is not None:
            return any(o.key.startswith("ckpt-2.") for o in loc.list())
        return any(persistent.glob(".ckpt-2.*"))

    def watch() -> None:
        while True:
            if begun():
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)

    threading.Thread(target=watch, daemon=True).start()


def main(d: Path, case: str) -> None:
    ckpt, w, b = model(-1.0)
    if case == "kill":
        mgr = manager(ckpt, d / "kill")
        if RANK == 2:
            kill_when_copying(d / "kill" / "persistent")
        set_step(w, b, 1)
        mgr.save()
        set_step(w, b, 2)
        mgr.save()
        mgr.wait_until_finished()
        report(case, survived=True)
        return
    if case == "preempt":
        here = d / "preempt"
        mgr = manager(ckpt, here)
        calls: list[int] = []
        signal.signal(signal.SIGUSR1, lambda *_: calls.append(1))
        mgr.save_on_signal(signal.SIGUSR1)
        for step in (2, 3):
            set_step(w, b, step)
            mgr.save(checkpoint_number=step)
        os.kill(os.getpid(), signal.SIGUSR1)  # as if during that save: only noted
        try:
            reached, error = mgr.reached_preemption(3), None
        except cv.CkptError as exc:
            reached, error = None, f"{type(exc).__name__}: {exc}"
        mgr.wait_until_finished()
        report(case, reached=reached, error=error, calls=len(calls),
               local=steps(node_dir(here)), persistent=steps(here / "persistent"))
        return
    if case == "hold":
        hold = d / "hold"
        mgr = manager(ckpt, hold, keep=1)
        (hold / f"ready-{RANK}").touch()
        deadline = time.monotonic() + 60
        while not (hold / "locked").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for step in range(1, 6):
            set_step(w, b, step)
            mgr.save()
        report("held", local=steps(node_dir(hold)))
        (hold / f"saved-{RANK}").touch()
        mgr.wait_until_finished()
        report(case, local=steps(node_dir(hold)), persistent=steps(hold / "persistent"))
        return
    mgr = manager(ckpt, d)
    if case == "save":
        took = []
        for step in range(1, 6):
            set_step(w, b, step)
            t0 = time.perf_counter()
            mgr.save()
            took.append(time.perf_counter() - t0)
        mgr.wait_until_finished()
        here = node_dir(d)
        report(case, local=steps(here), persistent=steps(d / "persistent"),
               parts=sorted(os.listdir(here / f"ckpt-5.{FORMAT}")),
               listed=[f"{Path(p).parent.name}/{Path(p).name}" for p in mgr.checkpoints],
               took=took)
    elif case in ("restore", "next"):
        path = mgr.restore_or_initialize()
        step = number(path)
        was = exact(w, b, step)
        report("restore", restored=path, exact=was, counter=int(ckpt.save_counter.numpy()))
        if case == "next":
            set_step(w, b, step + 10)
            report(case, restored=path, exact=was, saved=mgr.save(step + 10))
            mgr.wait_until_finished()


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(Path(sys.argv[1]), name)
