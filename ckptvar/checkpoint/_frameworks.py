"""Framework state in a checkpoint: objects with ``state_dict()`` and torch tensors as variables.

Owns :class:`StateDictTrackable` (how an object with ``state_dict()``/``load_state_dict()``,
:class:`~ckptvar.trackable.SupportsStateDict`: torch modules, optimizers, LR schedulers,
Hugging Face models, takes part in a :class:`~ckptvar.Checkpoint`) and
:func:`tensor_variable` (a torch tensor, or a ``DTensor``'s local shard, seen as a
variable over the tensor's own memory, so a save writes it without a copy and a restore
writes into it in place).

Keys are the state dict's paths under the object's name: ``model/fc.weight``,
``optimizer/state/0/exp_avg``. Values that are not tensors (step counts,
hyper-parameters, ``param_groups``, ``None``) are the object's Python state, kept with
their Python types (tuples stay tuples, int keys stay ints; a namedtuple takes its type
from the object's state dict before the restore, or is warned of). A restore is the
checkpoint's usual all-or-nothing restore into the tensors that exist (in place, CUDA
ones through the pinned staging buffer); tensors that are stored but do not exist yet (a
fresh optimizer's ``exp_avg``), that have no storage (a module on the ``meta`` device)
or that the host cannot fill in place (non-contiguous CPU tensors) are read into new
tensors, and the object's ``load_state_dict`` takes them, and the Python state, once
every value was read and checked.

A ``torch.Generator`` (``torch.default_generator``: the global RNG's) is such an object
too: its state (``get_state()``, uint8) under ``<name>/state``, its device as Python
state, and ``set_state`` of the stored state once every value was read and checked.

A ``DTensor`` (``Shard(dim)``/``Replicate`` placements, any mesh) is a variable holding
its local box of the logical value (a :class:`~ckptvar.Shard`); of replicas of one box,
only the process at coordinate 0 of the replicating mesh axes saves it.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

from .._frameworks import framework_of, from_numpy, to_numpy
from .._staging import element_dtype, is_on_gpu
from ..errors import CkptError
from ..graph import Graph
from ..trackable import SupportsStateDict, Trackable
from ..variables import FreshValue, Shard, Variable, set_device_value, shares_memory
from ._serialize import decode_state, encode_state, is_namedtuple, type_name, with_namedtuples
from ._walk import walk

__all__ = [
    "FrameworkStateError",
    "RestoredWhole",
    "StateDictTrackable",
    "SupportsNamedParameters",
    "SupportsStateDict",
    "autograd_back",
    "autograd_off",
    "begin_restores",
    "dtensor_box",
    "end_restores",
    "is_dtensor",
    "is_generator",
    "tensor_variable",
    "trackable_for",
]


class FrameworkStateError(CkptError, TypeError):
    """Framework state that cannot be checkpointed as it is (says which value and why)."""


@runtime_checkable
class SupportsNamedParameters(Protocol):
    """A module whose parameters say whether they train (``requires_grad``)."""

    def named_parameters(self) -> Any: ...


_DTENSOR: list[type] = []  # the DTensor class, once torch.distributed.tensor is loaded


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (nothing is imported to find out)."""
    if not _DTENSOR:
        if "torch.distributed.tensor" not in sys.modules:
            return False
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - loaded already

        _DTENSOR.append(DTensor)
    return isinstance(value, _DTENSOR[0])


def dtensor_box(t: Any, what: str) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """``(offset, local shape, owner)`` of this process's box of the DTensor ``t``.

    ``owner`` is False on a process whose box another process (coordinate 0 along every
    mesh axis the value is replicated over) saves.
    """
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor._utils import (  # noqa: PLC0415 - what DCP uses too
        compute_local_shape_and_global_offset,
    )

    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise FrameworkStateError(
                f"Cannot checkpoint {what}: its DTensor placement {p} is not supported "
                "(Shard(dim) and Replicate() are; redistribute a Partial value first)."
            )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coord = t.device_mesh.get_coordinate()
    owner = coord is not None and all(
        c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape), owner


def _view(t: Any) -> np.ndarray | None:
    """A writable NumPy view of a CPU tensor's memory, or None when there is none."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    view = to_numpy(t)
    return view if view.flags.c_contiguous and view.flags.writeable else None


def _host_copy(t: Any) -> bool:
    """Whether :func:`tensor_variable` saves ``t`` (a tensor, not a DTensor) from a copy
    made then: a CPU tensor the host cannot view (non-contiguous), whose later writes the
    copy never sees."""
    return t.device.type == "cpu" and _view(t) is None


def _variable(graph: Graph, name: str, host: np.ndarray, shard: Shard | None,
              trainable: bool = False) -> Variable:
    """A CPU variable whose buffer is ``host`` itself (no copy)."""
    with graph.as_default():
        var = Variable(FreshValue(lambda: host), shape=host.shape, dtype=host.dtype,
                       device="CPU:0", collections=[], trainable=trainable, name=name,
                       shard=shard)
    var.initialize()
    shares_memory(var)  # torch writes it in place, unseen by the version counter
    return var


def _device_variable(graph: Graph, name: str, t: Any, shard: Shard | None,
                     trainable: bool) -> Variable:
    """A variable standing for GPU tensor ``t``, left unmaterialized: a save stages ``t``
    through the pinned buffer (its snapshot: a copy on the device), a restore writes into
    ``t`` itself (``variables.set_device_value``)."""
    with graph.as_default():
        var = Variable(FreshValue(lambda: to_numpy(t, what=repr(name))),
                       shape=tuple(t.shape), dtype=element_dtype(t), device="CPU:0",
                       collections=[], trainable=trainable, name=name, shard=shard)
    set_device_value(var, t)
    shares_memory(var)  # torch writes it in place, unseen by the version counter
    return var


def tensor_variable(graph: Graph, name: str, t: Any, *, saving: bool,
                    trainable: bool = False) -> Variable | None:
    """``t`` (a torch tensor or DTensor) as a variable over its memory.

    Saving: ``None`` for a DTensor box another process saves; a CUDA tensor is staged
    through the pinned buffer at the save (never copied to the host whole); another
    tensor the host cannot view (non-contiguous) is copied to the host once. Restoring:
    a CUDA tensor (a DTensor's local shard too) is filled in place through the pinned
    buffer; ``None`` when the host cannot view it otherwise (the caller reads into a new
    tensor).
    """
    shard = None
    if is_dtensor(t):
        offset, _, owner = dtensor_box(t, repr(name))
        if saving and not owner:
            return None
        shard = Shard(tuple(t.shape), offset)
        t = t.to_local()
    elif t.device.type == "meta":
        if saving:
            raise FrameworkStateError(
                f"Cannot save {name!r}: it is a tensor on the 'meta' device (no storage).")
        return None
    host = _view(t)
    if host is not None:
        return _variable(graph, name, host, shard, trainable)
    if is_on_gpu(t):
        return _device_variable(graph, name, t, shard, trainable)
    if not saving:
        return None
    host = np.require(to_numpy(t, what=repr(name)), requirements="C")  # 0-d stays 0-d
    return _variable(graph, name, host, shard, trainable)


# -- the Python state: the state dict's structure, tensors left out -----------------------


_TENSOR = {"T": 1}
_TORCH_TYPE: dict[type, bool] = {}  # framework_of(value) == "torch", decided by type(value)


def _is_torch(value: Any) -> bool:
    """``framework_of(value) == "torch"``, answered once per type (the walks of a state
    dict ask it of every entry at every save)."""
    kind = type(value)
    hit = _TORCH_TYPE.get(kind)
    if hit is None:
        hit = _TORCH_TYPE[kind] = framework_of(value) == "torch"
    return hit


def _encode(value: Any, where: str) -> Any:
    """The state dict's structure as msgpack-able data; tensors become :data:`_TENSOR`."""
    if _is_torch(value):
        return _TENSOR
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise FrameworkStateError(
                    f"Cannot checkpoint {where}: its dict key {k!r} is not a str or int.")
            items.append([k, _encode(v, f"{where}/{k}")])
        return {"d": items}
    if isinstance(value, tuple):
        out: dict[str, Any] = {"t": [_encode(v, f"{where}/{i}") for i, v in enumerate(value)]}
        if is_namedtuple(value):
            out["n"] = type_name(value)  # a record only: the restoring object gives the type
        return out
    if isinstance(value, list):
        return {"l": [_encode(v, f"{where}/{i}") for i, v in enumerate(value)]}
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return {"v": value}
    if isinstance(value, np.generic):
        return {"v": value.item()}
    raise FrameworkStateError(
        f"Cannot checkpoint {where}: a {type(value).__module__}.{type(value).__qualname__} "
        "is neither a tensor nor a plain Python value (None, bool, int, float, str, bytes, "
        "list, tuple, dict)."
    )


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _split(sd: Any) -> tuple[Any, list[tuple[Any, ...]], list[Any]]:
    """``(_encode(sd), paths, tensors)``, the paths and tensors of ``_tensors(sd)``, in one
    walk of ``sd`` (what a save asks for each state dict); the encoding is ``None`` where
    :func:`_encode` would raise.

    Plain values are encoded where their container is met (no call, no path of their
    own): a state dict is mostly such values (hyper-parameters, step counts)."""
    paths: list[tuple[Any, ...]] = []
    tensors: list[Any] = []
    ok = [True]
    scalars = _SCALARS

    def leaf(value: Any) -> Any:
        ok[0] = ok[0] and isinstance(value, np.generic)
        return {"v": value.item() if isinstance(value, np.generic) else None}

    def enc(value: Any, path: tuple[Any, ...]) -> Any:
        if _is_torch(value):
            paths.append(path)
            tensors.append(value)
            return _TENSOR
        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if type(k) is not str and (isinstance(k, bool) or not isinstance(k, str | int)):
                    ok[0] = False
                items.append([k, {"v": v} if type(v) in scalars else enc(v, (*path, k))])
            return {"d": items}
        if isinstance(value, list | tuple):
            tag = "t" if isinstance(value, tuple) else "l"
            out: dict[str, Any] = {tag: [{"v": v} if type(v) in scalars
                                         else enc(v, (*path, i)) for i, v in enumerate(value)]}
            if type(value) is not tuple and is_namedtuple(value):
                out["n"] = type_name(value)
            return out
        if value is None or isinstance(value, bool | int | float | str | bytes):
            return {"v": value}
        return leaf(value)

    out = enc(sd, ())
    return (out if ok[0] else None), paths, tensors


_DICT, _TUPLE, _LIST, _TENSOR_AT = object(), object(), object(), object()  # sig markers
_PLAIN_KEYS = frozenset({str, int})


def _signature(sd: Any) -> tuple[list[Any] | None, list[Any]]:
    """``(signature, tensors)`` of a state dict: a flat list that is equal (``==``) for
    two state dicts exactly when their encodings (:func:`_split`) are the same, and the
    tensors in walk order. The signature is ``None`` where that cannot be told from it
    (a key or a value of another type than the exact plain types: a NumPy scalar, a
    subclass of ``int`` or ``str``); the caller then encodes anew.

    Each container is its kind and length before its items (``{"a": {"b": 1}, "c": 2}``
    is not ``{"a": {"b": 1, "c": 2}}``), each key itself (exactly a ``str`` or an
    ``int``: ``1`` is not ``"1"``, a ``bool`` is not taken), each plain value its exact
    type before it (``True`` is not ``1``, ``1.0`` is not ``1``) and a float equal to
    zero its sign after it (``-0.0`` is not ``0.0``); each tensor one marker.
    """
    sig: list[Any] = []
    tensors: list[Any] = []
    add = sig.append
    scalars = _SCALARS
    keys = _PLAIN_KEYS

    def walk(value: Any) -> bool:
        if _is_torch(value):
            add(_TENSOR_AT)
            tensors.append(value)
            return True
        kind = type(value)
        if kind in scalars:
            add(kind)
            add(value)
            if kind is float and value == 0.0:
                add(math.copysign(1.0, value))
            return True
        if isinstance(value, dict):
            add(_DICT)
            add(len(value))
            return all(type(k) in keys and (add(k) or walk(v)) for k, v in value.items())
        if isinstance(value, list | tuple):  # a namedtuple: its type (``_encode`` names it)
            add(_LIST if isinstance(value, list) else _TUPLE if kind is tuple else kind)
            add(len(value))
            return all(map(walk, value))
        return False

    return (sig if walk(sd) else None), tensors


def _tensor_paths(enc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path (raw keys) of every tensor of an encoded structure."""
    if enc == _TENSOR:
        yield prefix
    elif "d" in enc:
        for k, v in enc["d"]:
            yield from _tensor_paths(v, (*prefix, k))
    elif "t" in enc or "l" in enc:
        for i, v in enumerate(enc.get("t", enc.get("l"))):
            yield from _tensor_paths(v, (*prefix, i))


def _decode(enc: Any, tensors: dict[tuple[Any, ...], Any], prefix: tuple[Any, ...] = ()) -> Any:
    if enc == _TENSOR:
        return tensors[prefix]
    if "d" in enc:
        return {k: _decode(v, tensors, (*prefix, k)) for k, v in enc["d"]}
    if "t" in enc:
        return tuple(_decode(v, tensors, (*prefix, i)) for i, v in enumerate(enc["t"]))
    if "l" in enc:
        return [_decode(v, tensors, (*prefix, i)) for i, v in enumerate(enc["l"])]
    return enc["v"]


def _named(enc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[list[Any]]:
    """``[path, type name]`` of every namedtuple an encoded structure records."""
    if enc == _TENSOR or "v" in enc:
        return
    if "d" in enc:
        for k, v in enc["d"]:
            yield from _named(v, (*prefix, k))
        return
    for i, v in enumerate(enc.get("t", enc.get("l", []))):
        yield from _named(v, (*prefix, i))
    if isinstance(enc.get("n"), str):
        yield [list(prefix), enc["n"]]


def _has_namedtuple(sd: Any) -> bool:
    if isinstance(sd, dict):
        return any(map(_has_namedtuple, sd.values()))
    if isinstance(sd, list | tuple):
        return is_namedtuple(sd) or any(map(_has_namedtuple, sd))
    return False


def _typed(sd: Any, enc: Any, like: Any, key: str) -> Any:
    """``sd`` (decoded: tuples plain) with the namedtuples of ``like`` (the object's
    state dict before the restore) at the same places, as a trackable's Python state
    takes them (``with_namedtuples``: a stored namedtuple left plain is warned of)."""
    named = list(_named(enc))
    if not named and not _has_namedtuple(like):
        return sd
    return with_namedtuples(sd, like, named, key, holder="state_dict()", stacklevel=7)


def _tensors(sd: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if _is_torch(sd):
        yield prefix, sd
    elif isinstance(sd, dict):
        for k, v in sd.items():
            yield from _tensors(v, (*prefix, k))
    elif isinstance(sd, list | tuple):
        for i, v in enumerate(sd):
            yield from _tensors(v, (*prefix, i))


def autograd_off() -> bool:
    """Turn torch's autograd off on this thread; True when it was on (give that to
    :func:`autograd_back`). Nothing to do when torch is not loaded or autograd is off.

    A save asks for state dicts with autograd off: a ``DTensor``'s ``to_local()`` is then
    its local tensor, not an autograd op, and a ``state_dict()`` that computes a tensor
    gives one that needs no grad. (``torch.set_grad_enabled`` used as a function: one call
    each way, where ``with torch.no_grad()`` makes three objects.)
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    torch.set_grad_enabled(False)
    return True


def autograd_back(was_on: bool) -> None:
    """Turn autograd on again where :func:`autograd_off` turned it off."""
    if was_on:
        sys.modules["torch"].set_grad_enabled(True)


def _state_dict(obj: Any) -> Any:
    """``obj.state_dict()``; a torch module's with its tensors as they are (``keep_vars``:
    no ``detach()`` of each, which for a DTensor is a dispatched op; the values are the
    same tensors' memory either way). A module class with its own ``state_dict`` (whose
    signature may take no ``keep_vars``) is asked as it is."""
    torch = sys.modules.get("torch")
    if torch is not None and type(obj).state_dict is torch.nn.Module.state_dict:
        return obj.state_dict(keep_vars=True)
    return obj.state_dict()


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """``{path: variable}`` as nested dicts of children (keys ``a/b/c``).

    Raises :class:`FrameworkStateError` when two paths name one key (an int key and a
    str key of the same spelling, ``0`` and ``"0"``): one value would be lost.
    """
    out: dict[str, Any] = {}
    for path, var in flat.items():
        node = out
        for i, seg in enumerate(path):
            name = str(seg)
            last = i == len(path) - 1
            held = node.get(name)
            if held is not None and (last or not isinstance(held, dict)):
                raise FrameworkStateError(
                    f"Cannot checkpoint the state dict: its key path {path!r} is stored as "
                    f"{'/'.join(map(str, path[: i + 1]))!r}, as another of its keys is (an "
                    "int key and a str key of the same spelling); one value would be lost.")
            if last:
                node[name] = var
            else:
                node = node.setdefault(name, {})
    return out


def _identity(t: Any) -> tuple[Any, ...]:
    """What makes a cached variable (and a DTensor's box) still right for ``t``."""
    if is_dtensor(t):
        local = t.to_local()
        return (local.data_ptr(), tuple(local.shape), local.dtype, tuple(local.stride()),
                tuple(t.shape), tuple(t.placements), id(t.device_mesh))
    return (t.data_ptr(), tuple(t.shape), t.dtype, tuple(t.stride()), t.device)


def _identities(tensors: list[Any]) -> list[tuple[Any, ...]]:
    """What makes a save's tensors the last save's, tensor by tensor (asked with autograd
    off): a tensor's data pointer, shape, strides, dtype and device; a ``DTensor``'s the
    same of its local tensor, and its placements and mesh."""
    dtensor: Any = _DTENSOR[0] if _DTENSOR else None
    if dtensor is None:
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors]
    # (``local`` is bound in this function's scope, once per DTensor)
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
            if not isinstance(t, dtensor) else
            ((local := t.to_local()).data_ptr(), local.shape, local.stride(), local.dtype,
             t.placements, t.device_mesh)
            for t in tensors]


def _same_tensors(last: _LastSave, paths: list[tuple[Any, ...]], tensors: list[Any]) -> bool:
    """Whether ``tensors`` (a state dict's, at ``paths``) are the ones of the last save:
    the same tensor objects at the same paths, each over the same memory (data pointer,
    shape, strides, dtype; a DTensor's local tensor, placements and mesh too)."""
    return (len(tensors) == len(last.tensors)
            and all(map(operator.is_, tensors, last.tensors))
            and paths == last.paths
            and _identities(tensors) == last.identities)


class _LastSave(NamedTuple):
    """A state-dict object's last save: its tensors, where and what they were, and the
    children made of them (a save of the very same tensors returns those again); its
    state dict's signature (:func:`_signature`; ``None``: none), encoding, and that
    encoding packed (``packed[0]``: ``None`` until packed once)."""

    paths: list[tuple[Any, ...]]
    tensors: list[Any]
    identities: list[tuple[Any, ...]]
    children: dict[str, Any]
    sig: list[Any] | None
    enc: Any
    packed: list[bytes | None]


class _Restoring:
    """One restore in progress: the variables it fills and what ``load_state_dict`` gets."""

    def __init__(self, enc: Any, tensors: dict[tuple[Any, ...], Any],
                 variables: dict[tuple[Any, ...], Variable], fresh: bool) -> None:
        self.enc = enc
        self.tensors = tensors
        self.variables = variables
        #: True when ``load_state_dict`` must run (new tensors, or Python state to take)
        self.fresh = fresh
        self.assign = False
        #: the paths of tied tensors, each with the tensor it shares (:func:`_ties`)
        self.ties: dict[tuple[Any, ...], Any] = {}
        #: the checkpoint key and the object's state dict before the restore (the types
        #: of the namedtuples ``load_state_dict`` gets: :func:`_typed`)
        self.key = ""
        self.like: Any = None


class RestoredWhole(Trackable):
    """An object a checkpoint restores as a whole, around the restore of its variables:
    :meth:`begin_restore` before any value is matched (it may raise: nothing changed yet),
    then :meth:`finish_restore` after a successful restore, :meth:`abort_restore` after a
    failed one (:func:`begin_restores`, :func:`end_restores`)."""

    #: whether an object attached after the restore (that restore's deferred values) is
    #: restored whole as well (a pytree: its new tree is built then; a state-dict object:
    #: its ``load_state_dict`` takes the stored state), not value by value
    restored_on_attach: ClassVar[bool] = True

    def begin_restore(self, key: str, stored: Any, infos: Any) -> None:
        """Get ready: ``stored`` is the decoded Python state (``None``: none stored),
        ``infos`` the checkpoint's ``{key: ArrayInfo}``."""
        raise NotImplementedError

    def finish_restore(self, carry: Callable[[Variable, Variable], None] | None = None) -> None:
        """After a successful restore: take what it read."""
        raise NotImplementedError

    def abort_restore(self) -> None:
        """After a failed restore: take nothing."""
        raise NotImplementedError


class StateDictTrackable(RestoredWhole):
    """How an object with ``state_dict()``/``load_state_dict()`` takes part in a checkpoint.

    ``cv.Checkpoint(model=module)`` wraps ``module`` in one of these; its children are
    the state dict's tensors (as variables over their memory) and its Python state the
    rest of the state dict.
    """

    def __init__(self, obj: SupportsStateDict) -> None:
        self.obj = obj
        self._graph = Graph()
        #: path -> (the tensor's identity, its variable, whether another process saves it)
        self._cache: dict[tuple[Any, ...], tuple[tuple[Any, ...], Variable | None, bool]] = {}
        self._restoring: _Restoring | None = None
        #: path -> (identity, variable) of each tensor the last restore filled that
        #: ``load_state_dict`` then copied into another tensor (a non-contiguous
        #: parameter, an optimizer's deep-copied ``param_groups``): that tensor holds the
        #: stored value, and a variable made over it later is told to the restore
        self._given: dict[tuple[Any, ...], tuple[tuple[Any, ...], Variable]] = {}
        self._carry: Callable[[Variable, Variable], None] | None = None
        self._state: Any = None
        self._names: frozenset[str] | None = None  # of the parameters that train
        self._walked: Any = None  # the state dict of the last trackable_children()
        #: the last save's tensors and the children made of them: a save of the very
        #: same tensors again returns those children as they are; and when its state
        #: dict's signature is the same too (the same structure, keys and plain values,
        #: by type and value), the last encoding and its msgpack bytes
        self._last: _LastSave | None = None

    def _var(self, path: tuple[Any, ...], t: Any, saving: bool) -> Variable | None:
        """The variable over ``t``'s memory (made once per tensor and kept: a save of the
        same tensors again asks nothing of torch but their identity); ``None`` when
        saving a DTensor replica another process saves."""
        ident = _identity(t)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == ident:
            if saving and hit[2]:
                return None  # a replica another process saves
            if hit[1] is not None:
                return hit[1]
        replica = is_dtensor(t) and not dtensor_box(t, repr(path))[2]
        if saving and replica:
            self._cache[path] = (ident, None, True)
            return None
        name = "/".join(map(str, path))
        if self._names is None:
            self._names = self._trainable()
        var = tensor_variable(self._graph, name, t, saving=saving,
                              trainable=name in self._names)
        given = self._given.get(path)
        if var is not None and given is not None and given[0] == ident \
                and self._carry is not None:
            self._carry(given[1], var)
        if var is not None and _host_copy(t.to_local() if is_dtensor(t) else t):
            return var  # a copy holds this save's value only: never kept for the next
        self._cache[path] = (ident, var, replica)
        return var

    def _trainable(self) -> frozenset[str]:
        """The state-dict keys of parameters that train (a module's; none otherwise)."""
        if not isinstance(self.obj, SupportsNamedParameters):
            return frozenset()
        return frozenset(n for n, p in self.obj.named_parameters() if p.requires_grad)

    def trackable_children(self) -> dict[str, Any]:
        if self._restoring is not None:
            return _nest(dict(self._restoring.variables))
        self._names = None  # asked of the module only when a new variable is made
        on = autograd_off()  # (off already when the checkpoint asks: once a save)
        try:
            sd = _state_dict(self.obj)
            last = self._last
            sig = None
            if last is not None:
                # the same signature (structure, keys, plain values by type and value:
                # the same encoding, so the same paths) over the very same tensors,
                # each over the same memory: the last save's children and encoding
                sig, tensors = _signature(sd)
                if (sig is not None and sig == last.sig and len(tensors) == len(last.tensors)
                        and all(map(operator.is_, tensors, last.tensors))
                        and _identities(tensors) == last.identities):
                    self._walked = last.enc
                    return last.children
            enc, paths, tensors = _split(sd)
            if last is None:
                sig = _signature(sd)[0]
            # the walk that asked for the children asks for the Python state next: it is
            # this very state dict's (made once per walk, never kept past the next ask)
            self._walked = enc
            if last is not None and _same_tensors(last, paths, tensors):
                self._last = _LastSave(last.paths, last.tensors, last.identities,
                                       last.children, sig, enc, [None])
                return last.children
            self._last = None
            flat: dict[tuple[Any, ...], Any] = {}
            for path, t in zip(paths, tensors, strict=True):
                var = self._var(path, t, saving=True)
                if var is not None:
                    flat[path] = var
            identities = _identities(tensors)
        finally:
            autograd_back(on)
        children = _nest(flat)
        if all(path in self._cache for path in flat):  # no copy among them (``_var``)
            self._last = _LastSave(paths, tensors, identities, children, sig, enc, [None])
        return children

    def python_state(self) -> Any:
        if self._restoring is not None:
            return self._restoring.enc
        enc, self._walked = self._walked, None
        if enc is None:  # not walked just now, or not encodable (this says why)
            enc = _encode(self.obj.state_dict(), type(self.obj).__name__)
        return enc

    def packed_state(self, key: str) -> bytes:
        """:meth:`python_state` msgpack-encoded (``encode_state``); the kept save's
        encoding is packed once (its bytes are the same at every save that finds its
        state dict the same: :meth:`trackable_children`; a new encoding is kept with
        none)."""
        enc = self.python_state()
        last = self._last
        if last is None or last.enc is not enc:
            return encode_state(enc, key)
        packed = last.packed[0]
        if packed is None:
            packed = last.packed[0] = encode_state(enc, key)
        return packed

    def restore_python_state(self, state: Any) -> None:
        self._state = state

    # -- the restore: before matching, and once every value went in ----------------------
    def begin_restore(self, key: str, stored: Any, infos: Any) -> None:
        """Make a variable for every tensor the checkpoint holds for this object.

        ``stored`` is the decoded Python state (``None``: none stored; the current state
        dict's structure is used), ``infos`` the checkpoint's ``{key: ArrayInfo}``.
        """
        self._last = None  # the restore may give the object other tensors
        self._given, self._carry = {}, None
        self._state = None  # this restore's Python state, if the checkpoint has one
        torch = sys.modules.get("torch", None)
        sd = self.obj.state_dict()
        current = dict(_tensors(sd))
        self._names = self._trainable()
        # Python state (an optimizer's, a scheduler's) goes back through load_state_dict,
        # so the stored structure is restored whole, new tensors included; a state dict
        # of tensors only (a module's) keeps its own structure
        fresh = isinstance(stored, dict) and _has_values(stored)
        enc = stored if fresh else _encode(sd, key)
        paths = list(_tensor_paths(enc))
        tensors: dict[tuple[Any, ...], Any] = {}
        variables: dict[tuple[Any, ...], Variable] = {}
        assign = False
        new = _NewTensors(self._graph, torch, _params_by_index(self.obj, torch), _ties(
            self.obj) if any(t.device.type == "meta" for t in current.values()) else {})
        for path in paths:
            t = current.get(path)
            full = f"{key}/" + "/".join(map(str, path))
            info = infos.get(full) if hasattr(infos, "get") else None
            if t is not None:
                var = self._var(path, t, saving=False)
                if var is not None:
                    tensors[path], variables[path] = t, var
                    continue
                assign = assign or t.device.type == "meta"
            if info is None or torch is None:  # not stored: the status reports it
                continue
            tensors[path], variables[path] = new.made(t, path, info, full)
            fresh = True
        new.tie(tensors, variables)
        for path, t in current.items():  # tensors the checkpoint lacks: reported unmatched
            if path not in variables:
                var = self._var(path, t, saving=False)
                if var is not None:
                    variables[path] = var
                    tensors[path] = t
        self._restoring = _Restoring(enc, tensors, variables, fresh)
        self._restoring.assign = assign
        self._restoring.ties = new.ties
        self._restoring.key, self._restoring.like = key, sd

    def finish_restore(self, carry: Callable[[Variable, Variable], None] | None = None) -> None:
        """After a successful restore: ``load_state_dict`` when new tensors or state came.

        ``carry(old, new)`` is told each variable made later over a tensor into which
        ``load_state_dict`` copied the value the restore gave variable ``old``.
        """
        r, self._restoring = self._restoring, None
        if r is None or not r.fresh:
            return
        enc = self._state if self._state is not None else r.enc
        if r.assign:
            sd = _typed(_decode(enc, _tied_parameters(r.tensors, r.ties)), enc, r.like, r.key)
            self.obj.load_state_dict(sd, assign=True)  # type: ignore[call-arg]
        else:
            self.obj.load_state_dict(_typed(_decode(enc, r.tensors), enc, r.like, r.key))
        # the variables stay the object's: its tensors are the ones they fill (a later
        # walk, the status's included, meets them again)
        for path, t in _tensors(self.obj.state_dict()):
            var = r.variables.get(path)
            if var is None or path not in r.tensors:
                continue
            if _identity(t) == _identity(r.tensors[path]):
                replica = is_dtensor(t) and not dtensor_box(t, repr(path))[2]
                self._cache[path] = (_identity(t), var, replica)
            elif t is not r.tensors[path]:  # load_state_dict copied the restored value
                self._given[path] = (_identity(t), var)
        self._carry = carry

    def abort_restore(self) -> None:
        """After a failed restore: nothing was given to the object."""
        self._restoring = None

    def __repr__(self) -> str:
        return f"<StateDictTrackable of {type(self.obj).__name__}>"


def _has_values(enc: Any) -> bool:
    """Whether an encoded structure holds anything but tensors and containers."""
    if enc == _TENSOR:
        return False
    if "v" in enc:
        return True
    if "d" in enc:
        return any(_has_values(v) for _, v in enc["d"])
    return any(_has_values(v) for v in enc.get("t", enc.get("l", [])))


class _NewTensors:
    """The new tensors a restore makes for stored values (the variable over each one's
    memory). Tied tensors (an output head's weight that is the embedding's) without
    storage get one new tensor for all their paths, so that they stay one tensor."""

    def __init__(self, graph: Graph, torch: Any, params: list[Any],
                 ties: dict[tuple[Any, ...], Any]) -> None:
        self.graph, self.torch, self.params, self.ties = graph, torch, params, ties
        self._tied: dict[int, tuple[Any, Variable]] = {}  # by id of the tied tensor

    def made(self, t: Any, path: tuple[Any, ...], info: Any, full: str
             ) -> tuple[Any, Variable]:
        """A new tensor for the stored value ``full`` (at ``path``; ``t``: the current
        tensor there, if any) and its variable; a tied path's tie's, once made."""
        tied = self.ties.get(path)
        if tied is not None and id(tied) in self._tied:
            return self._tied[id(tied)]
        t_new = _new_tensor(self.torch, t, path, info, self.params)
        var = tensor_variable(self.graph, "/".join(map(str, path)), t_new, saving=False)
        if var is None:
            raise FrameworkStateError(f"Cannot restore {full!r}: no host memory for it.")
        if tied is not None:
            self._tied[id(tied)] = t_new, var
        return t_new, var

    def tie(self, tensors: dict[tuple[Any, ...], Any],
            variables: dict[tuple[Any, ...], Variable]) -> None:
        """Give each tied path the checkpoint lacks its tie's new tensor."""
        for path, tied in self.ties.items():
            if path not in tensors and id(tied) in self._tied:
                tensors[path], variables[path] = self._tied[id(tied)]


def _ties(obj: Any) -> dict[tuple[Any, ...], Any]:
    """The state-dict paths of ``obj``'s tensors that are one tensor under several keys
    (tied weights: ``lm_head.weight is embed.weight``), each with that tensor (a module's
    parameter as it is, ``keep_vars``); paths of tensors held once are left out."""
    by_tensor: dict[int, list[tuple[tuple[Any, ...], Any]]] = {}
    for path, t in _tensors(_state_dict(obj)):
        by_tensor.setdefault(id(t), []).append((path, t))
    return {path: t for group in by_tensor.values() if len(group) > 1 for path, t in group}


def _tied_parameters(tensors: dict[tuple[Any, ...], Any], ties: dict[tuple[Any, ...], Any]
                     ) -> dict[tuple[Any, ...], Any]:
    """``tensors``, each restored tensor of tied parameters made one ``nn.Parameter``
    given at each of its paths: ``load_state_dict(assign=True)`` then sets that very
    parameter on every module that shared it (it would wrap each path's tensor in a
    parameter of its own, the same memory but no longer the same parameter)."""
    if not ties:
        return tensors
    torch = sys.modules["torch"]
    out = dict(tensors)
    made: dict[int, Any] = {}
    for path, tied in ties.items():
        t = tensors.get(path)
        if t is None or not isinstance(tied, torch.nn.Parameter):
            continue
        param = made.get(id(t))
        if param is None:
            param = made[id(t)] = torch.nn.Parameter(t, requires_grad=tied.requires_grad)
        out[path] = param
    return out


def _params_by_index(obj: Any, torch: Any) -> list[Any]:
    """An optimizer's parameters in ``state_dict`` order (its ``state`` keys); else []."""
    groups = getattr(obj, "param_groups", None) if torch is not None else None
    if not isinstance(groups, list):
        return []
    return [p for g in groups if isinstance(g, dict) for p in g.get("params", ())]


def _new_tensor(torch: Any, t: Any, path: tuple[Any, ...], info: Any,
                params: list[Any]) -> Any:
    """A new tensor for a stored value: like the optimizer's parameter when it matches
    (on its GPU: ``load_state_dict`` then keeps the very tensor the restore filled)."""
    # (through ckptvar's own mapping: bfloat16 and float8 have no NumPy type torch takes)
    dtype = from_numpy(np.empty(0, np.dtype(info.dtype)), "torch",
                       what="/".join(map(str, path))).dtype
    shape = tuple(info.shape)
    like = t
    if like is None and len(path) == 3 and path[0] == "state" and isinstance(path[1], int) \
            and path[1] < len(params):
        like = params[path[1]]
    if like is not None and tuple(like.shape) == shape:
        if is_dtensor(like):
            return torch.empty_like(like, dtype=dtype)
        if is_on_gpu(like):  # filled in place through the pinned buffer, then kept as is
            return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype)


def begin_restores(root: Trackable, states: Any, infos: Any, path: Any
                   ) -> tuple[list[Any], list[RestoredWhole]]:
    """The walk of ``root`` for a restore, and the objects in it restored whole
    (state-dict objects, pytrees: ``root``'s own, and those its modules and trackables
    hold), each put in restore mode (see ``begin_restore``) before its children are met."""
    nodes = walk(root, stop=RestoredWhole)
    out: list[RestoredWhole] = []
    below: list[Any] = []
    try:
        # (a plain variable is no such object: no call for each)
        for node in [n for n in nodes if type(n.obj) is not Variable]:
            obj = node.obj
            if isinstance(obj, RestoredWhole) and node.first:
                blob = states.get(node.key)
                stored = None if blob is None else decode_state(blob, node.key, path)
                out.append(obj)  # (ended below if its own begin raises)
                obj.begin_restore(node.key, stored, infos)
                below += walk(obj, node.key)[1:]  # its children, in restore mode now
    except BaseException:
        end_restores(out, ok=False)  # none left restoring: its next save would be stale
        raise
    return nodes + below, out


def end_restores(adapters: list[RestoredWhole], *, ok: bool,
                 carry: Callable[[Variable, Variable], None] | None = None) -> None:
    """After the restore: give the objects their state (``ok``), or forget it.

    ``carry(old, new)``: variable ``new`` holds what the restore gave ``old`` (a tensor
    ``load_state_dict`` copied the restored value into; ``finish_restore``). When an
    object's ``load_state_dict`` raises, the others still finish (none is left restoring,
    where its next save would write the checkpoint's state), then the first error is raised.
    """
    first: BaseException | None = None
    for a in adapters:  # every object leaves its restore, whichever raises
        try:
            if ok:
                a.finish_restore(carry)
            else:
                a.abort_restore()
        except BaseException as exc:  # noqa: BLE001 - raised below, once all are done
            first = first or exc
    if first is not None:
        raise first


def is_generator(value: Any) -> bool:
    """A ``torch.Generator`` (torch asked only once imported: a generator needs it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Generator)


class GeneratorState:
    """A ``torch.Generator`` seen as an object with ``state_dict()``: ``{"state": the
    generator's state (a uint8 tensor), "device": its device}``.

    ``get_state()`` makes a new tensor at each call; the state is copied into one kept
    tensor instead, so its variable (filled in place by a restore, then ``set_state``) is
    the one every later walk meets, however far the generator drew since, as a module's
    tensors are.
    """

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self._state: Any = None

    def state_dict(self) -> dict[str, Any]:
        state = self.generator.get_state()
        kept = self._state
        if kept is not None and kept.shape == state.shape:
            kept.copy_(state)
        else:
            self._state = kept = state
        return {"state": kept, "device": str(self.generator.device)}

    def load_state_dict(self, state_dict: Any) -> None:
        self.generator.set_state(state_dict["state"])


def trackable_for(value: Any) -> Any:
    """``value`` as something a checkpoint tracks: a state-dict object, or a
    ``torch.Generator``, gets its wrapper."""
    if isinstance(value, SupportsStateDict) and not isinstance(value, Trackable):
        return StateDictTrackable(value)
    if is_generator(value):
        return StateDictTrackable(GeneratorState(value))
    return value
