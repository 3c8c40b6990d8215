"""The first incremental save after a restart: the bytes it writes, and its time.

A job trains a 64 MiB ``cv.Variable`` table (262,144 rows of 64 float32) with an
incremental manager: step 1 whole, step 2 a row delta of 1% of its rows. It ends; a new
process (a new checkpoint over a new variable) restores the latest step with
``restore_or_initialize()``, touches 1% of the rows with ``scatter_update`` (Zipf ids)
and saves: this step's bytes on disk (hard-linked files not counted) and its save time
are printed, per format. ``--restore-first``: the new process restores in TensorFlow's
order instead, ``ckpt.restore(cv.latest_checkpoint(DIR))`` before its manager is
built. Every process is a real one, started with the ``PYTHONPATH`` given (``--tree``,
several to compare trees in one run, interleaved).

    python -m benchmarks.restart_bytes --tree /path/to/old --tree /path/to/new [--restore-first]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS, WIDTH = 262_144, 64  # 64 MiB of float32
TOUCH = ROWS // 100  # 1% of the rows


def _model() -> tuple[object, object]:
    import numpy as np  # noqa: PLC0415 - in the child processes only

    import ckptvar as cv  # noqa: PLC0415

    table = cv.Variable(np.random.default_rng(0).random((ROWS, WIDTH), dtype=np.float32),
                        name="table")
    return cv.Checkpoint(table=table), table


def _touch(table: object, seed: int) -> None:
    import numpy as np  # noqa: PLC0415

    ids = np.unique(np.random.default_rng(seed).zipf(1.1, 4 * TOUCH) % ROWS)
    rows = np.unique(np.random.default_rng(7).permutation(ROWS)[ids])[:TOUCH]
    table.scatter_update(rows, np.full((rows.size, WIDTH), seed, np.float32))  # type: ignore[attr-defined]


def _added(step: Path) -> int:
    if step.is_file():
        return step.stat().st_size
    return sum(p.stat().st_size for p in step.rglob("*")
               if p.is_file() and p.stat().st_nlink == 1)


def _child(role: str, directory: str, fmt: str) -> None:
    import ckptvar as cv  # noqa: PLC0415

    ckpt, table = _model()
    restored = None
    if role == "restart-first":  # TensorFlow's order: the restore, then the manager
        restored = cv.latest_checkpoint(directory)
        ckpt.restore(restored).assert_consumed()  # type: ignore[attr-defined]
    manager = cv.CheckpointManager(ckpt, directory, format=fmt, incremental=True)
    if role == "first":
        manager.save()
        _touch(table, 1)
        manager.save()
        return
    if restored is None:
        restored = manager.restore_or_initialize()
    _touch(table, 2)
    t0 = time.perf_counter()
    step = Path(manager.save())
    took = time.perf_counter() - t0
    with cv.open(step) as reader:
        deltas = reader.deltas()
    print(json.dumps({"restored": Path(str(restored)).name, "step": step.name,
                      "added": _added(step), "save_s": round(took, 4),
                      "delta": deltas.get("table")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="a source tree to run (its PYTHONPATH); default: this one")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--restore-first", action="store_true",
                        help="restore before the manager is built (TensorFlow's order)")
    parser.add_argument("--child", nargs=3, metavar=("ROLE", "DIR", "FORMAT"))
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    trees = args.tree or [str(Path(__file__).resolve().parent.parent)]
    for _ in range(args.repeat):
        for fmt in ("h5", "zarr"):
            for tree in trees:
                env = {**os.environ, "PYTHONPATH": tree}
                with tempfile.TemporaryDirectory() as d:
                    run = [sys.executable, __file__, "--child"]  # ckptvar from the tree
                    subprocess.run([*run, "first", d, fmt], env=env, check=True,
                                   timeout=600)
                    role = "restart-first" if args.restore_first else "restart"
                    out = subprocess.run([*run, role, d, fmt], env=env, check=True,
                                         timeout=600, capture_output=True, text=True)
                print(json.dumps({"tree": tree, "format": fmt, "order": role,
                                  **json.loads(out.stdout.strip().splitlines()[-1])}),
                      flush=True)


if __name__ == "__main__":
    main()
