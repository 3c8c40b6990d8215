"""Registered JAX pytree nodes: whether a value is one, and its children's names.

A node is a flax ``TrainState``, an ``nnx.State``, an equinox Module, a class given to
``jax.tree_util.register_dataclass``; its children are named by their key paths, as Orbax
names them (attribute, dict key, index).

JAX is asked only once something imported it: before that, nothing can be registered
with it, and nothing here imports it.

>>> is_tree_node({"a": 1}), is_tree_node(None), is_tree_node(3.0)
(False, False, False)
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_tree_node", "jax_node", "qualname"]

_PY = (bool, int, float, str, bytes)


def jax_node(tree: Any, at: str) -> tuple[list[tuple[str, Any]], Any] | None:
    """A registered JAX pytree node's children, named by their key paths, and its
    one-level treedef (its static fields, ``aux_data``, stay in it); ``None`` for any
    other value (``at``, its path, names it in errors)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    tu = jax.tree_util
    leaves, treedef = tu.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if len(leaves) == 1 and leaves[0][0] == ():
        return None  # a leaf to JAX as well
    where = at or "the tree"
    return [("/".join(_key_name(tu, k, where, tree) for k in path), child)
            for path, child in leaves], treedef


def _key_name(tu: Any, key: Any, at: str, node: Any) -> str:
    """The name of one key of a pytree node's key path (Orbax's: attribute, dict key, index)."""
    if isinstance(key, tu.GetAttrKey):
        return str(key.name)
    if isinstance(key, tu.DictKey):
        k = key.key
        if isinstance(k, bool) or not isinstance(k, str | int):
            raise TypeError(
                f"Cannot name a child of {at!r} (a {qualname(node)}): its dict key {k!r} "
                "is neither a str nor an int.")
        return str(k)
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(
        f"Cannot name a child of {at!r} (a {qualname(node)}): its key path entry {key!r} "
        f"is a {qualname(key)}, none of jax.tree_util's GetAttrKey, DictKey, SequenceKey "
        "and FlattenedIndexKey, which name a stored value.")


def is_tree_node(value: Any) -> bool:
    """Whether ``value`` is a registered JAX pytree node other than a dict, list or tuple;
    False, importing nothing, where nothing imported JAX. (Arrays of every kind are
    leaves to JAX.)"""
    if isinstance(value, list | tuple | dict) or value is None or isinstance(value, _PY):
        return False
    return jax_node(value, "") is not None


def qualname(value: Any) -> str:
    """``module.QualName`` of ``value``'s type, as errors name it."""
    return f"{type(value).__module__}.{type(value).__qualname__}"
