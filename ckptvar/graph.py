"""Graphs: namespaces for variable names, scopes, collections and the ``get_variable`` store.

Owns :class:`Graph` (a name registry with TensorFlow's uniquification, the per-thread name
scope and variable scope stacks, weak collections, and the store of variables made by
``get_variable``), the default-graph stack (:func:`get_default_graph`,
:func:`reset_default_graph`, ``Graph.as_default``), :func:`name_scope`,
:func:`variable_scope` / :class:`VariableScope` with TF1 reuse semantics (``AUTO_REUSE``),
:class:`GraphKeys` and the collection functions.

Collections hold variables through weak references, so a variable nobody references any
more disappears from them; other objects are held normally. The ``get_variable`` store
holds its variables strongly, as TensorFlow 1 does.

>>> g = Graph()
>>> with g.as_default(), name_scope("block") as scope:
...     scope, g.unique_name("v"), g.unique_name("v")
('block/', 'block/v', 'block/v_1')
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from . import _naming
from .errors import CkptError, VariableScopeError

if TYPE_CHECKING:
    from .variables import Variable

__all__ = [
    "AUTO_REUSE",
    "Graph",
    "GraphKeys",
    "VariableScope",
    "add_to_collection",
    "get_collection",
    "get_default_graph",
    "get_variable_scope",
    "global_variables",
    "local_variables",
    "name_scope",
    "reset_default_graph",
    "trainable_variables",
    "variable_scope",
]


class GraphKeys:
    """Standard collection names (the same strings as TensorFlow's)."""

    GLOBAL_VARIABLES = "variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    LOCAL_VARIABLES = "local_variables"
    MODEL_VARIABLES = "model_variables"


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


class GraphStateError(CkptError, RuntimeError):
    """The default-graph stack was misused (e.g. reset inside ``as_default()``)."""


class VariableScope:
    """A variable scope: a name prefix for ``get_variable`` plus reuse/initializer/dtype defaults.

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
        name_scope: str = "",
    ) -> None:
        self._name = name
        self._reuse = reuse
        self.initializer = initializer
        self.dtype = dtype
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

    def get_variable(self, name: str, *args: Any, **kwargs: Any) -> Variable:
        """``get_variable`` inside this scope (see :func:`ckptvar.get_variable`)."""
        from .variables import get_variable  # noqa: PLC0415 - variables imports graph

        with variable_scope(self):
            return get_variable(name, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<VariableScope {self._name!r} reuse={self._reuse!r}>"


class _Strong:
    """A collection entry held strongly (for objects that are not variables)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class Graph:
    """A namespace for variables: names, scopes, collections and the ``get_variable`` store.

    ``with g.as_default():`` makes ``g`` the default graph for the block (in this thread).
    """

    def __init__(self) -> None:
        self._names = _naming.NameRegistry()
        self._local = threading.local()
        self._lock = threading.RLock()
        self._collections: dict[str, list[Any]] = {}
        self._variable_store: dict[str, Variable] = {}
        self._scope_counts: dict[str, int] = {}

    # --- names ---------------------------------------------------------------------------
    @property
    def _name_stack(self) -> str:
        return getattr(self._local, "name_stack", "")

    @_name_stack.setter
    def _name_stack(self, value: str) -> None:
        self._local.name_stack = value

    def get_name_scope(self) -> str:
        """The current name scope, without a trailing slash (``""`` at the root)."""
        return self._name_stack

    def unique_name(self, name: str, mark_as_used: bool = True) -> str:
        """``name`` under the current name scope, made unique in this graph.

        As TensorFlow: case-insensitive, ``x``, ``x_1``, ``x_2``...; the composed name is
        marked as used, so a later explicit ``x_1`` becomes ``x_1_1``.
        """
        return self._names.unique_name(_naming.join(self._name_stack, name),
                                       mark_as_used=mark_as_used)

    def _mark_used(self, name: str) -> None:
        self._names.mark_used(name)

    @contextmanager
    def name_scope(self, name: str | None) -> Iterator[str]:
        """Push a name scope; yields it with a trailing slash (``"block/"``).

        ``None`` or ``""`` goes back to the root; a name ending in ``/`` is an absolute
        scope used exactly as given; any other name is made unique under the current scope.
        """
        if name:
            if not isinstance(name, str):
                raise VariableScopeError(f"A scope name is a string, not {name!r}.")
            if not _naming.valid_scope_name(name, nested=bool(self._name_stack)):
                raise VariableScopeError(f"{name!r} is not a valid scope name.")
        old = self._name_stack
        if not name:
            new, returned = "", ""
        elif name.endswith("/"):
            new, returned = name[:-1], name
            self._mark_used(new)
        else:
            new = self.unique_name(name)
            returned = new + "/"
        self._name_stack = new
        try:
            yield returned
        finally:
            self._name_stack = old

    # --- variable scopes -----------------------------------------------------------------
    def _var_scope(self) -> VariableScope:
        scope = getattr(self._local, "var_scope", None)
        if scope is None:
            scope = self._local.var_scope = VariableScope("")
        return scope

    def _set_var_scope(self, scope: VariableScope) -> None:
        self._local.var_scope = scope

    def _count_scope(self, name: str) -> None:
        with self._lock:
            self._scope_counts[name] = self._scope_counts.get(name, 0) + 1

    def _unique_scope_name(self, prefix: str) -> str:
        current = self._var_scope().name
        full = _naming.join(current, prefix)
        with self._lock:
            if not self._scope_counts.get(full):
                return prefix
            i = 1
            while self._scope_counts.get(f"{full}_{i}"):
                i += 1
            return f"{prefix}_{i}"

    # --- collections ---------------------------------------------------------------------
    def add_to_collection(self, name: str, value: Any) -> None:
        """Append ``value`` to collection ``name`` (variables are held weakly)."""
        entry: Any = weakref.ref(value) if getattr(value, "_weak_in_collections", False) \
            else _Strong(value)
        with self._lock:
            self._collections.setdefault(name, []).append(entry)

    def add_to_collections(self, names: Any, value: Any) -> None:
        """Add ``value`` to each collection in ``names`` (a string or an iterable), once each."""
        names = (names,) if isinstance(names, str) else tuple(dict.fromkeys(names))
        for name in names:
            self.add_to_collection(name, value)

    def get_collection(self, name: str, scope: str | None = None) -> list[Any]:
        """A new list with the live items of collection ``name``, in insertion order.

        With ``scope``, only items whose ``name`` matches it (``re.match``, as TensorFlow).
        """
        with self._lock:
            entries = self._collections.get(name, [])
            items = [e() for e in entries]
            if any(item is None for item in items):  # drop entries of freed variables
                self._collections[name] = [e for e, i in zip(entries, items, strict=True)
                                           if i is not None]
        items = [item for item in items if item is not None]
        if scope is None:
            return items
        pattern = re.compile(scope)
        return [item for item in items
                if isinstance(getattr(item, "name", None), str) and pattern.match(item.name)]

    def get_all_collection_keys(self) -> list[str]:
        with self._lock:
            return list(self._collections)

    def clear_collection(self, name: str) -> None:
        with self._lock:
            self._collections.pop(name, None)

    # --- the get_variable store ----------------------------------------------------------
    def _stored_variable(self, name: str) -> Variable | None:
        with self._lock:
            return self._variable_store.get(name)

    def _store_variable(self, name: str, variable: Variable) -> None:
        with self._lock:
            self._variable_store[name] = variable

    # --- default graph -------------------------------------------------------------------
    @contextmanager
    def as_default(self) -> Iterator[Graph]:
        """Make this graph the default one (in this thread) inside the ``with`` block."""
        stack = _graph_stack()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()


_default_graph = Graph()
_default_lock = threading.Lock()
_thread = threading.local()


def _graph_stack() -> list[Graph]:
    stack = getattr(_thread, "graphs", None)
    if stack is None:
        stack = _thread.graphs = []
    return stack


def get_default_graph() -> Graph:
    """The graph new variables go into: the innermost ``as_default()`` one, else the global one."""
    stack = _graph_stack()
    return stack[-1] if stack else _default_graph


def reset_default_graph() -> None:
    """Replace the global default graph with an empty one (names, collections, store).

    Raises :class:`GraphStateError` inside a ``Graph.as_default()`` block.
    """
    global _default_graph
    if _graph_stack():
        raise GraphStateError(
            "reset_default_graph() was called inside a Graph.as_default() block; leave the "
            "block first."
        )
    with _default_lock:
        _default_graph = Graph()


@contextmanager
def name_scope(name: str | None, default_name: str | None = None) -> Iterator[str]:
    """Prefix the names of variables created inside with ``name/`` (nested scopes join with /).

    A second ``name_scope("block")`` at the same level becomes ``block_1/``. Yields the
    scope (``"block/"``). ``name_scope`` does not prefix ``get_variable`` names.

    >>> with Graph().as_default():
    ...     with name_scope("a") as a, name_scope("b") as b:
    ...         a, b
    ('a/', 'a/b/')
    """
    with get_default_graph().name_scope(name if name is not None else default_name) as scope:
        yield scope


def get_variable_scope() -> VariableScope:
    """The current variable scope of the default graph (in this thread)."""
    return get_default_graph()._var_scope()


@contextmanager
def variable_scope(
    name_or_scope: str | VariableScope | None,
    default_name: str | None = None,
    *,
    reuse: bool | _AutoReuse | None = None,
    initializer: Any = None,
    dtype: Any = None,
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
    - ``initializer``/``dtype``: defaults for ``get_variable`` inside; inherited.
    """
    graph = get_default_graph()
    old = graph._var_scope()
    if isinstance(name_or_scope, VariableScope):
        scope = VariableScope(
            name_or_scope.name,
            reuse=reuse if reuse else name_or_scope.reuse,
            initializer=initializer if initializer is not None else name_or_scope.initializer,
            dtype=dtype if dtype is not None else name_or_scope.dtype,
            name_scope=name_or_scope.original_name_scope,
        )
        name_scope_arg = name_or_scope.original_name_scope or None
    else:
        if name_or_scope is None:
            if default_name is None:
                raise VariableScopeError("variable_scope needs name_or_scope or default_name.")
            if reuse is True:
                raise VariableScopeError("reuse=True cannot be used without a name_or_scope.")
            local = graph._unique_scope_name(default_name)
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
            name_scope=ns,
        )
        name_scope_arg = ns or None
    graph._count_scope(scope.name)
    graph._set_var_scope(scope)
    try:
        if auxiliary_name_scope:
            with graph.name_scope(name_scope_arg):
                yield scope
        else:
            yield scope
    finally:
        graph._set_var_scope(old)


def add_to_collection(name: str, value: Any) -> None:
    """Add ``value`` to collection ``name`` of the default graph."""
    get_default_graph().add_to_collection(name, value)


def get_collection(key: str, scope: str | None = None) -> list[Any]:
    """The live items of collection ``key`` of the default graph (see ``Graph.get_collection``)."""
    return get_default_graph().get_collection(key, scope)


def global_variables(scope: str | None = None) -> list[Variable]:
    """The variables in ``GraphKeys.GLOBAL_VARIABLES`` (every variable, by default)."""
    return get_collection(GraphKeys.GLOBAL_VARIABLES, scope)


def trainable_variables(scope: str | None = None) -> list[Variable]:
    """The variables in ``GraphKeys.TRAINABLE_VARIABLES``."""
    return get_collection(GraphKeys.TRAINABLE_VARIABLES, scope)


def local_variables(scope: str | None = None) -> list[Variable]:
    """The variables in ``GraphKeys.LOCAL_VARIABLES``."""
    return get_collection(GraphKeys.LOCAL_VARIABLES, scope)
