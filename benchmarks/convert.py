"""The ``convert`` workload: ``ckpt convert`` against ``cv.save(cv.load())`` of the same file.

Run ``python -m benchmarks.convert [--quick] [--size MIB] [--repeat N] [--formats ...]
[--dir D] [--json]``. In one run on this machine it writes a source checkpoint of
``VALUES`` float32 values (1 GiB in all; 16 MiB with ``--quick``) and, for each output
format (``.safetensors``, ``.h5``, ``.zarr``), runs in a fresh process each:

- ``save(load())``: ``cv.save(dst, cv.load(src))``, everything in memory at once (the
  goal: a conversion takes at most 1.1x that);
- ``streamed``: ``ckpt convert --window`` 1/8 of the total, so the conversion must
  stream through its scratch file;
- ``in memory``: a window larger than the total (the whole output built in memory);

and, as the floor, ``cp`` of the source file (the raw disk limit for the same bytes).
A first round (not counted) fills the page cache and a bytecode cache that every later
process reads. ``--repeat N`` runs every row N times, interleaved round by round (the machine's load
changes between rounds more than within one), and reports the median wall time and its
spread (fastest and slowest) and, against ``save(load())`` of the same format, the
median and spread of the per-round ratios (each row's time over that of
``save(load())`` in the same round). Beside the times: CPU seconds (user + system), the peak anonymous memory
of the process and its peak RSS (sampled from ``/proc``; RSS also counts the mapped
file pages it touches), and the window.
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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

VALUES = 8
FORMATS = (".safetensors", ".h5", ".zarr")


def _measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall time, CPU time and peak memory of ``cmd`` (memory sampled from /proc every 5 ms).

    Anonymous memory is what a conversion holds itself; pages of its memory-mapped
    scratch file are page cache (they count in RSS, and the kernel can drop them).
    """
    peaks = {"RssAnon:": 0, "VmRSS:": 0}
    done = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    status = Path(f"/proc/{proc.pid}/status")

    def sample() -> None:
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    name = line.split(":", 1)[0] + ":"
                    if name in peaks:
                        peaks[name] = max(peaks[name], int(line.split()[1]))
            except (OSError, ValueError, IndexError):  # it just ended
                pass
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read().decode() if proc.stderr else ""
    _, wait_status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed ({proc.returncode}): {err}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
            "peak_mib": peaks["RssAnon:"] / 1024, "rss_mib": peaks["VmRSS:"] / 1024}


_SAVE_LOAD = "import sys, ckptvar as cv; cv.save(sys.argv[2], cv.load(sys.argv[1]))"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def run(
    directory: Path, total: int, repeat: int = 1, formats: tuple[str, ...] = FORMATS
) -> list[dict[str, Any]]:
    """Build the source, run every row ``repeat`` times (interleaved); each row's figures."""
    rows_per = total // (VALUES * 1024 * 4)
    src = directory / "src.h5"
    cv.save(src, {f"v{i}": np.full((rows_per, 1024), i, np.float32) for i in range(VALUES)})
    nbytes = src.stat().st_size
    window = max(total // 8, 1 << 20)
    ckpt = [sys.executable, "-m", "ckptvar", "convert", "--quiet", "--force"]
    jobs: dict[str, tuple[list[str], Path, float | None]] = {
        "cp (raw)": (["cp", str(src), str(directory / "copy.bin")], directory / "copy.bin", None)
    }
    for suffix in formats:
        dst = directory / f"out{suffix}"
        jobs[f"{suffix} save(load())"] = (
            [sys.executable, "-c", _SAVE_LOAD, str(src), str(dst)], dst, None)
        for name, win in (("streamed", window), ("in memory", 2 * total)):
            jobs[f"{suffix} {name}"] = ([*ckpt, str(src), str(dst), "--window", str(win)], dst,
                                        win / 2**20)
    # Every process reads its modules' bytecode from a cache the first round writes (not
    # counted), as an installed package would: compiling ckptvar's sources in each
    # process (PYTHONDONTWRITEBYTECODE) would add ~0.2 s to every row.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(directory / "pycache")
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in jobs}
    for round_ in range(repeat + 1):
        for row, (cmd, out, _win) in jobs.items():
            m = _measure(cmd, env)
            _remove(out)
            if round_:
                runs[row].append(m)
    results: list[dict[str, Any]] = [{"row": "source", "bytes": nbytes, "repeat": repeat}]
    raw = statistics.median(m["wall"] for m in runs["cp (raw)"])
    for row, (_cmd, _out, win) in jobs.items():
        walls = [m["wall"] for m in runs[row]]
        r: dict[str, Any] = {
            "row": row, "wall": statistics.median(walls), "wall_min": min(walls),
            "wall_max": max(walls), "cpu": statistics.median(m["cpu"] for m in runs[row]),
            "peak_mib": max(m["peak_mib"] for m in runs[row]),
            "rss_mib": max(m["rss_mib"] for m in runs[row]), "window_mib": win,
        }
        r["x_raw"] = r["wall"] / raw
        goal = runs.get(f"{row.split()[0]} save(load())")
        if row == "cp (raw)" or goal is None:
            r["x_save_load"] = None
        else:
            paired = [m["wall"] / g["wall"] for m, g in zip(runs[row], goal, strict=True)]
            r["x_save_load"] = statistics.median(paired)
            r["x_save_load_min"], r["x_save_load_max"] = min(paired), max(paired)
        results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB instead of 1 GiB")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--size", type=int, default=None, metavar="MIB",
                        help="the source's size in MiB (default 1024; 16 with --quick)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each row N times, interleaved; medians and spreads")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                        metavar="SUFFIX", help=f"output formats (default: {' '.join(FORMATS)})")
    args = parser.parse_args(argv)
    total = (16 << 20) if args.quick else (1 << 30)
    if args.size is not None:
        total = args.size << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = run(Path(d), total, max(1, args.repeat), tuple(args.formats))
    if args.json:
        print(json.dumps(rows))
        return 0
    n = rows[0]["repeat"]
    print(f"ckpt convert of {rows[0]['bytes'] / 2**20:.0f} MiB ({VALUES} values), "
          f"{n} round{'s' if n != 1 else ''}: medians, [fastest-slowest]")
    print(f"{'row':<26}{'wall s':>7}{'[spread]':>14}{'x s(l)':>7}{'[per round]':>13}"
          f"{'cpu s':>7}{'anon MiB':>9}{'RSS MiB':>8}{'window':>8}")
    for r in rows[1:]:
        win = "" if r["window_mib"] is None else f"{r['window_mib']:.0f}M"
        xsl = spread = ""
        if r["x_save_load"] is not None:
            xsl = f"{r['x_save_load']:.2f}"
            spread = f"[{r['x_save_load_min']:.2f}-{r['x_save_load_max']:.2f}]"
        walls = f"[{r['wall_min']:.2f}-{r['wall_max']:.2f}]"
        print(f"{r['row']:<26}{r['wall']:>7.2f}{walls:>14}"
              f"{xsl:>7}{spread:>13}{r['cpu']:>7.2f}{r['peak_mib']:>9.0f}{r['rss_mib']:>8.0f}"
              f"{win:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
