"""A pytree as a ``cv.Checkpoint``'s own argument: ``cv.Checkpoint(state=train_state)``.

Owns :class:`TreeTrackable`, how a registered JAX pytree node (a flax ``TrainState``, an
``nnx.State``, an equinox Module, a ``jax.tree_util.register_dataclass`` class) takes
part in a checkpoint. Its children are the tree's array leaves, as variables under the
names ``cv.save`` gives them (``state/params/dense/kernel``, ``state/opt_state/0/mu/...``);
its Python state the tree's Python values. JAX arrays cannot be written in place, so a
restore builds a new tree of the current one's structure and types (static fields
included: they are never read from the file), with the same ``like=`` rules as
``cv.load`` (shapes and dtypes checked first, ``cast=True``, ``jax.ShapeDtypeStruct``
leaves with their sharding), and the checkpoint's attribute becomes that tree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._frameworks import framework_of, to_numpy
from ..errors import CheckpointMismatchError
from ..graph import Graph
from ..variables import FreshValue, Variable, shares_memory
from ._frameworks import FrameworkStateError, RestoredWhole
from ._pytree import flatten as flatten_tree
from ._pytree import (
    from_python,
    is_abstract,
    is_array,
    is_tree_node,
    key_data,
    key_targets,
    leaf_result,
    leaf_target,
    python_value,
    rebuild,
    wrap_keys,
)

__all__ = ["TreeTrackable", "is_tree_node"]


#: the Python types a stored 0-d array may load into (a train state's ``step``), by kind
_NUMBER_KINDS = {bool: "b", int: "iu", float: "f"}


def _nest(flat: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``{"a/b": v}`` as ``{"a": {"b": v}}`` (the checkpoint walk joins the names again)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split("/")
        for i, seg in enumerate(parents):
            held = node.setdefault(seg, {})
            if not isinstance(held, dict):
                raise TypeError(
                    f"Cannot checkpoint {owner}/{key!r}: {'/'.join(parents[:i + 1])!r} is "
                    "a value of the tree and a container of it at once.")
            node = held
        if last in node:
            raise TypeError(
                f"Cannot checkpoint {owner}/{key!r}: it is a value of the tree and a "
                "container of it at once.")
        node[last] = value
    return out


class _Restoring:
    """One restore in progress: the variables it fills and how each becomes a leaf."""

    def __init__(self, variables: dict[str, Variable], hows: dict[str, Any],
                 python: dict[str, Any], numbers: dict[str, type], keys: dict[str, Any]
                 ) -> None:
        self.variables = variables
        self.hows = hows
        self.python = python  # the stored Python values, by path
        self.numbers = numbers  # paths of Python numbers stored as 0-d arrays: their type
        self.keys = keys  # paths of typed PRNG keys: their impl


class TreeTrackable(RestoredWhole):
    """How a pytree takes part in a checkpoint (``cv.Checkpoint(state=tree)``).

    ``tree`` is the tree a save writes and a restore's like tree; after a restore it is
    the restored tree (the checkpoint's attribute too).
    """

    def __init__(self, tree: Any, name: str) -> None:
        self.tree = tree
        self._name = name
        self._graph = Graph()
        #: path -> (the leaf, its variable): a JAX array is immutable, so the same array
        #: object at the same path is saved through the same variable again (and a
        #: restored leaf, over its variable's buffer, through the variable it came from)
        self._cache: dict[str, tuple[Any, Variable]] = {}
        self._python: dict[str, Any] | None = None
        self._restoring: _Restoring | None = None
        #: paths of Python numbers a restore read from 0-d arrays: saved as such again
        #: (the stored layout stays as first written), of the dtype they had
        self._numbers: dict[str, np.dtype] = {}
        #: ``given(old, new)`` after a restore built the new tree (its holder's attribute
        #: takes it); ``None``: the holder takes it itself (a ``cv.Checkpoint``)
        self.given: Callable[[Any, Any], None] | None = None

    # -- saving ---------------------------------------------------------------------------
    def _leaves(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(array leaves, Python values)`` of the tree, by path."""
        leaves = flatten_tree(self.tree)
        arrays: dict[str, Any] = {}
        python: dict[str, Any] = {}
        for key, value in leaves.items():
            if is_abstract(value):
                raise TypeError(
                    f"Cannot save {self._name}/{key}: a jax.ShapeDtypeStruct holds no values "
                    "(give the checkpoint the tree of arrays before saving).")
            if is_array(value) or (key in self._numbers and isinstance(value, bool | int | float)):
                arrays[key] = value
            else:
                python[key] = python_value(value)
        return arrays, python

    def _variable(self, key: str, value: Any) -> Variable:
        hit = self._cache.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        leaf, value = value, key_data(value)  # (a typed PRNG key: its key data)
        if getattr(value, "is_fully_addressable", True) is False:
            raise FrameworkStateError(
                f"Cannot checkpoint {self._name}/{key}: a jax.Array over devices of several "
                "processes; save the tree with cv.save(path, tree, coordinator=...) "
                "(docs/frameworks.md).")
        if isinstance(value, bool | int | float):
            host = np.asarray(value, self._numbers[key])
        else:
            host = value if isinstance(value, np.ndarray) else to_numpy(
                value, what=f"{self._name}/{key}")
        host = np.asarray(host)
        with self._graph.as_default():
            var = Variable(FreshValue(lambda: host), shape=host.shape, dtype=host.dtype,
                           device="CPU:0", collections=[], trainable=False, name=key)
        var.initialize()
        if framework_of(value) != "jax":
            shares_memory(var)  # a NumPy or torch leaf may change in place, unseen
            return var  # (its variable holds this save's copy or view: made anew)
        self._cache[key] = (leaf, var)
        return var

    def trackable_children(self) -> dict[str, Any]:
        if self._restoring is not None:
            return _nest(self._restoring.variables, self._name)
        arrays, python = self._leaves()
        self._python = python
        flat = {k: self._variable(k, v) for k, v in arrays.items()}
        for key in [k for k in self._cache if k not in flat]:
            del self._cache[key]
        return _nest(flat, self._name)

    def python_state(self) -> Any:
        if self._restoring is not None:
            return self._restoring.python or None
        python, self._python = self._python, None
        if python is None:
            python = self._leaves()[1]
        return python or None

    def restore_python_state(self, state: Any) -> None:
        """Nothing: :meth:`begin_restore` took the stored Python values already."""

    # -- restoring ------------------------------------------------------------------------
    def begin_restore(self, key: str, stored: Any, infos: Any) -> None:
        """Make a variable for every array leaf of the current tree (the like tree) and
        check that the checkpoint holds every leaf (``CheckpointMismatchError`` naming
        the keys it lacks, before anything changes)."""
        leaves = flatten_tree(self.tree)
        arrays = {k: v for k, v in leaves.items() if is_array(v)}
        keys = key_targets(arrays)
        python = stored if isinstance(stored, dict) else {}
        known = isinstance(infos, Mapping)  # (else the restore itself says what it lacks)
        variables: dict[str, Variable] = {}
        hows: dict[str, Any] = {}
        values: dict[str, Any] = {}
        numbers: dict[str, type] = {}
        missing: list[str] = []
        for k, like in leaves.items():
            full = f"{key}/{k}"
            if k in arrays:
                if k in python:
                    raise CheckpointMismatchError(
                        f"{full!r} is stored as a Python value ({from_python(python[k])!r}), "
                        "but the tree has an array there; nothing was restored.")
                variables[k], hows[k] = leaf_target(self._graph, k, arrays[k])
                if known and full not in infos:
                    missing.append(full)
            elif k in python:
                values[k] = from_python(python[k])
            elif known and full in infos:
                variables[k], numbers[k] = self._number(full, like, infos[full])
            else:
                missing.append(full)
        if missing:
            raise CheckpointMismatchError(
                f"The checkpoint has no value for {', '.join(map(repr, missing))} (of the "
                f"tree {key!r}); nothing was restored.")
        self._restoring = _Restoring(variables, hows, values, numbers, keys)

    def _number(self, full: str, like: Any, info: Any) -> tuple[Variable, type]:
        """The variable a stored 0-d array is read into, for the Python number ``like``."""
        kinds = _NUMBER_KINDS.get(type(like), "")
        dtype = np.dtype(info.dtype)
        if tuple(info.shape) != () or dtype.kind not in kinds:
            raise CheckpointMismatchError(
                f"{full!r} is stored as an array ({dtype}, shape {tuple(info.shape)}), but "
                f"the tree has the Python value {like!r} there; nothing was restored.")
        with self._graph.as_default():
            var = Variable(np.zeros((), dtype), dtype=dtype, device="CPU:0", collections=[],
                           trainable=False, name=full)
        return var, type(like)

    def finish_restore(self, carry: Any = None) -> None:
        """After a successful restore: the tree rebuilt from the values it read."""
        r, self._restoring = self._restoring, None
        if r is None:
            return
        values = dict(r.python)
        for k, var in r.variables.items():
            if k in r.numbers:
                values[k] = r.numbers[k](np.asarray(var.value()).item())
            else:
                values[k] = leaf_result(var, r.hows[k])
        wrap_keys(values, r.keys)
        old, self.tree = self.tree, rebuild(self.tree, values)
        # the next walk (the status's, the next save's) meets the restored variables: each
        # leaf is its variable's own buffer (NumPy; torch over it) or immutable (JAX)
        self._cache = {k: (values[k], var) for k, var in r.variables.items()}
        self._numbers = {k: np.dtype(r.variables[k].dtype) for k in r.numbers}
        if self.given is not None:
            self.given(old, self.tree)

    def abort_restore(self) -> None:
        """After a failed restore: the tree stays as it was."""
        self._restoring = None

    def __repr__(self) -> str:
        return f"<TreeTrackable of {type(self.tree).__name__}>"
