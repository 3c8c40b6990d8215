"""One benchmark measurement, run in a fresh process by ``scripts/bench.py``.

This file stands alone (NumPy is its only top-level import) so that it also runs
under another interpreter, e.g. a separate virtual environment holding TensorFlow.
It receives one job as JSON on the command line (or, with ``--serve SUBJECT``, one
job per line on stdin, each run in a process forked from a server that has imported
the subject's library once), builds the workload's inputs,
touches and frees about twice the workload's size (fresh memory on this kind of VM
costs 0.2-6 s per GiB at random, so every timed call starts with backed pages),
warms or drops the page cache of the files involved, times exactly one call and
prints one line ``BENCHRESULT {json}`` with the time and the peak RSS growth.

Subjects are the raw-file limit, ckptvar and the peers; each is a small adapter
class with the same verbs (``save``, ``load``, ``restore``, ``read_one``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import mmap
import os
import shutil
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MARK = "BENCHRESULT "
MiB = 1 << 20
GiB = 1 << 30

# --------------------------------------------------------------------------- workloads


def model_spec(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """149 float32 tensors with GPT-style transformer shapes: ~1 GiB (full) or ~1 MiB (quick).

    12 blocks of 12 tensors (layer norms, fused QKV, attention projection, MLP), token and
    position embeddings, the final layer norm and an untied output projection.
    """
    d, layers, vocab, pos = (32, 12, 512, 64) if quick else (1024, 12, 56752, 1024)
    spec: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, d)), ("wpe", (pos, d))]
    for i in range(layers):
        p = f"h/{i}/"
        spec += [
            (p + "ln_1/gamma", (d,)),
            (p + "ln_1/beta", (d,)),
            (p + "attn/c_attn/kernel", (d, 3 * d)),
            (p + "attn/c_attn/bias", (3 * d,)),
            (p + "attn/c_proj/kernel", (d, d)),
            (p + "attn/c_proj/bias", (d,)),
            (p + "ln_2/gamma", (d,)),
            (p + "ln_2/beta", (d,)),
            (p + "mlp/c_fc/kernel", (d, 4 * d)),
            (p + "mlp/c_fc/bias", (4 * d,)),
            (p + "mlp/c_proj/kernel", (4 * d, d)),
            (p + "mlp/c_proj/bias", (d,)),
        ]
    spec += [("ln_f/gamma", (d,)), ("ln_f/beta", (d,)), ("lm_head/kernel", (d, vocab))]
    return spec


#: The tensor the lazy workload reads (16 MiB in the full model).
LAZY_KEY = "h/5/mlp/c_fc/kernel"


def small_spec(count: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` float32 tensors of 64-4096 elements (~8 KiB each; 20,000 make ~159 MiB)."""
    rng = np.random.default_rng(1234)
    sizes = rng.integers(64, 4097, size=count)
    spec: list[tuple[str, tuple[int, ...]]] = []
    for i, n in enumerate(sizes.tolist()):
        shape = (n,) if i % 2 else (n // 16, 16) if n % 16 == 0 else (n,)
        spec.append((f"blocks/{i // 100}/v{i % 100}", shape))
    return spec


def spec_for(job: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    if job["workload"] == "small":
        return small_spec(job["count"])
    if job.get("alone"):
        return [s for s in model_spec(job["quick"]) if s[0] == LAZY_KEY]
    return model_spec(job["quick"])


def spec_nbytes(spec: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(4 * int(np.prod(s)) for _, s in spec)


_POOL: np.ndarray | None = None


def _pool() -> np.ndarray:
    """16 Mi normal floats (scale 0.02, like trained weights); inputs are slices of it."""
    global _POOL
    if _POOL is None:
        _POOL = np.random.default_rng(0).standard_normal(16 * MiB // 4 * 4, dtype=np.float32)
        _POOL *= np.float32(0.02)
    return _POOL


def fill(key: str, a: np.ndarray) -> np.ndarray:
    """Write ``key``'s deterministic values into ``a`` (float32, any shape) from the pool."""
    pool = _pool()
    i = zlib.crc32(key.encode())
    flat = a.reshape(-1)
    pos, j = 0, 0
    while pos < flat.size:
        n = min(flat.size - pos, pool.size // 2)
        off = (i * 7919 + j * 104729) % (pool.size - n + 1)
        flat[pos : pos + n] = pool[off : off + n]
        pos += n
        j += 1
    return a


def make_arrays(spec: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """Deterministic inputs: each tensor is filled from the pool at its own offsets."""
    return {key: fill(key, np.empty(shape, np.float32)) for key, shape in spec}


# --------------------------------------------------------------------------- machinery


def _status(field: str) -> int:
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


def check_arrays(got: dict[str, np.ndarray], spec: list[tuple[str, tuple[int, ...]]],
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


# --------------------------------------------------------------------------- subjects


class Subject:
    """One way of storing tensors. ``save`` / ``load`` / ``read_one`` are what gets timed."""

    name = "?"
    suffix = ""
    ops: tuple[str, ...] = ()

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def prepare_save(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        """The object ``save`` takes, holding the workload's values (built, not timed)."""
        return make_arrays(spec)

    def save(self, path: str, prepared: Any) -> Any:
        raise NotImplementedError

    def load(self, path: str) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def prepare_restore(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        """Existing arrays of the right shapes for ``restore`` to overwrite (all ones)."""
        return {k: np.ones(shape, np.float32) for k, shape in spec}

    def restore(self, path: str, prepared: Any) -> Any:
        raise NotImplementedError

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        return prepared

    def read_one(self, path: str, key: str) -> np.ndarray:
        raise NotImplementedError

    def load_gpu(self, path: str) -> dict[str, Any]:
        """Every tensor on the first CUDA device, copies finished (``gpu`` workload)."""
        raise NotImplementedError(f"{self.name} has no GPU load")


def _raw_index(spec_arrays: dict[str, np.ndarray]) -> bytes:
    index, off = {}, 0
    for k, a in spec_arrays.items():
        index[k] = [a.dtype.str, list(a.shape), off]
        off += a.nbytes
    body = json.dumps(index).encode()
    return len(body).to_bytes(8, "little") + body


class Raw(Subject):
    """The limit: one file, a JSON index, one write() per tensor / readinto() per tensor."""

    name = "raw"
    suffix = ".raw"

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with open(path, "wb", buffering=0) as f:
            f.write(_raw_index(arrays))
            for a in arrays.values():
                f.write(memoryview(a).cast("B"))
            if self.options.get("fsync"):
                os.fsync(f.fileno())
        if self.options.get("fsync"):
            sync_dir(path)

    @staticmethod
    def _index(f: Any) -> tuple[dict[str, Any], int]:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n

    def _each(self, path: str) -> Iterator[tuple[str, np.ndarray]]:
        """Each tensor in file order, read with one ``readinto`` into a fresh array."""
        with open(path, "rb", buffering=0) as f:
            index, _ = self._index(f)
            for k, (dt, shape, _off) in index.items():
                a = np.empty(shape, dt)
                f.readinto(memoryview(a).cast("B"))
                yield k, a

    def load(self, path: str) -> dict[str, np.ndarray]:
        return dict(self._each(path))

    def restore(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with open(path, "rb", buffering=0) as f:
            index, _ = self._index(f)
            for k in index:
                f.readinto(memoryview(arrays[k]).cast("B"))

    def load_gpu(self, path: str) -> dict[str, Any]:
        """Read a tensor into host memory, copy it to the device, then the next."""
        import cupy as cp

        out = {k: cp.asarray(a, blocking=True) for k, a in self._each(path)}
        cp.cuda.runtime.deviceSynchronize()
        return out

    def read_one(self, path: str, key: str) -> np.ndarray:
        with open(path, "rb", buffering=0) as f:
            index, base = self._index(f)
            dt, shape, off = index[key]
            a = np.empty(shape, dt)
            f.seek(base + off)
            f.readinto(memoryview(a).cast("B"))
        return a


class Safetensors(Subject):
    name = "safetensors"
    suffix = ".safetensors"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import safetensors.numpy as stn

        self.st = stn

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        self.st.save_file(arrays, path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        return self.st.load_file(path)

    def read_one(self, path: str, key: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)

    def load_gpu(self, path: str) -> dict[str, Any]:
        """``safe_open(..., device="cuda:0")`` through torch (safetensors' GPU path)."""
        import torch
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cuda:0") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        torch.cuda.synchronize()
        return out


class Torch(Subject):
    name = "torch"
    suffix = ".pt"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import torch

        self.torch = torch

    def prepare_save(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        return {k: self.torch.from_numpy(a) for k, a in make_arrays(spec).items()}

    def save(self, path: str, tensors: Any) -> None:
        self.torch.save(tensors, path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        sd = self.torch.load(path, map_location="cpu", weights_only=True)
        return {k: t.numpy() for k, t in sd.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        sd = self.torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return np.array(sd[key].numpy())


class Npz(Subject):
    name = "npz"
    suffix = ".npz"

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        np.savez(path, **arrays)

    def load(self, path: str) -> dict[str, np.ndarray]:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    def read_one(self, path: str, key: str) -> np.ndarray:
        with np.load(path) as z:
            return z[key]


class H5py(Subject):
    """Plain h5py, one dataset per tensor (groups follow the key's ``/``)."""

    name = "h5py"
    suffix = ".h5"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import h5py

        self.h5py = h5py

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with self.h5py.File(path, "w") as f:
            for k, a in arrays.items():
                f.create_dataset(k, data=a)

    def _datasets(self, f: Any) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        f.visititems(lambda n, o: found.append((n, o)) if isinstance(o, self.h5py.Dataset)
                     else None)
        return found

    def load(self, path: str) -> dict[str, np.ndarray]:
        with self.h5py.File(path, "r") as f:
            return {k: ds[()] for k, ds in self._datasets(f)}

    def restore(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        with self.h5py.File(path, "r") as f:
            for k, ds in self._datasets(f):
                ds.read_direct(arrays[k])

    def read_one(self, path: str, key: str) -> np.ndarray:
        with self.h5py.File(path, "r") as f:
            return f[key][()]


class Zarr(Subject):
    """Plain zarr-python 3: default codecs and chunks, or (``one_chunk``) raw single chunks."""

    name = "zarr"
    suffix = ".zarr"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import zarr

        self.zarr = zarr

    def save(self, path: str, arrays: dict[str, np.ndarray]) -> None:
        g = self.zarr.open_group(path, mode="w")
        for k, a in arrays.items():
            if self.options.get("one_chunk"):
                g.create_array(k, data=a, chunks=a.shape, compressors=None)
            else:
                g.create_array(k, data=a)

    def load(self, path: str) -> dict[str, np.ndarray]:
        g = self.zarr.open_group(path, mode="r")
        members = g.members(max_depth=None)
        return {k: m[...] for k, m in members if isinstance(m, self.zarr.Array)}

    def read_one(self, path: str, key: str) -> np.ndarray:
        return self.zarr.open_array(path, path=key, mode="r")[...]


def _tf_escape(name: str) -> str:
    return name.replace(".", "..").replace("/", ".S")


class TF(Subject):
    """tf.train.Checkpoint of tf.Variables kept in a dict on a tf.Module."""

    name = "tf"
    suffix = ".tfckpt"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf

        self.tf = tf

    def _checkpoint(self, variables: dict[str, Any]) -> Any:
        m = self.tf.Module()
        m.params = variables
        return self.tf.train.Checkpoint(model=m)

    def prepare_save(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        # one NumPy input at a time: TensorFlow copies it, and the next one reuses its pages
        return self._checkpoint({k: self.tf.Variable(fill(k, np.empty(s, np.float32)))
                                 for k, s in spec})

    def save(self, path: str, ckpt: Any) -> None:
        ckpt.write(path)

    def load(self, path: str) -> dict[str, np.ndarray]:
        r = self.tf.train.load_checkpoint(path)
        out = {}
        suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
        for full in r.get_variable_to_shape_map():
            if full.startswith("model/params/") and full.endswith(suffix):
                name = full[len("model/params/") : -len(suffix)]
                name = name.replace(".S", "/").replace("..", ".")
                out[name] = r.get_tensor(full)
        return out

    def prepare_restore(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        variables = {k: self.tf.Variable(self.tf.ones(s, self.tf.float32)) for k, s in spec}
        return self._checkpoint(variables), variables

    def restore(self, path: str, prepared: Any) -> Any:
        ckpt, _ = prepared
        ckpt.read(path).assert_consumed()

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        _, variables = prepared
        return {k: v.numpy() for k, v in variables.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        r = self.tf.train.load_checkpoint(path)
        return r.get_tensor(f"model/params/{_tf_escape(key)}/.ATTRIBUTES/VARIABLE_VALUE")


def _cv_segment(key: str) -> str:
    return key.replace("/", ".")


class CkptVar(Subject):
    """ckptvar through its public API.

    ``api="checkpoint"`` (default): a ``cv.Module`` holding a dict of ``cv.Variable``
    saved with ``cv.Checkpoint(model=...).write(path)``; keys are
    ``model/params/<name with '.' for '/'>``. ``api="save"``: ``cv.save(path, arrays,
    **write_options)`` with the workload's own keys (how writer options such as
    ``durable=False`` are reached). ``cv.load`` results are mapped back to the
    workload's names; ``verify=False`` in the options turns checksums off on load.
    """

    name = "ckptvar"
    PREFIX = "model/params/"

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(options)
        import ckptvar as cv

        self.cv = cv
        self.format = options["format"]
        self.suffix = "." + self.format
        self.api = options.get("api", "checkpoint")
        self.write_options = dict(options.get("write_options") or {})
        self.verify = bool(options.get("verify", True))

    def _module(self, variables: dict[str, Any]) -> Any:
        m = self.cv.Module(name="model")
        m.params = variables
        return m

    def prepare_save(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        if self.api == "save":
            return make_arrays(spec)
        cv = self.cv
        variables = {}
        for k, s in spec:  # filled in place: one allocation per variable, no input copy
            v = cv.Variable(cv.initializers.zeros(), shape=s, dtype="float32", name=k)
            fill(k, np.asarray(v.value()))
            variables[_cv_segment(k)] = v
        return cv.Checkpoint(model=self._module(variables))

    def save(self, path: str, prepared: Any) -> None:
        if self.api == "save":
            self.cv.save(path, prepared, **self.write_options)
        else:
            prepared.write(path)

    def key(self, name: str) -> str:
        return name if self.api == "save" else self.PREFIX + _cv_segment(name)

    def unkey(self, key: str) -> str | None:
        if self.api == "save":
            return key
        if not key.startswith(self.PREFIX):
            return None  # save_counter
        return key[len(self.PREFIX):].replace(".", "/")

    def load(self, path: str) -> dict[str, np.ndarray]:
        got = self.cv.load(path, verify=self.verify)
        out = {}
        for k, v in got.items():
            name = self.unkey(k)
            if name is not None:
                out[name] = v
        return out

    def prepare_restore(self, spec: list[tuple[str, tuple[int, ...]]]) -> Any:
        cv = self.cv
        variables = {_cv_segment(k): cv.Variable(cv.initializers.ones(), shape=s,
                                                  dtype="float32", name=k) for k, s in spec}
        ckpt = cv.Checkpoint(model=self._module(variables))
        materialize(variables)  # the buffers exist (and are backed) before the timed call
        return ckpt, variables

    def restore(self, path: str, prepared: Any) -> Any:
        ckpt, _ = prepared
        return ckpt.restore(path, verify=self.verify)

    def restored_arrays(self, prepared: Any) -> dict[str, np.ndarray]:
        _, variables = prepared
        return {k.replace(".", "/"): np.asarray(v.value()) for k, v in variables.items()}

    def read_one(self, path: str, key: str) -> np.ndarray:
        with self.cv.open(path) as r:
            return r[self.key(key)].read(verify=self.verify)

    def load_gpu(self, path: str) -> dict[str, Any]:
        import cupy as cp

        got = self.cv.load(path, device="GPU:0", verify=self.verify)
        cp.cuda.runtime.deviceSynchronize()
        return {name: v for k, v in got.items() if (name := self.unkey(k)) is not None}


SUBJECT_CLASSES: dict[str, type[Subject]] = {
    "raw": Raw,
    "safetensors": Safetensors,
    "torch": Torch,
    "npz": Npz,
    "h5py": H5py,
    "zarr": Zarr,
    "tf": TF,
    "ckptvar": CkptVar,
}


# --------------------------------------------------------------------------- ckptvar-only ops


class _Model:
    """Builds the workload's Variables from initializers (for restore-as-initialization)."""

    def __init__(self, cv: Any, spec: list[tuple[str, tuple[int, ...]]]) -> None:
        self.cv, self.spec = cv, spec

    def build(self) -> tuple[Any, dict[str, Any]]:
        cv = self.cv
        init = cv.initializers.random_normal(stddev=0.02, seed=1)
        variables = {_cv_segment(k): cv.Variable(init, shape=s, dtype="float32", name=k)
                     for k, s in self.spec}
        m = cv.Module(name="model")
        m.params = variables
        return m, variables


def materialize(variables: dict[str, Any]) -> None:
    """Force every variable's value into memory (a restore may be applied lazily)."""
    for v in variables.values():
        v.value()


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


# --------------------------------------------------------------------------- the job


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


class AnonPeak:
    """Samples RssAnon every few milliseconds on a thread: the peak of private memory.

    VmHWM also counts file pages mapped in (a reader that mmaps the checkpoint shows
    the file's size there although it allocates nothing), so both are reported.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.base = _status("RssAnon")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _status("RssAnon"))

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))

    @property
    def growth(self) -> int:
        return self.peak - self.base


PROFILE: dict[str, Any] = {}


def _timed(fn: Callable[[], Any], peak_ok: bool) -> tuple[float, int, Any]:
    gc.collect()
    reset_peak()
    base = _status("VmRSS")
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
    peak = _status("VmHWM") - base if peak_ok else -1
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


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    workload, op, path = job["workload"], job["op"], job["path"]
    PROFILE["on"] = bool(job.get("profile"))
    t_start = time.perf_counter()
    subject = SUBJECT_CLASSES[job["subject"]](job.get("options") or {})
    t_import = time.perf_counter() - t_start
    spec = spec_for(job)
    nbytes = spec_nbytes(spec)
    peak_ok = reset_peak()
    out: dict[str, Any] = {"nbytes": nbytes, "count": len(spec)}
    touch = 2 * nbytes

    if op in ("save", "setup"):
        prepared = subject.prepare_save(spec)
        remove(path)
        os.sync()
        if op == "setup":
            subject.save(path, prepared)
            os.sync()
            out["disk_bytes"] = disk_bytes(path)
            return out
        touch_and_free(touch)
        t, peak, _ = _timed(lambda: subject.save(path, prepared), peak_ok)
        out["disk_bytes"] = disk_bytes(path)
    elif op.startswith(("load_", "restore_", "verify_")):
        is_restore = "restore" in op
        prepared = None
        if is_restore:
            prepared = subject.prepare_restore(spec)
        prepare_cache(path, op.endswith("cold"), touch, out)
        if is_restore:
            t, peak, _ = _timed(lambda: subject.restore(path, prepared), peak_ok)
            got = subject.restored_arrays(prepared)
        else:
            t, peak, got = _timed(lambda: subject.load(path), peak_ok)
        check_arrays(got, spec, job["quick"])
    elif op in ("gpu_warm", "gpu_cold"):
        init_cuda(job["subject"])  # context creation is not part of any subject's load
        prepare_cache(path, op == "gpu_cold", touch, out)
        t, peak, got = _timed(lambda: subject.load_gpu(path), peak_ok)
        check_arrays(got, spec, job["quick"])
    elif op == "gpu_h2d":
        import cupy as cp
        import cupyx

        init_cuda("raw")
        host = cupyx.empty_pinned((nbytes,), np.uint8)
        host.fill(1)
        dev = cp.empty(nbytes, np.uint8)
        cp.cuda.runtime.deviceSynchronize()

        def h2d() -> None:
            dev.set(host)
            cp.cuda.runtime.deviceSynchronize()

        t, peak, _ = _timed(h2d, peak_ok)
    elif op in ("lazy_warm", "lazy_cold"):
        key = LAZY_KEY
        nb = 4 * int(np.prod(dict(spec)[key]))
        out["nbytes"] = nb
        prepare_cache(path, op == "lazy_cold", 2 * nb, out)
        t, peak, got = _timed(lambda: subject.read_one(path, key), peak_ok)
        check_arrays({key: got}, [(key, dict(spec)[key])], job["quick"])
    elif op in ("init_build_restore", "init_restore_first", "init_build"):
        assert isinstance(subject, CkptVar)
        cv = subject.cv
        model = _Model(cv, spec)
        warm_cache(path)
        touch_and_free(touch)

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
            variables = {_cv_segment(k): cv.Variable(init, shape=s, dtype="float32", name=k)
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
              "init_build": build_only}[op]
        t, peak, variables = _timed(fn, peak_ok)
        if op != "init_build":
            check_arrays({k.replace(".", "/"): np.asarray(v.value())
                          for k, v in variables.items()}, spec, job["quick"])
    elif op in ("bg_blocking", "bg_background", "bg_copy"):
        remove(path)
        os.sync()
        if op == "bg_copy":
            arrays = make_arrays(spec)
            touch_and_free(touch)
            t, peak, _ = _timed(lambda: {k: a.copy() for k, a in arrays.items()}, peak_ok)
        else:
            assert isinstance(subject, CkptVar)
            ckpt = subject.prepare_save(spec)
            prefix = str(Path(path).with_suffix(""))
            touch_and_free(touch)
            if op == "bg_blocking":
                t, peak, _ = _timed(lambda: ckpt.save(prefix, format=subject.format), peak_ok)
            else:
                gc.collect()
                reset_peak()
                base = _status("VmRSS")
                with AnonPeak() as anon:
                    t0 = time.perf_counter()
                    handle = ckpt.save(prefix, format=subject.format, blocking=False)
                    t = time.perf_counter() - t0
                    handle.wait()
                    out["total_s"] = time.perf_counter() - t0
                peak = _status("VmHWM") - base if peak_ok else -1
                out["anon_peak"] = anon.growth
            for f in glob.glob(prefix + "-*"):
                remove(f)
    else:
        raise ValueError(f"unknown op {op!r}")
    out.update(t=t, peak_rss=peak, import_s=t_import, job_s=time.perf_counter() - t_start,
               pid=os.getpid())
    if "anon_peak" in PROFILE and op not in ("bg_background",):
        out["anon_peak"] = PROFILE["anon_peak"]
    if "text" in PROFILE:
        out["profile"] = PROFILE["text"]
    return out


def run_one(job: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The job's result, or ``{"error": ...}`` for any failure (never raises)."""
    try:
        return (probe() if job.get("op") == "probe" else run_job(job)), True
    except Exception as exc:  # noqa: BLE001 - report any failure to the driver
        return {"error": f"{type(exc).__name__}: {exc}"[:500],
                "traceback": traceback.format_exc()[-2000:]}, False


#: What each subject imports: a server imports it once, before forking measurements.
PRELOAD = {"safetensors": ("safetensors", "safetensors.numpy"), "torch": ("torch",),
           "h5py": ("h5py",), "zarr": ("zarr",), "tf": ("tensorflow",),
           "ckptvar": ("ckptvar",)}


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
    _pool()  # the input pool is read-only: children share its pages
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
