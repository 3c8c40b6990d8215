"""Devices: where a variable's memory lives, and the array backend for each place.

Owns the :class:`Device` value (``"CPU:0"``, ``"GPU:1"``), parsing of the spellings users
write (``"cpu"``, ``"GPU:0"``, ``"cuda:1"``, ``"/device:GPU:0"``, ``"/job:w/task:0/device:CPU:0"``),
the :func:`device` placement context, default placement, :func:`list_devices`, placement
logging (:func:`set_log_device_placement`, logger ``"ckptvar"``), and the two array backends:
NumPy for the CPU and CuPy for CUDA GPUs. CuPy is imported lazily, on the first question
about GPUs, and the answer is cached.

Note: the package exports the :class:`device` context manager as ``ckptvar.device``, which
hides this module as an attribute of the package; import from it by name
(``from ckptvar.device import Device``) or with ``importlib.import_module("ckptvar.device")``.

>>> str(Device.parse("/device:cpu:0")), str(Device.parse("gpu")), str(Device.parse("cuda:1"))
('CPU:0', 'GPU:0', 'GPU:1')
>>> with device("CPU:0"):
...     str(current_device())
'CPU:0'
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from .errors import DeviceError

__all__ = [
    "Device",
    "cupy_or_none",
    "current_device",
    "default_device",
    "device",
    "gpu_count",
    "list_devices",
    "log_placement",
    "placement_for",
    "set_log_device_placement",
    "supports_dtype",
    "to_device",
    "to_host",
    "xp_for",
]

logger = logging.getLogger("ckptvar")

_KIND_ALIASES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU"}
_SPEC = re.compile(r"^(?P<kind>[A-Za-z]+)(?::(?P<index>\d+))?$")


@dataclass(frozen=True, order=True)
class Device:
    """A place for arrays: ``Device("CPU", 0)`` prints as ``"CPU:0"``.

    >>> Device.parse("GPU:1") == Device("GPU", 1)
    True
    """

    kind: Literal["CPU", "GPU"]
    index: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "GPU"

    @classmethod
    def parse(cls, spec: str | Device) -> Device:
        """Normalise a device spelling; does not check that the device exists.

        Accepted: ``"CPU"``, ``"cpu:0"``, ``"GPU:1"``, ``"gpu"``, ``"cuda"``, ``"cuda:1"``,
        ``"/device:GPU:0"``, ``"/gpu:0"`` and TensorFlow's full
        ``"/job:localhost/replica:0/task:0/device:CPU:0"``. Raises :class:`DeviceError`
        for anything else.
        """
        if isinstance(spec, Device):
            return spec
        if not isinstance(spec, str):
            raise DeviceError(f"A device is a string like 'CPU:0' or 'GPU:0', not {spec!r}.")
        text = spec.strip()
        if "/" in text:
            # The device is the last path component; "/device:GPU:0" names it after "device:".
            last = [part for part in text.split("/") if part][-1:] or [""]
            text = last[0]
            if text.lower().startswith("device:"):
                text = text[len("device:") :]
        match = _SPEC.match(text)
        kind = _KIND_ALIASES.get(match.group("kind").lower()) if match else None
        if match is None or kind is None:
            raise DeviceError(
                f"Cannot parse device {spec!r}: expected 'CPU:0', 'GPU:<n>' or 'cuda:<n>'."
            )
        return cls(kind, int(match.group("index") or 0))  # type: ignore[arg-type]


# --- backends ---------------------------------------------------------------------------------

_probe_lock = threading.Lock()
_cupy_module: ModuleType | None = None
_gpu_count: int | None = None
_no_gpu_reason = ""  # why gpu_count() is 0, for a DeviceError


def cupy_or_none() -> ModuleType | None:
    """The ``cupy`` module when it imports and sees at least one CUDA device, else ``None``."""
    return _cupy_module if gpu_count() else None


def gpu_count() -> int:
    """How many CUDA devices CuPy sees (0 without CuPy or without a driver); cached."""
    global _cupy_module, _gpu_count, _no_gpu_reason
    if _gpu_count is None:
        with _probe_lock:
            if _gpu_count is None:
                count = 0
                try:
                    import cupy  # noqa: PLC0415 - optional and heavy: imported on first use

                    count = int(cupy.cuda.runtime.getDeviceCount())
                    _cupy_module = cupy
                    if not count:
                        _no_gpu_reason = "CuPy found no CUDA device"
                except ImportError as exc:
                    _no_gpu_reason = (f"CuPy is not installed (pip install 'ckptvar[gpu]'; "
                                      f"import cupy said: {exc})")
                except Exception as exc:  # noqa: BLE001 - any CUDA runtime or driver error
                    count = 0
                    _no_gpu_reason = ("CuPy found no usable CUDA device "
                                      f"({type(exc).__name__}: {exc})")
                _gpu_count = count
    return _gpu_count


def list_devices() -> list[str]:
    """The devices that exist here, CPU first: ``['CPU:0']`` or ``['CPU:0', 'GPU:0', ...]``."""
    return ["CPU:0"] + [f"GPU:{i}" for i in range(gpu_count())]


def _check_exists(dev: Device, spec: Any) -> Device:
    if (dev.kind == "CPU" and dev.index == 0) or (dev.is_gpu and dev.index < gpu_count()):
        return dev
    shown = spec if isinstance(spec, str) else str(spec)
    why = f" No GPU can be used: {_no_gpu_reason}." if dev.is_gpu and not gpu_count() else ""
    raise DeviceError(
        f"Device {shown!r} ({dev}) does not exist here; available devices: "
        f"{', '.join(list_devices())}.{why}"
    )


def resolve(spec: str | Device) -> Device:
    """Parse ``spec`` and check that the device exists (else :class:`DeviceError`)."""
    return _check_exists(Device.parse(spec), spec)


# CuPy has no bfloat16, float8 or int4 arrays.
_GPU_KINDS = frozenset("biufc")


def supports_dtype(dev: Device, dtype: np.dtype) -> bool:
    """Whether arrays of ``dtype`` can live on ``dev``."""
    return not dev.is_gpu or np.dtype(dtype).kind in _GPU_KINDS


def xp_for(dev: Device) -> ModuleType:
    """The array module for ``dev``: ``numpy`` on the CPU, ``cupy`` on a GPU."""
    if dev.is_gpu:
        cp = cupy_or_none()
        if cp is None:
            _check_exists(dev, str(dev))
        return cp  # type: ignore[return-value]
    return np


def to_device(array: np.ndarray, dev: Device) -> Any:
    """A copy of host ``array`` on ``dev`` (a GPU); on the CPU, ``array`` itself."""
    if not dev.is_gpu:
        return array
    cp = xp_for(dev)
    with cp.cuda.Device(dev.index):
        return cp.asarray(array)


def to_host(array: Any) -> np.ndarray:
    """A NumPy array with the contents of ``array`` (copied from a GPU; as-is on the CPU)."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "get") and type(array).__module__.startswith("cupy"):
        host: np.ndarray = array.get()
        return host
    return np.asarray(array)


def is_device_array(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (without importing CuPy)."""
    return type(value).__module__.startswith("cupy") and hasattr(value, "__cuda_array_interface__")


# --- placement ------------------------------------------------------------------------------

_local = threading.local()


def _stack() -> list[Device | None]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class device:  # lower case: a context manager used like a function, as tf.device
    """Place variables created inside the ``with`` block on one device.

    ``device(None)`` goes back to default placement. Asking for a device that does not
    exist raises :class:`DeviceError` at once, listing the devices that do.

    >>> with device("cpu"):
    ...     str(current_device())
    'CPU:0'
    """

    def __init__(self, spec: str | Device | None) -> None:
        self.device: Device | None = None if spec is None else resolve(spec)

    def __enter__(self) -> str | None:
        _stack().append(self.device)
        return None if self.device is None else str(self.device)

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


def current_device() -> Device | None:
    """The device of the innermost :class:`device` block, or ``None`` outside one."""
    stack = _stack()
    return stack[-1] if stack else None


def default_device(dtype: np.dtype) -> Device:
    """The fastest device that supports ``dtype``: ``GPU:0`` when CuPy sees one, else CPU:0."""
    gpu = Device("GPU", 0)
    if gpu_count() and supports_dtype(gpu, dtype):
        return gpu
    return Device("CPU", 0)


def placement_for(dtype: np.dtype, requested: str | Device | None = None) -> Device:
    """Where a new variable of ``dtype`` goes.

    An explicit ``requested`` device must exist and support the dtype (else
    :class:`DeviceError`). Inside a :class:`device` block the block's device is used,
    falling back to the CPU for a dtype the GPU backend lacks (like TensorFlow's soft
    placement). Otherwise :func:`default_device`.
    """
    dtype = np.dtype(dtype)
    if requested is not None:
        dev = resolve(requested)
        if not supports_dtype(dev, dtype):
            raise DeviceError(
                f"Cannot place a {dtype_label(dtype)} array on {dev}: CuPy has no such dtype; "
                "use device='CPU:0'."
            )
        return dev
    ctx = current_device()
    if ctx is not None:
        return ctx if supports_dtype(ctx, dtype) else Device("CPU", 0)
    return default_device(dtype)


def dtype_label(dtype: np.dtype) -> str:
    from ._dtypes import dtype_name  # noqa: PLC0415 - tiny helper, avoids a cycle at import

    return dtype_name(dtype)


# --- placement logging ------------------------------------------------------------------------

_log_placement = False
_own_handler: logging.Handler | None = None


def set_log_device_placement(enabled: bool) -> None:
    """Log (INFO, logger ``"ckptvar"``) the device each new variable is placed on.

    When the ``"ckptvar"`` logger has nowhere to write, a stderr handler is added while
    logging is on, so that the messages are seen, as TensorFlow prints them.
    """
    global _log_placement, _own_handler
    _log_placement = bool(enabled)
    if _log_placement:
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        if not logger.hasHandlers() and _own_handler is None:
            _own_handler = logging.StreamHandler()
            _own_handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(_own_handler)
    elif _own_handler is not None:
        logger.removeHandler(_own_handler)
        _own_handler = None


def log_placement(what: str, dev: Device) -> None:
    """Log one placement when :func:`set_log_device_placement` is on."""
    if _log_placement:
        logger.info("%s placed on device %s", what, dev)

