"""The plan of a run: the subjects (columns), which operations each runs, in what order.

``run_plan`` walks subjects and workloads, sets up the files a read needs, measures
each operation ``--repeats`` times through the ``Runner`` and returns the rows.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import round2, round3, scale, simulate
from benchmarks.harness import Runner, loadavg, say
from benchmarks.results import Row
from benchmarks.workloads import FULL_SMALL_COUNT, QUICK_SMALL_COUNT


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
    # the other public paths (round3.py's per-value rows only)
    defs += [SubjectDef("ckptvar-h5 saver", "ckptvar", "ckptvar", {"format": "h5", "api": "saver"},
                        "ckptvar", restore=True),
             SubjectDef("ckptvar-h5 save", "ckptvar", "ckptvar", {"format": "h5", "api": "save"},
                        "ckptvar")]
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
    # framework arrays (round2.py): saved without fsync, as torch.save and safetensors do
    defs += [SubjectDef(f"ckptvar-{f} torch nd", "ckptvar_torch", "ckptvar",
                        {"format": f, "write_options": nondurable}, "torch")
             for f in ("h5", "zarr") if nondurable is not None]
    defs.append(SubjectDef("safetensors torch", "safetensors_torch", "peer", needs="safetensors"))
    return defs


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


def ops_for(sd: SubjectDef, workload: str) -> list[str]:  # noqa: PLR0911 - one rule a case
    if workload in round3.WORKLOADS or sd.label in round3.OWN_SUBJECTS:
        return round3.ops_for(sd, workload)
    if workload in round2.WORKLOADS or sd.cls in ("ckptvar_torch", "safetensors_torch"):
        return round2.ops_for(sd, workload) if workload in round2.WORKLOADS else []
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
    data = Path(args.dir).resolve()  # the workers run in the repository root
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
        if not any(ops_for(sd, w) for w in workloads
                   if w not in round2.WORKLOADS + round3.WORKLOADS):
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
    chosen = [sd for sd in defs if not args.subjects or sd.label in args.subjects]
    # the round-2 rows, subjects interleaved; --extra-repeats keeps the full run short
    round2.run(chosen, workloads, quick=quick, repeats=args.extra_repeats, data=data,
               suffix=suffix, measure=measure, setup=setup, rm=rm)
    round3.run(chosen, workloads, quick=quick, repeats=args.extra_repeats, data=data,
               suffix=suffix, measure=measure, rm=rm)
    if "scale" in workloads and (not args.subjects or "ckptvar-h5" in args.subjects):
        rows += scale_rows(quick, args.extra_repeats, data)
    return round2.merge(rows)


def atscale_rows(quick: bool) -> list[Row]:
    """The protocol at scale, simulated in this process (:mod:`benchmarks.simulate`)."""
    say("scale workload: the save and read planners on simulated ranks")
    if quick:
        result = simulate.run(simulate.QUICK_RANKS, simulate.QUICK_VARIABLES,
                              simulate.QUICK_TOP, 1)
    else:
        result = simulate.run(simulate.BENCH_RANKS, 1000, simulate.BENCH_TOP, 1)
    return simulate.to_rows(result, lambda op, times, extra: Row(
        "atscale", op, "ckptvar-h5", "ckptvar", times=list(times), extra=extra))


def scale_rows(quick: bool, repeats: int, data: Path) -> list[Row]:
    """The ``scale`` workload's rows (:mod:`benchmarks.scale`, under ``mpiexec``), and the
    simulated ones of :func:`atscale_rows`."""
    rows = atscale_rows(quick)
    why = scale.available()
    if why is not None:
        say(f"scale workload skipped: {why}")
        return rows
    say("scale workload: 4 processes save, 3 and 1 restore (mpiexec)")
    total = scale.QUICK_TOTAL if quick else scale.BENCH_TOTAL
    try:
        m = scale.measure(total, max(repeats, 3), str(data))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        say(f"scale workload failed: {str(exc)[-500:]}")
        return rows
    return rows + scale.to_rows(m, lambda op, times, extra: Row(
        "scale", op, "ckptvar-h5", "ckptvar", times=list(times), extra=dict(extra),
        nbytes=m["nbytes"]))


def suffix(sd: SubjectDef) -> str:
    if sd.cls in ("ckptvar", "ckptvar_torch"):
        return "." + sd.options["format"]
    return {"raw": ".raw", "safetensors": ".safetensors", "torch": ".pt", "npz": ".npz",
            "h5py": ".h5", "zarr": ".zarr", "tf": ".tfckpt",
            "safetensors_torch": ".safetensors"}[sd.cls]


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    for p in path.parent.glob(path.name + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
