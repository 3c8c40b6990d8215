"""One job of the restart crash harness (tests/test_crash.py), on 1 or N processes.

Usage: ``crash_job.py WHERE FMT JOB`` (plain ``python`` for one process, or under
``mpiexec -n N python -m mpi4py``); ``$RESULT_DIR``: where each rank appends its
events; ``$S3_OPTIONS``: storage options (JSON) when WHERE is a URL; ``$LOCAL_TIER``: a
local directory, for a tiered manager (every step there, every one persisted to WHERE
in the background); with ``{node}`` in it, per-node local disks: ranks ``2k`` and
``2k+1`` are node ``k`` (``{node}`` is ``k``), each node seeing only its own directory.
``$INCREMENTAL=1``: an incremental manager, with a value that never changes (every step
refers to, or links, the first one's bytes).

The job opens a ``CheckpointManager`` on WHERE as a restarted job does, restores
the latest committed step and checks it bit-exact (every value is a function of
its step), reports what it restored, saves the next step, checks that nothing a
dead save left is there any more (rank 0, after every rank's save), reports that,
then saves step after step until it is killed, reporting each step once saved.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.locations import (
    STAGING_PREFIX,
    is_partial,
    list_committed_steps,
    open_location,
    parse_staging_name,
    process_alive,
    read_commit,
)

where, fmt, job = sys.argv[1], sys.argv[2], sys.argv[3]
coord = cv.distributed.from_env(timeout=60)
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"job{job}-rank{RANK}.jsonl"
opts = json.loads(os.environ.get("S3_OPTIONS") or "null")
tier = (os.environ.get("LOCAL_TIER") or "").format(node=RANK // 2) or None
incremental = os.environ.get("INCREMENTAL") == "1"
ROWS, COLS = 48, 2000
LOCAL_NAMES = {"checkpoint_state.json", ".checkpoint_state.lock", ".checkpoint_saving.lock"}


def report(event: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": event, "rank": RANK, "pid": os.getpid(), **fields}) + "\n")
        f.flush()


def rows() -> tuple[int, int]:
    return RANK * ROWS // SIZE, (RANK + 1) * ROWS // SIZE


def values(step: int) -> dict[str, np.ndarray]:
    lo, hi = rows()
    grid = np.arange(ROWS * COLS, dtype=np.float64).reshape(ROWS, COLS)
    return {"w": (grid * 1e-3 + step)[lo:hi], "b": np.full(7, step, np.float32),
            "step": np.array(step, np.int64)}


def leftovers() -> list[str]:  # noqa: C901, PLR0912 - each place a save leaves things
    """What is at WHERE (and in TMPDIR) that no committed step owns (rank 0; a node's
    first rank: its local tier)."""
    found = []
    for entry in os.scandir(tempfile.gettempdir()):
        if entry.name.startswith(STAGING_PREFIX):
            owner = parse_staging_name(entry.name)
            if owner is None or not process_alive(owner[1]):
                found.append(entry.path)
    if tier is not None:  # the first step's persistent copy and its clean-up are done
        listed = {Path(p).name for p in mgr.checkpoints}
        for name in os.listdir(tier):
            if is_partial(name) or (name not in LOCAL_NAMES and name not in listed):
                found.append(f"{tier}/{name}")
    if RANK != 0:  # a node's first rank: its local tier only
        return found
    if "://" not in where:
        listed = {Path(p).name for p in mgr.checkpoints} | held()
        for name in os.listdir(where):
            if is_partial(name) or (name not in LOCAL_NAMES and name not in listed):
                found.append(name)
        return found
    loc = open_location(where, storage_options=opts)
    owned: set[str] = set()
    steps = list_committed_steps(loc)
    for step in steps:
        record = read_commit(loc, step)
        assert record is not None
        owned |= {step + ".commit", record.data, record.index}
    for obj in loc.list():
        if obj.key in owned or any(obj.key.startswith(s + "/") for s in steps):
            continue
        found.append(obj.key)
    return found


def held() -> set[str]:
    """The pruned steps kept because kept incremental steps refer to their bytes."""
    state = Path(where) / "checkpoint_state.json"
    if not state.exists():
        return set()
    section = json.loads(state.read_text())["sections"].get("ckpt", {})
    return {e["path"] for e in section.get("pending_delete", []) if e.get("held_for")}


w = cv.Variable(np.zeros((rows()[1] - rows()[0], COLS)), name="w",
                shard=cv.Shard(full_shape=(ROWS, COLS), offset=(rows()[0], 0)))
b = cv.Variable(np.zeros(7, np.float32), name="b")
step = cv.Variable(0, dtype="int64", name="step")
ckpt = cv.Checkpoint(w=w, b=b, step=step)
extra: dict[str, object] = {}
if tier:
    extra.update(local_directory=tier, local_max_to_keep=2)
if incremental:
    frozen = cv.Variable(np.arange(rows()[0] * COLS, rows()[1] * COLS, dtype=np.float32)
                         .reshape(-1, COLS), name="frozen",
                         shard=cv.Shard(full_shape=(ROWS, COLS), offset=(rows()[0], 0)))
    ckpt.frozen = frozen
    extra.update(incremental=True)
mgr = cv.CheckpointManager(ckpt, where, max_to_keep=3, format=fmt, storage_options=opts,
                           coordinator=coord if SIZE > 1 else None, **extra)
restored = mgr.restore_or_initialize()
s = int(step.numpy())
want = values(s)
exact = restored is None or all(
    np.array_equal(v.numpy(), want[k]) for k, v in (("w", w), ("b", b), ("step", step)))
report("restored", path=restored, step=s, exact=bool(exact), skipped=mgr.skipped,
       listed=[Path(p).name for p in mgr.checkpoints])
first = True
while True:
    s += 1
    for k, var in (("w", w), ("b", b), ("step", step)):
        var.assign(values(s)[k])
    path = mgr.save()
    if first:
        first = False
        coord.barrier(tag="first", timeout=60)
        # every process (with tiers a collective): the copies committed, and the
        # pruned steps' bytes freed (in the background: in flight, not left over)
        mgr.wait_until_finished()
        # rank 0 checks WHERE; the first rank of each node its node's local tier
        report("first", step=s, path=path,
               leftovers=leftovers() if RANK == 0 or (tier and RANK % 2 == 0) else [])
    report("saved", step=s)
