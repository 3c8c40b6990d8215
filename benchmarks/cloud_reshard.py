"""The ``cloud_reshard`` benchmark: a resharding restore from an object store against a
same-layout one, in one run.

Run ``python -m benchmarks.cloud_reshard [--mib M] [--repeats N] [--json F]``; needs
``mpiexec`` (the test extra's mpich), mpi4py, obstore and ``moto[server]``. It starts
moto's S3 server on 127.0.0.1 behind a counting TCP proxy; 3 processes save one float32
value of ``--mib`` MiB as row slabs whose edges do not fall on the 256 KiB checksum blocks
(``cv.Checkpoint(w=...).save(url, coordinator=)``); then, alternating, 3 processes
restore it into the same slabs (same layout) and 2 processes into halves (resharded: the
middle stored slab straddles both new ones). Each restore is timed on every rank from a
barrier to its end; a row is the slowest rank's time, the median of ``--repeats``, with
the bytes through the proxy ÷ the bytes the ranks' slabs hold and the GET requests.

Goals (issue "performance, round three", goal 4): resharded ≤ 1.3× same layout, and
bytes fetched ≤ 1.05× what the ranks need, in one pass. Uses the public API only.
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

from benchmarks.cloud import CountingProxy, make_bucket, options_for, start_moto

COLS = 4096  # float32: 16 KiB a row, 16 rows a 256 KiB checksum block


def _slab(rows: int, size: int, rank: int) -> tuple[int, int]:
    return rank * rows // size, (rank + 1) * rows // size


def _values(lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of the stored value (each element exact in float32)."""
    import numpy as np

    flat = np.arange(lo * COLS, hi * COLS, dtype=np.int64) % 1_000_003
    return flat.astype(np.float32).reshape(hi - lo, COLS)


def child(what: str, url: str, rows: int, out_dir: str) -> None:
    """One rank of a save or restore job (under ``mpiexec``)."""
    import numpy as np

    import ckptvar as cv

    opts = json.loads(os.environ["BENCH_S3_OPTIONS"])
    coord = cv.distributed.from_env(timeout=600)
    lo, hi = _slab(rows, coord.size, coord.rank)
    full_shape = (rows, COLS)
    if what == "save":
        value = _values(lo, hi)
    else:
        value = np.zeros((hi - lo, COLS), np.float32)
    var = cv.Variable(value, name="w", shard=cv.Shard(full_shape=full_shape, offset=(lo, 0)),
                      device="CPU:0")
    ckpt = cv.Checkpoint(w=var)
    coord.barrier(tag="bench:start", timeout=600)
    t0 = time.perf_counter()
    if what == "save":
        ckpt.save(f"{url}/ckpt.h5", coordinator=coord, timeout=600, storage_options=opts)
    else:
        ckpt.restore(f"{url}/ckpt-1.h5", coordinator=coord, timeout=600,
                     storage_options=opts)
    dt = time.perf_counter() - t0
    ok = True
    if what == "restore":
        ok = bool(np.array_equal(var.numpy(), _values(lo, hi)))
    Path(out_dir, f"rank{coord.rank}.json").write_text(
        json.dumps({"s": dt, "need": int(value.nbytes), "ok": ok}))


def _job(n: int, what: str, url: str, rows: int, opts: dict[str, Any]) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="cloud-reshard-")
    env = dict(os.environ, BENCH_S3_OPTIONS=json.dumps(opts))
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(n), sys.executable, "-m",
           "mpi4py", "-m", "benchmarks.cloud_reshard", "--child", what, url, str(rows), out]
    try:
        subprocess.run(cmd, env=env, check=True, timeout=900, cwd=root)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if len(ranks) != n or not all(r["ok"] for r in ranks):
        raise RuntimeError(f"{what} on {n} processes failed: {ranks}")
    return {"s": max(r["s"] for r in ranks), "need": sum(r["need"] for r in ranks)}


def run(mib: int, repeats: int) -> dict[str, Any]:
    rows = max(48, (mib << 20) // (COLS * 4))
    rows = rows - rows % 16 + 5  # the slabs' edges fall inside the 16-row checksum blocks
    proc, endpoint = start_moto()
    proxy = CountingProxy(endpoint)
    try:
        bucket, _ = make_bucket(endpoint)
        opts = options_for(proxy.endpoint)
        url = f"s3://{bucket}/reshard"
        save = _job(3, "save", url, rows, opts)
        rows_out: dict[str, list[dict[str, float]]] = {"3 -> 3": [], "3 -> 2": []}
        for _ in range(repeats):
            for label, n in (("3 -> 3", 3), ("3 -> 2", 2)):
                proxy.reset()
                got = _job(n, "restore", url, rows, opts)
                rows_out[label].append({"s": got["s"],
                                        "fetched": proxy.bytes_down / got["need"],
                                        "gets": proxy.requests.get("GET", 0)})
    finally:
        proxy.close()
        proc.kill()
    out: dict[str, Any] = {"mib": rows * COLS * 4 / 2**20, "save_s": save["s"], "rows": {}}
    for label, runs in rows_out.items():
        out["rows"][label] = {
            "s": statistics.median(r["s"] for r in runs),
            "s_min": min(r["s"] for r in runs), "s_max": max(r["s"] for r in runs),
            "fetched": statistics.median(r["fetched"] for r in runs),
            "gets": statistics.median(r["gets"] for r in runs),
        }
    same, resh = out["rows"]["3 -> 3"]["s"], out["rows"]["3 -> 2"]["s"]
    out["ratio"] = resh / same
    return out


def report(f: dict[str, Any]) -> str:
    lines = [f"{f['mib']:.0f} MiB as 3 row slabs on moto (S3), saved in {f['save_s']:.2f} s; "
             "medians (min - max)", "",
             "| restore | s (slowest rank) | bytes fetched / needed | GET requests |",
             "|---|---|---|---|"]
    for label, r in f["rows"].items():
        lines.append(f"| {label} | {r['s']:.2f} ({r['s_min']:.2f} - {r['s_max']:.2f}) | "
                     f"{r['fetched']:.3f}x | {r['gets']:.0f} |")
    lines += ["", f"resharded / same layout: {f['ratio']:.2f}x (goal <= 1.3x)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], int(argv[3]), argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    f = run(args.mib, args.repeats)
    print(report(f))
    if args.json:
        Path(args.json).write_text(json.dumps(f, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
