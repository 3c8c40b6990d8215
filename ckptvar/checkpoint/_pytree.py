"""Pytrees in ``cv.save(path, tree)`` and ``cv.load(path, like=tree)``, sharded leaves too.

Nested containers of arrays of any framework, sharded ones included.

Owns :func:`flatten` (a tree's leaves by their ``/``-joined paths), :func:`is_plain`
(whether ``cv.save`` can write a mapping as it always did), :func:`save_tree`,
:func:`load_tree` and :func:`rebuild`. A tree is dicts (str or int keys), lists, tuples,
namedtuples and registered JAX pytree nodes (a flax ``TrainState``, an ``nnx.State``, an
equinox Module) of leaves; a node's children are named by their ``jax.tree_util`` key
paths as Orbax names them (an attribute by its name, a dict key by the key, a position by
its index), and it is rebuilt from the like tree's treedef (its static fields the
like's). JAX is asked only once something imported it: nothing else can be registered.
A leaf is an array (NumPy, torch, JAX, CuPy; a NumPy scalar) or a Python value
(``None``, bool, int, float, str, bytes), which is kept in the checkpoint's metadata
with its type. ``load_tree`` returns ``like``'s structure with ``like``'s kinds of
arrays: NumPy for NumPy, a new torch tensor on the like's device for a tensor, a
``jax.Array`` with the like's sharding for a ``jax.Array`` or a
``jax.ShapeDtypeStruct(..., sharding=...)``; a ``DTensor`` is filled in place.

Sharded leaves (a ``DTensor``; a ``jax.Array`` over several devices, of one process or
many) are saved collectively through the multi-process protocol (``_collective``): each
process writes only the boxes it owns, each from its shard's buffer, never assembled
(of replicas of one box, one process writes it),
and a restore reads only the boxes each process needs (``_collective_restore``),
whatever mesh, placement or process count wrote them.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .._dtypes import dtype_name
from .._frameworks import framework_of, from_numpy, to_numpy
from .._staging import staged, to_writable
from ..distributed import Coordinator, from_env
from ..errors import CheckpointMismatchError, CkptError, MissingValueError
from ..graph import Graph
from ..storage import is_chunked
from ..variables import FreshValue, Shard, Variable, device_value
from ._collective import collective_write
from ._collective_restore import collective_restore
from ._files import native_backend, open_checkpoint_reader
from ._frameworks import FrameworkStateError, is_dtensor, tensor_variable
from ._logical import Logical, apply_targets, as_target
from ._tree_nodes import is_tree_node, jax_node, qualname

__all__ = [
    "flatten",
    "from_python",
    "is_abstract",
    "is_array",
    "is_plain",
    "is_tree_node",
    "key_data",
    "key_targets",
    "leaf_result",
    "leaf_target",
    "load_tree",
    "python_value",
    "rebuild",
    "save_tree",
    "wrap_keys",
]

#: Where the Python values of a tree are kept in the checkpoint's metadata.
META_KEY = "pytree"

_PY = (bool, int, float, str, bytes)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _children(tree: Any, at: str = "") -> Iterator[tuple[str, Any]] | None:
    """The named children of a container (``None``: a leaf); ``at`` is its path."""
    node = _node(tree, at)
    return None if node is None else iter(node[0])


def _node(tree: Any, at: str = "") -> tuple[list[tuple[str, Any]], Any] | None:
    """``(named children, treedef)`` of a container; ``None`` for a leaf. The treedef
    (one level: its children as leaves) is a registered JAX pytree node's, ``None`` for a
    dict, list, tuple or namedtuple, which are named and rebuilt as they always were."""
    if isinstance(tree, Mapping) and not isinstance(tree, dict):
        node = jax_node(tree, at)  # (a FrozenDict, an nnx.State: rebuilt by JAX)
        if node is not None:
            return node
    if isinstance(tree, Mapping):
        out = []
        for k, v in tree.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"A tree's dict keys are str or int, got {k!r}.")
            out.append((str(k), v))
        return out, None
    if _is_namedtuple(tree):
        return list(zip(type(tree)._fields, tree, strict=True)), None
    if isinstance(tree, list | tuple):
        return [(str(i), v) for i, v in enumerate(tree)], None
    if tree is None or isinstance(tree, _PY):
        return None
    return jax_node(tree, at)


def is_array(value: Any) -> bool:
    """An array leaf: NumPy (a NumPy scalar too), torch, JAX, CuPy, a ShapeDtypeStruct."""
    if isinstance(value, np.ndarray | np.generic):
        return True
    if framework_of(value) is not None:
        return True
    return is_abstract(value) or is_chunked(value)


def is_abstract(value: Any) -> bool:
    """A ``jax.ShapeDtypeStruct`` (a shape, a dtype and maybe a sharding; no data)."""
    return type(value).__name__ == "ShapeDtypeStruct" and framework_of(value) == "jax"


def _is_key(value: Any) -> bool:
    """A typed jax PRNG key array (``jax.random.key``) or a ``ShapeDtypeStruct`` of one:
    no NumPy dtype holds it, so its key data (``jax.random.key_data``, uint32) is stored."""
    if framework_of(value) != "jax":
        return False
    import jax  # noqa: PLC0415 - a jax value is here

    return bool(jax.numpy.issubdtype(value.dtype, jax.dtypes.prng_key))


def key_data(value: Any) -> Any:
    """``value``, or a typed key array's key data (same sharding, a trailing axis more)."""
    if not _is_key(value):
        return value
    import jax  # noqa: PLC0415 - a jax value is here

    return jax.random.key_data(value)


def _key_data_like(like: Any) -> tuple[Any, Any]:
    """``(what the key data is loaded like, the key's impl)`` of a typed key ``like``."""
    import jax  # noqa: PLC0415 - a jax value is here

    impl = jax.random.key_impl(jax.numpy.empty((0,), like.dtype))
    if not is_abstract(like):
        return jax.random.key_data(like), impl
    data = jax.eval_shape(jax.random.key_data, like)
    abstract: Any = type(like)  # jax.ShapeDtypeStruct
    return abstract(data.shape, data.dtype, sharding=getattr(like, "sharding", None)), impl


def key_targets(arrays: dict[str, Any]) -> dict[str, Any]:
    """Replace each typed key of ``arrays`` (like leaves) by its key data's like; return
    ``{path: the key's impl}`` of those replaced."""
    keys = {}
    for k in [k for k, v in arrays.items() if _is_key(v)]:
        arrays[k], keys[k] = _key_data_like(arrays[k])
    return keys


def wrap_keys(values: dict[str, Any], keys: Mapping[str, Any]) -> None:
    """The loaded key data of each path of ``keys`` as a typed key of its impl, in place."""
    if keys:
        import jax  # noqa: PLC0415 - a jax value is here

        for key, impl in keys.items():
            values[key] = jax.random.wrap_key_data(values[key], impl=impl)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` in order; paths are the ``/``-joined keys and indexes.

    >>> flatten({"a": [1, None], "b": {"c": 2.5}})
    {'a/0': 1, 'a/1': None, 'b/c': 2.5}
    """
    out: dict[str, Any] = {}
    _flatten(tree, prefix, out)
    return out


def _flatten(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    kids = None if is_array(tree) else _children(tree, prefix)
    if kids is None:
        if not (tree is None or isinstance(tree, _PY) or is_array(tree)):
            raise TypeError(
                f"Cannot store {prefix or 'the tree'!r}: a {qualname(tree)} is neither an "
                "array nor a Python value (None, bool, int, float, str, bytes), nor a "
                "dict/list/tuple or registered JAX pytree node of them."
            )
        if prefix in out:
            raise ValueError(f"Two leaves of the tree have the key {prefix!r}.")
        out[prefix] = tree
        return
    empty = True
    for name, child in kids:
        empty = False
        _flatten(child, f"{prefix}/{name}" if prefix else name, out)
    if empty and prefix:
        out[prefix] = tree  # an empty container stays, as a Python value (its kind kept)


def is_plain(arrays: Any) -> bool:
    """True for a flat ``{str: array}`` mapping without sharded arrays (``cv.save`` as always).

    A mapping that is not a ``dict`` (a lazy one, whose values are made when asked, as
    ``ckpt convert`` passes) is taken as flat by its keys: its values are fetched once,
    by the writer, never here.
    """
    if not isinstance(arrays, Mapping):
        return False
    if not isinstance(arrays, dict):  # (a registered JAX node is a tree: nnx.State)
        return jax_node(arrays, "") is None and all(isinstance(k, str) for k in arrays)
    ndarray = np.ndarray
    for k, v in arrays.items():
        if v.__class__ is ndarray and k.__class__ is str:  # the common case, in one test
            continue
        if (not isinstance(k, str) or not is_array(v) or is_abstract(v) or _sharded(v)
                or _multi_device(v) or _is_key(v)):
            return False
    return True


def _sharded(value: Any) -> bool:
    """A DTensor, or a jax.Array spread over devices of several processes."""
    if is_dtensor(value):
        return True
    if framework_of(value) == "jax" and hasattr(value, "is_fully_addressable"):
        return not value.is_fully_addressable
    return False


def python_value(value: Any) -> Any:
    """A Python leaf as the metadata keeps it (an empty container: its kind)."""
    if value is None or isinstance(value, _PY):
        return value
    if isinstance(value, list | tuple):
        return {"seq": type(value).__name__ if type(value) in (list, tuple) else "tuple",
                "items": []}
    if isinstance(value, Mapping) or _node(value) is not None:
        # (a pytree node without children: an empty mapping of names, rebuilt from a like)
        return {"seq": "dict", "items": []}
    return value


def from_python(value: Any) -> Any:
    """A Python leaf as :func:`python_value` kept it."""
    if isinstance(value, dict) and set(value) == {"seq", "items"}:
        return {"list": [], "tuple": (), "dict": {}}[value["seq"]]
    return value


# -- saving -----------------------------------------------------------------------------


def _graph() -> Graph:
    return Graph()


def _jax_boxes(value: Any) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """``(offset, host view)`` of each box of a jax.Array this process writes: one replica
    of each distinct box of its sharding, by the lowest process holding it. Each shard's
    buffer is written as it is: the whole value is never assembled on the host."""
    shape = tuple(value.shape)

    def box_of(index: Any) -> tuple[tuple[int, int], ...]:
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=False))
        return box + tuple((0, n) for n in shape[len(box):])

    owners: dict[tuple[tuple[int, int], ...], int] = {}
    for dev, index in value.sharding.devices_indices_map(shape).items():
        box = box_of(index)
        owners[box] = min(owners.get(box, dev.process_index), dev.process_index)
    import jax  # noqa: PLC0415 - a jax value is here

    me = jax.process_index()
    out: list[tuple[tuple[int, ...], np.ndarray]] = []
    done = set()
    for shard in value.addressable_shards:
        box = box_of(shard.index)
        if box in done or owners.get(box) != me or not all(hi > lo for lo, hi in box):
            continue
        done.add(box)
        host = to_writable(shard.data, what="a shard")  # a GPU's: staged, not copied
        out.append((tuple(lo for lo, _ in box), host))
    out.sort(key=lambda item: item[0])
    return out


def _multi_device(value: Any) -> bool:
    """A jax.Array whose sharding spans several devices (of this process or more)."""
    if framework_of(value) != "jax" or is_abstract(value):
        return False
    sharding = getattr(value, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def _box_variable(graph: Graph, key: str, host: np.ndarray, shard: Shard) -> Variable:
    """A variable naming the box ``host`` holds, left uninitialized: the save writes
    ``host`` itself (a read-only view of a device buffer, which a variable would copy)."""
    with graph.as_default():
        return Variable(FreshValue(lambda: host), shape=host.shape, dtype=host.dtype,
                        device="CPU:0", collections=[], trainable=False, name=key,
                        shard=shard)


def _leaf_for_save(graph: Graph, key: str, value: Any) -> list[tuple[Any, Any]]:
    """``(host array, variable or None)`` of each box of one array leaf this process
    writes (none: another process writes it; several: a jax.Array's distinct shards, whose
    variable is then one :class:`Logical` of them)."""
    if is_dtensor(value):
        var = tensor_variable(graph, key, value, saving=True)
        if var is None:
            return []
        tensor = device_value(var)  # a GPU tensor: staged, never copied whole
        return [(var.value() if tensor is None else staged(tensor), var)]
    if _multi_device(value):
        return _device_parts(graph, key, value)
    host = value if isinstance(value, np.ndarray) else to_numpy(value, what=repr(key))
    return [(np.asarray(host, order="C"), None)]  # 0-d stays 0-d (ascontiguousarray: 1-d)


def _device_parts(graph: Graph, key: str, value: Any) -> list[tuple[Any, Any]]:
    """:func:`_leaf_for_save` of a jax.Array over several devices."""
    if math.prod(value.shape) == 0:
        # every shard is empty, so no box holds a byte: kept as one empty replicated value
        # (its boxes would all be skipped, and the key lost)
        return [(np.empty(tuple(value.shape), np.dtype(value.dtype)), None)]
    if value.sharding.is_fully_replicated:  # one box: all of it
        return [(to_writable(value.addressable_shards[0].data, what=repr(key)), None)]
    full = tuple(int(n) for n in value.shape)
    parts = [(host, _box_variable(graph, key, host, Shard(full, offset)))
             for offset, host in _jax_boxes(value)]
    if len(parts) <= 1:
        return parts
    logical = Logical(key, full, np.dtype(value.dtype), tuple(v for _, v in parts))
    return [(host, logical) for host, _ in parts]


def _no_options(path: str | os.PathLike[str], options: bool) -> None:
    if options:
        raise TypeError(
            f"Cannot save {os.fspath(path)!r} with storage_options= or writer options: its "
            "tree has sharded leaves (a DTensor, a jax.Array over several devices), which "
            "the multi-process protocol writes, durably, box by box (docs/frameworks.md).")


def save_tree(  # noqa: PLR0917
    path: str | os.PathLike[str], tree: Any, format: str | None, metadata: Any,
    coordinator: Coordinator | None, timeout: float | None,
    save_flat: Any, *, options: bool = False,
) -> Any:
    """Write ``tree``; with a coordinator (or sharded leaves), collectively.

    ``save_flat(path, arrays, metadata)`` writes a one-process checkpoint (``cv.save``).
    ``options``: the caller gave writer options or ``storage_options=``, which only
    ``save_flat`` takes (a collective save raises ``TypeError`` rather than drop them).
    """
    failure: BaseException | None = None
    arrays: dict[str, Any] = {}
    meta: Any = None
    try:  # with a coordinator, a tree this process cannot store is voted on
        leaves = flatten(tree)
        arrays = {k: key_data(v) for k, v in leaves.items()
                  if is_array(v) and not is_abstract(v)}
        python = {k: python_value(v) for k, v in leaves.items() if k not in arrays}
        bad = [k for k, v in leaves.items() if is_abstract(v)]
        if bad:
            raise TypeError(f"Cannot save {bad[0]!r}: a jax.ShapeDtypeStruct holds no values.")
        meta = _with_python(metadata, python)
    except BaseException as exc:
        if coordinator is None:
            raise
        failure = exc
    if coordinator is None and any(_sharded(v) or _multi_device(v) for v in arrays.values()):
        coordinator = from_env()  # one process included: its shards written as boxes
    if coordinator is None:
        host = {k: (v if isinstance(v, np.ndarray) else to_writable(v, what=repr(k)))
                for k, v in arrays.items()}
        return save_flat(path, host, meta)
    _no_options(path, options)
    coord = coordinator
    graph = _graph()
    rows: list[tuple[str, np.ndarray, dict[str, Any]]] = []
    variables: dict[str, Any] = {}
    fmt = "h5"
    try:
        if failure is not None:
            raise failure
        fmt = native_backend(path, format).name
        for key, value in arrays.items():
            for mine, var in _leaf_for_save(graph, key, value):  # none: another's boxes
                rows.append((key, mine, {"name": key}))
                variables[key] = var
    except BaseException as exc:  # noqa: BLE001 - reported through the vote
        failure = exc
    coord.vote(failure, tag=f"save:{os.path.basename(os.fspath(path))}:tree", timeout=timeout)
    return collective_write(path, fmt, rows, meta or {}, variables, coord, timeout=timeout)


def _with_python(metadata: Any, python: dict[str, Any]) -> Any:
    """The metadata stored: the user's, with the tree's Python values under ``"pytree"``."""
    if not python:
        return metadata
    if metadata is not None and (not isinstance(metadata, Mapping) or META_KEY in metadata):
        raise ValueError(
            f"A tree with Python values keeps them in the metadata under {META_KEY!r}: "
            f"metadata= must then be a dict without that key, got {metadata!r}.")
    return {**(metadata or {}), META_KEY: python}


# -- loading ----------------------------------------------------------------------------


def _like_shape_dtype(like: Any) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(like, np.ndarray | np.generic):
        return tuple(np.shape(like)), np.dtype(like.dtype)
    if framework_of(like) == "torch":
        import torch  # noqa: PLC0415 - a torch value is here

        dt = torch.empty(0, dtype=like.dtype)
        return tuple(like.shape), to_numpy(dt).dtype
    return tuple(like.shape), np.dtype(like.dtype)


def _jax_target_box(like: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box covering what this process's devices of ``like``'s sharding hold."""
    shape = tuple(like.shape)
    sharding = like.sharding
    los, his = [n for n in shape], [0 for _ in shape]
    any_dev = False
    for dev, index in sharding.devices_indices_map(shape).items():
        if dev.process_index != _process_index():
            continue
        any_dev = True
        for i, (s, n) in enumerate(zip(index, shape, strict=False)):
            a, b = s.indices(n)[:2]
            los[i], his[i] = min(los[i], a), max(his[i], b)
        for i in range(len(index), len(shape)):
            los[i], his[i] = 0, shape[i]
    if not any_dev:
        return (0,) * len(shape), (0,) * len(shape)
    return tuple(los), tuple(h - low for low, h in zip(los, his, strict=True))


def _process_index() -> int:
    import jax  # noqa: PLC0415

    return int(jax.process_index())


def _lazy(graph: Graph, key: str, shape: tuple[int, ...], dtype: np.dtype,
          shard: Shard | None) -> Variable:
    def unset() -> np.ndarray:
        raise CkptError(f"{key!r} was not restored")

    with graph.as_default():  # the key names it, save the empty key of a bare leaf
        return Variable(FreshValue(unset), shape=shape, dtype=dtype, device="CPU:0",
                        collections=[], trainable=False, name=key or "value", lazy=True,
                        shard=shard)


def leaf_target(graph: Graph, key: str, like: Any) -> tuple[Variable, Any]:
    """The variable a leaf is restored through, and how to turn it into the result."""
    if is_dtensor(like):
        var = tensor_variable(graph, key, like, saving=False)
        if var is None:
            raise FrameworkStateError(
                f"Cannot load {key!r} into its DTensor in place: its local tensor is "
                "neither contiguous host memory nor on a CUDA device (a 'meta' tensor or "
                "a strided view has no memory ckptvar can fill in place).")
        return var, ("dtensor", like)
    shape, dtype = _like_shape_dtype(like)
    sharding = getattr(like, "sharding", None) if framework_of(like) == "jax" else None
    if sharding is not None:
        try:  # before anything is read: a sharding that cannot split this shape
            sharding.shard_shape(shape)
        except ValueError as exc:
            raise CheckpointMismatchError(
                f"Cannot load {key!r} into its like= sharding: it cannot hold shape "
                f"{shape} ({exc}); nothing was loaded.") from exc
    if sharding is not None and not sharding.is_fully_addressable:
        offset, ext = _jax_target_box(like)
        return _lazy(graph, key, ext, dtype, Shard(shape, offset)), ("jax", like, offset)
    if sharding is not None and not _single_device(sharding):
        return _lazy(graph, key, shape, dtype, None), ("jax", like, (0,) * len(shape))
    return _lazy(graph, key, shape, dtype, None), ("plain", like)


def _single_device(sharding: Any) -> bool:
    return len(sharding.device_set) == 1


def _jax_result(host: np.ndarray, like: Any, offset: tuple[int, ...]) -> Any:
    """A jax.Array with ``like``'s sharding from ``host``, the box at ``offset`` of it."""
    import jax  # noqa: PLC0415 - a jax value is here

    shape = tuple(like.shape)
    pieces = []
    for dev, index in like.sharding.addressable_devices_indices_map(shape).items():
        sl = tuple(slice(s.indices(n)[0] - o, s.indices(n)[1] - o)
                   for s, n, o in zip(index, shape, offset, strict=False))
        # (a view when it is one run of rows; np.require keeps a 0-d value 0-d, where
        # np.ascontiguousarray makes it (1,))
        piece = np.require(host[sl], requirements="C")
        try:  # on the CPU, an aligned view is shared, not copied
            pieces.append(jax.device_put(piece, dev, may_alias=True))
        except TypeError:  # an older jax without may_alias=
            pieces.append(jax.device_put(piece, dev))
    return jax.make_array_from_single_device_arrays(shape, like.sharding, pieces)


def leaf_result(var: Variable, how: tuple[Any, ...]) -> Any:  # noqa: PLR0911 - one per kind
    kind, like = how[0], how[1]
    if kind == "dtensor":
        return like
    host = var.value()
    if kind == "jax":
        return _jax_result(host, like, how[2])

    if isinstance(like, np.generic):
        return host[()]
    if isinstance(like, np.ndarray):
        return host
    fw = framework_of(like)
    if fw == "torch":
        t = from_numpy(host, "torch")
        # a like on the 'meta' device has no storage to take the values: the CPU's
        return t if like.device.type in ("cpu", "meta") else t.to(like.device)
    if fw == "jax":
        sharding = getattr(like, "sharding", None)
        if sharding is not None:
            import jax  # noqa: PLC0415

            if getattr(like, "committed", True) is False:
                # placed by default (``jnp.zeros``, ``jax.random.key``): so is the result,
                # or a jitted step given it with arrays on other devices refuses it
                return jax.device_put(host)
            return jax.device_put(host, sharding)
        return from_numpy(host, "jax")
    if fw == "cupy":
        return from_numpy(host, "cupy")
    return host


def rebuild(like: Any, values: Mapping[str, Any]) -> Any:
    """``like``'s structure (its node types and static fields) over ``values``, the
    leaves by their paths (as :func:`flatten` names them)."""
    return _rebuild(like, "", values)


def _rebuild(like: Any, prefix: str, values: Mapping[str, Any]) -> Any:
    node = None if is_array(like) else _node(like, prefix)
    if node is None:
        return values[prefix]
    kids, treedef = node
    items = [(n, _rebuild(c, f"{prefix}/{n}" if prefix else n, values)) for n, c in kids]
    if treedef is not None:  # a registered JAX node: its type and static fields the like's
        return treedef.unflatten([v for _, v in items])
    if not items and prefix in values:
        return _empty_like(like, values[prefix])
    return _container(like, [v for _, v in items])


def _container(like: Any, children: list[Any]) -> Any:
    """A dict, namedtuple, tuple or list of ``like``'s kind holding ``children``."""
    if isinstance(like, Mapping):
        kind: Any = type(like)
        return kind(zip(list(like.keys()), children, strict=True))
    if _is_namedtuple(like):
        return type(like)(*children)
    if isinstance(like, tuple):
        return tuple(children)
    return children


def _empty_like(like: Any, stored: Any) -> Any:
    """An empty container as stored, of ``like``'s own type where that is a namedtuple
    (optax's ``EmptyState()``) or a dict subclass (``OrderedDict()``) of the same kind."""
    if type(stored) is tuple and not stored and _is_namedtuple(like):
        return type(like)()
    if type(stored) is dict and not stored and isinstance(like, dict) and type(like) is not dict:
        return type(like)()
    return stored


def _python_values(path: Any, leaves: Mapping[str, Any], arrays: Mapping[str, Any],
                   storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stored Python values of ``leaves`` that are no arrays (all there, or raise)."""
    with open_checkpoint_reader(path, storage_options) as reader:
        meta = reader.metadata()
        python = meta.get(META_KEY, {}) if isinstance(meta, dict) else {}
        out = {k: from_python(python[k]) for k in leaves if k not in arrays and k in python}
        stored = [k for k in leaves if k not in arrays and k not in python and k in reader]
        for k in stored:  # an array where the like tree has a Python value
            out[k] = _number_from(reader, k, leaves[k], path)
    missing = [k for k in leaves if k not in arrays and k not in out]
    if missing:
        raise MissingValueError(
            f"{str(path)!r} has no value for {', '.join(map(repr, missing))} (Python values "
            "of the tree); nothing was loaded.")
    return out


#: the NumPy kinds a stored 0-d array may have to load as a like leaf of this Python type
_NUMBER_KINDS = {bool: "b", int: "iu", float: "f"}


def _number_from(reader: Any, key: str, like: Any, path: Any) -> Any:
    """The stored 0-d array ``key`` as the Python number ``like`` is (a train state's step:
    an ``int`` before the first jitted step, a 0-d array after); else a mismatch."""
    info = reader.info(key)
    kinds = _NUMBER_KINDS.get(type(like), "")
    if tuple(info.shape) != () or np.dtype(info.dtype).kind not in kinds:
        raise CheckpointMismatchError(
            f"{key!r} is stored as an array ({np.dtype(info.dtype)}, shape "
            f"{tuple(info.shape)}) in {str(path)!r}, but the like tree has the Python value "
            f"{like!r} there; nothing was loaded.")
    return type(like)(np.asarray(reader.read(key)).item())


def _restore_here(path: Any, pairs: list[tuple[str, Variable]], verify: bool, cast: bool,
                  storage_options: Mapping[str, Any] | None) -> None:
    """One process: every value read and checked, then given (the errors as they are)."""
    with open_checkpoint_reader(path, storage_options) as reader:
        missing = [k for k, _ in pairs if k not in reader]
        meta = reader.metadata() if missing else None
        python = meta.get(META_KEY, {}) if isinstance(meta, dict) else {}
        for k in missing:
            if k in python:
                raise CheckpointMismatchError(
                    f"{k!r} is stored as a Python value ({from_python(python[k])!r}) in "
                    f"{str(path)!r}, but the like tree has an array there; nothing was "
                    "loaded.")
        if missing:
            raise MissingValueError(
                f"{str(path)!r} has no value for {', '.join(map(repr, missing))}; nothing "
                "was loaded.")
        infos = {k: reader.info(k) for k, _ in pairs}
        # the one-process restore: many values read at once, verified, then given
        apply_targets(reader, [(k, as_target(v)) for k, v in pairs], infos, verify=verify,
                      cast=cast)


def _refuse_narrowed(path: Any, arrays: Mapping[str, Any]) -> None:
    """``CheckpointMismatchError`` naming every JAX ``like=`` leaf (a ShapeDtypeStruct)
    whose dtype JAX cannot hold now (a 64-bit one with ``jax_enable_x64`` off): its
    jax.Array would come back narrowed (float64 values as float32), with nothing said."""
    narrowed = []
    for key, value in arrays.items():
        if framework_of(value) != "jax":
            continue
        import jax  # noqa: PLC0415 - a jax value is here

        try:
            want = np.dtype(value.dtype)
        except TypeError:  # a typed PRNG key: its key data is loaded
            continue
        held = np.dtype(jax.dtypes.canonicalize_dtype(want))
        if held != want:
            narrowed.append(f"{key!r} ({dtype_name(want)} -> {dtype_name(held)})")
    if narrowed:
        raise CheckpointMismatchError(
            f"Cannot load {str(path)!r}: JAX runs without 64-bit types (jax_enable_x64 is "
            f"off), so these like= leaves would come back narrowed: {', '.join(narrowed)}; "
            "nothing was loaded. Turn them on (jax.config.update('jax_enable_x64', True)) "
            "or give 32-bit like= leaves and cast=True."
        )


def load_tree(  # noqa: PLR0917
    path: str | os.PathLike[str], like: Any, coordinator: Coordinator | None,
    timeout: float | None, verify: bool, cast: bool,
    storage_options: Mapping[str, Any] | None,
) -> Any:
    """``like``'s structure read from ``path`` (all or nothing; collective with a coordinator)."""
    try:
        leaves = flatten(like)
    except BaseException as exc:
        if coordinator is None:
            raise
        coordinator.vote(exc, tag=f"load:{os.path.basename(os.fspath(path))}:tree",
                         timeout=timeout)
        raise
    arrays = {k: v for k, v in leaves.items() if is_array(v)}
    keys = key_targets(arrays)  # typed PRNG keys: their key data is loaded, then wrapped
    if coordinator is None and any(_sharded(v) or (is_abstract(v) and getattr(
            v, "sharding", None) is not None and not v.sharding.is_fully_addressable)
            for v in arrays.values()):
        coordinator = from_env()
    graph = _graph()
    pairs: list[tuple[str, Variable]] = []
    hows: dict[str, tuple[Any, ...]] = {}
    failure: BaseException | None = None
    values: dict[str, Any] = {}
    try:
        _refuse_narrowed(path, arrays)
        for key, value in arrays.items():
            var, how = leaf_target(graph, key, value)
            pairs.append((key, var))
            hows[key] = how
        if len(arrays) < len(leaves):
            values = _python_values(path, leaves, arrays, storage_options)
    except BaseException as exc:
        if coordinator is None:
            raise
        failure = exc
    if coordinator is None:
        _restore_here(path, pairs, verify, cast, storage_options)
    else:
        coordinator.vote(failure, tag=f"load:{os.path.basename(os.fspath(path))}:tree",
                         timeout=timeout)
        collective_restore(path, pairs, coordinator, timeout=timeout, verify=verify,
                           cast=cast, storage_options=storage_options)
    _results(pairs, hows, arrays, values)
    wrap_keys(values, keys)
    return rebuild(like, values)


def _results(pairs: list[tuple[str, Variable]], hows: dict[str, tuple[Any, ...]],
             arrays: dict[str, Any], values: dict[str, Any]) -> None:
    """Each loaded leaf's result into ``values``. A like tree holding one array object at
    several keys (tied weights: ``model.state_dict(keep_vars=True)``) gets one result for
    them, where their stored values are equal; where they differ, each key keeps its own,
    and a ``UserWarning`` says so."""
    first: dict[int, tuple[str, Variable]] = {}
    for key, var in pairs:
        tie = first.setdefault(id(arrays[key]), (key, var))
        if tie[0] != key and hows[key][0] != "dtensor":
            if np.array_equal(np.asarray(var.value()), np.asarray(tie[1].value())):
                values[key] = values[tie[0]]
                continue
            warnings.warn(
                f"The like tree holds one array at {key!r} and {tie[0]!r}, but their stored "
                "values differ: each is given its own (they are no longer one array).",
                UserWarning, stacklevel=4)
        values[key] = leaf_result(var, hows[key])
