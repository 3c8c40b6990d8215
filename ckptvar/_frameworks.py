"""Framework arrays (PyTorch, JAX, CuPy) to NumPy and back, without copies where possible.

Owns the one set of conversion rules between NumPy and the array types of other
frameworks; ``cv.save``, ``cv.load(like=...)`` and ``cv.Variable`` all go through it.
Frameworks are recognised by the module of the value's type and imported only when a
value of theirs is seen (or ``like=`` names one): ``import ckptvar`` never imports them.

To NumPy (:func:`to_numpy`):

- a PyTorch tensor on the CPU becomes a view of its memory (``detach()`` first; zero
  copies), ``torch.bfloat16`` and the float8 types by reinterpreting the bits as the
  same-sized integer and then as the ``ml_dtypes`` type (zero copies too); a CUDA tensor
  costs one device-to-host copy;
- a JAX array on the CPU becomes a read-only view of its buffer (zero copies); on a GPU,
  or sharded over several devices, one copy to the host;
- a CuPy array costs one device-to-host copy;
- anything else with ``__dlpack__`` but no ``__array__`` goes through ``np.from_dlpack``.

From NumPy (:func:`from_numpy`):

- ``"torch"``: ``torch.from_numpy`` shares the memory (zero copies), bfloat16 and float8
  through the same bit reinterpretation;
- ``"jax"``: ``jax.device_put(..., may_alias=True)`` on the CPU shares the memory when
  the buffer is 64-byte aligned (XLA's requirement) and copies it once otherwise;
- ``"cupy"``: always one host-to-device copy (``cv.load`` streams it, see ``device=``);
- ``"numpy"``: the array itself.

>>> import numpy as np
>>> a = np.arange(3, dtype=np.float32)
>>> to_numpy(a) is a, framework_of(a), from_numpy(a, "numpy") is a
(True, None, True)
"""

from __future__ import annotations

import importlib
from typing import Any

import ml_dtypes
import numpy as np

from .errors import CkptError

__all__ = ["LIKES", "FrameworkError", "check_like", "framework_of", "from_numpy", "to_numpy"]

#: The values ``cv.load(like=...)`` accepts.
LIKES = ("numpy", "torch", "jax", "cupy")

_PREFIXES = (("torch", "torch"), ("jaxlib", "jax"), ("jax", "jax"), ("cupy", "cupy"))

#: torch dtypes NumPy has no native type for: (same-sized integer view, ml_dtypes type).
_TORCH_BITS: dict[str, tuple[str, np.dtype]] = {
    "bfloat16": ("int16", np.dtype(ml_dtypes.bfloat16)),
    "float8_e4m3fn": ("uint8", np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": ("uint8", np.dtype(ml_dtypes.float8_e5m2)),
}
_BITS_BY_NP: dict[np.dtype, tuple[str, str]] = {
    np_dt: (name, view) for name, (view, np_dt) in _TORCH_BITS.items()
}


class FrameworkError(CkptError, TypeError):
    """A framework array that cannot be converted (an unsupported dtype or kind)."""


def framework_of(value: Any) -> str | None:
    """``"torch"``, ``"jax"`` or ``"cupy"`` for an array of that framework, else ``None``.

    Decided from the module of ``type(value)``, so nothing is imported to find out.
    """
    if isinstance(value, np.ndarray):
        return None
    mod = type(value).__module__
    for prefix, name in _PREFIXES:
        if mod == prefix or mod.startswith(prefix + "."):
            return name
    return None


def to_numpy(value: Any, *, what: str = "the value") -> Any:
    """A NumPy array for a framework array (a view on the CPU); other values unchanged.

    ``what`` names the value in error messages (e.g. ``"'w' in model.h5"``).
    """
    fw = framework_of(value)
    if fw is None:
        if (
            not isinstance(value, np.ndarray)
            and hasattr(value, "__dlpack__")
            and not hasattr(value, "__array__")
        ):
            return np.from_dlpack(value)
        return value
    try:
        if fw == "torch":
            return _torch_to_numpy(value)
        if fw == "cupy":
            return value.get()
        return np.asarray(value)  # jax: a view of a CPU buffer, else one copy to the host
    except (TypeError, RuntimeError, ValueError) as exc:
        if isinstance(exc, CkptError):
            raise
        raise FrameworkError(
            f"Cannot convert {what} ({type(value).__module__}.{type(value).__qualname__}, "
            f"dtype {getattr(value, 'dtype', '?')}) to a NumPy array: {exc}"
        ) from exc


def _torch_to_numpy(t: Any) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # the one device-to-host copy
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = str(t.dtype).removeprefix("torch.")
    bits = _TORCH_BITS.get(name)
    if bits is not None:
        torch = importlib.import_module("torch")
        arr: np.ndarray = t.view(getattr(torch, bits[0])).numpy().view(bits[1])
        return arr
    out: np.ndarray = t.numpy()
    return out


def check_like(like: str) -> str:
    """``like`` itself when it names a framework :data:`LIKES` knows, else ``ValueError``."""
    if like not in LIKES:
        raise ValueError(f"like= must be one of {list(LIKES)!r}, got {like!r}.")
    return like


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise FrameworkError(
            f"like={name!r} needs {name}, which is not installed: {exc}"
        ) from exc


def from_numpy(array: Any, like: str, *, what: str = "the value") -> Any:
    """``array`` (NumPy on the host, or CuPy on a GPU) as an array of framework ``like``.

    From the host: torch shares the memory; jax shares it when it is 64-byte aligned and
    copies once otherwise; cupy copies to the current device. From a CuPy array, torch
    and jax take the device memory through DLPack (zero copies).
    """
    check_like(like)
    if like == "numpy":
        return array
    mod = _import(like)
    on_gpu = framework_of(array) == "cupy"
    if like == "cupy":
        return array if on_gpu else mod.asarray(array)
    if on_gpu:
        if like == "torch":
            return mod.from_dlpack(array)
        return importlib.import_module("jax.dlpack").from_dlpack(array)
    if like == "torch":
        return _numpy_to_torch(mod, array, what)
    return _numpy_to_jax(mod, array)


def _numpy_to_torch(torch: Any, array: np.ndarray, what: str) -> Any:
    if not array.flags.writeable:
        array = array.copy()  # torch tensors are writable: never alias read-only memory
    bits = _BITS_BY_NP.get(array.dtype)
    if bits is not None:
        name, view = bits
        return torch.from_numpy(array.view(view)).view(getattr(torch, name))
    try:
        return torch.from_numpy(array)
    except TypeError as exc:
        raise FrameworkError(
            f"Cannot give {what} ({array.dtype}) as a torch tensor: {exc}; "
            "load it with like='numpy' instead."
        ) from exc


def _numpy_to_jax(jax: Any, array: np.ndarray) -> Any:
    cpu = jax.devices("cpu")[0]
    try:
        return jax.device_put(array, cpu, may_alias=True)
    except TypeError:  # an older jax without may_alias=: one copy
        return jax.device_put(array, cpu)
