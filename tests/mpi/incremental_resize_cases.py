"""Incremental steps across world sizes, on real processes (``mpiexec``).

Usage: ``mpiexec -n N python -m mpi4py incremental_resize_cases.py run WHERE FORMAT FIRST LAST``;
``WHERE`` a directory or an ``s3://`` URL (``$S3_OPTIONS``: its storage options). Each
rank appends one JSON line to ``$RESULT_DIR/rank<r>.jsonl``.

``run``: a job of N processes builds the model (:func:`model`: its boxes depend on N),
restores the latest step if there is one (``restore_or_initialize``) and saves steps
``FIRST..LAST`` with an incremental manager (``max_to_keep=2``), each step changing
what :func:`changes` says: a few rows of ``table`` (``scatter_update``: row deltas),
rows of ``quiet`` held by the first process only (the others' boxes unchanged), the
whole ``head``; ``sparse`` has no rows on the last process. After each save rank 0
loads every committed step (listed or held) in this process (``cv.load``) and compares
it with :func:`expected`, and notes the row deltas of the step (``reader.deltas()``); at
the end every committed step is restored on the N processes. Each rank reports the
mismatches, the deltas, what it logged, and the steps.
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

ROWS = 1200  # table: (ROWS, 1024) float32, 4.9 MB, each box over 1 MiB (a row delta's least)
TABLE_ROWS = {2: (700, 500), 3: (350, 450, 400)}  # uneven: boxes in each process's file
SPARSE_ROWS = {2: (24, 0), 3: (10, 14, 0)}  # the last process holds no row of it


def changes(step: int) -> dict[str, Any]:
    """What step ``step`` changes: rows of ``table``, rows of ``quiet``, ``head``."""
    return {
        "table": sorted({(step * 37) % ROWS, (step * 53 + 11) % ROWS, (step * 101 + 7) % ROWS}),
        "quiet": [step % 20] if step % 2 else [],  # rows of the first process only
    }


def expected(step: int) -> dict[str, np.ndarray]:
    """The full value of every variable at ``step``."""
    table = np.random.default_rng(0).random((ROWS, 1024), dtype=np.float32)
    quiet = np.random.default_rng(1).random((ROWS, 4), dtype=np.float32)
    for t in range(1, step + 1):
        rows = changes(t)
        table[rows["table"]] = float(t)
        quiet[rows["quiet"]] = -float(t)
    return {
        "table": table,
        "quiet": quiet,
        "sparse": np.random.default_rng(2).random((24, 3), dtype=np.float32),
        "head": np.full(50, float(step), np.float32),
    }


def box(key: str, rank: int, size: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``key`` process ``rank`` of ``size`` holds."""
    counts = {"table": TABLE_ROWS.get(size), "sparse": SPARSE_ROWS.get(size)}.get(key)
    n = expected(0)[key].shape[0]
    if counts is None:
        return rank * n // size, (rank + 1) * n // size
    return sum(counts[:rank]), sum(counts[: rank + 1])


def model(rank: int, size: int) -> tuple[Any, dict[str, Any]]:
    import ckptvar as cv

    made: dict[str, Any] = {}
    for key, full in expected(0).items():
        if key == "head":
            made[key] = cv.Variable(full.copy(), name=key)
            continue
        lo, hi = box(key, rank, size)
        made[key] = cv.Variable(full[lo:hi].copy(), name=key,
                                shard=cv.Shard(full_shape=full.shape, offset=(lo, 0)))
    return cv.Checkpoint(**made), made


def apply(made: dict[str, Any], step: int, rank: int, size: int) -> None:
    """Train one step: write what :func:`changes` says, on the rows this process holds."""
    want = expected(step)
    rows = changes(step)
    for key in ("table", "quiet"):
        lo, hi = box(key, rank, size)
        mine = np.array([r for r in rows[key] if lo <= r < hi], dtype=np.int64)
        made[key].scatter_update(mine - lo, want[key][mine])
    made["head"].assign(want["head"])


def holds(made: dict[str, Any], step: int) -> bool:
    want = expected(step)
    for key, var in made.items():
        lo = var.shard.offset[0] if var.shard is not None else 0
        if not np.array_equal(var.numpy(), want[key][lo: lo + var.shape[0]]):
            return False
    return True


def committed(where: str, opts: dict[str, Any] | None) -> list[str]:
    """Every committed step (listed or held), oldest first by number."""
    import ckptvar as cv

    if where.startswith("s3://"):
        from ckptvar.locations import list_committed_steps, open_location

        names = list_committed_steps(open_location(where, storage_options=opts))
    else:
        names = [n for n in os.listdir(where) if n.startswith("ckpt-")
                 and not n.endswith(".partial") and "." in n]
        names = [n for n in names if cv.checkpoint.parse_step_name(n) is not None]
    return sorted(names, key=lambda n: cv.checkpoint.parse_step_name(n).step)


def check_loads(where: str, opts: dict[str, Any] | None) -> dict[str, str]:
    """``cv.load`` of every committed step in this process: what is wrong with each."""
    import ckptvar as cv

    wrong = {}
    for name in committed(where, opts):
        step = cv.checkpoint.parse_step_name(name).step
        try:
            got = cv.load(f"{where}/{name}", storage_options=opts)
        except Exception as exc:  # noqa: BLE001 - reported
            wrong[name] = f"{type(exc).__name__}: {exc}"
            continue
        bad = [k for k, v in expected(step).items() if not np.array_equal(got[k], v)]
        if bad:
            wrong[name] = f"differs in {bad}"
    return wrong


def run(where: str, fmt: str, first: int, last: int) -> dict[str, Any]:
    import ckptvar as cv

    coord = cv.distributed.from_env(timeout=60)
    rank, size = coord.rank, coord.size
    opts = json.loads(os.environ["S3_OPTIONS"]) if where.startswith("s3://") else None
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("ckptvar").addHandler(Keep(logging.INFO))
    logging.getLogger("ckptvar").setLevel(logging.INFO)
    ckpt, made = model(rank, size)
    mgr = cv.CheckpointManager(ckpt, where, max_to_keep=2, format=fmt, incremental=True,
                               coordinator=coord, storage_options=opts)
    restored = mgr.restore_or_initialize()
    fields: dict[str, Any] = {"restored_from": restored and Path(restored).name,
                              "restored_ok": holds(made, first - 1)}
    wrong: dict[str, dict[str, str]] = {}
    deltas: dict[str, list[str]] = {}
    for step in range(first, last + 1):
        apply(made, step, rank, size)
        path = mgr.save(checkpoint_number=step, timeout=60)
        coord.barrier(tag=f"saved-{step}", timeout=60)
        if rank == 0:
            bad = check_loads(where, opts)
            if bad:
                wrong[str(step)] = bad
            with cv.open(path, storage_options=opts) as reader:
                deltas[str(step)] = sorted(reader.deltas())
        coord.barrier(tag=f"loaded-{step}", timeout=120)
    fields["wrong"] = wrong
    fields["deltas"] = deltas
    fields["listed"] = [Path(p).name for p in mgr.checkpoints]
    fields["committed"] = names = committed(where, opts)
    back: dict[str, bool | str] = {}
    for name in names:
        step = cv.checkpoint.parse_step_name(name).step
        try:
            ckpt.restore(f"{where}/{name}", coordinator=coord, timeout=60,
                         storage_options=opts)
            back[name] = holds(made, step)
        except Exception as exc:  # noqa: BLE001 - reported
            back[name] = f"{type(exc).__name__}: {exc}"
    fields["restores"] = back
    fields["said"] = [m for m in said if "writing every value" in m or "whole" in m]
    coord.barrier(tag="done", timeout=60)
    return fields


def main() -> None:
    mode, where, fmt, first, last = sys.argv[1:6]
    assert mode == "run", mode
    rank = int(os.environ.get("PMI_RANK", "0"))
    try:
        fields = run(where, fmt, int(first), int(last))
    except Exception:
        (Path(os.environ["RESULT_DIR"]) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": mode, "rank": rank, "ok": True, **fields}) + "\n")


if __name__ == "__main__":
    main()
