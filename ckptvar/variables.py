"""Variables: named, mutable arrays with a locked dtype and shape.

Owns :class:`Variable` (creation, lazy materialisation, in-place writes with the dtype and
shape locks, constraints, the array protocol and operators), :func:`get_variable`,
:func:`deferred_init`, :func:`global_variables_initializer`,
:func:`report_uninitialized_variables`, and the hooks the checkpoint layer uses:
:func:`register_creation_hook`, ``Variable._materialized``,
``Variable._set_initial_value_source``, ``Variable._restore_value``,
``Variable._host_buffer`` and ``Variable._uid``.

>>> import numpy as np
>>> from ckptvar.graph import Graph
>>> with Graph().as_default():
...     v = Variable([[1.0, 2.0], [3.0, 4.0]], name="v")
...     v.assign_add([[1, 1], [1, 1]]).numpy()
array([[2., 3.],
       [4., 5.]], dtype=float32)
>>> with Graph().as_default():
...     w = Variable([1, 2, 3])
...     (w.dtype, w.name, int(np.argmax(w)), w[1:].tolist())
(dtype('int32'), 'Variable', 2, [2, 3])
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import initializers as _init
from .device import (
    Device,
    DeviceError,
    cupy_or_none,
    is_device_array,
    log_placement,
    placement_for,
    to_device,
    to_host,
)
from ._dtypes import as_dtype, check_castable, dtype_name, infer_dtype
from .errors import (
    CkptError,
    DTypeLockError,
    ShapeLockError,
    UninitializedVariableError,
    VariableScopeError,
)
from .graph import AUTO_REUSE, Graph, GraphKeys, get_default_graph, get_variable_scope

__all__ = [
    "CreationHookHandle",
    "Variable",
    "VariableArgumentError",
    "VariableStateError",
    "deferred_init",
    "get_variable",
    "global_variables_initializer",
    "register_creation_hook",
    "report_uninitialized_variables",
]

Shape = tuple[int | None, ...] | None


class VariableStateError(CkptError, RuntimeError):
    """An internal hook was used in a state that forbids it (e.g. a source after materialising)."""


class VariableArgumentError(CkptError, ValueError):
    """The arguments given to ``Variable`` or ``get_variable`` do not describe a variable."""


# --- creation hooks ---------------------------------------------------------------------------

_hooks: list[Callable[[Variable], None]] = []
_hooks_lock = threading.Lock()


class CreationHookHandle:
    """Returned by :func:`register_creation_hook`; ``remove()`` unregisters the hook."""

    def __init__(self, fn: Callable[[Variable], None]) -> None:
        self._fn = fn

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        with _hooks_lock:
            for i, hook in enumerate(_hooks):
                if hook is self._fn:
                    del _hooks[i]
                    break

    def __enter__(self) -> CreationHookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_creation_hook(fn: Callable[[Variable], None]) -> CreationHookHandle:
    """Call ``fn(variable)`` at the end of every ``Variable.__init__`` (all threads).

    When a hook runs, the variable's name, shape, dtype, device and ``trainable`` are set
    and it is in its collections; a variable built from an initializer has not run it yet
    (nothing is materialised), so the hook may supply the value with
    ``variable._set_initial_value_source(fn)``. Hooks run in registration order.
    """
    with _hooks_lock:
        _hooks.append(fn)
    return CreationHookHandle(fn)


# --- deferred initialization ------------------------------------------------------------------

_deferred = threading.local()


@contextmanager
def deferred_init() -> Iterator[None]:
    """Variables created inside get a dtype and shape but no value until initialized.

    Reading such a variable raises :class:`UninitializedVariableError`; ``initialize()``,
    :func:`global_variables_initializer`, a full ``assign`` or a restore gives it a value.
    A variable built from an initializer allocates nothing meanwhile.
    """
    _deferred.depth = getattr(_deferred, "depth", 0) + 1
    try:
        yield
    finally:
        _deferred.depth -= 1


def _deferring() -> bool:
    return getattr(_deferred, "depth", 0) > 0


_uids = itertools.count(1)
_uid_lock = threading.Lock()


def _next_uid() -> int:
    with _uid_lock:
        return next(_uids)


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _check_same_kind(value: Any, dst: np.dtype, what: str) -> None:
    """Raise :class:`DTypeLockError` unless ``value`` converts to ``dst`` under ``same_kind``.

    Arrays follow NumPy's ``same_kind`` rule exactly (``uint8 -> int32`` is fine,
    ``int32 -> uint8`` is not). Python scalars and lists are "weak", as in NumPy 2 and
    TensorFlow: only their kind counts, so ``[1, 2]`` fits a ``uint8`` variable.
    bfloat16 and the other ``ml_dtypes`` count as floats.
    """
    try:
        src = infer_dtype(value)
    except TypeError as exc:
        raise DTypeLockError(f"Cannot convert {what}: {exc}") from None
    weak = not hasattr(value, "dtype")
    std = src.kind in _KIND_RANK and dst.kind in _KIND_RANK
    if weak and std and _KIND_RANK[src.kind] <= _KIND_RANK[dst.kind]:
        return
    if not weak and std:
        if np.can_cast(src, dst, casting="same_kind"):
            return
        raise DTypeLockError(
            f"Cannot convert {what} of dtype {dtype_name(src)} to dtype {dtype_name(dst)} "
            "(only same_kind conversions are allowed)."
        )
    check_castable(src, dst, what=what)


def _shape_str(shape: Shape) -> str:
    if shape is None:
        return "<unknown>"
    return str(tuple(shape))


def _compatible(lock: Shape, shape: tuple[int, ...]) -> bool:
    if lock is None:
        return True
    return len(lock) == len(shape) and all(a is None or a == b for a, b in zip(lock, shape,
                                                                               strict=True))


def _normalize_shape(shape: Any) -> Shape:
    if shape is None:
        return None
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    try:
        dims = tuple(None if d is None else int(d) for d in shape)
    except TypeError:
        raise VariableArgumentError(f"A shape is a tuple of ints (or None), not {shape!r}.") \
            from None
    if any(d is not None and d < 0 for d in dims):
        raise VariableArgumentError(f"Negative dimension in shape {dims}.")
    return dims


def _fully_defined(shape: Shape) -> bool:
    return shape is not None and all(d is not None for d in shape)


# --- array views returned by indexing ------------------------------------------------------------


class VariableSlice(np.ndarray):
    """The array ``variable[index]`` returns: a copy of the selected values, plus ``assign``.

    ``v[:2, :2].assign(x)`` writes ``x`` into that part of ``v`` in place. Arithmetic on a
    slice returns plain NumPy arrays.
    """

    _variable: Variable | None
    _index: Any

    def __array_finalize__(self, obj: Any) -> None:
        self._variable = None
        self._index = None

    def assign(self, value: Any) -> Variable:
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


def _slice_result(selected: Any, variable: Variable, index: Any) -> Any:
    if isinstance(selected, np.ndarray) or np.isscalar(selected) or isinstance(selected,
                                                                               np.generic):
        out = np.array(selected, copy=True).view(VariableSlice)
    else:  # a CuPy array: attach assign() through a subclass when CuPy allows it
        out = selected.copy()
        cls = _cupy_slice_class()
        if cls is not None:
            try:
                out = out.view(array_class=cls)
            except TypeError:
                return out
        else:
            return out
    out._variable = variable
    out._index = index
    return out


_cupy_slice_cls: Any = None


def _cupy_slice_class() -> Any:
    global _cupy_slice_cls
    if _cupy_slice_cls is None:
        cp = cupy_or_none()
        if cp is None:
            return None

        class CupyVariableSlice(cp.ndarray):  # type: ignore[misc,name-defined]
            _variable = None
            _index = None

            def assign(self, value: Any) -> Variable:
                if self._variable is None:
                    raise VariableArgumentError(
                        "Only an array taken directly from a variable can be assigned."
                    )
                return self._variable._assign_slice(self._index, value)

        _cupy_slice_cls = CupyVariableSlice
    return _cupy_slice_cls


# --- the variable -------------------------------------------------------------------------------


def _operand(x: Any) -> Any:
    return x._operand() if isinstance(x, Variable) else x


def _binary(op: Callable[[Any, Any], Any]) -> Callable[[Variable, Any], Any]:
    def method(self: Variable, other: Any) -> Any:
        return op(self._operand(), _operand(other))

    return method


def _reflected(op: Callable[[Any, Any], Any]) -> Callable[[Variable, Any], Any]:
    def method(self: Variable, other: Any) -> Any:
        return op(_operand(other), self._operand())

    return method


def _unary(op: Callable[[Any], Any]) -> Callable[[Variable], Any]:
    def method(self: Variable) -> Any:
        return op(self._operand())

    return method


def _inplace(op: Callable[[Any, Any], Any]) -> Callable[[Variable, Any], Variable]:
    def method(self: Variable, other: Any) -> Variable:
        return self.assign(op(self._operand(), _operand(other)))

    return method


class Variable:
    """A named, mutable array with a locked dtype and shape, living on one device.

    Args:
        initial_value: an array-like, a ``Variable`` (its value is copied), a zero-argument
            callable returning the value, or an initializer ``init(shape, dtype)`` (with
            ``shape=`` and, optionally, ``dtype=``, default float32). A variable built from
            an initializer materialises lazily, at its first read or write.
        name: default ``"Variable"``; made unique in the graph under the current name
            scope (``Mark``, ``Mark_1``). A name ending in ``/`` is used exactly, unscoped.
        dtype: converts the value (``same_kind``); inferred as TensorFlow does otherwise.
        shape: the locked shape; ``None`` entries unlock a dimension. With
            ``validate_shape=False`` (and no ``shape``) every dimension is unlocked.
        trainable: default ``True`` (``False`` when ``collections`` holds
            ``GraphKeys.LOCAL_VARIABLES``); trainable variables join ``TRAINABLE_VARIABLES``.
        device: ``"CPU:0"``, ``"GPU:0"``, ``"cuda:1"``...; default: the ``device()`` block's,
            else the fastest device that supports the dtype.
        constraint: ``f(value) -> value`` applied after every write.
        collections: default ``[GraphKeys.GLOBAL_VARIABLES]``.
        lazy: ``True`` defers initialization (as inside :func:`deferred_init`).

    Comparisons are elementwise, as for arrays; a variable hashes by identity, so use
    ``is`` (not ``==`` or ``in``) to find one in a list.
    """

    _weak_in_collections = True  # graph collections hold variables weakly
    __array_priority__ = 100.0

    def __init__(
        self,
        initial_value: Any = None,
        *,
        name: str | None = None,
        dtype: Any = None,
        shape: Any = None,
        trainable: bool | None = None,
        device: str | None = None,
        constraint: Callable[[Any], Any] | None = None,
        collections: Sequence[str] | None = None,
        validate_shape: bool = True,
        lazy: bool | None = None,
        _graph: Graph | None = None,
    ) -> None:
        if initial_value is None:
            raise VariableArgumentError(
                "Variable needs an initial_value: an array-like, a callable, or an "
                "initializer together with shape=."
            )
        if constraint is not None and not callable(constraint):
            raise VariableArgumentError(f"constraint must be callable, got {constraint!r}.")
        self._uid = _next_uid()
        self._lock = threading.RLock()
        self._graph = _graph if _graph is not None else get_default_graph()
        self._constraint = constraint
        self._value: Any = None
        self._source: Callable[[], Any] | None = None  # pending value, taken at first use
        self._source_owned = False  # whether the source returns a fresh array to adopt
        self._initializer_fn: Callable[[], Any] | None = None  # kept for initialize()
        self._initialized = False
        deferred = _deferring() if lazy is None else bool(lazy)
        req_shape = _normalize_shape(shape)

        # 1. Work out what the initial value is and its dtype and shape.
        host: Any = None  # a concrete initial value, already converted
        thunk: Callable[[], Any] | None = None
        owned = False
        if isinstance(initial_value, Variable):
            dt = as_dtype(dtype) if dtype is not None else initial_value.dtype
            host = self._convert_initial(initial_value._read(), dt, name)
        elif _init.is_initializer(initial_value):
            dt = as_dtype("float32" if dtype is None else dtype)
            if not _fully_defined(req_shape):
                raise VariableArgumentError(
                    f"An initializer needs a fully defined shape= for variable "
                    f"{name or 'Variable'!r}, got shape={shape!r}."
                )
            init, init_shape = initial_value, tuple(req_shape)  # type: ignore[arg-type]
            thunk, owned = (lambda: _init.call_initializer(init, init_shape, dt)), True
        elif callable(initial_value) and not hasattr(initial_value, "__array__"):
            if dtype is not None and _fully_defined(req_shape):
                dt = as_dtype(dtype)
                thunk = initial_value
            else:
                value = initial_value()
                dt = as_dtype(dtype) if dtype is not None else infer_dtype(value)
                host = self._convert_initial(value, dt, name)
        else:
            dt = as_dtype(dtype) if dtype is not None else infer_dtype(initial_value)
            host = self._convert_initial(initial_value, dt, name)
        self._dtype: np.dtype = dt
        value_shape = tuple(host.shape if host is not None else req_shape)  # type: ignore[arg-type]
        if not validate_shape and shape is None:
            lock: Shape = None
        else:
            lock = req_shape if req_shape is not None else value_shape
            if not _compatible(lock, value_shape):
                raise ShapeLockError(
                    f"Cannot create variable {name or 'Variable'!r}: the initial value has shape "
                    f"{value_shape}, which does not match shape={_shape_str(lock)}."
                )
        self._shape: Shape = lock

        # 2. Name, device, collections.
        self._device_obj = placement_for(dt, device)  # before naming: a bad device uses no name
        self._name = self._make_name(name)
        log_placement(
            f"Variable {self._name!r} ({dtype_name(dt)}, shape {_shape_str(self._shape)})",
            self._device_obj,
        )
        if collections is None:
            collections = [GraphKeys.GLOBAL_VARIABLES]
        collections = list(dict.fromkeys(collections))
        if trainable is None:
            trainable = GraphKeys.LOCAL_VARIABLES not in collections
        self._trainable = bool(trainable)
        if self._trainable and GraphKeys.TRAINABLE_VARIABLES not in collections:
            collections.append(GraphKeys.TRAINABLE_VARIABLES)
        self._collections = tuple(collections)
        self._graph.add_to_collections(collections, self)

        # 3. The value: concrete values are materialised now; initializers wait.
        if host is not None:
            if deferred:
                snapshot = host
                self._initializer_fn, self._source_owned = (lambda: snapshot), True
            else:
                self._value = to_device(host, self._device_obj)
                self._initialized = True
        else:
            assert thunk is not None
            if deferred:
                self._initializer_fn, self._source_owned = thunk, owned
            else:
                self._source, self._source_owned = thunk, owned
                self._initializer_fn = thunk
                self._initialized = True

        # 4. Creation hooks (restore-on-create and friends).
        with _hooks_lock:
            hooks = list(_hooks)
        for hook in hooks:
            hook(self)

    # --- construction helpers ------------------------------------------------------------
    @staticmethod
    def _convert_initial(value: Any, dt: np.dtype, name: str | None) -> np.ndarray:
        """A fresh host array of ``dt`` holding ``value`` (never sharing its memory)."""
        what = f"the initial value of variable {name or 'Variable'!r}"
        src = to_host(value) if is_device_array(value) else value
        _check_same_kind(src, dt, what)
        return np.array(src, dtype=dt, copy=True, order="C")

    def _make_name(self, name: str | None) -> str:
        if name is None:
            name = "Variable"
        if not isinstance(name, str) or not name or name == "/":
            raise VariableArgumentError(f"A variable name is a non-empty string, not {name!r}.")
        if name.endswith("/"):
            exact = name[:-1]
            self._graph._mark_used(exact)
            return exact
        return self._graph.unique_name(name)

    # --- attributes ----------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> Shape:
        """The locked shape: a tuple (``None`` for an unlocked dimension), or ``None``."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape) if self._shape is not None else self._read().ndim

    @property
    def device(self) -> str:
        """Where the value lives: ``"CPU:0"``, ``"GPU:0"``, ..."""
        return str(self._device_obj)

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def constraint(self) -> Callable[[Any], Any] | None:
        return self._constraint

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def initialized(self) -> bool:
        """Whether the variable has a value (possibly not yet materialised)."""
        return self._initialized

    @property
    def _materialized(self) -> bool:
        """True once memory holds the value (hook for the checkpoint layer)."""
        return self._value is not None

    # --- materialisation -----------------------------------------------------------------
    def _materialize(self) -> Any:
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is not None:
                return self._value
            if self._source is None:
                raise UninitializedVariableError(
                    f"Variable {self._name!r} is uninitialized: call its initialize(), "
                    "global_variables_initializer(), assign a value or restore a checkpoint "
                    "before reading it."
                )
            arr = self._source()
            self._value = self._adopt(arr, owned=self._source_owned)
            self._source = None
            self._initialized = True
            return self._value

    def _adopt(self, arr: Any, *, owned: bool) -> Any:
        """Make ``arr`` (host or device) the backing array, copying only when needed."""
        if is_device_array(arr) and not self._device_obj.is_gpu:
            arr, owned = to_host(arr), True
        if isinstance(arr, np.ndarray):
            if arr.dtype != self._dtype:
                check_castable(arr.dtype, self._dtype,
                               what=f"the initial value of variable {self._name!r}")
                arr, owned = arr.astype(self._dtype), True
            if not _compatible(self._shape, arr.shape) or (
                _fully_defined(self._shape) and arr.shape != self._shape
            ):
                raise ShapeLockError(
                    f"Cannot initialize variable {self._name!r}: value shape {arr.shape} does "
                    f"not match the variable's shape {_shape_str(self._shape)}."
                )
            if not owned or not arr.flags.c_contiguous or not arr.flags.writeable:
                arr = np.array(arr, copy=True, order="C")
            return to_device(arr, self._device_obj)
        # already a device array
        return arr if owned else arr.copy()

    def _read(self) -> Any:
        return self._materialize()

    def _operand(self) -> Any:
        """The value as an operand: a read-only view on the CPU (no copy), the array on a GPU."""
        value = self._materialize()
        if isinstance(value, np.ndarray):
            view = value.view()
            view.flags.writeable = False
            return view
        return value

    def initialize(self) -> Variable:
        """Give an uninitialized variable its initial value (runs the initializer now).

        A variable that is already initialized is left as it is.
        """
        with self._lock:
            if self._initialized:
                if self._value is None:
                    self._materialize()
                return self
            if self._initializer_fn is None:  # pragma: no cover - every path sets one
                raise UninitializedVariableError(f"Variable {self._name!r} has no initializer.")
            self._source = self._initializer_fn
            self._materialize()
        return self

    def initialized_value(self) -> Any:
        """Initialize the variable if needed and return (a copy of) its value."""
        self.initialize()
        return self.read_value()

    # --- checkpoint hooks ----------------------------------------------------------------
    def _set_initial_value_source(self, fn: Callable[[], np.ndarray]) -> None:
        """Replace the pending initial value with ``fn()`` (taken at first read or write).

        ``fn()`` returns a host NumPy array of exactly this variable's dtype and shape,
        which is adopted without another copy on the CPU (copied to the device on a GPU).
        The initializer is then never called. Marks the variable initialized. Raises
        :class:`VariableStateError` (a ``RuntimeError``) once the variable is materialised.
        """
        with self._lock:
            if self._value is not None:
                raise VariableStateError(
                    f"Variable {self._name!r} already holds a value; an initial-value source "
                    "can only be set before it is materialised."
                )
            self._source, self._source_owned = fn, True
            self._initializer_fn = fn
            self._initialized = True

    def _restore_value(self, array: np.ndarray) -> None:
        """Set the value from host ``array`` (exactly this dtype and shape; the caller checked).

        Copies into the existing buffer in place when materialised (host to device on a
        GPU); otherwise adopts ``array`` itself on the CPU. The constraint is not applied.
        Marks the variable initialized.
        """
        with self._lock:
            buf = self._value
            if buf is not None and tuple(buf.shape) == tuple(array.shape):
                _write_into(buf, array, self._device_obj)
            else:
                self._value = self._adopt(array, owned=True)
            self._source = None
            self._initialized = True

    def _host_buffer(self) -> np.ndarray | None:
        """The backing buffer itself when materialised, on the CPU and C-contiguous; else None."""
        buf = self._value
        if isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable:
            return buf
        return None

    # --- reading -------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host NumPy copy of the value."""
        value = self._materialize()
        return value.copy() if isinstance(value, np.ndarray) else to_host(value)

    def read_value(self) -> Any:
        """A copy of the value on the variable's device (NumPy on the CPU, CuPy on a GPU)."""
        return self._materialize().copy()

    def value(self) -> Any:
        """The backing array itself (NumPy on the CPU, CuPy on a GPU). Do not write to it."""
        return self._materialize()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self._materialize()
        if copy is False:
            if not isinstance(value, np.ndarray) or (dtype is not None and
                                                     np.dtype(dtype) != value.dtype):
                raise DeviceError(
                    f"Variable {self._name!r} on {self.device} cannot be viewed as a NumPy "
                    f"array of dtype {dtype} without a copy."
                )
            return self._operand()
        host = self.numpy()
        return host if dtype is None else host.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = tuple(_operand(x) for x in inputs)
        out = kwargs.pop("out", None)
        if out is not None and any(isinstance(o, Variable) for o in out):
            # Writing into a variable goes through assign, with its locks.
            result = getattr(ufunc, method)(*args, **kwargs)
            results = result if isinstance(result, tuple) else (result,)
            for target, res in zip(out, results, strict=False):
                if isinstance(target, Variable):
                    target.assign(res)
                elif target is not None:
                    target[...] = res
            outs = tuple(out)
            return outs[0] if len(outs) == 1 else outs
        if out is not None:
            kwargs["out"] = out
        return getattr(ufunc, method)(*args, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        buffers: list[Any] = []

        def unwrap(x: Any) -> Any:
            if isinstance(x, Variable):
                operand = x._operand()
                buffers.append(operand)
                return operand
            if isinstance(x, list | tuple):
                return type(x)(unwrap(i) for i in x)
            if isinstance(x, dict):
                return {k: unwrap(v) for k, v in x.items()}
            return x

        result = func(*unwrap(args), **unwrap(kwargs))
        return _detach(result, buffers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, Variable):
            index = index._operand()
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

    def __repr__(self) -> str:
        head = (f"<cv.Variable {self._name!r} shape={_shape_str(self._shape)} "
                f"dtype={dtype_name(self._dtype)}")
        if self._device_obj.is_gpu:
            head += f" device={self.device}"
        if not self._initialized:
            return head + ", numpy=<uninitialized>>"
        value = self.numpy()
        if value.ndim == 0:  # as TensorFlow: numpy=5.0
            return f"{head}, numpy={value}>"
        return f"{head}, numpy=\n{np.array_repr(value)}>"

    __hash__ = object.__hash__

    def __copy__(self) -> Variable:
        """A variable is its own shallow copy (as in TensorFlow)."""
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles the value, name, shape lock, ``trainable``, constraint and collections.

        Unpickling makes a new variable with exactly that name in the default graph, placed
        by default placement.
        """
        return (_unpickle_variable, (self.numpy(), self._name, self._shape, self._trainable,
                                     self._constraint, self._collections))

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new variable with a copy of the value, the same name, settings and collections."""
        new = Variable(
            self,
            name=self._name + "/",  # exactly the same name
            dtype=self._dtype,
            shape=self._shape,
            validate_shape=self._shape is not None,
            trainable=self._trainable,
            device=self.device,
            constraint=self._constraint,
            collections=self._collections,
            _graph=self._graph,
        )
        memo[id(self)] = new
        return new

    # --- writing -------------------------------------------------------------------------
    def _convert(self, value: Any, what: str) -> Any:
        """``value`` as an array of this dtype (host, or device on a GPU); checks same_kind."""
        value = _operand(value)
        if is_device_array(value):
            if not self._device_obj.is_gpu:
                value = to_host(value)
            else:
                _check_same_kind(value, self._dtype, what)
                return value.astype(self._dtype, copy=False)
        _check_same_kind(value, self._dtype, what)
        return np.asarray(value, dtype=self._dtype)

    def _shape_error(self, shape: tuple[int, ...], target: Shape, what: str = "") -> ShapeLockError:
        return ShapeLockError(
            f"Cannot assign to variable {self._name!r}{what}: shape {tuple(shape)} does not "
            f"match the variable's shape {_shape_str(target)}."
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

    def assign(self, value: Any) -> Variable:
        """Write ``value`` in place (same buffer); returns the variable.

        The value is converted to the variable's dtype (``same_kind``) and must have the
        variable's shape. On any error the value is unchanged.
        """
        what = f"a value assigned to variable {self._name!r}"
        arr = self._convert(value, what)
        if not _compatible(self._shape, tuple(arr.shape)):
            raise self._shape_error(arr.shape, self._shape)
        with self._lock:
            if self._constraint is not None:
                arr = self._constrained(_copy(arr))
            buf = self._value
            if buf is not None and tuple(buf.shape) == tuple(arr.shape):
                _write_into(buf, arr, self._device_obj)
            else:  # first value, or a new shape along an unlocked dimension
                self._value = self._adopt(_copy(arr), owned=True)
                self._source = None
                self._initialized = True
        return self

    def _update(self, delta: Any, op: Any, verb: str) -> Variable:
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
                new = self._constrained(op(buf, _match_backend(arr, buf)).astype(self._dtype))
                _write_into(buf, new, self._device_obj)
            else:
                op(buf, _match_backend(arr, buf), out=buf)  # same dtype: no casting
        return self

    def assign_add(self, delta: Any) -> Variable:
        """Add ``delta`` (broadcastable to the variable's shape) in place; returns the variable."""
        return self._update(delta, np.add, "added to")

    def assign_sub(self, delta: Any) -> Variable:
        """Subtract ``delta`` in place; returns the variable."""
        return self._update(delta, np.subtract, "subtracted from")

    def _assign_slice(self, index: Any, value: Any) -> Variable:
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
            if self._constraint is not None:
                new = buf.copy()
                new[index] = _match_backend(arr, buf)
                _write_into(buf, self._constrained(new), self._device_obj)
            else:
                buf[index] = _match_backend(arr, buf)
        return self

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
    __divmod__ = _binary(divmod)
    __rdivmod__ = _reflected(divmod)
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
    __eq__ = _binary(operator.eq)  # type: ignore[assignment]
    __ne__ = _binary(operator.ne)  # type: ignore[assignment]
    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __abs__ = _unary(abs)
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


def _unpickle_variable(value: np.ndarray, name: str, shape: Shape, trainable: bool,
                       constraint: Any, collections: Sequence[str]) -> Variable:
    return Variable(value, name=name + "/", shape=shape, validate_shape=shape is not None,
                    trainable=trainable, constraint=constraint, collections=collections)


def _copy(arr: Any) -> Any:
    return arr.copy()


def _match_backend(arr: Any, buf: Any) -> Any:
    """``arr`` on the same backend as ``buf`` (host arrays are sent to the GPU)."""
    if isinstance(buf, np.ndarray) or is_device_array(arr):
        return arr
    import cupy  # noqa: PLC0415 - only reached with a GPU buffer

    with cupy.cuda.Device(buf.device.id):
        return cupy.asarray(arr)


def _write_into(buf: Any, arr: Any, dev: Device) -> None:
    """Copy ``arr`` into ``buf`` in place (host to device on a GPU)."""
    if isinstance(buf, np.ndarray):
        np.copyto(buf, to_host(arr), casting="unsafe")
        return
    import cupy  # noqa: PLC0415 - only reached with a GPU buffer

    with cupy.cuda.Device(dev.index):
        if isinstance(arr, np.ndarray) and arr.flags.c_contiguous and buf.flags.c_contiguous:
            buf.set(arr)
        else:
            buf[...] = cupy.asarray(arr)


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
    import cupy  # noqa: PLC0415 - only reached with GPU arrays

    return bool(cupy.may_share_memory(a, b))


# --- get_variable and initialization helpers -----------------------------------------------------


def _default_initializer(dtype: np.dtype, name: str) -> Any:
    kind = "f" if dtype.kind == "V" else dtype.kind
    if kind == "f":
        return _init.glorot_uniform
    if kind in "iub":
        return _init.zeros
    raise VariableScopeError(
        f"No default initializer for variable {name!r} of dtype {dtype_name(dtype)}; pass "
        "initializer=."
    )


def get_variable(
    name: str,
    shape: Any = None,
    dtype: Any = None,
    initializer: Any = None,
    trainable: bool | None = None,
    collections: Sequence[str] | None = None,
    *,
    device: str | None = None,
    constraint: Callable[[Any], Any] | None = None,
    validate_shape: bool = True,
    lazy: bool | None = None,
) -> Variable:
    """Create ``scope/name``, or return it when the current variable scope reuses (TF1).

    - Name: the current *variable* scope's name joined with ``name`` (name scopes are
      ignored).
    - Reuse off: creates the variable; :class:`~ckptvar.errors.VariableScopeError` (a
      ``ValueError``) if it already exists. ``reuse=True``: returns the existing one, error if
      missing. ``AUTO_REUSE``: either. A reused variable must agree with ``shape`` and
      ``dtype`` when they are given.
    - ``initializer``: an initializer (default: the scope's, else ``glorot_uniform`` for
      floats and ``zeros`` for ints and bools), or a concrete value (then no ``shape``).
    - ``dtype``: default the scope's, else float32.

    The graph's variable store keeps these variables alive.
    """
    graph = get_default_graph()
    scope = get_variable_scope()
    full = f"{scope.name}/{name}" if scope.name else name
    reuse = scope.reuse
    req_dtype = dtype if dtype is not None else scope.dtype
    found = graph._stored_variable(full)
    if found is not None:
        if reuse is not True and reuse is not AUTO_REUSE:
            raise VariableScopeError(
                f"Variable {full!r} already exists, disallowed. Did you mean to set "
                "reuse=True or reuse=AUTO_REUSE in variable_scope?"
            )
        req_shape = _normalize_shape(shape)
        if req_shape is not None and found.shape is not None and not (
            len(req_shape) == len(found.shape)
            and all(a is None or b is None or a == b
                    for a, b in zip(req_shape, found.shape, strict=True))
        ):
            raise VariableScopeError(
                f"Trying to share variable {full!r}, but specified shape {req_shape} and found "
                f"shape {_shape_str(found.shape)}."
            )
        if req_dtype is not None and as_dtype(req_dtype) != found.dtype:
            raise VariableScopeError(
                f"Trying to share variable {full!r}, but specified dtype "
                f"{dtype_name(as_dtype(req_dtype))} and found dtype {dtype_name(found.dtype)}."
            )
        return found
    if reuse is True:
        raise VariableScopeError(
            f"Variable {full!r} does not exist, or was not created with get_variable(). Did "
            "you mean to set reuse=AUTO_REUSE in variable_scope?"
        )
    if initializer is None:
        initializer = scope.initializer
    from_value = initializer is not None and not (
        _init.is_initializer(initializer) or callable(initializer)
    ) or isinstance(initializer, Variable)
    if from_value:
        if shape is not None:
            raise VariableScopeError(
                f"Variable {full!r}: if the initializer is a constant value, do not specify "
                "shape."
            )
        initial: Any = initializer
        var_dtype = req_dtype
        var_shape = None
    else:
        dt = as_dtype(req_dtype if req_dtype is not None else "float32")
        var_shape = _normalize_shape(shape)
        if not _fully_defined(var_shape):
            raise VariableScopeError(
                f"Shape of a new variable ({full!r}) must be fully defined, but instead was "
                f"{shape!r}."
            )
        initial = initializer if initializer is not None else _default_initializer(dt, full)
        var_dtype = dt
    with graph.name_scope(None):
        variable = Variable(
            initial,
            name=full,
            dtype=var_dtype,
            shape=var_shape,
            trainable=trainable,
            device=device,
            constraint=constraint,
            collections=collections,
            validate_shape=validate_shape,
            lazy=lazy,
            _graph=graph,
        )
    graph._store_variable(full, variable)
    return variable


def global_variables_initializer() -> list[Variable]:
    """Initialize every uninitialized variable in ``GLOBAL_VARIABLES``; returns them.

    Variables that already have a value (including a restored one) and variables only in
    ``LOCAL_VARIABLES`` are left alone.
    """
    done = []
    for variable in get_default_graph().get_collection(GraphKeys.GLOBAL_VARIABLES):
        if isinstance(variable, Variable) and not variable.initialized:
            variable.initialize()
            done.append(variable)
    return done


def report_uninitialized_variables(var_list: Sequence[Variable] | None = None) -> list[str]:
    """The names of the variables (global and local by default) that have no value yet."""
    if var_list is None:
        graph = get_default_graph()
        seen: dict[int, Variable] = {}
        for key in (GraphKeys.GLOBAL_VARIABLES, GraphKeys.LOCAL_VARIABLES):
            for v in graph.get_collection(key):
                if isinstance(v, Variable):
                    seen.setdefault(id(v), v)
        var_list = list(seen.values())
    return [v.name for v in var_list if not v.initialized]

