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
``verify`` (checksums on vs off), ``gpu`` (needs CuPy and a CUDA device), ``scale``
(4 processes save one checkpoint, 3 and 1 restore it, and the save protocol's overhead
for 10,000 variables; needs mpi4py and ``mpiexec``: :mod:`benchmarks.scale`), and, only
when asked for, ``cloud`` (:mod:`benchmarks.cloud`: checkpoints on a moto S3 server it
starts, against obstore's own calls).

Examples::

    python scripts/bench.py --quick                      # seconds; a test runs it
    python scripts/bench.py                              # full run, a few minutes
    python scripts/bench.py --only small --subjects raw,ckptvar-h5,h5py --repeats 1
    python scripts/bench.py --tf-python /work/bench-tf-venv/bin/python --png docs/benchmarks.png
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import LOG, Runner, machine, say
from benchmarks.plan import SubjectDef, run_plan, subject_defs
from benchmarks.report import write_outputs
from benchmarks.results import rows_from_json
from benchmarks.workloads import WORKLOADS

#: Workloads with their own run and report, run only when named in ``--only``.
OWN_RUN = ("cloud", "incremental")


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
    bad = [w for w in args.only if w not in (*WORKLOADS, *OWN_RUN)]
    if bad:
        p.error(f"unknown workload(s) {bad}; choose from {WORKLOADS}")
    args.subjects = [s for s in args.subjects.split(",") if s]
    args.ops = [s for s in args.ops.split(",") if s]
    if args.tf_python and not Path(args.tf_python).exists():
        p.error(f"--tf-python {args.tf_python!r} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "cloud" in args.only:  # its own run and report (a server, obstore baselines)
        from benchmarks import cloud  # noqa: PLC0415 - needs obstore and moto, only here

        args.only.remove("cloud")
        cloud.main(["--quick"] if args.quick else
                   (["--repeats", str(args.repeats)] if args.repeats else []))
        if not args.only:
            return 0
    if "incremental" in args.only:  # its own run and report (steps of two managers)
        from benchmarks import incremental  # noqa: PLC0415 - only when asked for

        args.only.remove("incremental")
        incremental.main(["--quick"] if args.quick else [])
        if not args.only:
            return 0
    if args.report_from:
        data = json.loads(Path(args.report_from).read_text())
        LOG.extend(data.get("log", []))
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
