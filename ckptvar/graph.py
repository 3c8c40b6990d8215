"""Graphs: namespaces for variable names, name scopes and collections.

Owns :class:`Graph` (a name registry with TensorFlow's uniquification, the per-thread name
scope stack, weak collections, and :meth:`Graph.extension`: per-graph state that another
module owns, such as the TF1 variable scopes and ``get_variable`` store of
:mod:`ckptvar.variables.tf1`), the default-graph stack (:func:`get_default_graph`,
:func:`reset_default_graph`, ``Graph.as_default``), :func:`name_scope`, :class:`GraphKeys`
and the collection functions.

Collections hold variables through weak references, so a variable nobody references any
more disappears from them; other objects are held normally.

>>> g = Graph()
>>> with g.as_default(), name_scope("block") as scope:
...     scope, g.unique_name("v"), g.unique_name("v")
('block/', 'block/v', 'block/v_1')
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from . import _naming
from .errors import CkptError, VariableScopeError

T = TypeVar("T")

__all__ = [
    "Graph",
    "GraphKeys",
    "GraphStateError",
    "add_to_collection",
    "get_collection",
    "get_default_graph",
    "global_variables",
    "local_variables",
    "name_scope",
    "reset_default_graph",
    "trainable_variables",
]


class GraphKeys:
    """Standard collection names (the same strings as TensorFlow's)."""

    GLOBAL_VARIABLES = "variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    LOCAL_VARIABLES = "local_variables"
    MODEL_VARIABLES = "model_variables"


class GraphStateError(CkptError, RuntimeError):
    """The default-graph stack was misused (e.g. reset inside ``as_default()``)."""


class _Strong:
    """A collection entry held strongly (for objects that are not variables)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class Graph:
    """A namespace for variables: names, name scopes, collections, and extensions.

    ``with g.as_default():`` makes ``g`` the default graph for the block (in this thread).
    """

    def __init__(self) -> None:
        self._names = _naming.NameRegistry()
        self._local = threading.local()
        self._lock = threading.RLock()
        self._collections: dict[str, list[Any]] = {}
        self._extensions: dict[str, Any] = {}

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

    def mark_used(self, name: str) -> None:
        """Record the exact name ``name`` as used (later ``unique_name`` calls avoid it)."""
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
            self.mark_used(new)
        else:
            new = self.unique_name(name)
            returned = new + "/"
        self._name_stack = new
        try:
            yield returned
        finally:
            self._name_stack = old

    # --- state other modules keep per graph --------------------------------------------
    def extension(self, key: str, factory: Callable[[], T]) -> T:
        """The object stored under ``key`` for this graph, made by ``factory()`` on first use.

        Lets a module keep per-graph state (such as the TF1 ``get_variable`` store) without
        the graph knowing about it; it lives as long as the graph.
        """
        with self._lock:
            found = self._extensions.get(key)
            if found is None:
                found = self._extensions[key] = factory()
            return found  # type: ignore[no-any-return,unused-ignore]

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
    """Replace the global default graph with an empty one (names, collections, extensions).

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


def add_to_collection(name: str, value: Any) -> None:
    """Add ``value`` to collection ``name`` of the default graph."""
    get_default_graph().add_to_collection(name, value)


def get_collection(key: str, scope: str | None = None) -> list[Any]:
    """The live items of collection ``key`` of the default graph (see ``Graph.get_collection``)."""
    return get_default_graph().get_collection(key, scope)


def global_variables(scope: str | None = None) -> list[Any]:
    """The variables in ``GraphKeys.GLOBAL_VARIABLES`` (every variable, by default)."""
    return get_collection(GraphKeys.GLOBAL_VARIABLES, scope)


def trainable_variables(scope: str | None = None) -> list[Any]:
    """The variables in ``GraphKeys.TRAINABLE_VARIABLES``."""
    return get_collection(GraphKeys.TRAINABLE_VARIABLES, scope)


def local_variables(scope: str | None = None) -> list[Any]:
    """The variables in ``GraphKeys.LOCAL_VARIABLES``."""
    return get_collection(GraphKeys.LOCAL_VARIABLES, scope)
