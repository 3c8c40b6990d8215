"""How a variable behaves as an array: operators, the NumPy protocols, slices, buffer copies.

Owns :class:`ArrayBehaviour` (the mixin that gives ``Variable`` its arithmetic, comparison
and in-place operators, ``__array__``, ``__array_ufunc__``, ``__array_function__``,
indexing, ``len``/``iter``/``bool``/``int``/``float``/``index``), :class:`VariableSlice`
(and its CuPy twin) returned by ``variable[index]`` with an ``assign`` method, and the
helpers that copy into a buffer on the host or a GPU (:func:`write_into`,
:func:`match_backend`). A class using the mixin supplies ``_materialize()``, ``numpy()``,
``read_value()``, ``assign()`` and ``_assign_slice()``.

>>> import numpy as np
>>> s = np.arange(4.0).view(VariableSlice)
>>> type(s + 1) is np.ndarray, s[1:].tolist()
(True, [1.0, 2.0, 3.0])
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._dtypes import check_value_castable, dtype_name
from ..device import Device, cupy_or_none, is_device_array, to_host
from ..errors import CkptError, DeviceError, DTypeLockError, ShapeLockError
from ._shapes import Shape, VariableArgumentError

__all__ = [
    "ArrayBehaviour",
    "VariableSlice",
    "match_backend",
    "operand",
    "write_into",
]


class VariableSlice(np.ndarray):
    """The array ``variable[index]`` returns: a copy of the selected values, plus ``assign``.

    ``v[:2, :2].assign(x)`` writes ``x`` into that part of ``v`` in place. Arithmetic on a
    slice returns plain NumPy arrays.
    """

    _variable: Any
    _index: Any

    def __array_finalize__(self, obj: Any) -> None:
        self._variable = None
        self._index = None

    def assign(self, value: Any) -> Any:
        """Write ``value`` (broadcast to this slice's shape) into the variable; returns it."""
        if self._variable is None:
            raise VariableArgumentError(
                "Only an array taken directly from a variable by indexing can be assigned."
            )
        return self._variable._assign_slice(self._index, value)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(x.view(np.ndarray) if isinstance(x, VariableSlice) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, VariableSlice) else x
                                  for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, index: Any) -> Any:
        return self.view(np.ndarray)[index]

    def __repr__(self) -> str:
        return repr(self.view(np.ndarray))

    def __reduce__(self) -> Any:
        return self.view(np.ndarray).__reduce__()


def _slice_result(selected: Any, variable: Any, index: Any) -> Any:
    if isinstance(selected, np.ndarray) or np.isscalar(selected) or isinstance(selected,
                                                                               np.generic):
        out = np.array(selected, copy=True).view(VariableSlice)
    else:  # a CuPy array: attach assign() through a subclass when CuPy allows it
        out = _as_cupy_slice(selected.copy())
        if out is None:
            return selected.copy()
    out._variable = variable
    out._index = index
    return out


def _as_cupy_slice(arr: Any) -> Any:
    """``arr`` (a CuPy array) as a ``CupyVariableSlice`` over the same memory, or None."""
    cls = _cupy_slice_class()
    if cls is None:
        return None
    try:
        out = arr.view(array_class=cls)
    except TypeError:  # a CuPy without view(array_class=): build the subclass over the memory
        out = None
    if not isinstance(out, cls):
        try:
            out = cls(arr.shape, arr.dtype, arr.data, strides=arr.strides)
        except TypeError:
            return None
    return out


@functools.cache
def _cupy_slice_class() -> Any:
    """``CupyVariableSlice`` (a ``cupy.ndarray`` with ``assign``), or None without CuPy."""
    cp = cupy_or_none()
    if cp is None:
        return None

    class CupyVariableSlice(cp.ndarray):  # type: ignore[misc,name-defined]
        _variable: Any = None
        _index: Any = None

        def assign(self, value: Any) -> Any:
            if self._variable is None:
                raise VariableArgumentError(
                    "Only an array taken directly from a variable can be assigned."
                )
            return self._variable._assign_slice(self._index, value)

    return CupyVariableSlice


def operand(x: Any) -> Any:
    """``x`` itself, or a variable's value as an operand (a read-only view on the CPU)."""
    return x._operand() if isinstance(x, ArrayBehaviour) else x


def _binary(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        return op(self._operand(), operand(other))

    return method


def _reflected(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        return op(operand(other), self._operand())

    return method


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return op(self._operand())

    return method


def _inplace(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        with self._lock:  # read, compute and write as one step: no write lost in between
            return self.assign(op(self._operand(), operand(other)))

    return method


class ArrayBehaviour:
    """The array side of a variable: protocols and operators over ``self._materialize()``."""

    __array_priority__ = 100.0
    _lock: threading.RLock  # held by every write (re-entrant)
    _name: str
    _shape: Shape
    _dtype: np.dtype

    # supplied by the class that uses the mixin
    def _materialize(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def numpy(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_value(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def assign(self, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _assign_slice(self, index: Any, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def device(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _operand(self) -> Any:
        """The value as an operand: a read-only view on the CPU (no copy), the array on a GPU."""
        value = self._materialize()
        if isinstance(value, np.ndarray):
            view = value.view()
            view.flags.writeable = False
            return view
        return value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self._materialize()
        if copy is False:
            if not isinstance(value, np.ndarray) or (dtype is not None and
                                                     np.dtype(dtype) != value.dtype):
                raise DeviceError(
                    f"Variable {self._name!r} on {self.device} cannot be viewed as a NumPy "
                    f"array of dtype {dtype} without a copy."
                )
            view: np.ndarray = self._operand()
            return view
        host = self.numpy()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = tuple(operand(x) for x in inputs)
        target = inputs[0]
        if method == "at" and isinstance(target, ArrayBehaviour):
            # ufunc.at writes into its first operand in place, and NumPy lets it write
            # through a read-only view: it goes through assign (dtype lock, constraint,
            # the version an incremental checkpoint reads), on a copy of the value
            for value in args[2:]:  # ufunc.at would truncate 0.5 into an int variable
                check_value_castable(value, target._dtype, what=(
                    f"a value given to {ufunc.__name__}.at(variable {target._name!r})"))
            with target._lock:  # read, compute and write as one step
                new = target.numpy()
                ufunc.at(new, *args[1:], **kwargs)
                target.assign(new)
            return None
        out = kwargs.pop("out", None)
        if out is not None and any(isinstance(o, ArrayBehaviour) for o in out):
            # Writing into a variable goes through assign, with its locks, each held from
            # the read to the write (np.add(v, 1, out=v) loses no other thread's write).
            # where= picks the elements written; the others keep the value out= held.
            where = kwargs.pop("where", True) if method == "__call__" else True
            with contextlib.ExitStack() as held:
                for target in sorted({id(o): o for o in out if isinstance(o, ArrayBehaviour)}
                                     .values(), key=id):
                    held.enter_context(target._lock)
                return _ufunc_into(getattr(ufunc, method), args, tuple(out), kwargs, where)
        if out is not None:
            kwargs["out"] = out
        return getattr(ufunc, method)(*args, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        buffers: list[Any] = []

        def unwrap(x: Any) -> Any:
            if isinstance(x, ArrayBehaviour):
                value = x._operand()
                buffers.append(value)
                return value
            if isinstance(x, list | tuple):
                return type(x)(unwrap(i) for i in x)
            if isinstance(x, dict):
                return {k: unwrap(v) for k, v in x.items()}
            return x

        out = kwargs.get("out")
        targets = out if isinstance(out, tuple) else (out,)
        if any(isinstance(t, ArrayBehaviour) for t in targets):
            _write_out(func, targets, lambda given: func(
                *unwrap(args), **unwrap({**kwargs, "out": given if isinstance(out, tuple)
                                         else given[0]})))
            return out
        result = func(*unwrap(args), **unwrap(kwargs))
        return _detach(result, buffers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, ArrayBehaviour):
            index = index._operand()
        with self._lock:  # the copy is taken whole: never half of a concurrent write
            return _slice_result(self._materialize()[index], self, index)

    def __setitem__(self, index: Any, value: Any) -> None:
        self._assign_slice(index, value)

    def __len__(self) -> int:
        if self._shape and self._shape[0] is not None:
            return self._shape[0]
        return len(self._materialize())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.read_value())

    def __bool__(self) -> bool:
        return bool(self._materialize())

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __complex__(self) -> complex:
        return complex(self.numpy())

    def __index__(self) -> int:
        if self._dtype.kind not in "iu":
            raise DTypeLockError(
                f"Only an integer variable can be used as an index; {self._name!r} is "
                f"{dtype_name(self._dtype)}."
            )
        return operator.index(self.numpy().item())

    __hash__ = object.__hash__

    # --- operators -----------------------------------------------------------------------
    __add__ = _binary(operator.add)
    __radd__ = _reflected(operator.add)
    __sub__ = _binary(operator.sub)
    __rsub__ = _reflected(operator.sub)
    __mul__ = _binary(operator.mul)
    __rmul__ = _reflected(operator.mul)
    __truediv__ = _binary(operator.truediv)
    __rtruediv__ = _reflected(operator.truediv)
    __floordiv__ = _binary(operator.floordiv)
    __rfloordiv__ = _reflected(operator.floordiv)
    __mod__ = _binary(operator.mod)
    __rmod__ = _reflected(operator.mod)
    __pow__ = _binary(operator.pow)
    __rpow__ = _reflected(operator.pow)
    __matmul__ = _binary(operator.matmul)
    __rmatmul__ = _reflected(operator.matmul)
    __divmod__ = _binary(builtins.divmod)
    __rdivmod__ = _reflected(builtins.divmod)
    __and__ = _binary(operator.and_)
    __rand__ = _reflected(operator.and_)
    __or__ = _binary(operator.or_)
    __ror__ = _reflected(operator.or_)
    __xor__ = _binary(operator.xor)
    __rxor__ = _reflected(operator.xor)
    __lshift__ = _binary(operator.lshift)
    __rlshift__ = _reflected(operator.lshift)
    __rshift__ = _binary(operator.rshift)
    __rrshift__ = _reflected(operator.rshift)
    __lt__ = _binary(operator.lt)
    __le__ = _binary(operator.le)
    __gt__ = _binary(operator.gt)
    __ge__ = _binary(operator.ge)
    __eq__ = _binary(operator.eq)
    __ne__ = _binary(operator.ne)
    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __abs__ = _unary(operator.abs)
    __invert__ = _unary(operator.invert)
    # In-place operators write into the variable (NumPy style), through assign.
    __iadd__ = _inplace(operator.add)
    __isub__ = _inplace(operator.sub)
    __imul__ = _inplace(operator.mul)
    __itruediv__ = _inplace(operator.truediv)
    __ifloordiv__ = _inplace(operator.floordiv)
    __imod__ = _inplace(operator.mod)
    __ipow__ = _inplace(operator.pow)
    __imatmul__ = _inplace(operator.matmul)


def _ufunc_into(call: Callable[..., Any], args: tuple[Any, ...], out: tuple[Any, ...],
                kwargs: dict[str, Any], where: Any = True) -> Any:
    """Run a ufunc call, then write each result into its ``out`` (a variable: by assign);
    ``where`` (the ufunc's own) picks the elements written, the others keep their value."""
    result = call(*args, **kwargs)
    results = result if isinstance(result, tuple) else (result,)
    for target, computed in zip(out, results, strict=False):
        res = computed
        if where is not True and target is not None:
            res = np.where(where, computed, operand(target))
        if isinstance(target, ArrayBehaviour):
            target.assign(res)
        elif target is not None:
            target[...] = res
    return out[0] if len(out) == 1 else out


def match_backend(arr: Any, buf: Any) -> Any:
    """``arr`` on the same backend as ``buf`` (host arrays are sent to the GPU)."""
    if isinstance(buf, np.ndarray) or is_device_array(arr):
        return arr
    import cupy

    with cupy.cuda.Device(buf.device.id):
        return cupy.asarray(arr)


def write_into(buf: Any, arr: Any, dev: Device) -> None:
    """Copy ``arr`` into ``buf`` in place (host to device on a GPU)."""
    if isinstance(buf, np.ndarray):
        np.copyto(buf, to_host(arr), casting="unsafe")
        return
    import cupy

    with cupy.cuda.Device(dev.index):
        if isinstance(arr, np.ndarray) and arr.flags.c_contiguous and buf.flags.c_contiguous:
            buf.set(arr)
        else:
            buf[...] = cupy.asarray(arr)


def _write_out(func: Any, targets: tuple[Any, ...], call: Callable[[tuple[Any, ...]], Any],
               ) -> None:
    """``np.clip(v, 0, 1, out=v)``: ``call`` writes into a copy of each variable's value,
    then each is assigned (a variable's own buffer is never written past its locks)."""
    copies = tuple(t._materialize().copy() if isinstance(t, ArrayBehaviour) else t
                   for t in targets)
    names = ", ".join(repr(t._name) for t in targets if isinstance(t, ArrayBehaviour))
    what = f"Cannot write the result of {func.__name__}() into variable {names}"
    try:
        call(copies)
    except CkptError:
        raise
    except TypeError as exc:  # a dtype the variable cannot take
        raise DTypeLockError(f"{what}: {exc}") from None
    except ValueError as exc:  # a shape that does not fit
        raise ShapeLockError(f"{what}: {exc}") from None
    for target, copy in zip(targets, copies, strict=True):
        if isinstance(target, ArrayBehaviour):
            target.assign(copy)


def _detach(result: Any, buffers: list[Any]) -> Any:
    """Copy results of NumPy functions that would alias a variable's buffer."""
    if not buffers:
        return result
    if isinstance(result, tuple | list):
        return type(result)(_detach(r, buffers) for r in result)
    if hasattr(result, "shape") and hasattr(result, "dtype") and not np.isscalar(result):
        for buf in buffers:
            if type(result) is type(buf) and _may_share(result, buf):
                return result.copy()
    return result


def _may_share(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.may_share_memory(a, b))
    import cupy

    return bool(cupy.may_share_memory(a, b))

