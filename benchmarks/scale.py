"""The ``scale`` workload: one checkpoint written by 4 processes, restored on 3 and on 1.

Run ``python -m benchmarks.scale [--quick] [--dir D]`` (needs mpi4py and ``mpiexec``).
Measures, in one run on this machine (durable saves throughout):

- ``save x4``: 4 processes (``mpiexec -n 4``) saving ``--total`` bytes (1 GiB; 4 MiB
  with ``--quick``) in 8 row-sharded float32 variables into ONE checkpoint, against
  ``save x1``: one process saving the same bytes as plain variables;
- ``restore 4->3``, ``restore 4->1`` against ``load x1`` (one process restoring the
  single-process checkpoint);
- ``protocol``: plan + prepare + vote + commit seconds of a save of 10,000 small
  variables on 4 processes with the plan cached (the second of two saves).

Each figure is the slowest rank's time between two barriers. Prints a table and the
ratios. The rank-side code is this module run under ``mpiexec`` (``--rank-job``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

VARS = 8
COLS = 1024


def _rows(total: int) -> int:
    return max(4 * 12, total // (VARS * COLS * 4))


def _box(rows: int, rank: int, size: int) -> tuple[int, int]:
    return rank * rows // size, (rank + 1) * rows // size


def _variables(cv: Any, rows: int, rank: int, size: int, fill: bool) -> dict[str, Any]:
    lo, hi = _box(rows, rank, size)
    out = {}
    for i in range(VARS):
        value = (np.full((hi - lo, COLS), i, "float32") if fill
                 else np.zeros((hi - lo, COLS), "float32"))
        if size == 1:
            out[f"v{i}"] = cv.Variable(value, name=f"v{i}")
        else:
            out[f"v{i}"] = cv.Variable(value, name=f"v{i}",
                                       shard=cv.Shard(full_shape=(rows, COLS), offset=(lo, 0)))
    return out


def rank_job(op: str, d: Path, rows: int) -> None:
    """One rank's part (under mpiexec): time ``op`` between barriers, rank 0 prints JSON."""
    import ckptvar as cv  # noqa: PLC0415 - only the rank jobs load ckptvar
    from ckptvar.checkpoint import _collective  # noqa: PLC0415

    coord = cv.distributed.from_env()
    result: dict[str, Any] = {}
    if op in ("save4", "save1"):
        ckpt = cv.Checkpoint(**_variables(cv, rows, coord.rank, coord.size, True))
        coord.barrier(tag="start")
        t0 = time.perf_counter()
        ckpt.save(d / op / "ckpt.h5", coordinator=coord)
        coord.barrier(tag="end")
        result["t"] = time.perf_counter() - t0
    elif op in ("restore", "load1"):
        src = d / ("save4" if op == "restore" else "save1") / "ckpt-1.h5"
        ckpt = cv.Checkpoint(**_variables(cv, rows, coord.rank, coord.size, False))
        coord.barrier(tag="start")
        t0 = time.perf_counter()
        ckpt.restore(src, coordinator=coord)
        coord.barrier(tag="end")
        result["t"] = time.perf_counter() - t0
    elif op == "protocol":
        vs = {f"p{i}": cv.Variable(np.full((4,), i, "float32"), name=f"p{i}",
                                   shard=cv.Shard(full_shape=(4 * coord.size,),
                                                  offset=(4 * coord.rank,)))
              for i in range(10_000)}
        ckpt = cv.Checkpoint(**vs)
        laps = []
        for _ in range(2):
            coord.barrier(tag="start")
            ckpt.save(d / "protocol" / "ckpt.h5", coordinator=coord)
            laps.append(dict(_collective.last_timings))
        result["laps"] = coord.allgather(laps[-1], tag="laps")
    if coord.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def _run(n: int, op: str, d: Path, rows: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "benchmarks.scale",
           "--rank-job", op, "--dir", str(d), "--rows", str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env,
                          check=False, cwd=Path(__file__).resolve().parent.parent)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--total", type=int, default=1 << 30)
    p.add_argument("--dir", default=None)
    p.add_argument("--rank-job", default=None)
    p.add_argument("--rows", type=int, default=0)
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, Path(args.dir), args.rows)
        return 0
    total = 4 << 20 if args.quick else args.total
    rows = _rows(total)
    with tempfile.TemporaryDirectory(prefix="ckptvar-scale-", dir=args.dir) as tmp:
        d = Path(tmp)
        t = {
            "save x1": _run(1, "save1", d, rows)["t"],
            "save x4": _run(4, "save4", d, rows)["t"],
            "load x1": _run(1, "load1", d, rows)["t"],
            "restore 4->3": _run(3, "restore", d, rows)["t"],
            "restore 4->1": _run(1, "restore", d, rows)["t"],
        }
        laps = _run(4, "protocol", d, rows)["laps"]
    nbytes = rows * COLS * 4 * VARS
    print(f"scale workload: {nbytes / 2**20:.0f} MiB in {VARS} variables "
          f"({os.cpu_count()} CPUs)")
    print("| op | seconds | ratio |")
    print("|---|---|---|")
    for op, sec in t.items():
        ref = t["save x1"] if op.startswith("save") else t["load x1"]
        print(f"| {op} | {sec:.3f} | {sec / ref:.2f}x |")
    overhead = max(sum(v for k, v in lap.items() if k != "write") for lap in laps)
    print(f"protocol overhead (plan+prepare+vote+commit, 10,000 variables, 4 ranks, cached "
          f"plan, slowest rank): {overhead * 1e3:.1f} ms; per step on the slowest rank: "
          + ", ".join(f"{k} {max(lap[k] for lap in laps) * 1e3:.1f} ms" for k in laps[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
