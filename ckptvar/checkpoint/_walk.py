"""The object-graph walk: from a root, every variable and trackable with its key.

Breadth first, children in their tracked order, so the walk is deterministic and
a value reachable by several paths is first met by its shortest one. A
``PartitionedVariable`` is a leaf, like a variable (it is stored as one logical value). Each
trackable and container is expanded once (cycles are fine); a variable met again
by another path is recorded as an alias of its first key (shared variables are
stored once and restored into every path).

Another library's object that a trackable holds (a torch module, optimizer or LR
scheduler, an object with ``state_dict()``; a registered JAX pytree node), as a child or,
for a ``cv.Module``, as a public attribute, is met as the trackable that stands for it
(made by the function :func:`set_stand_in` was given: ``_held``'s), under its name.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .._frameworks import framework_of
from ..module import Module
from ..trackable import SupportsStateDict, Trackable, trackable_children
from ..variables import PartitionedVariable, Variable
from ._keys import escape_segment
from ._tree_nodes import is_tree_node

__all__ = ["Node", "child_items", "is_array", "is_framework_object", "is_jax_tree", "set_stand_in",
           "untracked", "walk"]


@dataclass(slots=True)
class Node:
    """One object met by the walk.

    ``key`` is its (escaped) path; ``parent`` the trackable or container holding it
    under the raw name ``name`` (``None`` for the root); ``first`` is False for a
    variable or trackable already met by an earlier path. Treat it as read-only.
    """

    key: str
    obj: Any
    parent: Any
    name: str | None
    first: bool = True


def _join(prefix: str, name: str) -> str:
    if type(name) is str and name and "%" not in name and "/" not in name:
        seg = name  # nothing to escape (the common case)
    else:
        seg = escape_segment(name)
    return f"{prefix}/{seg}" if prefix else seg


def child_items(obj: Any, key: str = "") -> Iterable[tuple[str, Any]]:
    """The ``(raw name, child)`` pairs of a trackable, list, tuple or dict, in order
    (a dict's own items when every name is a str: no generator step per child)."""
    if isinstance(obj, Trackable):
        children = trackable_children(obj)
        if not isinstance(children, dict):
            raise TypeError(
                f"{type(obj).__name__}.trackable_children() must return a dict, "
                f"got {type(children).__name__} (at {key or '<root>'!r})."
            )
        return _with_stand_ins(obj, children).items()
    if isinstance(obj, list | tuple):
        return [(str(i), child) for i, child in enumerate(obj)]
    if isinstance(obj, dict):
        if set(map(type, obj)) <= _STR:  # the common case: the names as they are
            return obj.items()
        out = []
        for name, child in obj.items():
            if isinstance(name, bool) or not isinstance(name, str | int):
                if _is_node(child):
                    raise TypeError(
                        f"Cannot checkpoint the dict entry {name!r} under {key or '<root>'!r}: "
                        "only str and int dict keys can name a checkpoint value."
                    )
                continue
            out.append((str(name), child))
        named = [n for n, child in out if _is_node(child)]
        if len(set(named)) < len(named):  # {1: a, "1": b}: one key for two values
            clash = next(n for n in named if named.count(n) > 1)
            raise TypeError(
                f"Cannot checkpoint the dict under {key or '<root>'!r}: the keys {int(clash)!r} "
                f"and {clash!r} would both name the checkpoint value {clash!r}."
            )
        return out
    return ()


_STR = frozenset({str})

#: ``make(holder, name, value)``: the trackable standing for another library's object
#: ``value`` that trackable ``holder`` holds under ``name`` (:func:`set_stand_in`)
_STAND_IN: list[Callable[[Trackable, str, Any], Trackable]] = []


def set_stand_in(make: Callable[[Trackable, str, Any], Trackable]) -> None:
    """Make the walk meet each object of another library a trackable holds as
    ``make(holder, name, value)`` (set once, by the checkpoint package)."""
    _STAND_IN[:] = [make]


def is_framework_object(value: Any) -> bool:
    """Whether ``value`` is another library's object a checkpoint saves whole: one with
    ``state_dict()``/``load_state_dict()`` (a torch module, optimizer, LR scheduler,
    GradScaler) or a registered JAX pytree node (not a trackable, container or array)."""
    if isinstance(value, _NODE_TYPES) or value is None or isinstance(value, _PLAIN):
        return False
    return isinstance(value, SupportsStateDict) or (not is_array(value) and is_tree_node(value))


_PLAIN = (bool, int, float, str, bytes)


def is_jax_tree(value: Any) -> bool:
    """Whether a dict, list or tuple is a JAX pytree a checkpoint takes whole, as it takes
    a registered node (``{"params": params, "opt_state": optax_state}``): its leaves are
    JAX arrays (one at least; typed keys and ``jax.ShapeDtypeStruct``s too), registered
    JAX nodes and Python values, nothing a checkpoint tracks (a variable, a module).
    JAX arrays are immutable, so such a tree, like a node, is restored as a new tree; a
    container of NumPy or torch arrays, which a user expects filled in place, is not one.
    """
    if not isinstance(value, list | tuple | dict):
        return False
    found = False
    todo: list[Any] = [value]
    while todo:
        obj = todo.pop()
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
        elif obj is None or isinstance(obj, _PLAIN):
            continue
        elif (framework_of(obj) == "jax" and is_array(obj)) or is_tree_node(obj):
            found = True
        else:
            return False
    return found


def _with_stand_ins(obj: Trackable, children: dict[str, Any]) -> dict[str, Any]:
    """``children`` with each object of another library the trackable whose stand-in
    it is, and, for a ``cv.Module`` that does not say itself what it saves, each public
    attribute holding one that is not a child added (by its attribute name)."""
    out: dict[str, Any] | None = None
    for name, child in children.items():
        if type(child) is not Variable and _STAND_IN and (is_framework_object(child)
                                                          or is_jax_tree(child)):
            out = dict(children) if out is None else out
            out[name] = _STAND_IN[0](obj, name, child)
    if isinstance(obj, Module) and _STAND_IN and not _names_its_state(type(obj)):
        for name, value in list(obj.__dict__.items()):
            if name[:1] != "_" and name not in children and is_framework_object(value):
                out = dict(children) if out is None else out
                out[name] = _STAND_IN[0](obj, name, value)
    return children if out is None else out


_NODE_TYPES = (Variable, PartitionedVariable, Trackable, list, tuple, dict)


def _is_node(value: Any) -> bool:
    return isinstance(value, _NODE_TYPES)


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array (NumPy, torch, JAX, CuPy, a NumPy scalar): what a
    checkpoint does not track unless it is held by a ``cv.Variable``.

    >>> import numpy as np
    >>> is_array(np.ones(2)), is_array(np.float32(1)), is_array(3), is_array("a")
    (True, True, False, False)
    """
    return (hasattr(value, "__array__") or hasattr(value, "__dlpack__")
            or (hasattr(value, "shape") and hasattr(value, "dtype")))


def untracked(container: list[Any] | tuple[Any, ...] | dict[Any, Any], key: str
              ) -> list[tuple[str, Any]]:
    """``(key, value)`` of each value in ``container`` (and the lists, tuples and dicts in
    it) that a checkpoint does not track: neither a variable, a trackable object nor a
    container; what a save leaves out.

    >>> import numpy as np
    >>> [(k, type(v).__name__) for k, v in untracked({"w": np.ones(2), "lr": [0.1]}, "p")]
    [('p/w', 'ndarray'), ('p/lr/0', 'float')]
    """
    out: list[tuple[str, Any]] = []
    todo: deque[tuple[str, Any]] = deque([(key, container)])
    seen = {id(container)}
    while todo:
        at, obj = todo.popleft()
        try:
            items = list(child_items(obj, at))
        except TypeError:  # a key that cannot name a value: the save says so
            continue
        for name, child in items:
            child_key = _join(at, name)
            if isinstance(child, list | tuple | dict):
                if id(child) not in seen:
                    seen.add(id(child))
                    todo.append((child_key, child))
            elif not _is_node(child):
                out.append((child_key, child))
    return out


def walk(root: Any, root_key: str = "", stop: type | None = None) -> list[Node]:
    """Every variable, trackable and container reachable from ``root`` (root first);
    the children of an object of class ``stop`` are not walked."""
    stops = () if stop is None else stop
    nodes: list[Node] = [Node(root_key, root, None, None)]
    seen: set[int] = {id(root)}
    queue: deque[tuple[str, Any]] = deque([(root_key, root)])
    add = nodes.append
    while queue:
        key, obj = queue.popleft()
        _arrays_left_out(obj, key)
        for name, child in child_items(obj, key):
            leaf = type(child) is Variable  # the common case, without the isinstance calls
            if not leaf:
                if not isinstance(child, _NODE_TYPES):
                    _left_out(obj, key, name, child)
                    continue
                leaf = isinstance(child, Variable | PartitionedVariable)
            if type(name) is str and name and key and "%" not in name and "/" not in name:
                child_key = f"{key}/{name}"  # _join's common case, without the call
            else:
                child_key = _join(key, name)
            ident = id(child)
            first = ident not in seen
            if leaf:
                seen.add(ident)
                add(Node(child_key, child, obj, name, first))
                continue
            if not first:
                if isinstance(child, Trackable):
                    add(Node(child_key, child, obj, name, False))
                continue
            seen.add(ident)
            add(Node(child_key, child, obj, name))
            if not isinstance(child, stops):
                queue.append((child_key, child))
    return nodes


def _names_its_state(cls: type) -> bool:
    """Whether trackable class ``cls`` says itself what it saves (it overrides
    ``trackable_children`` or ``python_state``, or their private spellings): its
    attributes are taken at its word."""
    return any(getattr(cls, hook) is not getattr(Trackable, hook)
               for hook in ("trackable_children", "python_state", "_trackable_children",
                            "_python_state"))


#: ``(class, attribute, value type)`` of each attribute :func:`_arrays_left_out` named
_said: set[tuple[type, str, type]] = set()


def _arrays_left_out(obj: Any, key: str) -> None:
    """Where ``obj`` is a trackable (a ``cv.Module`` or another one tracking what it is
    given), say that each of its public attributes holding an array, which a checkpoint
    does not track, is not saved (once per class, attribute and type of value); and, for a
    trackable other than a module (which tracks them), each holding another library's
    object (a torch module, a JAX pytree) it does not track. Attributes named with a
    leading underscore and anything else stay quiet."""
    if not isinstance(obj, Trackable):
        return
    attrs = getattr(obj, "__dict__", None)
    if not attrs or _names_its_state(type(obj)):
        return
    children: dict[str, Any] | None = None
    module = isinstance(obj, Module)
    for name, value in attrs.items():
        if name[:1] == "_" or _is_node(value):
            continue
        array = is_array(value)
        if array or (not module and is_framework_object(value)):
            said = (type(obj), name, type(value))
            if said in _said:
                continue
            if children is None:
                children = trackable_children(obj)
            if _tracked(children, name, value, array):
                continue
            _said.add(said)
            what = f"{type(value).__module__}.{type(value).__qualname__}"
            if not array:
                warnings.warn(
                    f"{_join(key, name)!r} is a {what} held by the attribute {name!r} of "
                    f"{type(obj).__qualname__}: a trackable saves what it tracks, so it is "
                    f"not saved (nor restored). To keep it, track it (self.track({name!r}, "
                    f"self.{name}); a cv.Module tracks such attributes itself); to say it "
                    "is not state, name it with a leading underscore (docs/frameworks.md).",
                    UserWarning,
                    stacklevel=4,
                )
                continue
            warnings.warn(
                f"{_join(key, name)!r} is a {what} held by the attribute {name!r} of "
                f"{type(obj).__qualname__}: a checkpoint saves variables and trackable "
                "objects, so it is not saved (nor restored). To keep it, hold it in a "
                f"cv.Variable (self.{name} = cv.Variable(...)); to say it is not state, "
                "name it with a leading underscore (docs/checkpoints.md).",
                UserWarning,
                stacklevel=4,
            )


def _tracked(children: dict[str, Any], name: str, value: Any, array: bool) -> bool:
    """Whether the attribute ``name`` holding ``value`` is saved all the same: a child of
    its name (a checkpoint's pytree), or, for an object of another library, a child of
    another name."""
    return name in children or (not array and any(c is value for c in children.values()))


def _left_out(container: Any, at: str, name: str, value: Any) -> None:
    """Say that ``value``, under ``name`` in ``container`` (at ``at``), is not saved (once
    per key and type: Python's warning registry): any child a trackable names that is
    neither a variable, a trackable nor a container (``track("mask", array)``); in a list,
    tuple or dict, an array, state-dict object or JAX pytree node (other values there,
    numbers and strings, are a module's configuration: quiet)."""
    what = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(container, Trackable):
        warnings.warn(
            f"{_join(at, name)!r} is a {what}, a child of {type(container).__qualname__}: a "
            "checkpoint saves variables, trackable objects and containers of them, so it is "
            "not saved (nor restored). Hold an array in a cv.Variable, and a number or "
            "string in the trackable's python_state() (docs/checkpoints.md).",
            UserWarning,
            stacklevel=4,
        )
        return
    if not (is_array(value) or isinstance(value, SupportsStateDict) or is_tree_node(value)):
        return
    how = ("Pass it as the checkpoint's own argument, cv.Checkpoint(name=...), or hold it "
           "as a module's attribute"
           if isinstance(value, SupportsStateDict) or is_tree_node(value) else
           "Hold it in a cv.Variable, or save a pytree of arrays with cv.save(path, tree)")
    warnings.warn(
        f"{_join(at, name)!r} is a {what} in a container: a checkpoint saves variables and "
        f"trackable objects, so it is not saved (nor restored). {how} (docs/frameworks.md).",
        UserWarning,
        stacklevel=4,
    )
