"""The variable: creation and lifecycle.

Owns :class:`Variable`: creation (dtype inference, the shape lock, naming, placement,
collections), moving through its lifecycle states (``self._state``: one of
:class:`~ckptvar.variables._lifecycle.Unset`, ``Pending``, ``Ready``), reading, pickling
and copying, what box of a logical variable it holds (:attr:`Variable.logical_box`), and
the hooks the checkpoint layer uses, reached only through the restore seam at the end
of this module (:func:`is_materialized`, :func:`host_buffer`, :func:`restore_value`,
:func:`set_initial_value_source`, :func:`give_restored`; for incremental saves
:func:`write_version` and :func:`read_buffer`). Writes come from
:class:`~ckptvar.variables._lifecycle.WriteBehaviour`, the array behaviour from
:class:`~ckptvar.variables._array.ArrayBehaviour`.

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

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import initializers as _init
from .._dtypes import as_dtype, check_castable, dtype_name, infer_dtype
from .._frameworks import framework_of, to_numpy
from ..device import is_device_array, log_placement, placement_for, to_device, to_host
from ..errors import CkptError, DTypeLockError, ShapeLockError, UninitializedVariableError
from ..graph import Graph, GraphKeys, get_default_graph
from ._array import ArrayBehaviour, write_into
from ._hooks import deferring, next_uid, run_creation_hooks
from ._lifecycle import FreshValue, Pending, Ready, Unset, WriteBehaviour, host_array
from ._rows import RowLog
from ._shapes import (
    Shape,
    VariableArgumentError,
    compatible,
    defined_dims,
    fully_defined,
    normalize_shape,
    shape_str,
)
from ._slices import LogicalBox, SaveSliceInfo, Shard, check_shard

__all__ = [
    "Variable",
    "VariableStateError",
    "give_restored",
    "host_buffer",
    "host_buffers",
    "is_materialized",
    "read_buffer",
    "read_buffers",
    "restore_value",
    "rows_written",
    "set_initial_value_source",
    "set_save_slice_info",
    "shapes_and_dtypes",
    "shares_memory",
    "track_rows",
    "unsharded",
    "write_counts",
    "write_version",
]


class VariableStateError(CkptError, RuntimeError):
    """An internal hook was used in a state that forbids it (e.g. a source after materialising)."""


class Variable(WriteBehaviour, ArrayBehaviour):
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
        shard: a :class:`~ckptvar.Shard`: this variable holds one box of a larger logical
            variable of the same name (one process's part in a multi-process job).

    Comparisons are elementwise, as for arrays; a variable hashes by identity, so use
    ``is`` (not ``==`` or ``in``) to find one in a list.
    """

    _weak_in_collections = True  # graph collections hold variables weakly

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
        shard: Shard | None = None,
        _graph: Graph | None = None,
    ) -> None:
        _check_arguments(initial_value, constraint, collections)
        self._uid = next_uid()
        self._writes = 0  # finished writes (see _version)
        self._exposed = False  # value() handed the backing array out: writes may go unseen
        self._row_log: RowLog | None = None  # rows written per version, once asked for
        self._lock = threading.RLock()
        self._graph = _graph if _graph is not None else get_default_graph()
        self._constraint = constraint
        self._save_slice_info: SaveSliceInfo | None = None
        self._device_value: Any = None
        deferred = deferring() if lazy is None else bool(lazy)
        req_shape = normalize_shape(shape)

        # 1. Work out what the initial value is and its dtype and shape.
        dt, host, thunk, owned = _initial_value(initial_value, dtype, req_shape, shape, name)
        self._dtype: np.dtype = dt
        value_shape = tuple(host.shape if host is not None else req_shape)  # type: ignore[arg-type]
        if not validate_shape and shape is None:
            lock: Shape = None
        else:
            lock = req_shape if req_shape is not None else value_shape
            if not compatible(lock, value_shape):
                raise ShapeLockError(
                    f"Cannot create variable {name or 'Variable'!r}: the initial value has shape "
                    f"{value_shape}, which does not match shape={shape_str(lock)}."
                )
        self._shape: Shape = lock
        self._shard = None if shard is None else check_shard(shard, lock, name or "Variable")

        # 2. Name, device, collections.
        self._device_obj = placement_for(dt, device)  # before naming: a bad device uses no name
        self._name = self._make_name(name)
        log_placement(
            f"Variable {self._name!r} ({dtype_name(dt)}, shape {shape_str(self._shape)})",
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

        # 3. The state: concrete values are materialised now; initializers wait.
        self._state: Unset | Pending | Ready
        if host is not None:
            if deferred:
                snapshot = host
                self._state = Unset(lambda: snapshot, owned=True)
            else:
                self._state = Ready(to_device(host, self._device_obj))
        else:
            assert thunk is not None
            self._state = Unset(thunk, owned) if deferred else Pending(thunk, owned)

        # 4. Creation hooks (restore-on-create and friends).
        run_creation_hooks(self)

    # --- construction helpers ------------------------------------------------------------
    def _make_name(self, name: str | None) -> str:
        if name is None:
            name = "Variable"
        if not isinstance(name, str) or not name or name == "/":
            raise VariableArgumentError(f"A variable name is a non-empty string, not {name!r}.")
        if name.endswith("/"):
            exact = name[:-1]
            self._graph.mark_used(exact)
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
        return len(self._shape) if self._shape is not None else self._materialize().ndim

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
        return not isinstance(self._state, Unset)

    @property
    def _materialized(self) -> bool:
        """True once memory holds the value (hook for the checkpoint layer)."""
        return isinstance(self._state, Ready)

    # --- slices of a logical variable ----------------------------------------------------
    @property
    def shard(self) -> Shard | None:
        """The :class:`~ckptvar.Shard` this variable holds (multi-process), else ``None``."""
        return self._shard

    @property
    def save_slice_info(self) -> SaveSliceInfo | None:
        """For a part of a :class:`~ckptvar.PartitionedVariable`: where it sits in the whole."""
        return self._save_slice_info

    def _set_save_slice_info(self, info: SaveSliceInfo) -> None:
        """Mark this variable as one part of a partitioned variable (``get_variable`` does)."""
        if self._shard is not None:
            raise VariableArgumentError(
                f"Variable {self._name!r} already holds a shard; it cannot also be a partition."
            )
        if self._shape is None or tuple(info.var_shape) != tuple(self._shape):
            raise VariableArgumentError(
                f"SaveSliceInfo var_shape {tuple(info.var_shape)} does not match the shape "
                f"{shape_str(self._shape)} of variable {self._name!r}."
            )
        self._save_slice_info = info

    @property
    def logical_box(self) -> LogicalBox:
        """Which logical variable this holds and which box of it: ``(name, full_shape, offset,
        shape)``. A plain variable holds all of itself (offset zeros, ``sliced`` False)."""
        if self._save_slice_info is not None:
            info = self._save_slice_info
            return LogicalBox(info.full_name, tuple(info.full_shape), tuple(info.var_offset),
                              tuple(info.var_shape), sliced=True)
        if self._shard is not None:
            return LogicalBox(self._name, self._shard.full_shape, self._shard.offset,
                              defined_dims(self._shard.shape), sliced=True)
        shape = self._shape
        if not fully_defined(shape):
            shape = tuple(self._materialize().shape)
        dims = defined_dims(shape)
        return LogicalBox(self._name, dims, (0,) * len(dims), dims, sliced=False)

    # --- materialisation -----------------------------------------------------------------
    def _materialize(self) -> Any:
        state = self._state
        if type(state) is Ready:
            return state.value
        with self._lock:
            state = self._state
            if isinstance(state, Ready):
                return state.value
            if isinstance(state, Unset):
                raise UninitializedVariableError(
                    f"Variable {self._name!r} is uninitialized: call its initialize(), "
                    "global_variables_initializer(), assign a value or restore a checkpoint "
                    "before reading it."
                )
            try:
                produced = state.source()
            except (DTypeLockError, ShapeLockError) as exc:  # an initializer refused the
                raise type(exc)(  # variable's dtype or shape: said with its name
                    f"Cannot initialize variable {self._name!r}: {exc}") from None
            value = self._adopt(produced, owned=state.owned)
            self._state = Ready(value)
            self._wrote()
            return value

    def _adopt(self, arr: Any, *, owned: bool) -> Any:
        """Make ``arr`` (host or device) the backing array, copying only when needed."""
        if is_device_array(arr) and not self._device_obj.is_gpu:
            arr, owned = to_host(arr), True
        elif not isinstance(arr, np.ndarray) and not is_device_array(arr):
            # a list, tuple or scalar from an initial-value function or an initializer
            arr, owned = _convert_initial(arr, self._dtype, self._name), True
        if isinstance(arr, np.ndarray):
            if arr.dtype != self._dtype:
                check_castable(arr.dtype, self._dtype,
                               what=f"the initial value of variable {self._name!r}")
                arr, owned = arr.astype(self._dtype), True
            if not compatible(self._shape, arr.shape) or (
                fully_defined(self._shape) and arr.shape != self._shape
            ):
                raise ShapeLockError(
                    f"Cannot initialize variable {self._name!r}: value shape {arr.shape} does "
                    f"not match the variable's shape {shape_str(self._shape)}."
                )
            if not owned or not arr.flags.c_contiguous or not arr.flags.writeable:
                arr = np.array(arr, copy=True, order="C")
            return to_device(arr, self._device_obj)
        # already a device array
        return arr if owned else arr.copy()

    def initialize(self) -> Variable:
        """Give an uninitialized variable its initial value (runs the initializer now).

        A variable that is already initialized is left as it is.
        """
        with self._lock:
            state = self._state
            if isinstance(state, Unset):
                self._state = Pending(state.init, state.owned)
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
            if isinstance(self._state, Ready):
                raise VariableStateError(
                    f"Variable {self._name!r} already holds a value; an initial-value source "
                    "can only be set before it is materialised."
                )
            self._state = Pending(fn, owned=True)
            self._wrote()

    def _restore_value(self, array: np.ndarray) -> None:
        """Set the value from host ``array`` (exactly this dtype and shape; the caller checked).

        Copies into the existing buffer in place when materialised (host to device on a
        GPU); otherwise adopts ``array`` itself on the CPU. The constraint is not applied.
        Marks the variable initialized.
        """
        with self._lock:
            state = self._state
            if isinstance(state, Ready) and tuple(state.value.shape) == tuple(array.shape):
                write_into(state.value, array, self._device_obj)
            else:
                self._state = Ready(self._adopt(array, owned=True))
            self._wrote()

    @property
    def _version(self) -> int | None:
        """How many writes the value has had, or None when that is not known.

        Every write path counts (``assign`` and its family, slice assignment, ``+=``, NumPy
        ``out=``, restore, initialization). ``value()`` hands out the backing array itself,
        whose in-place writes nobody sees: from then on the version is None and an
        incremental checkpoint compares this variable by its block checksums instead.
        """
        return None if self._exposed else self._writes

    def _read_buffer(self) -> Any:
        """The backing array, for reading only (a save): unlike ``value()``, not handed out."""
        return self._materialize()

    def _device_buffer(self) -> Any:
        """The backing CuPy array when materialised on a GPU and C-contiguous; else None.
        The caller (a restore) writes into it: handing it out counts as a write."""
        state = self._state
        buf = state.value if isinstance(state, Ready) else None
        if buf is not None and is_device_array(buf) and buf.flags.c_contiguous:
            self._wrote()
            return buf
        return None

    def _host_buffer(self) -> np.ndarray | None:
        """The backing buffer when materialised, on the CPU and C-contiguous; else None.
        The caller (a restore) writes into it: handing it out counts as a write."""
        state = self._state
        buf = state.value if isinstance(state, Ready) else None
        if isinstance(buf, np.ndarray):
            flags = buf.flags  # once: each access makes a flags object (a restore asks per value)
            if flags.c_contiguous and flags.writeable:
                self._wrote()
                return buf
        return None

    # --- reading -------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host NumPy copy of the value (taken whole: never half of a concurrent write)."""
        with self._lock:
            value = self._materialize()
            return value.copy() if isinstance(value, np.ndarray) else to_host(value)

    def read_value(self) -> Any:
        """A copy of the value on the variable's device (NumPy on the CPU, CuPy on a GPU),
        taken whole: never half of a concurrent write."""
        with self._lock:
            return self._materialize().copy()

    def value(self) -> Any:
        """The backing array itself (NumPy on the CPU, CuPy on a GPU). Do not write to it:
        the version counter cannot see such writes, so from now on an incremental
        checkpoint compares this variable by its checksums (docs/checkpoints.md)."""
        value = self._materialize()
        self._exposed = True
        return value

    def __repr__(self) -> str:
        head = (f"<cv.Variable {self._name!r} shape={shape_str(self._shape)} "
                f"dtype={dtype_name(self._dtype)}")
        if self._device_obj.is_gpu:
            head += f" device={self.device}"
        if not self.initialized:
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
        """Pickles the value, name, shape lock, ``trainable``, constraint, collections, shard
        and, for a part of a partitioned variable, its ``save_slice_info``.

        Unpickling makes a new variable with exactly that name in the default graph, placed
        by default placement.
        """
        args: tuple[Any, ...] = (self.numpy(), self._name, self._shape, self._trainable,
                                 self._constraint, self._collections)
        if self._save_slice_info is not None:
            args = (*args, self._shard, self._save_slice_info)
        elif self._shard is not None:
            args = (*args, self._shard)
        return (_unpickle_variable, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        """A new variable with a copy of the value, the same name, settings and collections
        (and ``save_slice_info``: a copied partition is still that part of the whole). An
        uninitialized variable's copy is uninitialized too, with its own initial value."""
        initial: Any = self
        state = self._state
        if isinstance(state, Unset):  # no value to copy: the copy initializes as this one would
            if not fully_defined(self._shape):
                raise UninitializedVariableError(
                    f"Cannot deep-copy variable {self._name!r}: it is uninitialized and its "
                    f"shape {shape_str(self._shape)} is not fully defined; initialize it first."
                )
            init, dt, name = state.init, self._dtype, self._name
            initial = FreshValue(lambda: _convert_initial(init(), dt, name))
        new = Variable(
            initial,
            lazy=initial is not self,
            name=self._name + "/",  # exactly the same name
            dtype=self._dtype,
            shape=self._shape,
            validate_shape=self._shape is not None,
            trainable=self._trainable,
            device=self.device,
            constraint=self._constraint,
            collections=self._collections,
            shard=self._shard,
            _graph=self._graph,
        )
        if self._save_slice_info is not None:
            new._set_save_slice_info(self._save_slice_info)
        memo[id(self)] = new
        return new


def _unpickle_variable(value: np.ndarray, name: str, shape: Shape, trainable: bool,  # noqa: PLR0917 - existing pickles pass these positionally
                       constraint: Any, collections: Sequence[str],
                       shard: Shard | None = None,
                       save_slice_info: SaveSliceInfo | None = None) -> Variable:
    var = Variable(value, name=name + "/", shape=shape, validate_shape=shape is not None,
                   trainable=trainable, constraint=constraint, collections=collections,
                   shard=shard)
    if save_slice_info is not None:
        var._set_save_slice_info(save_slice_info)
    return var


def _check_arguments(initial_value: Any, constraint: Any, collections: Any) -> None:
    """Refuse constructor arguments that cannot describe a variable (before it takes a name)."""
    if initial_value is None:
        raise VariableArgumentError(
            "Variable needs an initial_value: an array-like, a callable, or an "
            "initializer together with shape=."
        )
    if constraint is not None and not callable(constraint):
        raise VariableArgumentError(f"constraint must be callable, got {constraint!r}.")
    if collections is not None and not isinstance(collections, list | tuple | set):
        raise VariableArgumentError(
            "collections is a list, tuple or set of collection names, not "
            f"{collections!r} (a string would be read as one collection per character)."
        )


class _Initial(NamedTuple):
    """What a constructor argument gives: a dtype, and a value now or a function for later."""

    dtype: np.dtype
    host: np.ndarray | None  # a concrete value, already converted
    thunk: Callable[[], Any] | None  # or a function producing it at first use
    owned: bool  # whether the function returns a fresh array the variable may adopt


def _initial_value(initial_value: Any, dtype: Any, req_shape: Shape, shape: Any,
                   name: str | None) -> _Initial:
    """Sort ``initial_value`` into a value now or a function for later, with its dtype."""
    initial_value = _host_view(initial_value, name)
    if isinstance(initial_value, Variable):
        dt = as_dtype(dtype) if dtype is not None else initial_value.dtype
        return _Initial(dt, _convert_initial(initial_value._materialize(), dt, name), None,
                        False)
    if isinstance(initial_value, FreshValue) or _init.is_initializer(initial_value):
        dt = as_dtype("float32" if dtype is None else dtype)
        if not fully_defined(req_shape):
            raise VariableArgumentError(
                f"An initializer needs a fully defined shape= for variable "
                f"{name or 'Variable'!r}, got shape={shape!r}."
            )
        if isinstance(initial_value, FreshValue):
            return _Initial(dt, None, initial_value.fn, initial_value.owned)
        init, init_shape = initial_value, defined_dims(req_shape)
        _init.check_produces(init, dt, f"Cannot make variable {name or 'Variable'!r}")
        # ckptvar's initializers make a new array; a user's may return one it keeps: copied
        return _Initial(dt, None, lambda: _init.call_initializer(init, init_shape, dt),
                        _init.returns_new_arrays(init))
    if callable(initial_value) and not hasattr(initial_value, "__array__"):
        # An initial-value function: called with no arguments, as TensorFlow does.
        if dtype is not None and fully_defined(req_shape):
            fn = initial_value
            return _Initial(as_dtype(dtype), None, lambda: _host_view(fn(), name), False)
        value = _host_view(initial_value(), name)
        dt = as_dtype(dtype) if dtype is not None else _inferred(value, name)
        return _Initial(dt, _convert_initial(value, dt, name), None, False)
    dt = as_dtype(dtype) if dtype is not None else _inferred(initial_value, name)
    return _Initial(dt, _convert_initial(initial_value, dt, name), None, False)


def _inferred(value: Any, name: str | None) -> np.dtype:
    """The dtype TensorFlow infers for ``value``; a value that is no array of a supported
    dtype (a string, an object) is a ``DTypeLockError`` naming the variable."""
    try:
        return infer_dtype(value)
    except TypeError as exc:
        raise DTypeLockError(
            f"Cannot create variable {name or 'Variable'!r} from its initial value: {exc}"
        ) from None


def _host_view(value: Any, name: str | None) -> Any:
    """A torch tensor or JAX array as a NumPy view of its memory (copied later, once)."""
    if framework_of(value) in ("torch", "jax"):
        return to_numpy(value, what=f"the initial value of variable {name or 'Variable'!r}")
    return value


def _convert_initial(value: Any, dt: np.dtype, name: str | None) -> np.ndarray:
    """A fresh host array of ``dt`` holding ``value`` (never sharing its memory)."""
    what = f"the initial value of variable {name or 'Variable'!r}"
    src = to_host(value) if is_device_array(value) else value
    return host_array(src, dt, what, copy=True)


# --------------------------------------------------------------------------- the restore seam
# What the checkpoint layer (and the sibling modules tf1, partitioned) may do to a
# variable beyond its public API: these functions are the only door to the hooks.


def is_materialized(var: Variable) -> bool:
    """Whether memory holds ``var``'s value (not merely pending)."""
    return var._materialized


def host_buffer(var: Variable) -> np.ndarray | None:
    """``var``'s backing buffer itself when materialised on the CPU, C-contiguous and
    writeable (a restore may read straight into it); else ``None``."""
    return var._host_buffer()


def host_buffers(variables: Sequence[Variable]) -> list[np.ndarray | None]:
    """:func:`host_buffer` of each variable, in one pass (a restore of many small
    variables pays no call per variable); ``None`` also for a variable that stands for
    a framework's GPU tensor (:func:`device_value`). Each buffer handed out counts as a
    write, as :func:`host_buffer`'s does."""
    out: list[np.ndarray | None] = []
    add, ndarray = out.append, np.ndarray
    for var in variables:
        if type(var) is not Variable:
            add(None if var._device_value is not None else var._host_buffer())
            continue
        state = var._state
        buf = state.value if type(state) is Ready and var._device_value is None else None
        if type(buf) is ndarray:
            flags = buf.flags
            if flags.c_contiguous and flags.writeable:
                if var._row_log is None:
                    var._writes += 1  # _wrote, inline (no row log to tell)
                    add(buf)
                else:  # the row log hears of a write of the whole value
                    add(var._host_buffer())
                continue
        elif buf is not None:  # an ndarray subclass, or not a host array
            add(var._host_buffer())
            continue
        add(None)
    return out


def unsharded(variables: Sequence[Variable]) -> bool:
    """Whether no variable holds a :class:`~ckptvar.Shard` (``var.shard is None`` for each,
    in one pass: no call per variable)."""
    return list(map(_shard_of, variables)).count(None) == len(variables)


_shard_of = operator.attrgetter("_shard")


def read_buffers(variables: Sequence[Variable]) -> list[np.ndarray] | None:
    """:func:`read_buffer` of each variable, in one pass (a background save's snapshot of
    many values pays no call per value), when every one is a :class:`Variable` whose value
    is materialised in a host NumPy array and stands for no GPU tensor; else ``None``
    (the caller asks :func:`read_buffer` and :func:`device_value` of each)."""
    out: list[np.ndarray] = []
    add, ndarray = out.append, np.ndarray
    for var in variables:
        if type(var) is not Variable or var._device_value is not None:
            return None
        state = var._state
        if type(state) is not Ready or not isinstance(state.value, ndarray):
            return None
        add(state.value)
    return out


def shapes_and_dtypes(variables: Sequence[Variable]) -> tuple[list[Shape], list[np.dtype]]:
    """``([var.shape, ...], [var.dtype, ...])`` of the variables, in one pass each (no
    call per variable)."""
    if set(map(type, variables)) <= {Variable}:
        return [v._shape for v in variables], [v._dtype for v in variables]
    return [v.shape for v in variables], [v.dtype for v in variables]


def device_buffer(var: Variable) -> Any:
    """``var``'s backing CuPy array when materialised on a GPU and C-contiguous (a
    restore may copy straight into it through the pinned buffer); else ``None``."""
    return var._device_buffer()


def restore_value(var: Variable, array: np.ndarray) -> None:
    """Give ``var`` the host ``array`` (its exact dtype and shape; the caller checked)."""
    var._restore_value(array)


def set_initial_value_source(var: Variable, fn: Callable[[], np.ndarray]) -> None:
    """Make ``fn()`` ``var``'s initial value, taken at first use (the initializer never runs)."""
    var._set_initial_value_source(fn)


def give_restored(var: Variable, value: np.ndarray) -> None:
    """A restored ``value`` for ``var``: assigned if materialised, else its initial value."""
    if var._materialized:
        var._restore_value(value)
    else:
        var._set_initial_value_source(lambda: value)


def write_version(var: Variable) -> tuple[int, int] | None:
    """``(identity, writes)`` of ``var``'s value: equal between two looks only when no
    write happened in between; ``None`` when unknown (its buffer was handed out by
    ``value()``: compare it by its checksums instead)."""
    version = var._version
    return None if version is None else (var._uid, version)


_WRITES = operator.attrgetter("_writes")


def write_counts(variables: Sequence[Variable]) -> list[int]:
    """The write count of each variable, in one pass (a restore notes them for many
    variables at once): with the variable's identity, its :func:`write_version` at
    that moment, unless its buffer was handed out (``write_version`` is None then,
    and stays so)."""
    return list(map(_WRITES, variables))


def rows_written(var: Variable, version: tuple[int, int] | None) -> np.ndarray | None:
    """The sorted first-axis indices written since ``version`` (a :func:`write_version`
    of ``var``), or None when not known (another variable, the buffer handed out by
    ``value()``, rows not tracked since then, or a write of the whole value). Tracking
    starts with :func:`track_rows`."""
    log = var._row_log
    if (version is None or log is None or var._exposed or version[0] != var._uid
            or version[1] > var._writes):
        return None
    return log.since(version[1])


def track_rows(var: Variable) -> None:
    """Make ``var`` note which rows each write touches from now on (:func:`rows_written`)."""
    with var._lock:
        if var._row_log is None:
            var._row_log = RowLog(var._writes)


def shares_memory(var: Variable) -> None:
    """Say that ``var``'s memory is written by others too (a torch tensor's, which
    optimizers update in place): its version is unknown from now on, as after
    ``value()``, so an incremental checkpoint compares it by its checksums."""
    with var._lock:
        var._exposed = True


def read_buffer(var: Variable) -> Any:
    """``var``'s backing array, for reading only (a save): not handed out to the user."""
    return var._read_buffer()


def set_device_value(var: Variable, value: Any) -> None:
    """Make ``var`` stand for ``value``, a framework tensor on a GPU (a CUDA torch tensor):
    a save stages ``value`` through the pinned buffer instead of reading ``var``'s buffer,
    and a restore writes into ``value``'s own memory; ``var`` itself stays unmaterialized."""
    var._device_value = value


def device_value(var: Variable) -> Any:
    """The GPU tensor :func:`set_device_value` gave ``var``, or None."""
    return var._device_value


def set_save_slice_info(var: Variable, info: SaveSliceInfo) -> None:
    """Mark ``var`` as one part of a partitioned variable (``get_variable`` does)."""
    var._set_save_slice_info(info)
