"""The measurement process: one job in, one ``BENCHRESULT {json}`` line out.

Started by the driver as ``scripts/_bench_worker.py``. It stands alone (NumPy is its
only top-level import beyond this package) so that it also runs under another
interpreter, e.g. a separate virtual environment holding TensorFlow. It receives one
job as JSON on the command line (or, with ``--serve SUBJECT``, one job per line on
stdin, each run in a process forked from a server that has imported the subject's
library once), runs the job's operation (``benchmarks.ops``) and prints one line
``BENCHRESULT {json}`` with the time and the peak memory growth, or the error.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from typing import Any

import numpy as np

from benchmarks.ops import run_job
from benchmarks.workloads import value_pool

MARK = "BENCHRESULT "


def probe() -> dict[str, Any]:
    """Which subjects import in this interpreter, with their versions."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__}
    for mod in ("safetensors", "torch", "h5py", "zarr", "tensorflow", "ckptvar", "cupy",
                "matplotlib"):
        try:
            if mod == "tensorflow":
                os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
            m = __import__(mod)
            found[mod] = getattr(m, "__version__", "?")
            if mod == "ckptvar":
                missing = [n for n in ("Checkpoint", "Module", "Variable", "load", "open")
                           if not hasattr(m, n)]
                if missing:
                    raise ImportError(f"ckptvar has no {', '.join(missing)} yet")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not installed"
            found[mod] = None
            found[mod + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if found.get("torch"):
        try:
            import torch

            found["torch_cuda"] = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001
            found["torch_cuda"] = False
    if found.get("cupy"):
        try:
            import cupy

            found["cuda_devices"] = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001
            found["cuda_devices"] = 0
            found["cupy_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return found


def run_one(job: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The job's result, or ``{"error": ...}`` for any failure (never raises)."""
    try:
        return (probe() if job.get("op") == "probe" else run_job(job)), True
    except Exception as exc:  # noqa: BLE001 - report any failure to the driver
        return {"error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-2000:]}, False


#: ckptvar loads its public names on first use: import what `import ckptvar` imported
#: before that (io, checkpoint, storage), and h5py, which an HDF5 save loads on first use
#: (a one-time cost per process, 40-230 ms on the 2-CPU VM: inside every timed HDF5 save
#: before 2026-11-27, while each peer's server preloads its library). Not zarr-python:
#: ckptvar writes and reads uncompressed Zarr without it.
_CKPTVAR = ("ckptvar", "ckptvar.io", "ckptvar.checkpoint", "ckptvar.storage", "h5py")
#: What each subject imports: a server imports it once, before forking measurements.
PRELOAD = {"safetensors": ("safetensors", "safetensors.numpy"), "torch": ("torch",),
           "h5py": ("h5py",), "zarr": ("zarr",), "tf": ("tensorflow",),
           "ckptvar": _CKPTVAR, "ckptvar_torch": (*_CKPTVAR, "torch"),
           "safetensors_torch": ("safetensors.torch",)}


def serve(subject: str) -> int:
    """Fork server: import ``subject``'s library once, then fork one process per job.

    Reads one JSON job per line on stdin; for each it forks a child that runs the job
    exactly as a fresh interpreter would (its own memory, page-cache state and peak
    counters; no thread or pool of the server's, which starts none) and sends the result
    back through a pipe; the server prints it as a ``BENCHRESULT`` line. This saves the
    interpreter start and the import per measurement (TensorFlow: ~4 s, torch: ~2 s).
    """
    if subject == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for mod in PRELOAD.get(subject, ()):
        __import__(mod)
    value_pool()  # the input pool is read-only: children share its pages
    gc.collect()
    gc.freeze()  # children's collections skip the server's objects (no copy-on-write)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the measurement
            os.close(r)
            code = 1
            try:
                result, ok = run_one(job)
                data = (MARK + json.dumps(result) + "\n").encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view):]
                code = 0 if ok else 1
            finally:
                os._exit(code)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        text = b"".join(chunks).decode(errors="replace")
        if MARK not in text:
            why = (f"killed by signal {-os.waitstatus_to_exitcode(status)}"
                   if os.WIFSIGNALED(status) else f"exited {os.waitstatus_to_exitcode(status)}")
            text = MARK + json.dumps({"error": f"measurement process {why}"}) + "\n"
        sys.stdout.write("\n" + text)
        sys.stdout.flush()
    return 0


def main() -> int:
    if sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    result, ok = run_one(json.loads(sys.argv[1]))
    sys.stdout.write("\n" + MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
