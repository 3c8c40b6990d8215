"""``cv.Module``: a container of variables and sub-modules that tracks what it is given.

Owns automatic tracking on attribute assignment (variables, partitioned variables —
saved as one logical variable, their parts listed in ``variables`` — trackables and
lists/tuples/dicts of them, nested, in assignment order; another library's object held
by a public attribute, a torch module or a JAX pytree, is met by the checkpoint walk,
which saves it as a checkpoint's own argument), the ``variables`` /
``trainable_variables`` / ``non_trainable_variables`` / ``submodules`` views (depth
first, deterministic, without duplicates), the default snake_case name, the
module's name scope and :meth:`Module.add_variable`, which honours a pending
restore (restore as initialization).

>>> import ckptvar as cv
>>> class MLPModel(cv.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = cv.Variable([1.0, 2.0], name="w")
...         self.layers = [cv.Variable(0, name="b")]
>>> m = MLPModel()
>>> m.name, [v.shape for v in m.variables]
('mlp_model', [(2,), ()])
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import initializers as _initializers
from ._dtypes import as_dtype, kind_of
from .graph import name_scope as _name_scope
from .trackable import Trackable, stand_ins, trackable_children
from .variables import PartitionedVariable, Variable

__all__ = ["Module", "iter_tracked"]

_CAMEL_1 = re.compile(r"(.)([A-Z][a-z]+)")
_CAMEL_2 = re.compile(r"([a-z0-9])([A-Z])")


def _snake_case(name: str) -> str:
    """``MLPModel`` -> ``mlp_model``, ``Dense`` -> ``dense``, ``ResNet50`` -> ``res_net50``."""
    return _CAMEL_2.sub(r"\1_\2", _CAMEL_1.sub(r"\1_\2", name)).lower()


_PLAIN = (type(None), bool, int, float, str, bytes)


def _is_tracked_value(value: Any) -> bool:
    return isinstance(value, Variable | PartitionedVariable | Trackable | list | tuple | dict)


def iter_tracked(value: Any, seen: set[int]) -> Iterator[Any]:  # noqa: C901 - one branch per kind of container walked
    """Depth-first: every Variable and Trackable reachable from ``value``, once each."""
    if isinstance(value, Variable):
        if id(value) not in seen:
            seen.add(id(value))
            yield value
        return
    if isinstance(value, PartitionedVariable):  # its parts are the module's variables
        for part in value:
            yield from iter_tracked(part, seen)
        return
    if isinstance(value, Trackable):
        if id(value) in seen:
            return
        seen.add(id(value))
        yield value
        children: Any = trackable_children(value).values()
    elif isinstance(value, list | tuple):
        if id(value) in seen:
            return
        seen.add(id(value))
        children = value
    elif isinstance(value, dict):
        if id(value) in seen:
            return
        seen.add(id(value))
        children = value.values()
    else:
        return
    for child in children:
        yield from iter_tracked(child, seen)


class _ModuleNameScope:
    """Reusable context manager: ``with module.name_scope:`` prefixes the module's scope.

    The scope is made unique once, where the module is created (``dense/``, then
    ``dense_1/`` for a second module of that name), and re-entered exactly after that.
    """

    def __init__(self, name: str) -> None:
        with _name_scope(name) as scope:
            self._name = scope  # absolute, ends with "/"
        self._local = threading.local()  # each thread's open scopes: never another's

    def _stack(self) -> list[Any]:
        stack: list[Any] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> str:
        cm = _name_scope(self._name)
        entered = cm.__enter__()
        self._stack().append(cm)
        return entered

    def __exit__(self, *exc: Any) -> None:
        self._stack().pop().__exit__(*exc)

    def __getstate__(self) -> dict[str, Any]:  # a copy or a pickle keeps the name only
        return {"_name": self._name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._name = state["_name"]
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"<name_scope {self._name!r}>"


class Module(Trackable):
    """A named container of variables, sub-modules and Python state.

    Args:
        name: the module's name; defaults to the class name in snake_case.
    """

    def __init__(self, name: str | None = None) -> None:
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"A module name must be a non-empty string without '/', got {name!r}.")
        object.__setattr__(self, "_cv_name", name)
        object.__setattr__(self, "_cv_scope", _ModuleNameScope(self.name))

    # -- tracking ---------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name.startswith("_cv_"):
            return
        if _is_tracked_value(value):
            self._track(name, value)
            return
        self._untrack(name)
        if not isinstance(value, _PLAIN) and name in self.__dict__.get(self._CV_DEFERRED, ()):
            # another library's object (a torch module, a JAX pytree) a restore waits for:
            # the checkpoint gives it its stored state now
            self._child_attached(name, value)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        self._untrack(name)
        stand_ins(self).pop(name, None)

    # -- names ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The module's name (the class name in snake_case unless given)."""
        return self.__dict__.get("_cv_name") or _snake_case(type(self).__name__)

    @property
    def name_scope(self) -> _ModuleNameScope:
        """A context manager prefixing variable names with ``<name>/``."""
        scope = self.__dict__.get("_cv_scope")
        if scope is None:
            scope = _ModuleNameScope(self.name)
            object.__setattr__(self, "_cv_scope", scope)
        return scope

    # -- views ------------------------------------------------------------------------
    def _reachable(self) -> Iterator[Any]:
        seen: set[int] = {id(self)}
        for child in trackable_children(self).values():
            yield from iter_tracked(child, seen)

    @property
    def variables(self) -> tuple[Variable, ...]:
        """Every variable reachable from this module, depth first, each once."""
        return tuple(v for v in self._reachable() if isinstance(v, Variable))

    @property
    def trainable_variables(self) -> tuple[Variable, ...]:
        """The variables with ``trainable=True``."""
        return tuple(v for v in self.variables if v.trainable)

    @property
    def non_trainable_variables(self) -> tuple[Variable, ...]:
        """The variables with ``trainable=False``."""
        return tuple(v for v in self.variables if not v.trainable)

    @property
    def submodules(self) -> tuple[Module, ...]:
        """Every module reachable from this one (not itself), depth first, each once."""
        return tuple(m for m in self._reachable() if isinstance(m, Module))

    # -- creation ---------------------------------------------------------------------
    def add_variable(
        self,
        name: str,
        shape: Any,
        dtype: Any = "float32",
        initializer: Any = None,
        trainable: bool = True,
    ) -> Variable:
        """Make a variable ``<module name>/<name>`` and track it as the child ``name``.

        The value comes from ``initializer`` (default: ``glorot_uniform`` for floats,
        ``zeros`` otherwise) at first use, unless a pending restore supplies the stored
        value first: then the initializer never runs.
        """
        dt = as_dtype(dtype)
        if initializer is None:
            inexact = kind_of(dt) in ("f", "c")  # bfloat16 and float8 included, int4 not
            initializer = _initializers.glorot_uniform if inexact else _initializers.zeros
        if isinstance(shape, int | np.integer):
            shape = (int(shape),)
        with self.name_scope:
            var = Variable(
                initializer, name=name, shape=tuple(shape), dtype=dt, trainable=trainable
            )
        self._track(name, var)
        return var

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__} {self.name!r}>"
