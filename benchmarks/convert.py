"""The ``convert`` workload: ``ckpt convert`` streams within a bounded window of memory.

Run ``python -m benchmarks.convert [--quick] [--dir D] [--json]``. In one run on this
machine it writes a source checkpoint of ``VALUES`` float32 values (1 GiB in all; 16 MiB
with ``--quick``) and converts it to ``.safetensors`` and to ``.h5`` twice each:

- ``streamed``: ``--window`` of 1/8 of the total, so the conversion must stream;
- ``in memory``: a window larger than the total (the whole output built in memory);

and, as the floor, ``cp`` of the source file (the raw disk limit for the same bytes).
Each row gives the wall time, its ratio to ``cp``, and the peak anonymous memory of the
converting process (sampled from ``/proc``; pages of the memory-mapped scratch file are
page cache, not counted), beside the window.
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
    peak_kib = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak_kib = max(peak_kib, int(line.split()[1]))
        except OSError:  # it just ended
            pass
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed ({proc.returncode}): {err}")
    return {"wall": wall, "peak_mib": peak_kib / 1024}


def run(directory: Path, total: int) -> list[dict[str, Any]]:
    """Build the source, run every conversion once; the rows, as dicts."""
    rows_per = total // (VALUES * 1024 * 4)
    src = directory / "src.h5"
    cv.save(src, {f"v{i}": np.full((rows_per, 1024), i, np.float32) for i in range(VALUES)})
    nbytes = src.stat().st_size
    copy = directory / "copy.bin"
    raw = _measure(["cp", str(src), str(copy)])
    copy.unlink()
    window = max(total // 8, 1 << 20)
    ckpt = [sys.executable, "-m", "ckptvar", "convert", "--quiet", "--force"]
    results = [{"row": "cp (raw)", "wall": raw["wall"], "peak_mib": raw["peak_mib"],
                "window_mib": None}]
    for suffix in (".safetensors", ".h5"):
        dst = directory / f"out{suffix}"
        for name, win in (("streamed", window), ("in memory", 2 * total)):
            m = _measure([*ckpt, str(src), str(dst), "--window", str(win)])
            results.append({"row": f"{suffix} {name}", "wall": m["wall"],
                            "peak_mib": m["peak_mib"], "window_mib": win / 2**20})
            dst.unlink()
    for r in results:
        r["x_raw"] = r["wall"] / raw["wall"]
    results.insert(0, {"row": "source", "bytes": nbytes})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB instead of 1 GiB")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    total = (16 << 20) if args.quick else (1 << 30)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = run(Path(d), total)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"ckpt convert of {rows[0]['bytes'] / 2**20:.0f} MiB ({VALUES} values)")
    print(f"{'row':<24}{'wall s':>9}{'x raw':>8}{'peak MiB':>10}{'window MiB':>12}")
    for r in rows[1:]:
        win = "" if r["window_mib"] is None else f"{r['window_mib']:.0f}"
        print(f"{r['row']:<24}{r['wall']:>9.2f}{r['x_raw']:>8.2f}{r['peak_mib']:>10.0f}{win:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
