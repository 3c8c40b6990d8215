"""A variable's lifecycle states and its writes.

Owns the three states a variable is in, exactly one at a time (:class:`Unset`: no value
until ``initialize()``; :class:`Pending`: a value not yet in memory, produced at first use;
:class:`Ready`: the backing array), :class:`FreshValue` (an initial-value function whose
result may be adopted without a copy), and :class:`WriteBehaviour`, the mixin that gives
a variable ``assign``, ``assign_add``, ``assign_sub`` and slice assignment with the dtype
(``same_kind``) and shape locks and the constraint. Every write counts itself once it has
finished (``_wrote``): the variable's version counter, which incremental checkpoints read.

>>> import numpy as np
>>> Ready(np.zeros(2)).value.tolist(), isinstance(Unset(lambda: 0, owned=True), Ready)
([0.0, 0.0], False)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import check_value_castable
from .._frameworks import framework_of, to_numpy
from ..device import Device, is_device_array, to_host
from ..errors import CkptError, DTypeLockError, ShapeLockError
from ._array import match_backend, operand, write_into
from ._rows import RowLog, rows_of, unique_rows
from ._shapes import Shape, compatible, shape_str

__all__ = [
    "FreshValue",
    "Pending",
    "Ready",
    "Unset",
    "WriteBehaviour",
    "convert_value",
    "host_array",
]


@dataclass(frozen=True, slots=True)
class Unset:
    """No value yet (deferred): ``initialize()`` calls ``init``; reads raise."""

    init: Callable[[], Any]
    owned: bool  # whether init() returns a fresh array the variable may adopt


@dataclass(frozen=True, slots=True)
class Pending:
    """Initialized, but the value is produced by ``source()`` at the first read or write."""

    source: Callable[[], Any]
    owned: bool


@dataclass(frozen=True, slots=True)
class Ready:
    """The value is in memory: ``value`` is the backing array (NumPy or CuPy)."""

    value: Any


class FreshValue:
    """A zero-argument function whose result is a new array that a variable may adopt.

    ``Variable(FreshValue(fn), shape=..., dtype=...)`` calls ``fn()`` at the first use,
    without copying its result on the CPU (``get_variable`` binds initializers this way).
    With ``owned=False`` the result may be an array someone else holds (a user's
    initializer may return one it keeps): the variable copies it.
    """

    __slots__ = ("fn", "owned")

    def __init__(self, fn: Callable[[], Any], *, owned: bool = True) -> None:
        self.fn = fn
        self.owned = owned

    def __call__(self) -> Any:
        return self.fn()



class WriteBehaviour:
    """Writes through the locks; the class using it supplies the state and ``_adopt``."""

    _name: str
    _dtype: np.dtype
    _shape: Shape
    _state: Unset | Pending | Ready
    _lock: threading.RLock
    _device_obj: Device
    _constraint: Callable[[Any], Any] | None
    _writes: int
    _exposed: bool
    _row_log: RowLog | None

    def _wrote(self, rows: np.ndarray | None = None) -> None:
        """Count a write that has finished (the version counter, ``_version``); ``rows``:
        the first-axis indices it wrote (None: the whole value), for the row log."""
        self._writes += 1
        log = self._row_log
        if log is not None:
            log.add(self._writes, rows)

    def _materialize(self) -> Any:  # pragma: no cover - supplied by Variable
        raise NotImplementedError

    def _adopt(self, arr: Any, *, owned: bool) -> Any:  # pragma: no cover - supplied by Variable
        raise NotImplementedError

    def _convert(self, value: Any, what: str) -> Any:
        """``value`` as an array of this dtype (host, or device on a GPU); checks same_kind."""
        value = operand(value)
        if framework_of(value) in ("torch", "jax"):  # as for an initial value: NumPy, not a dtype clash
            value = to_numpy(value, what=what)
        if is_device_array(value):
            if not self._device_obj.is_gpu:
                value = to_host(value)
            else:
                check_value_castable(value, self._dtype, what=what)
                return value.astype(self._dtype, copy=False)
        return host_array(value, self._dtype, what)

    def _shape_error(self, shape: tuple[int, ...], target: Shape, what: str = "") -> ShapeLockError:
        return ShapeLockError(
            f"Cannot assign to variable {self._name!r}{what}: shape {tuple(shape)} does not "
            f"match the variable's shape {shape_str(target)}."
        )

    def _constrained(self, new: Any) -> Any:
        result = self._constraint(new)  # type: ignore[misc]
        result = self._convert(result, f"the result of the constraint of {self._name!r}")
        if tuple(result.shape) != tuple(new.shape):
            raise ShapeLockError(
                f"The constraint of variable {self._name!r} returned shape "
                f"{tuple(result.shape)}; expected {tuple(new.shape)}."
            )
        return result

    def assign(self, value: Any) -> Any:
        """Write ``value`` in place (same buffer); returns the variable.

        The value is converted to the variable's dtype (``same_kind``) and must have the
        variable's shape. On any error the value is unchanged.
        """
        what = f"a value assigned to variable {self._name!r}"
        arr = self._convert(value, what)
        if not compatible(self._shape, tuple(arr.shape)):
            raise self._shape_error(arr.shape, self._shape)
        with self._lock:
            if self._constraint is not None:
                arr = self._constrained(arr.copy())
            state = self._state
            if isinstance(state, Ready) and tuple(state.value.shape) == tuple(arr.shape):
                write_into(state.value, arr, self._device_obj)
            else:  # first value, or a new shape along an unlocked dimension
                self._state = Ready(self._adopt(arr.copy(), owned=True))
            self._wrote()
        return self

    def _no_arithmetic_on_bool(self, method: str) -> None:
        """Refuse adding to (or subtracting from) a bool variable, as TensorFlow does:
        NumPy would make ``True + True`` a silent ``or`` and refuse ``-`` with its own error."""
        if self._dtype == np.bool_:
            raise DTypeLockError(
                f"{method} on bool variable {self._name!r}: a bool has no addition or "
                "subtraction; assign the new value instead (v.assign(np.logical_or(v, x)))."
            )

    def _update(self, delta: Any, op: Any, verb: str) -> Any:
        self._no_arithmetic_on_bool("assign_add" if op is np.add else "assign_sub")
        what = f"a value {verb} variable {self._name!r}"
        arr = self._convert(delta, what)
        with self._lock:
            buf = self._materialize()
            try:
                out_shape = np.broadcast_shapes(tuple(buf.shape), tuple(arr.shape))
            except ValueError:
                out_shape = None
            if out_shape != tuple(buf.shape):
                raise self._shape_error(arr.shape, tuple(buf.shape))
            if self._constraint is not None:
                new = self._constrained(op(buf, match_backend(arr, buf)).astype(self._dtype))
                write_into(buf, new, self._device_obj)
            else:
                op(buf, match_backend(arr, buf), out=buf)  # same dtype: no casting
            self._wrote()
        return self

    def assign_add(self, delta: Any) -> Any:
        """Add ``delta`` (broadcastable to the variable's shape) in place; returns the variable."""
        return self._update(delta, np.add, "added to")

    def assign_sub(self, delta: Any) -> Any:
        """Subtract ``delta`` in place; returns the variable."""
        return self._update(delta, np.subtract, "subtracted from")

    def _assign_slice(self, index: Any, value: Any) -> Any:
        what = f"a value assigned to variable {self._name!r}[...]"
        arr = self._convert(value, what)
        with self._lock:
            buf = self._materialize()
            target_shape = tuple(buf[index].shape)
            try:
                ok = np.broadcast_shapes(target_shape, tuple(arr.shape)) == target_shape
            except ValueError:
                ok = False
            if not ok:
                raise ShapeLockError(
                    f"Cannot assign to a slice of variable {self._name!r}: shape "
                    f"{tuple(arr.shape)} does not match the slice's shape {target_shape}."
                )
            rows = rows_of(index, buf.shape[0]) if buf.ndim else None
            if self._constraint is not None:
                new = buf.copy()
                new[index] = match_backend(arr, buf)
                write_into(buf, self._constrained(new), self._device_obj)
                rows = None  # the constraint may change any row
            else:
                buf[index] = match_backend(arr, buf)
            self._wrote(rows)
        return self

    def scatter_update(self, indices: Any, updates: Any) -> Any:
        """Write ``updates[i]`` into row ``indices[i]`` (first axis) in place; returns the
        variable. ``updates`` has shape ``indices.shape + shape[1:]`` (or broadcasts to
        it); with a repeated index, the last update wins. Row numbers run from 0 to
        ``shape[0] - 1``, as TensorFlow's: any other (a negative one too) raises
        ``IndexError`` and nothing is written."""
        return self._scatter(indices, updates, None, "scatter_update")

    def scatter_add(self, indices: Any, updates: Any) -> Any:
        """Add ``updates[i]`` to row ``indices[i]`` in place (repeated indices add up, as
        ``np.add.at``); returns the variable."""
        return self._scatter(indices, updates, np.add, "scatter_add")

    def scatter_sub(self, indices: Any, updates: Any) -> Any:
        """Subtract ``updates[i]`` from row ``indices[i]`` in place (repeated indices
        count each time); returns the variable."""
        return self._scatter(indices, updates, np.subtract, "scatter_sub")

    def _scatter_rows(self, idx: np.ndarray, n: int, verb: str) -> np.ndarray:
        """``idx`` as flat int64 row numbers, each in ``[0, n)`` (else ``IndexError``)."""
        flat = idx.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            bad = int(flat[(flat < 0) | (flat >= n)][0])
            hint = (" (row numbers count from 0, as TensorFlow's scatter indices; a "
                    "negative one does not count from the end)" if bad < 0 else "")
            raise IndexError(f"{verb} on variable {self._name!r}: row {bad} is outside "
                             f"its {n} rows [0, {n}){hint}.")
        return flat

    def _scatter(self, indices: Any, updates: Any, op: Any, verb: str) -> Any:
        if op is not None:
            self._no_arithmetic_on_bool(verb)
        idx = _row_indices(indices, f"{verb} on variable {self._name!r}")
        arr = self._convert(updates, f"the updates of {verb} on variable {self._name!r}")
        with self._lock:
            buf = self._materialize()
            if not buf.ndim:
                raise ShapeLockError(f"{verb} on variable {self._name!r}: a scalar has no rows.")
            n = buf.shape[0]
            flat = self._scatter_rows(idx, n, verb)
            target = tuple(idx.shape) + tuple(buf.shape[1:])
            try:
                ok = np.broadcast_shapes(target, tuple(arr.shape)) == target
            except ValueError:
                ok = False
            if not ok:
                raise ShapeLockError(
                    f"{verb} on variable {self._name!r}: updates of shape {tuple(arr.shape)} "
                    f"do not match indices {tuple(idx.shape)} and rows {tuple(buf.shape[1:])}."
                )
            upd = match_backend(np.broadcast_to(arr, target) if isinstance(arr, np.ndarray)
                                else arr, buf)
            # the rows written: for the row log, and a GPU's check of repeated indices
            rows = (unique_rows(flat) if self._row_log is not None
                    or not isinstance(buf, np.ndarray) else None)
            target_buf = buf.copy() if self._constraint is not None else buf
            if op is None:
                target_buf[flat] = upd.reshape((flat.size, *buf.shape[1:]))
            elif isinstance(target_buf, np.ndarray):
                op.at(target_buf, flat, upd.reshape((flat.size, *buf.shape[1:])))
            else:  # a device array: no ufunc.at; repeated indices are refused
                if rows is not None and rows.size != flat.size:
                    raise ValueError(f"{verb} on variable {self._name!r} on {self._device_obj}: "
                                     "repeated indices are not supported on a GPU.")
                part = target_buf[flat]
                target_buf[flat] = op(part, upd.reshape(part.shape))
            if self._constraint is not None:
                write_into(buf, self._constrained(target_buf), self._device_obj)
                rows = None
            self._wrote(rows)
        return self



def host_array(value: Any, dtype: np.dtype, what: str, *, copy: bool = False) -> np.ndarray:
    """``value`` as a NumPy array of ``dtype`` (a C-ordered copy with ``copy``), checked
    as every write is (``same_kind``); :class:`ShapeLockError` naming ``what`` for a ragged
    nested list."""
    try:
        check_value_castable(value, dtype, what=what)
        if copy:
            return np.array(value, dtype=dtype, copy=True, order="C")
        return np.asarray(value, dtype=dtype)
    except ValueError as exc:
        if isinstance(exc, CkptError) or "inhomogeneous" not in str(exc):
            raise
        raise ShapeLockError(
            f"Cannot convert {what}: its nested lists are not rectangular (rows of "
            f"different lengths): {exc}"
        ) from None


def convert_value(var: WriteBehaviour, value: Any, what: str) -> Any:
    """``value`` as an array of ``var``'s dtype (host, or device on a GPU); same_kind checked."""
    return var._convert(value, what)


def _row_indices(indices: Any, what: str) -> np.ndarray:
    """A scatter's ``indices`` as an integer array (``[]``, NumPy's float64 when empty:
    no row); ``TypeError`` naming ``what`` for any other non-integer dtype."""
    idx = np.asarray(to_host(operand(indices)))
    if not idx.size and idx.dtype.kind == "f" and isinstance(indices, list | tuple):
        idx = idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{what}: indices must be integers, got {idx.dtype}.")
    return idx
