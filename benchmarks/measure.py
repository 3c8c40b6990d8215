"""How one call is measured: page cache, fresh memory, peak memory and the clock.

Runs inside the measurement process: it warms or drops the page cache of a
checkpoint's files (and checks with ``mincore`` that the pages left), touches and
frees memory so the timed call finds backed pages, samples private memory on a
thread, times exactly one call (optionally under cProfile) and checks what a
subject returned against the workload's inputs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workloads import MiB, Spec, make_arrays


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def touch_and_free(nbytes: int) -> None:
    """Fault in and release ``nbytes`` so the next allocations find backed pages."""
    if nbytes <= 0:
        return
    a = np.ones(nbytes, dtype=np.uint8)
    del a
    gc.collect()


def files_of(path: str) -> list[str]:
    """Every file of a checkpoint: a file, a directory tree, or a prefix with sidecars."""
    p = Path(path)
    if p.is_dir():
        return [str(q) for q in p.rglob("*") if q.is_file()]
    out = [path] if p.is_file() else []
    out += [q for q in glob.glob(glob.escape(path) + ".*") if os.path.isfile(q)]
    return sorted(set(out))


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_of(path))


def remove(path: str) -> None:
    for f in files_of(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def warm_cache(path: str) -> None:
    """Read every file once so the page cache holds it."""
    buf = bytearray(8 * MiB)
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def drop_cache(path: str) -> None:
    """Flush dirty pages, then ask the kernel to drop the files' cached pages."""
    os.sync()
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare_cache(path: str, cold: bool, touch: int, out: dict[str, Any]) -> None:
    """Drop (``cold``) or fill the page cache of ``path``, and touch ``touch`` bytes.

    Cold: the memory is touched first (dropping comes last, so nothing refills the
    cache) and the fraction of pages still resident is recorded in ``out``.
    """
    if cold:
        touch_and_free(touch)
        drop_cache(path)
        out["cached_before"] = cached_fraction(path)
    else:
        warm_cache(path)
        touch_and_free(touch)


def cached_fraction(path: str) -> float:
    """Fraction of the files' pages resident in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    total = resident = 0
    for f in files_of(path):
        size = os.path.getsize(f)
        if size == 0:
            continue
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            view = np.frombuffer(m, dtype=np.uint8)
            libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
            del view
            resident += int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())
            total += pages
        finally:
            m.close()
    return resident / total if total else 0.0


def check_arrays(got: dict[str, np.ndarray], spec: Spec,
                 full: bool) -> None:
    """Fail loudly if a subject returned the wrong keys, shapes or (``full``) values."""
    want = {k: s for k, s in spec}
    if set(got) != set(want):
        missing = sorted(set(want) - set(got))[:3]
        extra = sorted(set(got) - set(want))[:3]
        raise AssertionError(f"keys differ: missing {missing}, unexpected {extra}")
    ref = make_arrays(spec) if full else {}
    for k, shape in want.items():
        a = got[k]  # NumPy, or (gpu workload) CuPy / torch: checked without a copy back
        dtype = np.dtype(str(a.dtype).removeprefix("torch."))
        if tuple(a.shape) != tuple(shape) or dtype != np.float32:
            raise AssertionError(f"{k}: got {tuple(a.shape)} {dtype}, expected {shape} float32")
        if full and not np.array_equal(to_host(a), ref[k]):
            raise AssertionError(f"{k}: values differ")


def sync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def init_cuda(subject: str) -> None:
    """Create the CUDA context (and the framework's allocator) before anything is timed."""
    if subject == "safetensors":
        import torch

        torch.empty(1, device="cuda:0")
        torch.cuda.synchronize()
    else:
        import cupy as cp

        cp.empty(1, np.uint8)
        cp.cuda.runtime.deviceSynchronize()


def to_host(x: Any) -> np.ndarray:
    """A NumPy array as it is; a CuPy array or a torch tensor as a NumPy array."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()
    return x.cpu().numpy()


class AnonPeak:
    """Samples RssAnon every few milliseconds on a thread: the peak of private memory.

    VmHWM also counts file pages mapped in (a reader that mmaps the checkpoint shows
    the file's size there although it allocates nothing), so both are reported.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.base = status_bytes("RssAnon")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, status_bytes("RssAnon"))

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_bytes("RssAnon"))

    @property
    def growth(self) -> int:
        return self.peak - self.base


PROFILE: dict[str, Any] = {}


def timed(fn: Callable[[], Any], peak_ok: bool) -> tuple[float, int, Any]:
    gc.collect()
    reset_peak()
    base = status_bytes("VmRSS")
    prof = None
    if PROFILE.get("on"):
        import cProfile

        prof = cProfile.Profile()
    with AnonPeak() as anon:
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        result = fn()
        if prof is not None:
            prof.disable()
        t = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - base if peak_ok else -1
    PROFILE["anon_peak"] = anon.growth
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(14)
        text = buf.getvalue()
        PROFILE["text"] = text[text.find("ncalls") - 3:] if "ncalls" in text else text
    return t, peak, result
