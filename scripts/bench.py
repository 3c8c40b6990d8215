#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: ckptvar against the raw-file limit and every peer.

Each measurement runs in a fresh process (``scripts/_bench_worker.py``, forked from a
server per subject that has imported its library, or with ``--spawn`` a new
interpreter); each row is the median of ``--repeats`` measurements. Prints markdown
tables (times, ratios to the raw file and to the best peer, peak RSS growth), writes
JSON and, when matplotlib is installed, a PNG chart. Uses ckptvar's public API only.

Workloads (``--only``): ``big`` (~1 GiB in 149 float32 tensors: save, load warm/cold,
restore into existing arrays), ``small`` (20,000 tensors of 64-4096 elements),
``lazy`` (one 16 MiB tensor out of the 1 GiB checkpoint), ``init`` (restore as
initialization vs build-then-restore), ``bgsave`` (time blocked by a background save),
``verify`` (checksums on vs off), ``gpu`` (needs CuPy and a CUDA device).

Examples::

    python scripts/bench.py --quick                      # seconds; a test runs it
    python scripts/bench.py                              # full run, a few minutes
    python scripts/bench.py --only small --subjects raw,ckptvar-h5,h5py --repeats 1
    python scripts/bench.py --tf-python /work/bench-tf-venv/bin/python --png docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_bench_worker.py"
MARK = "BENCHRESULT "

WORKLOADS = ("big", "small", "lazy", "init", "bgsave", "verify", "gpu")
FULL_SMALL_COUNT = 20_000
QUICK_SMALL_COUNT = 200


@dataclass(frozen=True)
class SubjectDef:
    """One column of the benchmark: which worker adapter, with which options."""

    label: str
    cls: str
    kind: str  # "raw", "ckptvar" or "peer"
    options: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None  # module that must import (from the probe)
    save_only: bool = False  # a save variant: loads are the same as its sibling's
    small_fraction: float = 1.0  # slow subjects run the small workload on fewer tensors
    restore: bool = False
    tf: bool = False


def subject_defs(nondurable: dict[str, Any] | None) -> list[SubjectDef]:
    defs = [
        SubjectDef("raw", "raw", "raw", restore=True),
        SubjectDef("raw+fsync", "raw", "raw", {"fsync": True}, save_only=True),
        SubjectDef("ckptvar-h5", "ckptvar", "ckptvar", {"format": "h5"}, "ckptvar", restore=True),
    ]
    if nondurable is not None:
        defs.append(SubjectDef("ckptvar-h5 nd", "ckptvar", "ckptvar",
                               {"format": "h5", "api": "save", "write_options": nondurable},
                               "ckptvar", save_only=True))
    defs.append(SubjectDef("ckptvar-zarr", "ckptvar", "ckptvar", {"format": "zarr"}, "ckptvar",
                           restore=True))
    if nondurable is not None:
        defs.append(SubjectDef("ckptvar-zarr nd", "ckptvar", "ckptvar",
                               {"format": "zarr", "api": "save", "write_options": nondurable},
                               "ckptvar", save_only=True))
    defs += [
        SubjectDef("safetensors", "safetensors", "peer", needs="safetensors"),
        SubjectDef("torch", "torch", "peer", needs="torch"),
        SubjectDef("npz", "npz", "peer"),
        SubjectDef("h5py", "h5py", "peer", needs="h5py", small_fraction=0.25),
        SubjectDef("zarr", "zarr", "peer", needs="zarr", small_fraction=0.02),
        SubjectDef("zarr 1-chunk", "zarr", "peer", {"one_chunk": True}, "zarr",
                   small_fraction=0.02),
        SubjectDef("tf", "tf", "peer", needs="tensorflow", small_fraction=0.1, tf=True,
                   restore=True),
    ]
    return defs


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


# --------------------------------------------------------------------------- running jobs


class Runner:
    """Runs worker jobs: each measurement in its own fresh process.

    By default a measurement is forked from a per-(interpreter, subject) server that
    imported the subject's library once (``_bench_worker.py --serve``); ``--spawn``
    starts a new interpreter for every measurement instead (slower by the imports:
    ~4 s for TensorFlow, ~2 s for torch, ~0.3 s for ckptvar or zarr).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.servers: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.logs: dict[tuple[str, str], Any] = {}  # each server's stderr
        self.env = dict(os.environ)
        self.env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def python_for(self, sd: SubjectDef) -> str:
        return self.args.tf_python if sd.tf and self.args.tf_python else sys.executable

    def call(self, python: str, job: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        if self.args.spawn or "subject" not in job:
            return self._spawn(python, job, timeout)
        return self._serve(python, job, timeout)

    def _spawn(self, python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            proc = subprocess.run([python, str(WORKER), json.dumps(job)], capture_output=True,
                                  text=True, timeout=timeout, env=self.env,
                                  cwd=str(HERE.parent))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        return {"error": f"worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}

    def _server(self, python: str, subject: str) -> subprocess.Popen[bytes]:
        key = (python, subject)
        srv = self.servers.get(key)
        if srv is None or srv.poll() is not None:
            log = self.logs.get(key) or tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            srv = subprocess.Popen(
                [python, str(WORKER), "--serve", subject], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=self.env,
                cwd=str(HERE.parent), start_new_session=True)
            self.servers[key], self.logs[key] = srv, log
        return srv

    def _serve(self, python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        srv = self._server(python, job["subject"])
        assert srv.stdin is not None and srv.stdout is not None
        try:
            srv.stdin.write((json.dumps(job) + "\n").encode())
            srv.stdin.flush()
        except BrokenPipeError:
            return self._server_died(python, job["subject"])
        deadline = time.monotonic() + timeout
        fd, buf = srv.stdout.fileno(), b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(MARK.encode()):
                    return json.loads(line[len(MARK):])
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._stop(python, job["subject"], kill=True)
                return {"error": f"timed out after {timeout:.0f} s"}
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return self._server_died(python, job["subject"])
            buf += chunk

    def _server_died(self, python: str, subject: str) -> dict[str, Any]:
        srv = self.servers.pop((python, subject))
        self._reap(srv)
        log = self.logs[(python, subject)]
        log.seek(0)
        err = log.read()[-800:].decode(errors="replace").strip()
        log.seek(0)
        log.truncate()
        return {"error": f"worker server exited {srv.returncode}: {err}"}

    def _stop(self, python: str, subject: str, kill: bool = False) -> None:
        srv = self.servers.pop((python, subject), None)
        if srv is None:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(srv.pid, signal.SIGKILL)
        self._reap(srv)

    @staticmethod
    def _reap(srv: subprocess.Popen[bytes]) -> None:
        """Close the server's pipes (closing stdin stops a live one) and wait for it."""
        for pipe in (srv.stdin, srv.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        srv.wait()

    def close(self) -> None:
        """Stop every server (they exit when their stdin closes)."""
        for python, subject in list(self.servers):
            self._stop(python, subject)
        for log in self.logs.values():
            log.close()
        self.logs.clear()


@dataclass
class Row:
    workload: str
    op: str
    subject: str
    kind: str
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)
    nbytes: int = 0
    count: int = 0
    disk_bytes: int | None = None
    errors: list[str] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)
    profile: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def stat(self, which: str) -> float:
        return min(self.times) if which == "min" else statistics.median(self.times)

    @property
    def peak(self) -> int | None:
        """Median growth of VmHWM (includes file pages mapped in)."""
        good = [p for p in self.peaks if p >= 0]
        return int(statistics.median(good)) if good else None

    @property
    def anon_peak(self) -> int | None:
        """Median growth of the sampled peak of RssAnon (private memory)."""
        return int(statistics.median(self.anon)) if self.anon else None

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload, "op": self.op, "subject": self.subject,
            "kind": self.kind, "median_s": self.median, "times_s": self.times,
            "peak_rss_bytes": self.peak, "peak_anon_bytes": self.anon_peak,
            "nbytes": self.nbytes, "count": self.count, "profile": self.profile,
            "disk_bytes": self.disk_bytes, "errors": self.errors,
            "extra": {k: statistics.median(v) for k, v in self.extra.items() if v},
            "extra_all": self.extra, "peaks_bytes": self.peaks, "anon_bytes": self.anon,
        }


# --------------------------------------------------------------------------- the plan


def ops_for(sd: SubjectDef, workload: str) -> list[str]:
    if workload == "big":
        if sd.save_only:
            return ["save"]
        ops = ["save", "load_warm", "load_cold"]
        return ops + (["restore_warm", "restore_cold"] if sd.restore else [])
    if workload == "small":
        if sd.save_only:
            return ["save"]
        return ["save", "load_warm"] + (["restore_warm"] if sd.restore else [])
    if workload == "lazy" and not sd.save_only:
        return ["lazy_warm", "lazy_cold"]
    if workload == "gpu" and not sd.save_only:
        # the raw file read to host then copied, and the pinned host->device limit
        if sd.kind == "raw":
            return ["gpu_h2d", "gpu_warm", "gpu_cold"]
        if sd.kind == "ckptvar" or sd.cls == "safetensors":
            return ["gpu_warm", "gpu_cold"]
        return []
    if sd.kind != "ckptvar" or sd.save_only:
        return []
    # ckptvar-only extras; their "on"/"blocking"/"load" references are the big rows
    if workload == "init":
        return ["init_build_restore", "init_restore_first"]
    if workload == "bgsave":
        return (["bg_copy"] if sd.options.get("format") == "h5" else []) + ["bg_background"]
    if workload == "verify":
        return ["verify_off", "verify_restore_off"]
    return []


def run_plan(args: argparse.Namespace, runner: Runner, defs: list[SubjectDef],
             workloads: list[str]) -> list[Row]:
    data = Path(args.dir)
    data.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    quick = args.quick

    def measure(sd: SubjectDef, workload: str, op: str, path: Path, repeats: int,
                job_extra: dict[str, Any] | None = None, row_op: str | None = None) -> Row:
        row = Row(workload, row_op or op, sd.label, sd.kind)
        for _ in range(repeats):
            job = {"subject": sd.cls, "options": dict(sd.options), "workload": workload,
                   "op": op, "path": str(path), "quick": quick,
                   "count": small_count(sd), **(job_extra or {})}
            if op.endswith("_off"):
                job["options"]["verify"] = False
            row.extra.setdefault("loadavg", []).append(loadavg())
            t0 = time.perf_counter()
            res = runner.call(runner.python_for(sd), job)
            wall = time.perf_counter() - t0
            row.extra.setdefault("wall_s", []).append(wall)
            if "error" in res:
                row.errors.append(res["error"])
                say(f"  {sd.label:<16} {workload:<6} {row.op:<20} ERROR {res['error'][:300]}")
                break
            row.times.append(res["t"])
            row.peaks.append(res["peak_rss"])
            if "anon_peak" in res:
                row.anon.append(res["anon_peak"])
            row.nbytes, row.count = res["nbytes"], res["count"]
            row.disk_bytes = res.get("disk_bytes", row.disk_bytes)
            for k in ("total_s", "cached_before"):
                if k in res:
                    row.extra.setdefault(k, []).append(res[k])
            say(f"  {sd.label:<16} {workload:<6} {row.op:<20} {res['t']:9.4f} s  "
                f"peak {res['peak_rss'] / 2**20:7.1f} MiB, anon "
                f"{res.get('anon_peak', 0) / 2**20:7.1f} MiB  (wall {wall:.1f} s)")
        if args.profile and sd.kind == "ckptvar" and row.times:
            res = runner.call(runner.python_for(sd), {**job, "profile": True})
            row.profile = res.get("profile", res.get("error", ""))
        rows.append(row)
        return row

    def small_count(sd: SubjectDef) -> int:
        n = QUICK_SMALL_COUNT if quick else FULL_SMALL_COUNT
        return max(20, int(n * sd.small_fraction)) if not quick else n

    def setup(sd: SubjectDef, workload: str, path: Path, **extra: Any) -> bool:
        job = {"subject": sd.cls, "options": dict(sd.options), "workload": workload,
               "op": "setup", "path": str(path), "quick": quick, "count": small_count(sd),
               **extra}
        res = runner.call(runner.python_for(sd), job)
        if "error" in res:
            say(f"  {sd.label:<16} setup of {path.name} failed: {res['error'][:300]}")
            return False
        return True

    for sd in defs:
        if args.subjects and sd.label not in args.subjects:
            continue
        big_path = data / f"{slug(sd.label)}-big{suffix(sd)}"
        big_ready = False
        for workload in workloads:
            ops = [op for op in ops_for(sd, workload) if not args.ops or op in args.ops]
            if not ops or (workload == "gpu" and not args.gpu):
                continue
            if workload == "gpu" and sd.cls == "safetensors" and not args.torch_cuda:
                continue  # safetensors reaches the GPU through torch only
            repeats = args.repeats if sd.kind != "peer" else args.peer_repeats
            if workload in ("init", "bgsave", "verify"):
                repeats = args.extra_repeats  # ckptvar-only extras
            if workload == "small":
                path = data / f"{slug(sd.label)}-small{suffix(sd)}"
                if ops and "save" not in ops and not setup(sd, "small", path):
                    continue
                for op in ops:
                    measure(sd, workload, op, path, repeats)
                rm(path)
                continue
            if workload == "big":
                for op in ops:
                    if op == "save":
                        big_ready = bool(measure(sd, "big", "save", big_path, repeats).times)
                    else:
                        if not big_ready:
                            big_ready = setup(sd, "big", big_path)
                        measure(sd, "big", op, big_path, repeats)
                continue
            if workload == "bgsave":
                for op in ops:
                    row = measure(sd, "big", op, data / f"{slug(sd.label)}-bg{suffix(sd)}",
                                  repeats)
                    row.workload = workload
                continue
            # lazy, init, verify, gpu read the big checkpoint
            if not big_ready:
                big_ready = setup(sd, "big", big_path)
                if not big_ready:
                    continue
            for op in ops:
                row = measure(sd, "lazy" if workload == "lazy" else "big", op, big_path, repeats)
                row.workload = workload
                if op == "gpu_h2d":
                    row.disk_bytes = None
            if workload == "lazy" and sd.kind == "ckptvar":
                alone = data / f"{slug(sd.label)}-alone{suffix(sd)}"
                if setup(sd, "big", alone, alone=True):
                    for op in ops:
                        measure(sd, "lazy", op, alone, args.extra_repeats, {"alone": True},
                                row_op=op + "_alone")
                rm(alone)
        rm(big_path)
    return rows


def suffix(sd: SubjectDef) -> str:
    if sd.cls == "ckptvar":
        return "." + sd.options["format"]
    return {"raw": ".raw", "safetensors": ".safetensors", "torch": ".pt", "npz": ".npz",
            "h5py": ".h5", "zarr": ".zarr", "tf": ".tfckpt"}[sd.cls]


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    for p in path.parent.glob(path.name + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


_LOG: list[str] = []


def say(msg: str) -> None:
    _LOG.append(msg)
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- reporting


def find(rows: list[Row], workload: str, op: str, subject: str) -> Row | None:
    for r in rows:
        if (r.workload, r.op, r.subject) == (workload, op, subject) and r.times:
            return r
    return None


def per_tensor_us(rows: list[Row], op: str, subject: str, stat: str = "median") -> float | None:
    """Cost per tensor above the raw file, in microseconds (small workload)."""
    r, raw = find(rows, "small", op, subject), find(rows, "small", op, "raw")
    if op == "save" and subject.startswith("ckptvar") and not subject.endswith(" nd"):
        raw = find(rows, "small", op, "raw+fsync") or raw
    if r is None or raw is None:
        return None
    return (r.stat(stat) / r.count - raw.stat(stat) / raw.count) * 1e6


def raw_for(rows: list[Row], r: Row) -> Row | None:
    """The raw row a subject compares with (durable ckptvar saves: raw+fsync)."""
    if r.op == "save" and r.kind == "ckptvar" and not r.subject.endswith(" nd"):
        return find(rows, r.workload, r.op, "raw+fsync") or find(rows, r.workload, r.op, "raw")
    return find(rows, r.workload, r.op, "raw")


def best_peer(rows: list[Row], workload: str, op: str) -> Row | None:
    peers = [r for r in rows if r.workload == workload and r.op == op and r.kind == "peer"
             and r.times]
    return min(peers, key=lambda r: r.median) if peers else None


def fmt_t(t: float | None) -> str:
    if t is None:
        return "—"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"


def mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.0f} MiB"


def fmt_x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


OP_TITLES = {
    ("big", "save"): "1 GiB model: save",
    ("big", "load_warm"): "1 GiB model: load, warm cache",
    ("big", "load_cold"): "1 GiB model: load, cold cache",
    ("big", "restore_warm"): "1 GiB model: restore into existing arrays, warm",
    ("big", "restore_cold"): "1 GiB model: restore into existing arrays, cold",
    ("gpu", "gpu_h2d"): "1 GiB host→device copy from pinned memory (the PCIe limit)",
    ("gpu", "gpu_warm"): "1 GiB model: load onto the GPU, warm cache",
    ("gpu", "gpu_cold"): "1 GiB model: load onto the GPU, cold cache",
    ("lazy", "lazy_warm"): "one 16 MiB tensor of the 1 GiB file, warm",
    ("lazy", "lazy_cold"): "one 16 MiB tensor of the 1 GiB file, cold",
    ("lazy", "lazy_warm_alone"): "the same tensor from a 1-tensor checkpoint, warm",
    ("lazy", "lazy_cold_alone"): "the same tensor from a 1-tensor checkpoint, cold",
}


def summary_table(rows: list[Row], labels: list[str]) -> list[str]:
    """The issue-style wide table: rows are operations, columns subjects, cells ratios."""
    cols = [lab for lab in labels if any(r.subject == lab and r.times for r in rows)]
    out = ["| workload | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for (wl, op), title in OP_TITLES.items():
        raw = find(rows, wl, op, "raw")
        if raw is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, wl, op, lab)
            if r is None:
                cells.append("")
            elif lab == "raw":
                cells.append(fmt_t(r.median))
            else:
                base = raw_for(rows, r)
                cells.append(fmt_x(r.median / base.median) if base else fmt_t(r.median))
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    for op, title in (("save", "save"), ("load_warm", "load"),
                      ("restore_warm", "restore into existing")):
        if find(rows, "small", op, "raw") is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, "small", op, lab)
            if r is None:
                cells.append("")
            elif lab == "raw":
                cells.append(fmt_t(r.median))
            else:
                us = per_tensor_us(rows, op, lab)
                cells.append("—" if us is None else f"{us:,.0f} µs")
        n = find(rows, "small", op, "raw").count
        out.append(f"| {n:,} small tensors: {title}, raw time / cost per tensor above raw | "
                   + " | ".join(cells) + " |")
    for op, title in (("save", "peak private memory growth on save (× data)"),
                      ("load_warm", "peak private memory growth on load (× data)"),
                      ("restore_warm", "peak private memory growth on restore (× data)")):
        if find(rows, "big", op, "raw") is None:
            continue
        cells = []
        for lab in cols:
            r = find(rows, "big", op, lab)
            cells.append("" if r is None or r.anon_peak is None
                         else f"{r.anon_peak / r.nbytes:.2f}")
        out.append(f"| 1 GiB model: {title} | " + " | ".join(cells) + " |")
    return out


def detail_table(rows: list[Row], workload: str) -> list[str]:
    sel = [r for r in rows if r.workload == workload]
    if not sel:
        return []
    out = ["| op | subject | median | min – max | × raw | × best peer | peak memory growth: "
           "private / RSS (private × data) | on disk |", "|---|---|---|---|---|---|---|---|"]
    for r in sel:
        if not r.times:
            out.append(f"| {r.op} | {r.subject} | error: {r.errors[0][:120] if r.errors else '?'}"
                       " | | | | | |")
            continue
        base = raw_for(rows, r)
        bp = best_peer(rows, r.workload, r.op)
        xr = r.median / base.median if base else None
        xp = r.median / bp.median if bp else None
        peak = "—" if r.peak is None else (
            f"{mib(r.anon_peak)} / {mib(r.peak)} ({(r.anon_peak or 0) / r.nbytes:.2f}×)")
        disk = "" if r.disk_bytes is None else f"{r.disk_bytes / 2**20:,.1f} MiB"
        extra = ""
        if "total_s" in r.extra:
            extra = f" (done after {fmt_t(statistics.median(r.extra['total_s']))})"
        out.append(f"| {r.op} | {r.subject} | {fmt_t(r.median)}{extra} | "
                   f"{fmt_t(min(r.times))} – {fmt_t(max(r.times))} | {fmt_x(xr)} | {fmt_x(xp)} "
                   f"| {peak} | {disk} |")
    return out


def ckptvar_tables(rows: list[Row]) -> list[str]:
    """Restore as initialization, background save and checksums, per format."""
    fmts = [f for f in ("h5", "zarr") if any(r.subject == f"ckptvar-{f}" for r in rows)]
    copy = next((r for r in rows if r.op == "bg_copy" and r.times), None)
    out: list[str] = []

    def cell(r: Row | None, total: bool = False) -> str:
        if r is None:
            return "—"
        t = fmt_t(r.median)
        if total and "total_s" in r.extra:
            t += f" (written after {fmt_t(statistics.median(r.extra['total_s']))})"
        return t + ("" if r.anon_peak is None else f", +{mib(r.anon_peak)}")

    sections = [
        ("restore as initialization (time, peak private memory growth)",
         ["build with initializers, then restore", "restore first, then build",
          "cv.load (reference)"],
         lambda s: [find(rows, "init", "init_build_restore", s),
                    find(rows, "init", "init_restore_first", s),
                    find(rows, "big", "load_warm", s)]),
        ("background save: time the caller is blocked",
         ["one copy of the model (reference)", "blocking save (durable)",
          "save(blocking=False): blocked"],
         lambda s: [copy, find(rows, "big", "save", s), find(rows, "bgsave", "bg_background", s)]),
        ("checksums on vs off (warm cache)",
         ["cv.load, verify on", "cv.load, verify=False", "restore, verify on",
          "restore, verify=False"],
         lambda s: [find(rows, "big", "load_warm", s), find(rows, "verify", "verify_off", s),
                    find(rows, "big", "restore_warm", s),
                    find(rows, "verify", "verify_restore_off", s)]),
    ]
    for title, names, pick in sections:
        cols = {f: pick(f"ckptvar-{f}") for f in fmts}
        if not any(r is not None for c in cols.values() for r in c[1:]):
            continue
        out += [f"## ckptvar: {title}", "", "| | " + " | ".join(fmts) + " |",
                "|---" * (len(fmts) + 1) + "|"]
        for i, name in enumerate(names):
            out.append(f"| {name} | " + " | ".join(cell(cols[f][i], total=True) for f in fmts)
                       + " |")
        out.append("")
    return out


def goals(rows: list[Row], stat: str = "median") -> list[dict[str, Any]]:
    """Every measurable goal of the issue with its measured ratio (of medians, or minima)."""
    out: list[dict[str, Any]] = []

    def add(goal: str, target: float, measured: float | None, le: bool = True,
            note: str = "") -> None:
        met = None if measured is None else (measured <= target if le else measured >= target)
        out.append({"goal": goal, "target": target, "measured": measured, "met": met,
                    "note": note})

    def ratio(wl: str, op: str, subj: str, base_subj: str = "raw") -> float | None:
        r, b = find(rows, wl, op, subj), find(rows, wl, op, base_subj)
        return r.stat(stat) / b.stat(stat) if r and b else None

    for fmt in ("h5", "zarr"):
        s = f"ckptvar-{fmt}"
        add(f"{fmt}: 1 GiB save (durable) ≤ 1.0× raw+fsync", 1.0, ratio("big", "save", s,
                                                                         "raw+fsync"))
        if find(rows, "big", "save", s + " nd"):
            add(f"{fmt}: 1 GiB save (durable=False) ≤ 1.0× raw", 1.0,
                ratio("big", "save", s + " nd"))
        # savers that do not fsync compare with ckptvar's durable=False variant when measured
        plain = s + " nd" if find(rows, "big", "save", s + " nd") else s
        add(f"{fmt}: 1 GiB save{' (durable=False)' if plain != s else ''} ≤ 1.0× safetensors",
            1.0, ratio("big", "save", plain, "safetensors"))
        add(f"{fmt}: 1 GiB load warm ≤ 1.5× raw", 1.5, ratio("big", "load_warm", s))
        add(f"{fmt}: 1 GiB load cold ≤ 1.15× raw", 1.15, ratio("big", "load_cold", s))
        add(f"{fmt}: 1 GiB restore warm ≤ 1.5× raw", 1.5, ratio("big", "restore_warm", s))
        add(f"{fmt}: 1 GiB restore cold ≤ 1.15× raw", 1.15, ratio("big", "restore_cold", s))
        add(f"{fmt}: small save ≤ 20 µs/tensor above raw", 20,
            per_tensor_us(rows, "save", s, stat))
        add(f"{fmt}: small load ≤ 20 µs/tensor above raw", 20,
            per_tensor_us(rows, "load_warm", s, stat))
        add(f"{fmt}: 16 MiB lazy warm ≤ 2.5× raw", 2.5, ratio("lazy", "lazy_warm", s))
        add(f"{fmt}: 16 MiB lazy cold ≤ 1.2× raw", 1.2, ratio("lazy", "lazy_cold", s))
        a, b = find(rows, "lazy", "lazy_warm", s), find(rows, "lazy", "lazy_warm_alone", s)
        add(f"{fmt}: lazy read independent of checkpoint size (1 GiB file / 1-tensor file, warm)",
            1.25, a.stat(stat) / b.stat(stat) if a and b else None)
        r = find(rows, "big", "save", s)
        add(f"{fmt}: peak extra memory on save ≤ 0.05× model", 0.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        r = find(rows, "big", "load_warm", s)
        add(f"{fmt}: peak memory on load ≤ 1.05× data", 1.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        r = find(rows, "big", "restore_warm", s)
        add(f"{fmt}: restore writes into the variables (peak ≤ 0.05× model)", 0.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
        for op, what in (("save", "save"), ("load_warm", "load")):
            mine = plain if op == "save" else s
            tf, me = find(rows, "big", op, "tf"), find(rows, "big", op, mine)
            add(f"{fmt}: 1 GiB {what}{' (durable=False)' if mine != s else ''} ≥ 2× faster "
                "than tf.train.Checkpoint", 2.0,
                tf.stat(stat) / me.stat(stat) if tf and me else None, le=False)
            if op == "save" and mine != s:
                me = find(rows, "big", op, s)
                add(f"{fmt}: 1 GiB save (durable) ≥ 2× faster than tf.train.Checkpoint "
                    "(informative)", 2.0,
                    tf.stat(stat) / me.stat(stat) if tf and me else None, le=False)
            tf, me = find(rows, "small", op, "tf"), find(rows, "small", op, s)
            add(f"{fmt}: small {what} ≥ 20× faster than tf.train.Checkpoint", 20.0,
                (tf.stat(stat) / tf.count) / (me.stat(stat) / me.count) if tf and me else None,
                le=False, note="per tensor (tf runs on fewer tensors)")
        for wl in ("big", "small"):
            tf, me = find(rows, wl, "restore_warm", "tf"), find(rows, wl, "restore_warm", s)
            add(f"{fmt}: {'1 GiB' if wl == 'big' else 'small'} restore ≥ "
                f"{2 if wl == 'big' else 20}× faster than tf.train.Checkpoint.read",
                2.0 if wl == "big" else 20.0,
                (tf.stat(stat) / tf.count) / (me.stat(stat) / me.count) if tf and me else None,
                le=False, note="per tensor")
        a, b = find(rows, "init", "init_restore_first", s), find(rows, "big", "load_warm", s)
        add(f"{fmt}: restore-as-initialization ≤ 1.0× cv.load", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        a, b = find(rows, "init", "init_restore_first", s), find(rows, "init",
                                                                   "init_build_restore", s)
        add(f"{fmt}: restore-as-initialization vs build-then-restore (informative)", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        h2d = find(rows, "gpu", "gpu_h2d", "raw")
        for temp in ("warm", "cold"):
            # >= 90% of min(disk, host->device) bandwidth: time <= max of the two limits / 0.9
            me, disk = find(rows, "gpu", f"gpu_{temp}", s), find(rows, "big", f"load_{temp}",
                                                                 "raw")
            limit = max(disk.stat(stat), h2d.stat(stat)) if disk and h2d else None
            add(f"{fmt}: GPU load, {temp}, ≥ 90% of min(disk, host→device) bandwidth", 0.9,
                limit / me.stat(stat) if me and limit else None, le=False,
                note="limit: raw host load vs pinned copy, the slower")
        a = find(rows, "bgsave", "bg_background", s)
        b = next((r for r in rows if r.op == "bg_copy" and r.times), None)
        add(f"{fmt}: background save blocks ≤ 1 memory copy", 1.0,
            a.stat(stat) / b.stat(stat) if a and b else None)
        r = find(rows, "bgsave", "bg_background", s)
        add(f"{fmt}: background save holds ≤ 1 snapshot (peak ≤ 1.05× model)", 1.05,
            r.anon_peak / r.nbytes if r and r.anon_peak is not None else None)
    return out


def goals_table(gl: list[dict[str, Any]]) -> list[str]:
    out = ["| goal | measured (medians) | met | on minima |", "|---|---|---|---|"]

    def show(m: float | None, goal: str) -> str:
        if m is None:
            return "not measured"
        return f"{m:,.1f} µs" if "µs" in goal else f"{m:.2f}×"

    for g in gl:
        met = {None: "—", True: "met", False: "**missed**"}[g["met"]]
        mn = show(g.get("measured_min"), g["goal"])
        if g.get("met_min") is not None and g["met_min"] != g["met"]:
            mn += " (met)" if g["met_min"] else " (missed)"
        out.append(f"| {g['goal']} | {show(g['measured'], g['goal'])} | {met} | {mn} |")
    return out


def all_goals(rows: list[Row]) -> list[dict[str, Any]]:
    """Goals on medians (what counts), with the same ratios on minima beside them."""
    gl = goals(rows)
    for g, m in zip(gl, goals(rows, "min"), strict=True):
        g["measured_min"], g["met_min"] = m["measured"], m["met"]
    return gl


def chart(rows: list[Row], labels: list[str], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    cols = [lab for lab in labels if lab != "raw" and any(r.subject == lab and r.times
                                                          for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    big_ops = [("save", "save"), ("load_warm", "load warm"), ("load_cold", "load cold")]
    width = 0.8 / max(1, len(big_ops))
    ax = axes[0]
    for j, (op, name) in enumerate(big_ops):
        vals = []
        for lab in cols:
            r = find(rows, "big", op, lab)
            base = raw_for(rows, r) if r else None
            vals.append(r.median / base.median if r and base else 0)
        ax.bar([i + j * width for i in range(len(cols))], vals, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks([i + width for i in range(len(cols))], cols, rotation=60, ha="right")
    ax.set_ylabel("time / raw file (log)")
    ax.set_title("~1 GiB, 149 tensors")
    ax.legend()
    ax = axes[1]
    for j, (op, name) in enumerate([("save", "save"), ("load_warm", "load")]):
        vals = [max(per_tensor_us(rows, op, lab) or 0, 0.1) for lab in cols]
        ax.bar([i + j * 0.4 for i in range(len(cols))], vals, 0.4, label=name)
    ax.axhline(20, color="r", lw=0.8, ls="--", label="goal 20 µs")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.2 for i in range(len(cols))], cols, rotation=60, ha="right")
    ax.set_ylabel("µs per tensor above raw (log; ≤ 0 drawn at 0.1)")
    ax.set_title("small tensors")
    ax.legend()
    ax = axes[2]
    lcols = ["raw", *cols]
    for j, (op, name) in enumerate([("lazy_warm", "warm"), ("lazy_cold", "cold")]):
        vals = []
        for lab in lcols:
            r = find(rows, "lazy", op, lab)
            vals.append(r.median * 1e3 if r else 0)
        ax.bar([i + j * 0.4 for i in range(len(lcols))], vals, 0.4, label=name)
    ax.set_xticks([i + 0.2 for i in range(len(lcols))], lcols, rotation=60, ha="right")
    ax.set_ylabel("ms")
    ax.set_title("one 16 MiB tensor out of the 1 GiB file")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------- main


def nondurable_options(probe: dict[str, Any]) -> dict[str, Any] | None:
    """``{"durable": False}`` when ``cv.save`` reaches a writer that takes it, else None."""
    if not probe.get("ckptvar"):
        return None
    try:
        import tempfile

        import numpy as np

        import ckptvar as cv

        with tempfile.TemporaryDirectory() as d:
            for fmt in ("h5", "zarr"):
                cv.save(os.path.join(d, "probe." + fmt), {"x": np.zeros(2, np.float32)},
                        durable=False)
    except Exception:  # noqa: BLE001 - no such option (TypeError), or ckptvar not ready
        return None
    return {"durable": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (seconds)")
    p.add_argument("--only", default="", help=f"comma list of workloads: {','.join(WORKLOADS)}")
    p.add_argument("--subjects", default="", help="comma list of subject labels (default all)")
    p.add_argument("--ops", default="", help="comma list of operations (e.g. save,load_cold)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measurements per raw/ckptvar row (default 3; quick 1)")
    p.add_argument("--peer-repeats", type=int, default=None,
                   help="measurements per peer row (default 2; quick 1)")
    p.add_argument("--extra-repeats", type=int, default=None,
                   help="measurements per ckptvar-only extra row (default 2; quick 1)")
    p.add_argument("--json", default="bench-results/bench.json", help="JSON output path")
    p.add_argument("--md", default="bench-results/bench.md", help="markdown output path")
    p.add_argument("--png", default="bench-results/bench.png", help="chart path ('' for none)")
    p.add_argument("--dir", default="bench-results/data", help="scratch directory for files")
    p.add_argument("--report-from", default="",
                   help="rebuild the markdown/JSON/chart from an earlier --json file; no runs")
    p.add_argument("--profile", action="store_true",
                   help="after each ckptvar row, one extra cProfiled run (kept out of the times)")
    p.add_argument("--spawn", action="store_true",
                   help="start a new interpreter per measurement instead of forking it from "
                        "a per-subject server that has imported the library (slower)")
    p.add_argument("--tf-python", default="",
                   help="an interpreter with TensorFlow for tf.train.Checkpoint (its own venv)")
    args = p.parse_args(argv)
    args.gpu = args.torch_cuda = False  # set from the probe in main()
    args.spawn = args.spawn or not hasattr(os, "fork")  # no fork server without fork()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.peer_repeats = args.peer_repeats or (1 if args.quick else min(2, args.repeats))
    args.extra_repeats = args.extra_repeats or (1 if args.quick else min(2, args.repeats))
    args.only = [w for w in args.only.split(",") if w] or list(WORKLOADS)
    bad = [w for w in args.only if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}; choose from {WORKLOADS}")
    args.subjects = [s for s in args.subjects.split(",") if s]
    args.ops = [s for s in args.ops.split(",") if s]
    if args.tf_python and not Path(args.tf_python).exists():
        p.error(f"--tf-python {args.tf_python!r} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from:
        data = json.loads(Path(args.report_from).read_text())
        _LOG.extend(data.get("log", []))
        write_outputs(args, data["meta"], rows_from_json(data))
        return 0
    started = time.perf_counter()
    runner = Runner(args)
    probe = runner.call(sys.executable, {"op": "probe"})
    tf_probe = runner.call(args.tf_python, {"op": "probe"}) if args.tf_python else {}
    nd = nondurable_options(probe)
    defs = subject_defs(nd)
    skipped: dict[str, str] = {}
    active: list[SubjectDef] = []
    for sd in defs:
        pr = tf_probe if sd.tf and args.tf_python else probe
        if args.subjects and sd.label not in args.subjects:
            continue
        if sd.needs and not pr.get(sd.needs):
            why = pr.get(sd.needs + "_error", f"{sd.needs} is not importable")
            if sd.tf and not args.tf_python:
                why += " (pass --tf-python with an interpreter that has TensorFlow)"
            skipped[sd.label] = why
            continue
        active.append(sd)
    if args.subjects:
        unknown = set(args.subjects) - {sd.label for sd in defs}
        if unknown:
            print(f"unknown subjects {sorted(unknown)}; known: {[d.label for d in defs]}",
                  file=sys.stderr)
            return 2
    for label, why in skipped.items():
        say(f"skipping {label}: {why}")
    workloads = list(args.only)
    gpu_note = ""
    if "gpu" in workloads:
        if not (probe.get("cupy") and probe.get("cuda_devices")):
            gpu_note = ("skipped: " + ("CuPy is not installed" if not probe.get("cupy")
                                       else "no CUDA device"))
            say(f"gpu workload {gpu_note}")
        else:
            args.gpu = True
            gpu_note = (f"{probe['cuda_devices']} CUDA device(s), CuPy {probe['cupy']}; "
                        "safetensors on the GPU " + ("through torch" if probe.get("torch_cuda")
                                                     else "not measured (no CUDA torch)"))
    args.torch_cuda = bool(probe.get("torch_cuda"))
    if nd is None:
        say("ckptvar has no durable= write option (or is not importable): "
            "no 'nd' (non-durable) rows")
    try:
        rows = run_plan(args, runner, active, workloads)
    finally:
        runner.close()
    labels = [sd.label for sd in active]
    meta = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "scripts/bench.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "repeats": args.repeats, "peer_repeats": args.peer_repeats,
        "extra_repeats": args.extra_repeats, "workloads": workloads, "labels": labels,
        "machine": machine(), "versions": probe,
        "tf_versions": tf_probe, "skipped": skipped, "gpu": gpu_note,
        "nondurable_option": nd, "spawn": args.spawn,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    write_outputs(args, meta, rows)
    shutil.rmtree(args.dir, ignore_errors=True) if not os.listdir(args.dir) else None
    say(f"wrote {args.json} and {args.md} in {time.perf_counter() - started:.0f} s")
    return 0


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    rows = []
    for d in data["rows"]:
        r = Row(d["workload"], d["op"], d["subject"], d["kind"], list(d["times_s"]),
                nbytes=d["nbytes"], count=d["count"], disk_bytes=d["disk_bytes"],
                errors=list(d["errors"]), profile=d.get("profile", ""))
        r.peaks = list(d.get("peaks_bytes") or ([d["peak_rss_bytes"]] if d["peak_rss_bytes"]
                                                is not None else []))
        r.anon = list(d.get("anon_bytes") or ([d["peak_anon_bytes"]] if d.get("peak_anon_bytes")
                                              is not None else []))
        r.extra = {k: list(v) if isinstance(v, list) else [v]
                   for k, v in (d.get("extra_all") or d.get("extra") or {}).items()}
        rows.append(r)
    return rows


def write_outputs(args: argparse.Namespace, meta: dict[str, Any], rows: list[Row]) -> None:
    """Markdown (stdout and --md), JSON (--json) and the chart (--png) for measured rows."""
    labels = meta.get("labels") or list(dict.fromkeys(r.subject for r in rows))
    gl = all_goals(rows)
    cold = [r for r in rows if "cached_before" in r.extra]
    raw_w, raw_c = find(rows, "big", "load_warm", "raw"), find(rows, "big", "load_cold", "raw")
    cold_note = ""
    if cold:
        resident = max(max(r.extra["cached_before"]) for r in cold)
        cold_note = (f"after os.sync() + posix_fadvise(DONTNEED) at most {resident:.1%} of a "
                     f"checkpoint's pages stayed in the page cache (mincore)")
        if raw_w and raw_c:
            cold_note += (f"; raw load warm {fmt_t(raw_w.median)} vs cold "
                          f"{fmt_t(raw_c.median)} ({raw_c.median / raw_w.median:.1f}×)")
    loads = [x for r in rows for x in r.extra.get("loadavg", []) if x >= 0]
    load_note = (f"1-minute load average before each measurement: median "
                 f"{statistics.median(loads):.1f}, max {max(loads):.1f} "
                 f"(on {meta['machine'].get('cpus')} CPUs)") if loads else ""
    meta = {**meta, "cold_cache": cold_note, "load": load_note}
    reps = f"medians of {meta['repeats']}"
    if meta.get("peer_repeats") and meta["peer_repeats"] != meta["repeats"]:
        reps += (f" (peers {meta['peer_repeats']}, ckptvar-only extras "
                 f"{meta.get('extra_repeats')})")
    md = [f"# ckptvar benchmark ({meta['date']})", "",
          f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cpus']} CPUs, "
          f"{meta['machine'].get('mem_gib', '?')} GiB; {meta['machine']['platform']}.",
          f"Command: `{meta['command']}`; {reps}, each in a fresh process "
          + ("(a new interpreter)" if meta.get("spawn") else
             "(forked from a server that has imported the subject's library)")
          + "; "
          f"run took {meta['elapsed_s']:.0f} s.", ""]
    v = meta.get("versions") or {}
    tv = meta.get("tf_versions") or {}
    vers = [f"{k} {v[k]}" for k in ("python", "numpy", "ckptvar", "h5py", "zarr", "safetensors",
                                    "torch") if v.get(k)]
    if tv.get("tensorflow"):
        vers.append(f"tensorflow {tv['tensorflow']} (own venv)")
    md += ["Versions: " + ", ".join(vers) + ".", ""]
    if meta["quick"]:
        md += ["Quick mode: tiny sizes (the 149-tensor model holds ~1 MiB, the small workload "
               f"{QUICK_SMALL_COUNT} tensors), one repeat: this run only shows that the "
               "benchmark works; its ratios mean nothing.", ""]
    if meta["skipped"]:
        md += ["Skipped: " + "; ".join(f"{k} ({w})" for k, w in meta["skipped"].items()) + ".",
               ""]
    if meta["gpu"]:
        md += [f"GPU loading: {meta['gpu']}.", ""]
    if cold_note:
        md += [f"Cold cache: {cold_note}.", ""]
    if load_note:
        md += [f"Machine load: {load_note}.", ""]
    walls: dict[str, float] = {}
    for r in rows:
        walls[r.subject] = walls.get(r.subject, 0.0) + sum(r.extra.get("wall_s", []))
    if walls:
        runs = sum(len(r.extra.get("wall_s", [])) for r in rows)
        md += [f"Where the run's time went: wall seconds per subject over {runs} "
               "measurements, set-up included: " + ", ".join(
                   f"{k} {v:.0f}" for k, v in sorted(walls.items(), key=lambda kv: -kv[1]))
               + ".", ""]
    md += ["## Summary (× = time / raw file in this run; durable ckptvar saves compare with "
           "raw+fsync)", "", *summary_table(rows, labels), ""]
    titles = {"big": "~1 GiB model, 149 tensors", "small": "small tensors",
              "lazy": "one 16 MiB tensor", "gpu": "loading onto the GPU"}
    for wl, title in titles.items():
        t = detail_table(rows, wl)
        if t:
            md += [f"## {title}", "", *t, ""]
    md += ckptvar_tables(rows)
    if gl and any(g["measured"] is not None for g in gl):
        md += ["## Goals", "", *goals_table([g for g in gl if g["measured"] is not None]), ""]
    profiled = [r for r in rows if r.profile]
    if profiled:
        md += ["## Profiles (cProfile of one extra run, sorted by own time)", ""]
        for r in profiled:
            md += [f"### {r.workload} / {r.op} / {r.subject}", "", "```text",
                   r.profile.rstrip(), "```", ""]
    text = "\n".join(md)
    print(text)
    result = {"meta": meta, "rows": [r.to_json() for r in rows], "goals": gl, "log": _LOG}
    for out in (args.json, args.md):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.md).write_text(text + "\n")
    if args.png:
        why = chart(rows, labels, Path(args.png))
        if why:
            say(why)


if __name__ == "__main__":
    raise SystemExit(main())
