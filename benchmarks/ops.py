"""The operations a job can name, one function each, and ``run_job`` that dispatches them.

Every operation builds its inputs before the clock starts, prepares the page cache and
fresh memory, times exactly one call (``measure.timed``) and checks what came back.
``OPS`` maps each operation's name to its function; an unknown name is refused.
"""

from __future__ import annotations

import gc
import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import round2
from benchmarks.measure import (
    PROFILE,
    AnonPeak,
    check_arrays,
    disk_bytes,
    init_cuda,
    prepare_cache,
    remove,
    reset_peak,
    status_bytes,
    timed,
    touch_and_free,
    warm_cache,
)
from benchmarks.subjects import SUBJECT_CLASSES, CkptVar, Model, Subject, cv_segment, materialize
from benchmarks.workloads import LAZY_KEY, Spec, make_arrays, spec_for, spec_nbytes

#: What an operation returns: the time of the call and the growth of VmHWM (-1: unknown).
Timing = tuple[float, int]


@dataclass
class Job:
    """One job as an operation sees it: the subject, its inputs' spec and the result so far."""

    op: str
    path: str
    quick: bool
    subject: Subject
    spec: Spec
    nbytes: int  # the workload's size
    peak_ok: bool
    out: dict[str, Any] = field(default_factory=dict)

    @property
    def touch(self) -> int:
        """Fresh memory to touch and free before the call: twice the workload's size."""
        return 2 * self.nbytes

    def ckptvar(self) -> CkptVar:
        if not isinstance(self.subject, CkptVar):
            raise TypeError(f"operation {self.op!r} is for ckptvar only")
        return self.subject


def op_setup(job: Job) -> None:
    """Write the checkpoint a later read measures (not timed)."""
    prepared = job.subject.prepare_save(job.spec)
    remove(job.path)
    os.sync()
    job.subject.save(job.path, prepared)
    os.sync()
    job.out["disk_bytes"] = disk_bytes(job.path)


def op_save(job: Job) -> Timing:
    prepared = job.subject.prepare_save(job.spec)
    remove(job.path)
    os.sync()
    touch_and_free(job.touch)
    t, peak, _ = timed(lambda: job.subject.save(job.path, prepared), job.peak_ok)
    job.out["disk_bytes"] = disk_bytes(job.path)
    return t, peak


def op_load(job: Job) -> Timing:
    """``load_*`` and ``verify_off``: a load into fresh arrays, warm or cold cache."""
    prepare_cache(job.path, job.op.endswith("cold"), job.touch, job.out)
    t, peak, got = timed(lambda: job.subject.load(job.path), job.peak_ok)
    check_arrays(got, job.spec, job.quick)
    return t, peak


def op_restore(job: Job) -> Timing:
    """``restore_*`` and ``verify_restore_off``: a restore into existing arrays."""
    prepared = job.subject.prepare_restore(job.spec)
    prepare_cache(job.path, job.op.endswith("cold"), job.touch, job.out)
    t, peak, _ = timed(lambda: job.subject.restore(job.path, prepared), job.peak_ok)
    check_arrays(job.subject.restored_arrays(prepared), job.spec, job.quick)
    return t, peak


def op_gpu_load(job: Job) -> Timing:
    init_cuda(type(job.subject).name)  # context creation is not part of any subject's load
    prepare_cache(job.path, job.op == "gpu_cold", job.touch, job.out)
    t, peak, got = timed(lambda: job.subject.load_gpu(job.path), job.peak_ok)
    check_arrays(got, job.spec, job.quick)
    return t, peak


def op_gpu_h2d(job: Job) -> Timing:
    """The host-to-device limit: one copy of the workload's size from pinned memory."""
    import cupy as cp  # noqa: PLC0415 - only on a machine with a GPU
    import cupyx  # noqa: PLC0415

    init_cuda("raw")
    host = cupyx.empty_pinned((job.nbytes,), np.uint8)
    host.fill(1)
    dev = cp.empty(job.nbytes, np.uint8)
    cp.cuda.runtime.deviceSynchronize()

    def h2d() -> None:
        dev.set(host)
        cp.cuda.runtime.deviceSynchronize()

    t, peak, _ = timed(h2d, job.peak_ok)
    return t, peak


def op_lazy(job: Job) -> Timing:
    """One tensor (``LAZY_KEY``) out of the checkpoint, opening it included."""
    key = LAZY_KEY
    shape = dict(job.spec)[key]
    nb = 4 * int(np.prod(shape))
    job.out["nbytes"] = nb
    prepare_cache(job.path, job.op == "lazy_cold", 2 * nb, job.out)
    t, peak, got = timed(lambda: job.subject.read_one(job.path, key), job.peak_ok)
    check_arrays({key: got}, [(key, shape)], job.quick)
    return t, peak


def op_init(job: Job) -> Timing:
    """Restore as initialization against build-then-restore (and building alone)."""
    subject = job.ckptvar()
    cv, spec, path = subject.cv, job.spec, job.path
    model = Model(cv, spec)
    warm_cache(path)
    touch_and_free(job.touch)

    def build_then_restore() -> dict[str, Any]:
        m, variables = model.build()
        materialize(variables)  # the initializers run, as in an eager framework
        cv.Checkpoint(model=m).restore(path)
        return variables

    def restore_then_build() -> dict[str, Any]:
        m = cv.Module(name="model")
        ckpt = cv.Checkpoint(model=m)
        status = ckpt.restore(path)  # kept: the values wait for the variables
        init = cv.initializers.random_normal(stddev=0.02, seed=1)
        variables = {cv_segment(k): cv.Variable(init, shape=s, dtype="float32", name=k)
                     for k, s in spec}
        m.params = variables
        materialize(variables)
        status.assert_consumed()
        return variables

    def build_only() -> dict[str, Any]:
        _, variables = model.build()
        materialize(variables)
        return variables

    fn = {"init_build_restore": build_then_restore, "init_restore_first": restore_then_build,
          "init_build": build_only}[job.op]
    t, peak, variables = timed(fn, job.peak_ok)
    if job.op != "init_build":
        check_arrays({k.replace(".", "/"): np.asarray(v.value())
                      for k, v in variables.items()}, spec, job.quick)
    return t, peak


def op_bg_copy(job: Job) -> Timing:
    """The reference for a background save: one copy of the model into fresh memory."""
    remove(job.path)
    os.sync()
    arrays = make_arrays(job.spec)
    touch_and_free(job.touch)
    t, peak, _ = timed(lambda: {k: a.copy() for k, a in arrays.items()}, job.peak_ok)
    return t, peak


def op_bg_save(job: Job) -> Timing:
    """``bg_blocking``: a blocking ``Checkpoint.save``; ``bg_background``: the time
    ``save(blocking=False)`` blocks the caller (and, in ``total_s``, until it is written)."""
    subject = job.ckptvar()
    remove(job.path)
    os.sync()
    ckpt = subject.prepare_save(job.spec)
    prefix = str(Path(job.path).with_suffix(""))
    touch_and_free(job.touch)
    if job.op == "bg_blocking":
        t, peak, _ = timed(lambda: ckpt.save(prefix, format=subject.format), job.peak_ok)
    else:
        gc.collect()
        reset_peak()
        base = status_bytes("VmRSS")
        with AnonPeak() as anon:
            t0 = time.perf_counter()
            handle = ckpt.save(prefix, format=subject.format, blocking=False)
            t = time.perf_counter() - t0
            handle.wait()
            job.out["total_s"] = time.perf_counter() - t0
        peak = status_bytes("VmHWM") - base if job.peak_ok else -1
        job.out["anon_peak"] = anon.growth
    for f in glob.glob(prefix + "-*"):
        remove(f)
    return t, peak


#: Every operation a job may name. ``setup`` writes a file and times nothing.
OPS: dict[str, Callable[[Job], Timing | None]] = {
    "setup": op_setup,
    "save": op_save,
    "load_warm": op_load,
    "load_cold": op_load,
    "verify_off": op_load,
    "restore_warm": op_restore,
    "restore_cold": op_restore,
    "verify_restore_off": op_restore,
    "gpu_warm": op_gpu_load,
    "gpu_cold": op_gpu_load,
    "gpu_h2d": op_gpu_h2d,
    "lazy_warm": op_lazy,
    "lazy_cold": op_lazy,
    "init_build_restore": op_init,
    "init_restore_first": op_init,
    "init_build": op_init,
    "bg_copy": op_bg_copy,
    "bg_blocking": op_bg_save,
    "bg_background": op_bg_save,
    **round2.OPS,
}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement job; its result has ``t``, ``peak_rss`` and the job's facts."""
    PROFILE["on"] = bool(job.get("profile"))
    t_start = time.perf_counter()
    subject = SUBJECT_CLASSES[job["subject"]](job.get("options") or {})
    t_import = time.perf_counter() - t_start
    op = job["op"]
    run = OPS.get(op)
    if run is None:
        raise ValueError(f"unknown op {op!r}")
    spec = spec_for(job)
    peak_ok = reset_peak()
    nbytes = spec_nbytes(spec)
    ctx = Job(op, job["path"], job["quick"], subject, spec, nbytes, peak_ok,
              {"nbytes": nbytes, "count": len(spec)})
    timing = run(ctx)
    out = ctx.out
    if timing is None:  # setup: nothing timed
        return out
    t, peak = timing
    out.update(t=t, peak_rss=peak, import_s=t_import, job_s=time.perf_counter() - t_start,
               pid=os.getpid())
    if "anon_peak" in PROFILE and op != "bg_background":
        out["anon_peak"] = PROFILE["anon_peak"]
    if "text" in PROFILE:
        out["profile"] = PROFILE["text"]
    return out
