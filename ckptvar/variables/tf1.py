"""The TensorFlow 1 variable API: variable scopes, ``get_variable`` and its store.

Owns :class:`VariableScope` and :func:`variable_scope` (TF1 reuse semantics,
:data:`AUTO_REUSE`, scope defaults for ``initializer``/``dtype``/``partitioner``),
:func:`get_variable_scope`, :func:`get_variable` (plain and partitioned), the per-graph
store that keeps ``get_variable``'s variables alive (kept through ``Graph.extension``),
:func:`global_variables_initializer` and :func:`report_uninitialized_variables`.

>>> from ckptvar.graph import Graph
>>> with Graph().as_default():
...     with variable_scope("layer"):
...         w = get_variable("w", shape=(2,), initializer=lambda shape, dtype: [1.0, 2.0])
...     with variable_scope("layer", reuse=True):
...         (get_variable("w") is w, w.name, w.numpy().tolist())
(True, 'layer/w', [1.0, 2.0])
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .. import _naming
from .. import initializers as _init
from .._dtypes import as_dtype, dtype_name, is_floating
from ..errors import VariableScopeError
from ..graph import Graph, GraphKeys, get_default_graph
from ._lifecycle import FreshValue
from ._shapes import VariableArgumentError, normalize_shape, shape_str
from ._variable import Variable, set_save_slice_info
from .partitioned import PartitionedVariable, PartitionInfo, defined_shape, make_partitioned

__all__ = [
    "AUTO_REUSE",
    "VariableScope",
    "get_variable",
    "get_variable_scope",
    "global_variables_initializer",
    "report_uninitialized_variables",
    "variable_scope",
]


class _AutoReuse:
    """The ``AUTO_REUSE`` flag: ``get_variable`` creates a variable if missing, else reuses it."""

    _instance: _AutoReuse | None = None

    def __new__(cls) -> _AutoReuse:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO_REUSE"

    def __reduce__(self) -> str:
        return "AUTO_REUSE"


AUTO_REUSE = _AutoReuse()


class VariableScope:
    """A variable scope: a name prefix for ``get_variable`` plus reuse and default arguments.

    Obtained from ``with variable_scope(...) as scope``; passing it back to
    :func:`variable_scope` re-enters the same names. :meth:`reuse_variables` turns on reuse
    for the rest of the ``with`` block.
    """

    def __init__(
        self,
        name: str = "",
        *,
        reuse: bool | _AutoReuse = False,
        initializer: Any = None,
        dtype: Any = None,
        partitioner: Callable[..., Sequence[int]] | None = None,
        name_scope: str = "",
    ) -> None:
        self._name = name
        self._reuse = reuse
        self.initializer = initializer
        self.dtype = dtype
        self.partitioner = partitioner
        self._name_scope = name_scope

    @property
    def name(self) -> str:
        """The prefix of ``get_variable`` names made in this scope (``""`` at the root)."""
        return self._name

    @property
    def original_name_scope(self) -> str:
        """The name scope (``"model/"``) that plain variables made in this scope get."""
        return self._name_scope

    @property
    def reuse(self) -> bool | _AutoReuse:
        """``True``, ``False`` or :data:`AUTO_REUSE`."""
        return self._reuse

    def reuse_variables(self) -> None:
        """Make ``get_variable`` in this scope return existing variables from now on."""
        self._reuse = True

    def set_initializer(self, initializer: Any) -> None:
        self.initializer = initializer

    def set_dtype(self, dtype: Any) -> None:
        self.dtype = dtype

    def set_partitioner(self, partitioner: Callable[..., Sequence[int]] | None) -> None:
        self.partitioner = partitioner

    def get_variable(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``get_variable`` inside this scope (see :func:`ckptvar.get_variable`)."""
        with variable_scope(self):
            return get_variable(name, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<VariableScope {self._name!r} reuse={self._reuse!r}>"


class _Tf1State:
    """One graph's TF1 state: the per-thread current scope, scope counts and the store."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.creating = threading.RLock()  # held by get_variable from lookup to store
        self.scope_counts: dict[str, int] = {}
        self.store: dict[str, Variable | PartitionedVariable] = {}

    def scope(self) -> VariableScope:
        scope = getattr(self.local, "scope", None)
        if scope is None:
            scope = self.local.scope = VariableScope("")
        return scope

    def unique_scope_name(self, prefix: str) -> str:
        full = _naming.join(self.scope().name, prefix)
        with self.lock:
            if not self.scope_counts.get(full):
                return prefix
            i = 1
            while self.scope_counts.get(f"{full}_{i}"):
                i += 1
            return f"{prefix}_{i}"

    def count_scope(self, name: str) -> None:
        with self.lock:
            self.scope_counts[name] = self.scope_counts.get(name, 0) + 1

    def stored(self, name: str) -> Variable | PartitionedVariable | None:
        with self.lock:
            return self.store.get(name)

    def keep(self, name: str, variable: Variable | PartitionedVariable) -> None:
        with self.lock:
            self.store[name] = variable


def _state(graph: Graph) -> _Tf1State:
    return graph.extension("ckptvar.variables.tf1", _Tf1State)


def get_variable_scope() -> VariableScope:
    """The current variable scope of the default graph (in this thread)."""
    return _state(get_default_graph()).scope()


@contextmanager
def variable_scope(
    name_or_scope: str | VariableScope | None,
    default_name: str | None = None,
    *,
    reuse: bool | _AutoReuse | None = None,
    initializer: Any = None,
    dtype: Any = None,
    partitioner: Callable[..., Sequence[int]] | None = None,
    auxiliary_name_scope: bool = True,
) -> Iterator[VariableScope]:
    """A TF1 variable scope: prefixes ``get_variable`` and plain variable names.

    - ``name_or_scope`` a string: the scope ``parent/name``; re-entering it by name gives
      the same prefix (for plain variables too). A :class:`VariableScope` re-enters that
      scope exactly, wherever you are. ``None`` needs ``default_name``, made unique
      (``default_name``, ``default_name_1``, ...).
    - ``reuse``: ``True`` makes ``get_variable`` return existing variables (and fail for
      missing ones); :data:`AUTO_REUSE` creates or reuses; ``None``/``False`` inherit the
      parent's flag (reuse can't be switched off inside a reusing scope, as in TF1).
    - ``initializer``/``dtype``/``partitioner``: defaults for ``get_variable`` inside;
      inherited.
    """
    graph = get_default_graph()
    state = _state(graph)
    old = state.scope()
    if isinstance(name_or_scope, VariableScope):
        scope = VariableScope(
            name_or_scope.name,
            reuse=reuse if reuse else name_or_scope.reuse,
            initializer=initializer if initializer is not None else name_or_scope.initializer,
            dtype=dtype if dtype is not None else name_or_scope.dtype,
            partitioner=partitioner if partitioner is not None else name_or_scope.partitioner,
            name_scope=name_or_scope.original_name_scope,
        )
        name_scope_arg = name_or_scope.original_name_scope or None
    else:
        if name_or_scope is None:
            if default_name is None:
                raise VariableScopeError("variable_scope needs name_or_scope or default_name.")
            if reuse is True:
                raise VariableScopeError("reuse=True cannot be used without a name_or_scope.")
            local = state.unique_scope_name(default_name)
        elif isinstance(name_or_scope, str):
            local = name_or_scope
        else:
            raise VariableScopeError(
                f"name_or_scope is a string or a VariableScope, not {name_or_scope!r}."
            )
        if not _naming.valid_scope_name(local, nested=True):
            raise VariableScopeError(f"{local!r} is not a valid variable scope name.")
        full = _naming.join(old.name, local)
        # The name scope re-uses the prefix: parent name scope + local name, not uniquified;
        # "" re-enters the current scope.
        ns = _naming.join(graph.get_name_scope(), local) if local else graph.get_name_scope()
        ns = ns + "/" if ns else ""
        scope = VariableScope(
            full,
            reuse=reuse or old.reuse,
            initializer=initializer if initializer is not None else old.initializer,
            dtype=dtype if dtype is not None else old.dtype,
            partitioner=partitioner if partitioner is not None else old.partitioner,
            name_scope=ns,
        )
        name_scope_arg = ns or None
    state.count_scope(scope.name)
    state.local.scope = scope
    try:
        if auxiliary_name_scope:
            with graph.name_scope(name_scope_arg):
                yield scope
        else:
            yield scope
    finally:
        state.local.scope = old


# --- get_variable ----------------------------------------------------------------------------


def _default_initializer(dtype: np.dtype, name: str) -> Any:
    if is_floating(dtype):
        return _init.glorot_uniform
    if dtype.kind in "iub":
        return _init.zeros
    raise VariableScopeError(
        f"No default initializer for variable {name!r} of dtype {dtype_name(dtype)}; pass "
        "initializer=."
    )


def _accepts(fn: Any, param: str) -> bool:
    """Whether ``fn`` can be called with the keyword ``param``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == param and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               or p.kind == p.VAR_KEYWORD for p in params)


def bind_initializer(initializer: Any, shape: tuple[int, ...], dtype: np.dtype,
                     partition_info: PartitionInfo | None = None) -> FreshValue:
    """``initializer`` called as TensorFlow's ``get_variable`` calls it, once, when needed.

    A class is instantiated first; the call is ``initializer(shape, dtype=dtype)``, plus
    ``partition_info=`` when the initializer accepts it (as TF1 does).
    """
    init = _init.as_initializer(initializer)  # (a factory passed bare: its default)
    kwargs: dict[str, Any] = {"dtype": dtype}
    own = isinstance(init, _init.Initializer) or getattr(init, "__module__", "") == _init.__name__
    if own:
        if partition_info is not None:  # the fan-based ones scale by the whole variable
            kwargs["partition_info"] = partition_info
    else:
        if _accepts(init, "partition_info"):
            kwargs["partition_info"] = partition_info
        try:
            inspect.signature(init).bind(tuple(shape), **kwargs)
        except TypeError as exc:
            raise VariableScopeError(
                f"get_variable calls its initializer as initializer(shape, dtype=...); "
                f"{init!r} cannot be called that way ({exc}). Pass a value, or a function "
                "of (shape, dtype)."
            ) from None
        except ValueError:  # no signature to check (a builtin): call it and see
            pass
    return FreshValue(lambda: init(tuple(shape), **kwargs), owned=_init.returns_new_arrays(init))


def _reused(found: Variable | PartitionedVariable, full: str, reuse: Any, shape: Any,
            dtype: Any, partitioner: Any) -> Variable | PartitionedVariable:
    """``found`` again, as ``get_variable`` returns it under ``reuse``, once it fits."""
    if reuse is not True and reuse is not AUTO_REUSE:
        raise VariableScopeError(
            f"Variable {full!r} already exists, disallowed. Did you mean to set "
            "reuse=True or reuse=AUTO_REUSE in variable_scope?"
        )
    _check_reuse(found, full, shape, dtype, partitioner is not None)
    if partitioner is not None and isinstance(found, PartitionedVariable):
        _check_partitions_reused(found, full, partitioner)
    return found


def _check_reuse(found: Variable | PartitionedVariable, full: str, shape: Any,
                 dtype: Any, partitioned: bool) -> None:
    if isinstance(found, PartitionedVariable) != partitioned:
        have, asked = ("a partitioned", "without") if not partitioned else (
            "an unpartitioned", "with")
        raise VariableScopeError(
            f"Trying to reuse variable {full!r} {asked} a partitioner, but {have} variable "
            "of that name exists."
        )
    req_shape = normalize_shape(shape)
    if req_shape is not None and found.shape is not None and not (
        len(req_shape) == len(found.shape)
        and all(a is None or b is None or a == b
                for a, b in zip(req_shape, found.shape, strict=True))
    ):
        raise VariableScopeError(
            f"Trying to share variable {full!r}, but specified shape {req_shape} and found "
            f"shape {shape_str(found.shape)}."
        )
    if dtype is not None and as_dtype(dtype) != found.dtype:
        raise VariableScopeError(
            f"Trying to share variable {full!r}, but specified dtype "
            f"{dtype_name(as_dtype(dtype))} and found dtype {dtype_name(found.dtype)}."
        )


def _check_partitions_reused(found: PartitionedVariable, full: str,
                             partitioner: Callable[..., Sequence[int]]) -> None:
    """A partitioner given on reuse must cut the variable as it is cut (TensorFlow 1's
    'Trying to reuse partitioned variable ..., but specified partitions ...')."""
    asked = tuple(int(p) for p in partitioner(shape=found.shape, dtype=found.dtype))
    if asked != found.partitions:
        raise VariableScopeError(
            f"Trying to reuse partitioned variable {full!r}, but specified partitions "
            f"{list(asked)} and found partitions {list(found.partitions)}."
        )


def get_variable(
    name: str,
    shape: Any = None,
    dtype: Any = None,
    initializer: Any = None,
    trainable: bool | None = None,
    collections: Sequence[str] | None = None,
    *,
    partitioner: Callable[..., Sequence[int]] | None = None,
    device: str | None = None,
    constraint: Callable[[Any], Any] | None = None,
    validate_shape: bool = True,
    lazy: bool | None = None,
) -> Any:
    """Create ``scope/name``, or return it when the current variable scope reuses (TF1).

    - Name: the current *variable* scope's name joined with ``name`` (name scopes are
      ignored).
    - Reuse off: creates the variable; :class:`~ckptvar.errors.VariableScopeError` (a
      ``ValueError``) if it already exists. ``reuse=True``: returns the existing one, error if
      missing. ``AUTO_REUSE``: either. A reused variable must agree with ``shape`` and
      ``dtype`` when they are given.
    - ``initializer``: an initializer (default: the scope's, else ``glorot_uniform`` for
      floats and ``zeros`` for ints and bools), called once as
      ``initializer(shape, dtype=dtype)`` (plus ``partition_info=`` when it accepts it), or a
      concrete value (then no ``shape``).
    - ``dtype``: default the scope's, else float32.
    - ``partitioner`` (default the scope's): ``partitioner(shape=, dtype=)`` -> how many
      parts along each axis (at most one axis > 1); the result is a
      :class:`~ckptvar.PartitionedVariable` whose parts are ``scope/name/part_0``, ...

    The graph's variable store keeps these variables alive.
    """
    if not isinstance(name, str) or not name:
        raise VariableArgumentError(
            f"get_variable needs a name: a non-empty string, not {name!r}."
        )
    graph = get_default_graph()
    state = _state(graph)
    scope = state.scope()
    full = f"{scope.name}/{name}" if scope.name else name
    reuse = scope.reuse
    req_dtype = dtype if dtype is not None else scope.dtype
    if partitioner is None:
        partitioner = scope.partitioner
    # One lookup-and-create at a time: threads asking for the same name with reuse get
    # one variable (and without reuse, all but one get the 'already exists' error).
    with state.creating:
        found = state.stored(full)
        if found is not None:
            return _reused(found, full, reuse, shape, req_dtype, partitioner)
        if reuse is True:
            raise VariableScopeError(
                f"Variable {full!r} does not exist, or was not created with get_variable(). Did "
                "you mean to set reuse=AUTO_REUSE in variable_scope?"
            )
        if initializer is None:
            initializer = scope.initializer
        from_value = initializer is not None and (
            isinstance(initializer, Variable) or not callable(initializer)
        )
        kwargs: dict[str, Any] = {
            "trainable": trainable, "device": device, "constraint": constraint,
            "collections": collections, "validate_shape": validate_shape, "lazy": lazy,
        }
        if partitioner is not None:
            created: Any = make_partitioned(
                full, shape, req_dtype, initializer, from_value, partitioner,
                make_part=lambda part, initial, dt, part_shape, info: _new_variable(
                    graph, state, part, initial, dt, part_shape, info, kwargs),
                default_initializer=_default_initializer, bind=bind_initializer,
            )
        elif from_value:
            if shape is not None:
                raise VariableScopeError(
                    f"Variable {full!r}: if the initializer is a constant value, do not specify "
                    "shape."
                )
            created = _new_variable(graph, state, full, initializer, req_dtype, None, None, kwargs)
        else:
            dt = as_dtype(req_dtype if req_dtype is not None else "float32")
            var_shape = defined_shape(shape, f"a new variable ({full!r})")
            init = initializer if initializer is not None else _default_initializer(dt, full)
            _init.check_produces(init, dt, f"Cannot make variable {full!r}")
            bound = bind_initializer(init, var_shape, dt)
            created = _new_variable(graph, state, full, bound, dt, var_shape, None, kwargs)
        state.keep(full, created)
        return created


def _new_variable(graph: Graph, state: _Tf1State, full: str, initial: Any, dtype: Any,
                  shape: Any, info: Any, kwargs: dict[str, Any]) -> Variable:
    if state.stored(full) is not None:
        raise VariableScopeError(
            f"Variable {full!r} already exists, disallowed (a partition would take its name)."
        )
    with graph.name_scope(None):
        variable = Variable(initial, name=full, dtype=dtype, shape=shape, _graph=graph,
                            **kwargs)
    if info is not None:
        set_save_slice_info(variable, info)
        state.keep(full, variable)
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


def report_uninitialized_variables(
    var_list: Sequence[Variable | PartitionedVariable] | None = None,
) -> list[str]:
    """The names of the variables (global and local by default) that have no value yet;
    a :class:`~ckptvar.PartitionedVariable` in ``var_list`` stands for its parts."""
    if var_list is None:
        graph = get_default_graph()
        seen: dict[int, Variable] = {}
        for key in (GraphKeys.GLOBAL_VARIABLES, GraphKeys.LOCAL_VARIABLES):
            for v in graph.get_collection(key):
                if isinstance(v, Variable):
                    seen.setdefault(id(v), v)
        var_list = list(seen.values())
    flat = [part for v in var_list
            for part in (v if isinstance(v, PartitionedVariable) else (v,))]
    return [v.name for v in flat if not v.initialized]
