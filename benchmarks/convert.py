"""The ``convert`` workload: ``ckpt convert`` streams within a bounded window of memory.

Run ``python -m benchmarks.convert [--quick] [--dir D] [--json]``. In one run on this
machine it writes a source checkpoint of ``VALUES`` float32 values (1 GiB in all; 16 MiB
with ``--quick``) and converts it to ``.safetensors`` and to ``.h5`` twice each:

- ``streamed``: ``--window`` of 1/8 of the total, so the conversion must stream;
- ``in memory``: a window larger than the total (the whole output built in memory);

and, as the floor, ``cp`` of the source file (the raw disk limit for the same bytes),
and, as the goal, ``cv.save(dst, cv.load(src))`` in a fresh process for each output
format (everything in memory at once): a conversion takes at most 1.1x that.
Each row gives the wall time, its ratio to ``cp`` and to ``save(load())`` of the same
output format, the peak anonymous memory of the converting process and its peak RSS
(sampled from ``/proc``; RSS also counts the mapped file pages it touches), beside the
window. ``--repeat N`` runs every row N times, interleaved, and keeps the fastest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

VALUES = 8


def _measure(cmd: list[str]) -> dict[str, float]:
    """Wall time and peak anonymous memory of ``cmd`` (sampled from /proc every 5 ms).

    Anonymous memory is what a conversion holds itself; pages of its memory-mapped
    scratch file are page cache (they count in RSS, and the kernel can drop them).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_kib = peak_rss_kib = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak_kib = max(peak_kib, int(line.split()[1]))
                elif line.startswith("VmRSS:"):
                    peak_rss_kib = max(peak_rss_kib, int(line.split()[1]))
        except OSError:  # it just ended
            pass
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed ({proc.returncode}): {err}")
    return {"wall": wall, "peak_mib": peak_kib / 1024, "rss_mib": peak_rss_kib / 1024}


_SAVE_LOAD = "import sys, ckptvar as cv; cv.save(sys.argv[2], cv.load(sys.argv[1]))"


def run(directory: Path, total: int, repeat: int = 1) -> list[dict[str, Any]]:
    """Build the source, run every row ``repeat`` times (interleaved); the fastest of each."""
    rows_per = total // (VALUES * 1024 * 4)
    src = directory / "src.h5"
    cv.save(src, {f"v{i}": np.full((rows_per, 1024), i, np.float32) for i in range(VALUES)})
    nbytes = src.stat().st_size
    window = max(total // 8, 1 << 20)
    ckpt = [sys.executable, "-m", "ckptvar", "convert", "--quiet", "--force"]
    jobs: dict[str, tuple[list[str], Path, float | None]] = {
        "cp (raw)": (["cp", str(src), str(directory / "copy.bin")], directory / "copy.bin", None)
    }
    for suffix in (".safetensors", ".h5"):
        dst = directory / f"out{suffix}"
        jobs[f"{suffix} save(load())"] = (
            [sys.executable, "-c", _SAVE_LOAD, str(src), str(dst)], dst, None)
        for name, win in (("streamed", window), ("in memory", 2 * total)):
            jobs[f"{suffix} {name}"] = ([*ckpt, str(src), str(dst), "--window", str(win)], dst,
                                        win / 2**20)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeat):
        for row, (cmd, out, win) in jobs.items():
            m = _measure(cmd)
            out.unlink()
            if row not in best or m["wall"] < best[row]["wall"]:
                best[row] = {"row": row, **m, "window_mib": win}
    results = list(best.values())
    raw = best["cp (raw)"]["wall"]
    for r in results:
        r["x_raw"] = r["wall"] / raw
        suffix = r["row"].split()[0]
        goal = best.get(f"{suffix} save(load())")
        r["x_save_load"] = r["wall"] / goal["wall"] if goal else None
    results.insert(0, {"row": "source", "bytes": nbytes})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB instead of 1 GiB")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--size", type=int, default=None, metavar="MIB",
                        help="the source's size in MiB (default 1024; 16 with --quick)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each row N times, interleaved, and keep the fastest")
    args = parser.parse_args(argv)
    total = (16 << 20) if args.quick else (1 << 30)
    if args.size is not None:
        total = args.size << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = run(Path(d), total, max(1, args.repeat))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"ckpt convert of {rows[0]['bytes'] / 2**20:.0f} MiB ({VALUES} values)")
    print(f"{'row':<26}{'wall s':>8}{'x raw':>7}{'x s(l)':>8}{'anon MiB':>10}{'RSS MiB':>9}"
          f"{'window MiB':>12}")
    for r in rows[1:]:
        win = "" if r["window_mib"] is None else f"{r['window_mib']:.0f}"
        xsl = "" if r["x_save_load"] is None else f"{r['x_save_load']:.2f}"
        print(f"{r['row']:<26}{r['wall']:>8.2f}{r['x_raw']:>7.2f}{xsl:>8}{r['peak_mib']:>10.0f}"
              f"{r['rss_mib']:>9.0f}{win:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
