"""The ``scale`` workload: one checkpoint written by 4 processes, restored on 3 and on 1.

Run ``python -m benchmarks.scale [--quick] [--total B] [--repeats N] [--dir D]`` (needs
mpi4py and ``mpiexec``); ``scripts/bench.py`` runs it as its ``scale`` workload (256 MiB;
4 MiB with ``--quick``). Measures, in one run on this machine (durable saves throughout):

- ``save_x4``: 4 processes (``mpiexec -n 4``) saving ``--total`` bytes (1 GiB by default)
  in 8 row-sharded float32 variables into ONE checkpoint, against ``save_x1``: one
  process saving the same bytes as plain variables;
- ``restore_4to3``, ``restore_4to1`` against ``load_x1`` (one process restoring the
  single-process checkpoint);
- the protocol: plan + prepare + vote + commit seconds of a save of 10,000 small
  variables on 4 processes, each save started at a barrier; the first plans from
  scratch, the others reuse the cached plan.

Each byte figure is the time between two barriers (the slowest rank's), repeated
``--repeats`` times inside one ``mpiexec``. The rank-side code is this module run
under ``mpiexec`` (``--rank-job``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

VARS = 8
COLS = 1024
PROTOCOL_VARS = 10_000
#: Bytes of the full run (``scripts/bench.py``): keeps the whole bench under 10 minutes.
BENCH_TOTAL = 256 << 20
QUICK_TOTAL = 4 << 20


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


def rank_job(op: str, d: Path, rows: int, repeats: int = 1) -> None:
    """One rank's part (under mpiexec): time ``op`` between barriers, rank 0 prints JSON."""
    import ckptvar as cv  # noqa: PLC0415 - only the rank jobs load ckptvar

    coord = cv.distributed.from_env()
    result: dict[str, Any] = {"t": []}
    if op in ("save4", "save1"):
        ckpt = cv.Checkpoint(**_variables(cv, rows, coord.rank, coord.size, True))
        for _ in range(repeats):  # ckpt-1, ckpt-2, ...
            result["t"].append(_timed(coord, lambda: ckpt.save(d / op / "ckpt.h5",
                                                              coordinator=coord)))
    elif op in ("restore", "load1"):
        src = d / ("save4" if op == "restore" else "save1") / "ckpt-1.h5"
        ckpt = cv.Checkpoint(**_variables(cv, rows, coord.rank, coord.size, False))
        for _ in range(repeats):
            result["t"].append(_timed(coord, lambda: ckpt.restore(src, coordinator=coord)))
    elif op == "protocol":
        result = _protocol(cv, coord, d / "protocol", max(repeats, 5))
    if coord.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _timed(coord: Any, fn: Any) -> float:
    """Seconds from a barrier to the next one around ``fn()`` (the slowest rank's time)."""
    coord.barrier(tag="start")
    t0 = time.perf_counter()
    fn()
    coord.barrier(tag="end")
    return time.perf_counter() - t0


def _protocol(cv: Any, coord: Any, d: Path, repeats: int) -> dict[str, Any]:
    """The save protocol's own time for 10,000 small sharded variables.

    Each save starts at a barrier and calls the collective write directly with the
    arrays a ``Checkpoint.save`` hands it, so the figure is the protocol's (plan,
    prepare, vote, commit: every lap but the write), not the skew of the ranks'
    earlier work. The first save plans from scratch; the others reuse the plan.
    """
    from ckptvar.checkpoint import _collective  # noqa: PLC0415
    from ckptvar.checkpoint._serialize import gather, host_arrays, metadata  # noqa: PLC0415
    from ckptvar.storage import paused_gc  # noqa: PLC0415

    vs = {f"p{i}": cv.Variable(np.full((4,), i, "float32"), name=f"p{i}",
                               shard=cv.Shard(full_shape=(4 * coord.size,),
                                              offset=(4 * coord.rank,)))
          for i in range(PROTOCOL_VARS)}
    plan = gather(cv.Checkpoint(**vs))
    plan.variables = _collective.rank_variables(plan.variables)
    meta = metadata(plan, save_counter=None, user=None)
    arrays = host_arrays(plan, copy=False)
    laps = []
    for i in range(repeats + 1):
        coord.barrier(tag="start")
        with paused_gc():  # as Checkpoint.save runs it
            _collective.collective_write(os.fspath(d / f"ckpt-{i}.h5"), "h5", arrays, meta,
                                         plan.variables, coord)
        laps.append(dict(_collective.last_timings))
    every = coord.allgather(laps, tag="laps")
    return {"laps": [[rank[i] for rank in every] for i in range(repeats + 1)]}


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def _run(n: int, op: str, d: Path, rows: int, repeats: int = 1) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "benchmarks.scale",
           "--rank-job", op, "--dir", str(d), "--rows", str(rows), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env,
                          check=False, cwd=Path(__file__).resolve().parent.parent)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


#: (row op, processes, rank job) of the byte figures, in the order they run.
RUNS = (("save_x1", 1, "save1"), ("save_x4", 4, "save4"), ("load_x1", 1, "load1"),
        ("restore_4to3", 3, "restore"), ("restore_4to1", 1, "restore"))


def measure(total: int, repeats: int, directory: str | None = None) -> dict[str, Any]:
    """Every figure of the workload: seconds per repeat of each op, and the protocol laps."""
    rows = _rows(total)
    out: dict[str, Any] = {"nbytes": rows * COLS * 4 * VARS}
    with tempfile.TemporaryDirectory(prefix="ckptvar-scale-", dir=directory) as tmp:
        d = Path(tmp)
        for name, n, job in RUNS:
            out[name] = _run(n, job, d, rows, repeats)["t"]
        out["laps"] = _run(4, "protocol", d, rows, repeats)["laps"]
    return out


def overheads(laps: list[list[dict[str, float]]]) -> list[float]:
    """Per save: the slowest rank's protocol seconds (every lap but the write).

    This counts, in a fast writer's vote, its wait for the slowest writer: the ranks'
    write skew (:func:`wall_overheads` leaves it out).
    """
    return [max(sum(v for k, v in lap.items() if k != "write") for lap in save) for save in laps]


def wall_overheads(laps: list[list[dict[str, float]]]) -> list[float]:
    """Per save: what the protocol adds to the save's wall time, i.e. the slowest rank's
    whole save (they start at one barrier) minus the slowest rank's write."""
    return [max(sum(lap.values()) for lap in save) - max(lap["write"] for lap in save)
            for save in laps]


def available() -> str | None:
    """``None`` when mpi4py and ``mpiexec`` are here, else why the workload cannot run."""
    try:
        import mpi4py  # noqa: F401, PLC0415
    except ImportError:
        return "mpi4py is not installed"
    if not (Path(_mpiexec()).exists() or shutil.which(_mpiexec())):
        return "no mpiexec"
    return None


def to_rows(m: dict[str, Any], row: Any) -> list[Any]:
    """``m`` as bench rows (``row(op, times, extra)`` makes one): an op per figure."""
    out = [row(name, m[name], {}) for name, _, _ in RUNS]
    laps = m["laps"]
    steps = {k: [max(lap[k] for lap in save) for save in laps[1:]] for k in laps[0][0]}
    out.append(row("protocol_cached", overheads(laps)[1:], steps))
    out.append(row("protocol_wall", wall_overheads(laps)[1:], {}))
    out.append(row("plan_uncached", [max(lap["plan"] for lap in laps[0])], {}))
    return out


def report(times: dict[str, list[float]], steps: dict[str, list[float]], nbytes: int) -> list[str]:
    """Markdown: the table of medians and ratios, and the protocol's figures."""
    med = {name: statistics.median(times[name]) for name, _, _ in RUNS}
    lines = [f"{nbytes / 2**20:.0f} MiB in {VARS} row-sharded float32 variables, "
             f"{os.cpu_count()} CPUs; median of {len(times['save_x1'])} (durable saves).", "",
             "| op | seconds (median) | all | x single process |", "|---|---|---|---|"]
    for name, _, _ in RUNS:
        ref = med["save_x1"] if name.startswith("save") else med["load_x1"]
        lines.append(f"| {name} | {med[name]:.3f} | "
                     + " ".join(f"{t:.3f}" for t in times[name]) + f" | {med[name] / ref:.2f}x |")
    cached = times["protocol_cached"]
    wall = times.get("protocol_wall") or []
    lines += ["", f"Protocol (plan + prepare + vote + commit), {PROTOCOL_VARS:,} variables on 4 "
              f"ranks, cached plan, slowest rank: median {statistics.median(cached) * 1e3:.1f} ms "
              f"(all: {', '.join(f'{c * 1e3:.0f}' for c in cached)} ms); per step (median of the "
              "slowest rank): " + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms"
                                            for k, v in steps.items())
              + f". Uncached plan (first save): {times['plan_uncached'][0] * 1e3:.0f} ms."
              + (f" What the protocol adds to a save's wall time (the save minus the slowest "
                 f"rank's write, so without the ranks' write skew): median "
                 f"{statistics.median(wall) * 1e3:.1f} ms (all: "
                 f"{', '.join(f'{c * 1e3:.0f}' for c in wall)} ms)." if wall else ""), ""]
    return lines


def tables(rows: list[Any]) -> list[str]:
    """The ``scale`` section of ``scripts/bench.py``'s report (nothing without its rows)."""
    mine = {r.op: r for r in rows if r.workload == "scale" and r.times}
    if any(name not in mine for name, _, _ in RUNS) or "protocol_cached" not in mine:
        return []
    times = {op: r.times for op, r in mine.items()}
    return ["## Scale: one checkpoint from 4 processes, restored on 3 and on 1", "",
            *report(times, mine["protocol_cached"].extra, mine["save_x1"].nbytes)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--total", type=int, default=1 << 30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--rank-job", default=None)
    p.add_argument("--rows", type=int, default=0)
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, Path(args.dir), args.rows, args.repeats)
        return 0
    m = measure(QUICK_TOTAL if args.quick else args.total, args.repeats, args.dir)
    rows = to_rows(m, lambda op, times, extra: (op, times, extra))
    steps = next(extra for op, _, extra in rows if op == "protocol_cached")
    print("\n".join(report({op: t for op, t, _ in rows}, steps, m["nbytes"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
