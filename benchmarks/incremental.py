"""The ``incremental`` workload: what ``CheckpointManager(incremental=True)`` writes per step.

Run ``python -m benchmarks.incremental [--quick] [--mib N] [--steps S] [--dir D] [--json]``.
In one run, for each format (h5, zarr) and each workload, it saves ``S`` steps with a
full manager and with an incremental one (durable saves, warm page cache) and gives per
step (medians): the bytes the process wrote (``wchar`` of ``/proc/self/io``: every
``write``/``pwrite``, the state file included), the bytes that changed, the save time,
the time to write only the changed bytes raw (one file, ``pwrite`` + ``fsync``: the
floor), and the time ``cv.save`` takes to write only the changed values ("changed
alone": the same bytes as a ckptvar checkpoint, with its fixed cost). Then a step with nothing changed, against a save of a checkpoint holding only
the small values (the record's cost), and the restore of the last incremental step
against the last full one (median of 7, verified).

Workloads (``N`` MiB of float32 state, 64 by default, 8 with ``--quick``):

- ``frozen``: 20 tensors, 18 frozen (90%), 2 trained (``assign_add`` each step);
- ``embedding-1%`` / ``embedding-10%``: one table of 64-wide rows, 1% or 10% of the
  rows touched per step (Zipf-distributed row ids; a row touched twice counts once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

ROW = 64  # floats per embedding row


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class Workload:
    """A model and the change one training step makes to it."""

    def __init__(self, name: str, nbytes: int, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        n = nbytes // 4
        if name == "frozen":
            per = n // 20
            self.vars = [cv.Variable(self.rng.random(per, dtype=np.float32), name=f"t{i}",
                                     trainable=i >= 18) for i in range(20)]
            self.fraction = 0.0
        else:
            rows = n // ROW
            self.vars = [cv.Variable(self.rng.random((rows, ROW), dtype=np.float32),
                                     name="table")]
            self.fraction = float(name.split("-")[1].rstrip("%")) / 100
        self.ckpt = cv.Checkpoint(**{v.name.split(":")[0]: v for v in self.vars})

    def step(self) -> list[np.ndarray]:
        """One training step; returns the changed bytes (what a perfect writer writes)."""
        if self.name == "frozen":
            for v in self.vars[18:]:
                v.assign_add(1.0)
            return [v.numpy() for v in self.vars[18:]]
        table = self.vars[0]
        rows = table.shape[0]
        ids = np.unique((self.rng.zipf(1.2, int(rows * self.fraction) * 2) - 1) % rows)
        ids = ids[: max(1, int(rows * self.fraction))]
        table[ids] = table[ids] + 1.0  # one scatter: a slice assignment
        return [table.numpy()[ids]]


def _raw_write(path: Path, changed: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        for a in changed:
            os.pwrite(fd, memoryview(np.ascontiguousarray(a)).cast("B"), pos)
            pos += a.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _steps(work: Workload, manager: cv.CheckpointManager, steps: int, raw: Path
           ) -> dict[str, Any]:
    manager.save()  # the first step is a full one either way
    written, changed, times, raws, alone = [], [], [], [], []
    for _ in range(steps):
        delta = work.step()
        changed.append(sum(a.nbytes for a in delta))
        raws.append(_raw_write(raw, delta))
        t0 = time.perf_counter()
        cv.save(raw.with_suffix(f".{manager.format}"),
                {f"v{i}": a for i, a in enumerate(delta)})
        alone.append(time.perf_counter() - t0)
        w0, t0 = _wchar(), time.perf_counter()
        manager.save()
        times.append(time.perf_counter() - t0)
        written.append(_wchar() - w0)
    return {"written": statistics.median(written), "changed": statistics.median(changed),
            "time": statistics.median(times), "raw": statistics.median(raws),
            "changed_alone": statistics.median(alone)}


def _no_change(manager: cv.CheckpointManager, record_only: Path) -> tuple[float, float]:
    """Median time of a step with nothing changed, and of saving a checkpoint that holds
    only the small values (its record and packed blob: the floor of any step)."""
    small = cv.Checkpoint(x=cv.Variable(np.zeros(3), name="x"))
    steps, floor = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        manager.save()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        small.write(record_only)
        floor.append(time.perf_counter() - t0)
    return statistics.median(steps), statistics.median(floor)


def _restore_times(targets: dict[str, tuple[cv.Checkpoint, str]]) -> dict[str, float]:
    """Median restore time of each mode's latest step, the modes taken in turn (the order
    effects of a shared machine fall on both alike)."""
    times: dict[str, list[float]] = {mode: [] for mode in targets}
    for _ in range(7):
        for mode, (ckpt, path) in targets.items():
            t0 = time.perf_counter()
            ckpt.restore(path)
            times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(ts) for mode, ts in times.items()}


def run(directory: Path, nbytes: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for fmt in ("h5", "zarr"):
        for name in ("frozen", "embedding-1%", "embedding-10%"):
            row: dict[str, Any] = {"format": fmt, "workload": name, "state": nbytes}
            targets: dict[str, tuple[cv.Checkpoint, str]] = {}
            for mode in ("full", "incremental"):
                with cv.Graph().as_default():
                    work = Workload(name, nbytes)
                    d = directory / f"{fmt}-{name}-{mode}"
                    manager = cv.CheckpointManager(work.ckpt, d, max_to_keep=3, format=fmt,
                                                   incremental=mode == "incremental")
                    row[mode] = _steps(work, manager, steps, directory / "raw.bin")
                    if mode == "incremental":
                        row["no_change"], row["record_only"] = _no_change(
                            manager, directory / f"record-only.{fmt}")
                    targets[mode] = (work.ckpt, manager.latest_checkpoint or "")
            restore = _restore_times(targets)
            for mode in targets:
                row[f"restore_{mode}"] = restore[mode]
                shutil.rmtree(directory / f"{fmt}-{name}-{mode}")
            inc = row["incremental"]
            row["written_over_changed"] = inc["written"] / max(inc["changed"], 1)
            row["time_over_raw"] = inc["time"] / max(inc["raw"], 1e-9)
            row["restore_ratio"] = row["restore_incremental"] / row["restore_full"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB of state, 3 steps")
    parser.add_argument("--mib", type=int, default=64, help="MiB of state per workload")
    parser.add_argument("--steps", type=int, default=10, help="steps after the first")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    nbytes, steps = (8 << 20, 3) if args.quick else (args.mib << 20, args.steps)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = run(Path(d), nbytes, steps)
    if args.json:
        print(json.dumps(rows))
        return 0
    mib = 2.0**20
    print(f"incremental vs full, {nbytes / mib:.0f} MiB of state, median of {steps} steps")
    print("| format | workload | full: MiB written, ms | incremental: MiB written, ms | "
          "changed MiB | raw ms | changed alone ms | written/changed | time/raw | "
          "no change ms (record-only) | restore incr/full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, i = r["full"], r["incremental"]
        print(f"| {r['format']} | {r['workload']} | {f['written'] / mib:.1f}, "
              f"{f['time'] * 1e3:.0f} | {i['written'] / mib:.1f}, {i['time'] * 1e3:.0f} | "
              f"{i['changed'] / mib:.2f} | {i['raw'] * 1e3:.1f} | "
              f"{i['changed_alone'] * 1e3:.1f} | "
              f"{r['written_over_changed']:.2f} | {r['time_over_raw']:.2f} | "
              f"{r['no_change'] * 1e3:.1f} ({r['record_only'] * 1e3:.1f}) | "
              f"{r['restore_ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
