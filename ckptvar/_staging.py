"""GPU arrays to the host through a bounded, reused, double-buffered pinned buffer.

A save never makes a host copy of a GPU value: :func:`staged` wraps a CUDA torch
tensor, a CuPy array or a JAX array on a GPU as a :class:`~ckptvar.storage.Chunked`
value, whose bytes ckptvar's own writers (HDF5, Zarr) take a piece at a time. Each
piece is copied device → host on a CUDA stream into one half of a pinned buffer while
the writer writes (and hashes) the other half; an event says when a half is full. The
two halves are allocated once per process and framework and reused by every later
save; a lock lets one value at a time use them (a background save and a foreground one
take turns per value).

Each half is ``CKPTVAR_STAGING_BYTES`` bytes (default 64 MiB, so 128 MiB of pinned
memory in all), rounded down to a multiple of 64 KiB (at least 64 KiB). A value that is
not C-contiguous on its device is first made contiguous there (device memory, not
host). Every writer takes the pieces as they come (other tools' formats and compressed
Zarr included, docs/frameworks.md), so no writer holds a host copy of a GPU value.

Without a GPU nothing here runs: on the CPU, framework arrays are views of their memory.

>>> staging_bytes() % (64 << 10) == 0
True
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._frameworks import framework_of, from_numpy, to_numpy
from .storage.chunked import is_chunked, piece_bytes

__all__ = ["DeviceValue", "element_dtype", "fill_device", "fill_device_rows", "fillable", "is_on_gpu",
           "row_slabs", "staged", "staged_copy", "staging_bytes", "to_writable", "upload"]

def staging_bytes() -> int:
    """The size of each half of the pinned staging buffer (``CKPTVAR_STAGING_BYTES``)."""
    return piece_bytes()


def is_on_gpu(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, CuPy array or JAX array on a CUDA device."""
    fw = framework_of(value)
    if fw == "cupy":
        return True
    if fw == "torch":
        return bool(value.device.type == "cuda")
    if fw == "jax":
        try:
            devices = value.devices()
        except (AttributeError, RuntimeError):
            return False
        return len(devices) == 1 and next(iter(devices)).platform == "gpu"
    return False


def to_writable(value: Any, *, what: str = "the value") -> Any:
    """What a writer takes for ``value``: a staged :class:`DeviceValue` for a GPU array,
    a NumPy array (a view where possible) otherwise."""
    if type(value) is np.ndarray or is_chunked(value):
        return value
    if is_on_gpu(value):
        return staged(value)
    return to_numpy(value, what=what)


# -- the pinned buffer ---------------------------------------------------------------------


class _Halves:
    """Two pinned host buffers of one framework, allocated once, and who holds them."""

    def __init__(self, alloc: Callable[[int], tuple[Any, np.ndarray]], size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        pairs = [alloc(size) for _ in range(2)]
        self.owners = [p[0] for p in pairs]  # keep the allocations alive
        self.views: list[np.ndarray] = [p[1] for p in pairs]


_halves: dict[str, _Halves] = {}
_halves_lock = threading.Lock()


def _pinned(kind: str) -> _Halves:
    size = staging_bytes()
    with _halves_lock:
        h = _halves.get(kind)
        if h is None or h.size != size:
            h = _halves[kind] = _Halves(_ALLOC[kind], size)
        return h


def _alloc_torch(n: int) -> tuple[Any, np.ndarray]:
    torch = importlib.import_module("torch")
    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    return t, t.numpy()


def _alloc_cupy(n: int) -> tuple[Any, np.ndarray]:
    cp = importlib.import_module("cupy")
    mem = cp.cuda.alloc_pinned_memory(n)
    return mem, np.frombuffer(mem, np.uint8, n)


_ALLOC: dict[str, Callable[[int], tuple[Any, np.ndarray]]] = {
    "torch": _alloc_torch, "cupy": _alloc_cupy,
}


# -- device values ---------------------------------------------------------------------------


class _TorchCopier:
    """Device → pinned copies of a flat ``uint8`` view of a CUDA tensor, on a side stream."""

    kind = "torch"

    def __init__(self, t: Any) -> None:
        torch = importlib.import_module("torch")
        self.torch = torch
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        self.flat = t.contiguous().reshape(-1).view(torch.uint8)
        self.device = t.device
        self.stream = torch.cuda.Stream(device=t.device)
        # The copies wait for the work that made the tensor (on the current stream).
        self.stream.wait_stream(torch.cuda.current_stream(t.device))

    def start(self, owner: Any, dst: np.ndarray, start: int, n: int) -> Any:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            owner[:n].copy_(self.flat[start : start + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


class _CupyCopier:
    """Device → pinned copies of a flat ``uint8`` view of a CuPy array, on a side stream."""

    kind = "cupy"

    def __init__(self, a: Any) -> None:
        cp = importlib.import_module("cupy")
        self.cp = cp
        self.device = a.device
        with a.device:
            self.flat = cp.ascontiguousarray(a).reshape(-1).view(cp.uint8)
            self.stream = cp.cuda.Stream(non_blocking=True)
            # The copies wait for the work queued so far on the current stream.
            self.stream.wait_event(cp.cuda.get_current_stream().record())

    def start(self, owner: Any, dst: np.ndarray, start: int, n: int) -> Any:
        cp = self.cp
        with self.device:
            cp.cuda.runtime.memcpyAsync(
                dst.ctypes.data, self.flat.data.ptr + start, n,
                cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
            return self.stream.record()

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


class DeviceValue:
    """A GPU array as a :class:`~ckptvar.storage.Chunked` value (see the module's text).

    ``byte_chunks()`` copies the next piece into one half of the pinned buffer while the
    caller uses the other; the view it yields is valid until the next is asked for.
    """

    def __init__(self, copier: Any, shape: tuple[int, ...], dtype: np.dtype, nbytes: int,
                 keep: Any = None) -> None:
        self.copier = copier
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self._keep = keep  # the array the flat view belongs to (kept alive)

    def byte_chunks(self) -> Iterator[memoryview]:
        total = self.nbytes
        if not total:
            return
        halves = _pinned(self.copier.kind)
        size = halves.size
        start, wait = self.copier.start, self.copier.wait
        with halves.lock:
            pending = start(halves.owners[0], halves.views[0], 0, min(size, total))
            try:
                pos, i = 0, 0
                while pos < total:
                    n = min(size, total - pos)
                    wait(pending)
                    pending = None
                    nxt = pos + n
                    if nxt < total:  # fill the other half while this one is used
                        k = (i + 1) % 2
                        pending = start(halves.owners[k], halves.views[k], nxt,
                                        min(size, total - nxt))
                    yield halves.views[i % 2][:n].data
                    pos, i = nxt, i + 1
            finally:  # never hand the halves on with a copy still landing in one
                if pending is not None:
                    wait(pending)


def staged(value: Any) -> DeviceValue:
    """``value`` (a GPU array of torch, CuPy or JAX) as a :class:`DeviceValue`."""
    fw = framework_of(value)
    if fw == "jax":  # through DLPack, no copy: to torch when it has CUDA, else to CuPy
        try:
            torch = importlib.import_module("torch")
            value = torch.utils.dlpack.from_dlpack(value)
            fw = "torch"
        except (ImportError, RuntimeError, TypeError, AttributeError):
            value = importlib.import_module("cupy").from_dlpack(value)
            fw = "cupy"
    if fw == "torch":
        dtype = element_dtype(value)
        copier: Any = _TorchCopier(value)
    elif fw == "cupy":
        dtype = np.dtype(value.dtype)
        copier = _CupyCopier(value)
    else:
        raise TypeError(f"Not a GPU array: {type(value).__module__}.{type(value).__qualname__}")
    shape = tuple(int(n) for n in value.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return DeviceValue(copier, shape, dtype, nbytes, keep=value)


def staged_copy(value: Any) -> DeviceValue:
    """A copy of GPU ``value`` made on its own device (a background save's snapshot:
    device memory, no host copy), staged like :func:`staged`."""
    fw = framework_of(value)
    if fw == "torch":
        return staged(value.detach().clone(memory_format=_contiguous()))
    if fw == "cupy":
        with value.device:
            return staged(value.copy())
    return staged(value)  # a jax.Array is immutable: no copy needed


def _contiguous() -> Any:
    return importlib.import_module("torch").contiguous_format


def element_dtype(t: Any) -> np.dtype:
    """The NumPy (or ml_dtypes) dtype of a torch tensor's elements, without a copy."""
    if framework_of(t) != "torch":
        dt: np.dtype = np.dtype(t.dtype)
        return dt
    torch = importlib.import_module("torch")
    probe = torch.empty(0, dtype=t.dtype)  # on the CPU: the same rules as to_numpy
    out: np.dtype = np.dtype(to_numpy(probe).dtype)
    return out


# -- the other way: stored values into GPU memory ---------------------------------------------


def fill_device(reader: Any, key: str, dst: Any, *, verify: bool = True) -> None:
    """Read stored value ``key`` into GPU array ``dst`` (a CuPy array or CUDA torch tensor,
    C-contiguous, of the stored shape and itemsize) through the pinned buffer.

    ``reader`` reads runs of elements (``storage.SupportsRuns``): each piece is read
    (and, with ``verify``, checked by the blocks that hold it) into one half while the
    other half's host → device copy runs; host memory never holds more than the buffer.
    """
    fw = framework_of(dst)
    info = reader.info(key)
    dtype = np.dtype(info.dtype)
    total = int(info.size)
    if not total:
        return
    halves = _pinned("torch" if fw == "torch" else "cupy")
    per = max(1, halves.size // dtype.itemsize)
    upload = _TorchUpload(dst) if fw == "torch" else _CupyUpload(dst)
    with halves.lock:
        events: list[Any] = [None, None]
        try:
            for i, start in enumerate(range(0, total, per)):
                k = i % 2
                if events[k] is not None:  # this half's last copy to the device is done
                    upload.wait(events[k])
                    events[k] = None
                count = min(per, total - start)
                host = halves.views[k][: count * dtype.itemsize].view(dtype)
                reader.read_run_into(key, start, host, verify=verify)
                events[k] = upload.start(halves.owners[k], host, start * dtype.itemsize)
        finally:
            for ev in events:
                if ev is not None:
                    upload.wait(ev)


def row_slabs(shape: tuple[int, ...], itemsize: int, budget: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each slab of whole leading rows of an array of ``shape``
    that fits ``budget`` bytes (a 0-d array: one slab); ``[]`` when one row does not fit.

    >>> row_slabs((10, 4), 4, 48)
    [(0, 3), (3, 3), (6, 3), (9, 1)]
    >>> row_slabs((), 8, 64), row_slabs((2, 100), 4, 64)
    ([(0, 1)], [])
    """
    if not shape:
        return [(0, 1)] if itemsize <= budget else []
    row = itemsize
    for n in shape[1:]:
        row *= n
    per = budget // row if row else shape[0]
    if per < 1:
        return []
    return [(i, min(per, shape[0] - i)) for i in range(0, shape[0], per)]


def fill_device_rows(read_rows: Callable[[int, np.ndarray], None], dtype: np.dtype,
                     dst: Any) -> bool:
    """Fill GPU array ``dst`` (C-contiguous, elements of ``dtype``'s size) through the
    pinned buffer, a slab of whole leading rows at a time: ``read_rows(first, out)`` reads
    rows ``first:first + len(out)`` of the value into host array ``out`` (one half of the
    buffer, of ``dtype``) while the other half's copy to the device runs.

    Returns False, having done nothing, when one row is larger than a half (the caller
    then reads the value to the host whole and copies it).
    """
    fw = framework_of(dst)
    shape = tuple(int(n) for n in dst.shape)
    dtype = np.dtype(dtype)
    if 0 in shape:
        return True  # nothing to copy
    halves = _pinned("torch" if fw == "torch" else "cupy")
    slabs = row_slabs(shape, dtype.itemsize, halves.size)
    if not slabs:
        return False
    row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    upload = _TorchUpload(dst) if fw == "torch" else _CupyUpload(dst)
    with halves.lock:
        events: list[Any] = [None, None]
        try:
            for i, (first, rows) in enumerate(slabs):
                k = i % 2
                if events[k] is not None:  # this half's last copy to the device is done
                    upload.wait(events[k])
                    events[k] = None
                host = halves.views[k][: rows * row].view(dtype)
                host = host.reshape((rows, *shape[1:])) if shape else host.reshape(())
                read_rows(first, host)
                events[k] = upload.start(halves.owners[k], host, first * row)
        finally:
            for ev in events:
                if ev is not None:
                    upload.wait(ev)
    return True


def fillable(dst: Any) -> bool:
    """Whether :func:`fill_device` can write into ``dst`` in place (C-contiguous)."""
    if framework_of(dst) == "torch":
        return bool(dst.is_contiguous())
    return bool(dst.flags.c_contiguous)


def upload(host: np.ndarray, dst: Any) -> None:
    """Copy host array ``host`` into GPU array ``dst`` (same shape), in place."""
    if framework_of(dst) == "torch":
        src = from_numpy(np.ascontiguousarray(host), "torch")
        with importlib.import_module("torch").no_grad():
            dst.copy_(src.reshape(dst.shape))
        return
    with dst.device:
        dst[...] = importlib.import_module("cupy").asarray(host).reshape(dst.shape)


class _TorchUpload:
    def __init__(self, t: Any) -> None:
        torch = importlib.import_module("torch")
        self.torch = torch
        self.flat = t.detach().reshape(-1).view(torch.uint8)
        self.stream = torch.cuda.Stream(device=t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        self.device = t.device

    def start(self, owner: Any, host: np.ndarray, at: int) -> Any:
        torch = self.torch
        n = host.nbytes
        with torch.cuda.stream(self.stream):
            self.flat[at : at + n].copy_(owner[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()
        # later work on the current stream sees the bytes
        self.torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _CupyUpload:
    def __init__(self, a: Any) -> None:
        cp = importlib.import_module("cupy")
        self.cp = cp
        self.device = a.device
        self.ptr = int(a.data.ptr)
        with a.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.stream.wait_event(cp.cuda.get_current_stream().record())

    def start(self, owner: Any, host: np.ndarray, at: int) -> Any:
        cp = self.cp
        with self.device:
            cp.cuda.runtime.memcpyAsync(self.ptr + at, host.ctypes.data, host.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            return self.stream.record()

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()
