"""The restore of a row-delta step against a full step of the same table, in turn.

Run ``python -m benchmarks.row_delta_restore [--dir D] [--mib 64,256] [--shares 1,3,6]
[--zipf] [--rounds 15] [--tree NAME=PATH ...] [--json]``.

For each format (h5, zarr), table size and share: a float32 table of 64-wide rows saved
whole by an incremental manager, then 10 steps each touching a tenth of the share's rows
(uniform ids; ``--zipf``: also the ``embedding-1%``/``-10%`` draws of
:mod:`benchmarks.incremental`), and the same table saved by a full manager. Then, in
turn, ``rounds`` times: a restore of the 10th row-delta step, of the full step and of
the step that wrote the delta's base whole (the same files its base is read from, so
the ratio against it is the delta's own cost; the one against the full step also
carries how the page cache holds the two sets of files). Each restore is verified
(the default) and timed in wall and process CPU time; the 10th step's is checked
bit-exact.

With ``--tree NAME=PATH`` (twice or more), the steps are written once and each round
runs one process per tree in turn with ``PATH`` first on ``PYTHONPATH`` (an A/B
against another checkout, interleaved); the rows then give medians per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

ROW = 64  # floats per row
STEPS = 10


def _ids(rng: np.random.Generator, rows: int, n: int, zipf: bool) -> np.ndarray:
    if zipf:  # as benchmarks.incremental draws them (a row touched twice counts once)
        return np.unique((rng.zipf(1.2, n * 2) - 1) % rows)[:n]
    return np.sort(rng.choice(rows, n, replace=False))


def build(directory: Path, fmt: str, mib: int, share: float, zipf: bool) -> dict[str, Any]:
    """The steps of one case: ``{"inc", "full", "base", "sum", "delta", "mib"}``."""
    rng = np.random.default_rng(0)
    rows = (mib << 20) // (ROW * 4)
    name = f"{fmt}-{mib}-{'zipf' if zipf else ''}{share:g}"
    with cv.Graph().as_default():
        table = cv.Variable(rng.random((rows, ROW), dtype=np.float32), name="table")
        ckpt = cv.Checkpoint(table=table)
        inc = cv.CheckpointManager(ckpt, directory / f"{name}-inc", max_to_keep=STEPS + 1,
                                   format=fmt, incremental=True)
        inc.save()
        per = max(1, int(rows * share / 100 / (1 if zipf else STEPS)))
        for _ in range(STEPS):
            ids = _ids(rng, rows, per, zipf)
            table.scatter_update(ids, table[ids] + 1.0)
            inc.save()
        inc.wait_until_finished()
        full = cv.CheckpointManager(ckpt, directory / f"{name}-full", max_to_keep=1,
                                    format=fmt)
        full.save()
        full.wait_until_finished()
        latest = inc.latest_checkpoint or ""
        with cv.open(latest) as reader:
            assert isinstance(reader, cv.storage.SupportsDeltas)
            delta = reader.deltas().get("table")
        return {"inc": latest, "full": full.latest_checkpoint,
                "base": str(Path(latest).parent / delta["base"]) if delta else latest,
                "sum": float(table.numpy().sum(dtype=np.float64)), "delta": delta,
                "mib": mib}


def time_cases(cases: dict[str, dict[str, Any]], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds of each restore, the three steps of a case in turn."""
    got: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for name, c in cases.items():
            rows = (c["mib"] << 20) // (ROW * 4)
            out = got.setdefault(name, {})
            with cv.Graph().as_default():
                table = cv.Variable(np.zeros((rows, ROW), np.float32), name="table")
                ckpt = cv.Checkpoint(table=table)
                for mode in ("inc", "full", "base"):
                    c0, t0 = time.process_time(), time.perf_counter()
                    ckpt.restore(c[mode])
                    out.setdefault(mode, []).append(time.perf_counter() - t0)
                    out.setdefault(f"{mode}_cpu", []).append(time.process_time() - c0)
                    if mode == "inc":
                        assert float(table.numpy().sum(dtype=np.float64)) == c["sum"]
    return got


def _rows(times: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    med = statistics.median
    lines = ["| case | tree | restore ms: row delta / full / base step | ÷ full: median, "
             "fastest, CPU | ÷ base step: median, CPU |", "|---|---|---|---|---|"]
    for tree, cases in times.items():
        for name, t in cases.items():
            lines.append(
                f"| {name}% | {tree} | {med(t['inc']) * 1e3:.1f} / {med(t['full']) * 1e3:.1f}"
                f" / {med(t['base']) * 1e3:.1f} | {med(t['inc']) / med(t['full']):.2f}, "
                f"{min(t['inc']) / min(t['full']):.2f}, "
                f"{med(t['inc_cpu']) / med(t['full_cpu']):.2f} | "
                f"{med(t['inc']) / med(t['base']):.2f}, "
                f"{med(t['inc_cpu']) / med(t['base_cpu']):.2f} |")
    return lines


def _build_all(args: argparse.Namespace, directory: Path) -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    for fmt in ("h5", "zarr"):
        for mib in (int(m) for m in args.mib.split(",")):
            for share in (float(s) for s in args.shares.split(",")):
                cases[f"{fmt}-{mib}-{share:g}"] = build(directory, fmt, mib, share, False)
        if args.zipf:
            for share in (1.0, 10.0):
                cases[f"{fmt}-64-zipf{share:g}"] = build(directory, fmt, 64, share, True)
    return cases


def _interleaved(args: argparse.Namespace, cases: dict[str, dict[str, Any]], directory: Path
                 ) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Rounds of one process per tree in turn, about five per tree."""
    listing = directory / "cases.json"
    listing.write_text(json.dumps(cases))
    trees = dict(t.split("=", 1) for t in args.tree)
    per = max(1, args.rounds // 5)
    times: dict[str, dict[str, dict[str, list[float]]]] = {}
    for _ in range(-(-args.rounds // per)):
        for tree, path in trees.items():
            done = subprocess.run(
                [sys.executable, __file__, "--time-only", str(listing),  # by path: ckptvar
                 "--rounds", str(per)],  # from PYTHONPATH, not the working directory
                env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                check=True, timeout=600)
            for name, t in json.loads(done.stdout).items():
                into = times.setdefault(tree, {}).setdefault(name, {})
                for k, v in t.items():
                    into.setdefault(k, []).extend(v)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--mib", default="64,256")
    parser.add_argument("--shares", default="1,3,6", help="percent of rows in the patches")
    parser.add_argument("--zipf", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--time-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.time_only is not None:  # one tree's round, asked by the A/B below
        cases = json.loads(args.time_only.read_text())
        json.dump(time_cases(cases, args.rounds), sys.stdout)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        directory = Path(scratch)
        cases = _build_all(args, directory)
        os.sync()
        times = (_interleaved(args, cases, directory) if args.tree
                 else {"this": time_cases(cases, args.rounds)})
    if args.json:
        json.dump({"cases": {k: v["delta"] for k, v in cases.items()}, "times": times},
                  sys.stdout)
    else:
        print("\n".join(_rows(times)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
