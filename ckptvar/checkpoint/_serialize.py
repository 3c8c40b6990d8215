"""From objects to what a checkpoint file holds: keys, host arrays, attributes, metadata.

No I/O here. :func:`gather` walks an object graph into a :class:`SaveContents`;
:func:`host_arrays` turns it into ``(key, array, attrs)`` triples — views of the
variables' own buffers for a blocking save (no copy), or a consistent snapshot
(one copy each, into a :class:`SnapshotBuffer` reused from one background save to
the next) for a background save; a logical variable (a partitioned variable, a
shard) is one value, assembled from its parts into one new host array; :func:`metadata` builds the msgpack-able
record stored beside the arrays (object graph aliases, Python state, save counter).
"""

from __future__ import annotations

import math
import operator
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .._staging import staged, staged_copy
from ..errors import CorruptCheckpointError
from ..storage import copy_pieces, snapshot, snapshot_pieces
from ..trackable import Trackable, python_state
from ..variables import PartitionedVariable, Variable, device_value, read_buffer, read_buffers
from ._logical import Logical, as_target, assemble
from ._walk import walk

__all__ = [
    "GRAPH_VERSION",
    "SaveContents",
    "SnapshotBuffer",
    "decode_state",
    "encode_state",
    "gather",
    "host_arrays",
    "is_namedtuple",
    "metadata",
    "read_graph",
    "read_namedtuples",
    "tuple_paths",
    "type_name",
    "with_namedtuples",
]

#: Version of the object-graph record this module writes under ``metadata["object_graph"]``.
GRAPH_VERSION = 1


@dataclass
class SaveContents:
    """What one save writes: variables by key, their aliases, and Python states."""

    variables: dict[str, Variable | Logical] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    python_state: dict[str, bytes] = field(default_factory=dict)
    #: the places of the tuples in each Python state that holds some (``encode_state``)
    tuples: dict[str, list[list[Any]]] = field(default_factory=dict)
    #: the place and type name of each namedtuple among them (``[path, "mod.Name"]``)
    namedtuples: dict[str, list[list[Any]]] = field(default_factory=dict)


_PACKERS = threading.local()  # one msgpack packer a thread, kept (see encode_state)
_KEPT_PACKER = 1 << 20


def encode_state(state: Any, key: str, tuples: dict[str, list[list[Any]]] | None = None,
                 namedtuples: dict[str, list[list[Any]]] | None = None) -> bytes:
    """msgpack-encode a trackable's Python state; ``TypeError`` naming ``key`` if it can't.

    msgpack stores a tuple as an array (a list to its readers): the place of each tuple
    in ``state`` goes into ``tuples[key]`` (a list of paths, innermost first; none: no
    entry), for :func:`decode_state` to make it a tuple again. A tuple as a map key
    cannot come back at all and is refused. A namedtuple is stored as its values; its
    place and type name go into ``namedtuples[key]`` (``[path, "module.QualName"]``), so
    that a restore gives it its type from the restoring object (:func:`with_namedtuples`)
    or says that it cannot: a type is never made from a name read from a file.

    Each thread keeps its packer (``msgpack.packb`` makes one, and its buffer, at every
    call: a background save encodes each object's state in its blocking part); one that
    packed more than :data:`_KEPT_PACKER` bytes is let go (its buffer never shrinks),
    one that raised starts empty again. The packer takes only exact types (a tuple, or a
    subclass, reaches :func:`_exact`): a state without tuples is packed in one pass.
    """
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True, strict_types=True,
                                                  default=_exact)
    try:
        try:
            packed: bytes = packer.pack(state)
        except _HasTuple:
            named: list[list[Any]] = []
            paths = tuple_paths(state, key, named)
            if tuples is not None:
                tuples[key] = paths
            if named and namedtuples is not None:
                namedtuples[key] = named
            out: bytes = msgpack.packb(state, use_bin_type=True)  # (a tuple: an array)
            return out
        if len(packed) > _KEPT_PACKER:
            _PACKERS.packer = None
        return packed
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"The Python state of {key!r} cannot be stored with msgpack ({exc}); "
            "use None, bool, int (64-bit), float, str, bytes, lists, tuples and dicts."
        ) from exc


class _HasTuple(Exception):
    """Raised by :func:`_exact` at a state's first tuple: its places are looked for."""


def _exact(obj: Any) -> Any:
    """The value msgpack packs for ``obj`` (a subclass of a type it stores: its base
    value, as msgpack itself would pack it); :class:`_HasTuple` for a tuple."""
    if isinstance(obj, tuple):
        raise _HasTuple
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, int):
        return int.__int__(obj)
    if isinstance(obj, float):
        return float.__float__(obj)
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, bytes):
        return b"" + obj
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def tuple_paths(state: Any, key: str, named: list[list[Any]] | None = None
                ) -> list[list[Any]]:
    """The place of each tuple in ``state`` (map keys and list indexes from the top),
    innermost first; ``TypeError`` naming ``key`` for a tuple used as a map key. Each
    namedtuple's ``[place, "module.QualName"]`` is appended to ``named``."""
    out: list[list[Any]] = []

    def visit(value: Any, path: list[Any]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, tuple):
                    raise TypeError(
                        f"The Python state of {key!r} has the tuple {k!r} as a map key"
                        f"{_place(path)}; msgpack cannot bring it back (use a str key).")
                visit(v, [*path, k])
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                visit(v, [*path, i])
            if isinstance(value, tuple):
                out.append(path)
                if named is not None and is_namedtuple(value):
                    named.append([path, type_name(value)])

    visit(state, [])
    return out


def is_namedtuple(value: Any) -> bool:
    """Whether ``value`` is a namedtuple (a tuple whose type has ``_fields``)."""
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def type_name(value: Any) -> str:
    """``"module.QualName"`` of ``value``'s type (what a record of a namedtuple says)."""
    return f"{type(value).__module__}.{type(value).__qualname__}"


def with_namedtuples(state: Any, like: Any, named: Any, key: str, *,
                     holder: str = "python_state()", stacklevel: int = 6) -> Any:
    """``state`` (decoded) with each tuple that is a namedtuple in ``like`` (the restoring
    object's own ``python_state()``, or what ``holder`` names, at the same place, with as
    many fields) made one of that type; ``named`` (the stored ``[path, type name]`` of
    the saved namedtuples) says which came back as plain tuples for want of such a type:
    a ``UserWarning`` names them and ``key``. No type is ever made from a name read from
    a file.

    >>> from collections import namedtuple
    >>> P = namedtuple("P", "x y")
    >>> with_namedtuples({"p": (1, 2), "q": [3]}, {"p": P(0, 0)}, [[["p"], "m.P"]], "k")
    {'p': P(x=1, y=2), 'q': [3]}
    """
    given: set[tuple[Any, ...]] = set()

    def visit(value: Any, like: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, dict):
            inner = like if isinstance(like, dict) else {}
            return {k: visit(v, inner.get(k) if _hashable(k) else None, (*path, k))
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            seq = like if isinstance(like, list | tuple) and len(like) == len(value) else ()
            items = [visit(v, seq[i] if seq else None, (*path, i)) for i, v in enumerate(value)]
            if isinstance(value, tuple) and is_namedtuple(like) and len(like) == len(value):
                given.add(path)
                return type(like)(*items)
            return tuple(items) if isinstance(value, tuple) else items
        return value

    out = visit(state, like, ())
    lost = [f"{'/'.join(map(str, p)) or '<the state itself>'} ({name})" for p, name in named or ()
            if isinstance(p, list) and tuple(p) not in given]
    if lost:
        warnings.warn(
            f"The Python state of {key!r} held namedtuples that come back as plain tuples: "
            f"{', '.join(lost)}. A restore gives a tuple its namedtuple type only where the "
            f"restoring object's {holder} holds a namedtuple of as many fields at that "
            "place (a type named by a file is never imported or made).",
            UserWarning, stacklevel=stacklevel)
    return out


def _hashable(key: Any) -> bool:
    return key is None or isinstance(key, bool | int | float | str | bytes)


def _place(path: list[Any]) -> str:
    return f" at {'/'.join(map(str, path))!r}" if path else ""


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode_state(blob: Any, key: str, path: Any, tuples: Any = None) -> Any:
    """Inverse of :func:`encode_state` (``tuples``: the stored paths of ``key``'s tuples,
    if any); damage raises ``CorruptCheckpointError``."""
    if not isinstance(blob, bytes | bytearray):
        raise CorruptCheckpointError(
            f"Python state of {key!r} in {str(path)!r} is not msgpack bytes "
            f"(found {type(blob).__name__})."
        )
    try:
        state = msgpack.unpackb(blob, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"Python state of {key!r} in {str(path)!r} is damaged: {exc}."
        ) from exc
    if tuples is None:
        return state
    try:
        return _with_tuples(state, tuples)
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"The tuples of the Python state of {key!r} in {str(path)!r} are damaged: {exc}."
        ) from None


def _with_tuples(state: Any, tuples: Any) -> Any:
    """``state`` with the list at each path of ``tuples`` made a tuple (deepest first)."""
    if not isinstance(tuples, list) or not all(isinstance(p, list) for p in tuples):
        raise ValueError("they are not a list of paths")
    for p in sorted(tuples, key=len, reverse=True):
        parent: Any = None
        here = state
        for step in p:
            parent = here
            if not _leads(here, step):
                raise ValueError(f"the path {p!r} leads nowhere")
            here = here[step]
        if not isinstance(here, list):
            raise ValueError(f"the path {p!r} is not a list")
        if parent is None:
            state = tuple(here)
        else:
            parent[p[-1]] = tuple(here)
    return state


def _leads(here: Any, step: Any) -> bool:
    """Whether ``here[step]`` is an item of a list or a map of a decoded state."""
    if isinstance(here, list):
        return type(step) is int and -len(here) <= step < len(here)
    hashable = step is None or isinstance(step, bool | int | float | str | bytes)
    return isinstance(here, dict) and hashable and step in here


def gather(root: Any, *, targets: bool = True) -> SaveContents:
    """Walk ``root`` and collect every variable (once) and every Python state.

    ``targets=False`` keeps a variable that holds a shard as it is (its :class:`Logical`
    is made only if the caller needs it: a multi-process save writes the shard itself).
    """
    plan = SaveContents()
    first_key: dict[int, str] = {}
    for node in walk(root):
        obj = node.obj
        if isinstance(obj, Variable | PartitionedVariable):
            if node.first:
                first_key[id(obj)] = node.key
                plan.variables[node.key] = (
                    obj if not targets and type(obj) is Variable else as_target(obj))
            else:
                plan.aliases.setdefault(first_key[id(obj)], []).append(node.key)
        elif isinstance(obj, Trackable) and node.first and node.parent is not None:
            state = python_state(obj)
            if state is not None:
                plan.python_state[node.key] = encode_state(state, node.key, plan.tuples,
                                                           plan.namedtuples)
    return plan


_ALIGN = 64  # each snapshot value starts on a cache line of the buffer


class SnapshotBuffer:
    """One host buffer that a background save's snapshot is copied into, kept for the next.

    A snapshot into fresh memory pays a page fault for every 4 KiB page it fills (NumPy
    asks for huge pages only from 4 MiB an array): 48 MiB in 2 MiB arrays took 19 ms,
    the same copy into memory written before 2.4 ms (a 2-CPU VM). So a checkpoint's
    background saves copy into one buffer, made (and faulted in) once and reused while
    it fits. It is reused only when nothing else holds a view of it: a save that is
    still running, or an error's traceback that keeps the last snapshot, makes the next
    save take a new one. One save at a time claims it: its owner's lock (a
    ``cv.Checkpoint``'s) is held from the claim until the views are made.

    >>> buf = SnapshotBuffer()
    >>> a, b = buf.views([((2, 3), np.dtype("float32")), ((5,), np.dtype("int8"))])
    >>> a.shape, b.dtype.name, np.shares_memory(a, b)
    ((2, 3), 'int8', False)
    >>> del a, b
    >>> buf.nbytes
    128
    """

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._idle = 0  # the buffer's reference count with no view of it alive
        self._specs: list[tuple[tuple[int, ...], np.dtype[Any]]] = []  # the last views'
        #: their offsets (``None``: an object array, never in the buffer), sizes, and the
        #: bytes they take
        self._layout: tuple[list[int | None], list[int], int] = ([], [], 0)
        #: the last snapshot's ``(keys, variables, attrs)`` (:func:`host_arrays`): a save
        #: of the very same variables under the same keys takes them again
        self.values: tuple[list[str], list[Variable], list[dict[str, Any]]] | None = None
        #: the last copy's plan, kept while its sources are the very same arrays: see
        #: :meth:`copy` (``None``: none kept)
        self._kept: _KeptCopy | None = None

    @property
    def nbytes(self) -> int:
        """The bytes held between saves (0: none)."""
        return 0 if self._buf is None else int(self._buf.nbytes)

    def _lay_out(self, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
        """Place each ``(shape, dtype)`` in the buffer, side by side (unless the last
        specs were the same)."""
        if specs == self._specs:  # the last save's values again: the same layout
            return
        offsets: list[int | None] = []
        sizes: list[int] = []
        total = 0
        for shape, dtype in specs:
            n = math.prod(shape) * dtype.itemsize
            offsets.append(None if dtype.hasobject else total)
            sizes.append(n)
            if not dtype.hasobject:
                total += -(-n // _ALIGN) * _ALIGN
        self._specs, self._layout = specs, (offsets, sizes, total)

    def _buffer(self, total: int) -> np.ndarray:
        """The buffer, of at least ``total`` bytes: the last one unless it no longer fits,
        is more than twice too big, or is still viewed."""
        buf = self._buf
        # any reference beyond those counted when the buffer was made (the attribute and
        # ``buf``, however this interpreter counts them) is a view still alive somewhere:
        # each view holds the buffer itself as its base
        if (buf is None or buf.nbytes < total or buf.nbytes > 2 * total + (1 << 20)
                or sys.getrefcount(buf) > self._idle):
            self._buf = None
            del buf
            buf = self._buf = np.empty(max(total, 1), np.uint8)
            self._idle = sys.getrefcount(buf)
        return buf

    def views(self, specs: Sequence[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[np.ndarray]:
        """A C-contiguous array of each ``(shape, dtype)``, side by side in the buffer."""
        self._kept = None  # (its views would count as views held elsewhere)
        self._lay_out(list(specs))
        offsets, _, total = self._layout
        buf = self._buffer(total)
        # one call a view, its base the buffer itself
        return [np.ndarray(shape, dtype, buf, off or 0)
                for (shape, dtype), off in zip(specs, offsets, strict=True)]

    def copy(self, sources: Sequence[np.ndarray], *, processes: int = 1) -> list[np.ndarray]:
        """A C-ordered copy of each array: in the buffer (an object array: new memory),
        helped by I/O threads where the CPUs are not taken by ``processes``
        (:func:`~ckptvar.storage.snapshot`).

        >>> buf = SnapshotBuffer()
        >>> a = np.arange(6.0).reshape(2, 3)
        >>> (c,) = buf.copy([a])
        >>> bool((c == a).all()), np.shares_memory(c, a), c.base is buf._buf
        (True, False, True)
        """
        kept = self._kept
        if kept is not None and kept.free(sources, self._buf):
            # the very same source arrays, and nothing but this object holds the last
            # copy's views or the buffer: the same views and pieces, copied again
            copy_pieces(kept.pieces, kept.nbytes, processes=processes)
            return list(kept.dests)
        self._kept = None  # (before the buffer's check: its views would count as held)
        self._lay_out([(a.shape, a.dtype) for a in sources])
        offsets, _, total = self._layout
        buf = self._buffer(total)
        dests = [np.empty(shape, dtype) if off is None else np.ndarray(shape, dtype, buf, off)
                 for (shape, dtype), off in zip(self._specs, offsets, strict=True)]
        # (an object array's ``None`` offset never reaches ``np.ndarray``)
        del buf
        out, pieces, nbytes = snapshot_pieces(sources, dests)
        del out  # (the same arrays as ``dests``)
        if all(off is not None for off in offsets):  # an object array: a new one each time
            self._kept = kept = _KeptCopy(list(sources), dests, pieces, nbytes)
            kept.mark(self._buf)
        copy_pieces(pieces, nbytes, processes=processes)
        return list(dests)

    def release(self) -> None:
        """Drop the buffer (the next snapshot makes a new one)."""
        self._buf = None
        self._kept = None


class _KeptCopy:
    """A :class:`SnapshotBuffer` copy's plan, for the next copy of the very same arrays.

    Its views of the buffer (``dests``) and ``(destination, source)`` pieces cost about
    30 us to make again for 32 arrays, cold. They are used again only when each source is
    the same array object as before (an array's memory, shape and dtype are its own for
    its life) and nothing but this object holds a view or the buffer: each view's
    reference count and the buffer's are those taken when the plan was made (a view held
    by a save in flight, a traceback or a user counts one more; so does a view of a view,
    whose base is the buffer itself). The sources stay referenced until the next copy or
    :meth:`SnapshotBuffer.release` (the variables they belong to are kept as long).
    """

    __slots__ = ("buf_refs", "dests", "nbytes", "pieces", "refs", "sources")

    def __init__(self, sources: list[np.ndarray], dests: list[np.ndarray],
                 pieces: list[tuple[np.ndarray, np.ndarray]], nbytes: int) -> None:
        self.sources, self.dests, self.pieces, self.nbytes = sources, dests, pieces, nbytes
        self.refs: list[int] = []
        self.buf_refs = 0

    def mark(self, buf: np.ndarray | None) -> None:
        """Take the reference counts :meth:`free` compares with, called as it is called
        (a method given the buffer attribute) while nothing else holds a view."""
        self.refs = list(map(sys.getrefcount, self.dests))
        self.buf_refs = sys.getrefcount(buf)

    def free(self, sources: Sequence[np.ndarray], buf: np.ndarray | None) -> bool:
        """Whether ``sources`` are the kept ones and nothing else holds the kept views."""
        return (len(sources) == len(self.sources)
                and all(map(operator.is_, sources, self.sources))
                and list(map(sys.getrefcount, self.dests)) == self.refs
                and sys.getrefcount(buf) == self.buf_refs)


def host_arrays(plan: SaveContents, *, copy: bool, into: SnapshotBuffer | None = None,
                processes: int = 1) -> list[tuple[str, np.ndarray, dict[str, Any]]]:
    """``(key, host array, attrs)`` for each variable; ``copy=True`` takes a snapshot.

    The snapshot's host values are copied into ``into`` (a buffer kept from the last
    snapshot; none: new memory), helped by I/O threads where the CPUs are not taken by
    the job's other ``processes`` (:func:`snapshot`). A value
    on a GPU is staged through the pinned buffer (``ckptvar._staging``), never copied to
    the host whole; its snapshot is a copy on its device. A snapshot into ``into`` of the
    very variables of its last one, each held in a host array, reads their buffers in
    one pass and reuses the last one's attributes (the bookkeeping of a value costs no
    call of its own).
    """
    if copy and into is not None:
        again = _snapshot_again(plan, into, processes)
        if again is not None:
            return again
    out, to_copy = _host_values(plan, copy)
    if into is not None:  # kept for the next snapshot when each value is a host array
        into.values = _to_keep(plan, out) if copy and len(to_copy) == len(out) else None
    if to_copy:
        sources = [out[i][1] for i in to_copy]
        copies = (snapshot(sources, processes=processes) if into is None
                  else into.copy(sources, processes=processes))
        for i, c in zip(to_copy, copies, strict=True):
            out[i] = (out[i][0], c, out[i][2])
    return out


def _host_values(plan: SaveContents, copy: bool,
                 ) -> tuple[list[tuple[str, Any, dict[str, Any]]], list[int]]:
    """:func:`host_arrays`' values before the copy, and which of them are still to copy."""
    out: list[tuple[str, Any, dict[str, Any]]] = []
    to_copy: list[int] = []
    for key, var in plan.variables.items():
        attrs = {"name": var.name, "trainable": bool(var.trainable)}
        if isinstance(var, Logical):  # a new host array already: a snapshot
            out.append((key, assemble(var, key), attrs))
            continue
        tensor = device_value(var)
        if tensor is not None:  # a framework tensor on a GPU: staged, never copied whole
            out.append((key, staged_copy(tensor) if copy else staged(tensor), attrs))
            continue
        value = read_buffer(var)
        if not isinstance(value, np.ndarray):  # on a GPU: staged, never copied whole
            out.append((key, staged_copy(value) if copy else staged(value), attrs))
            continue
        if copy:
            to_copy.append(len(out))
            host = value
        else:
            host = np.asarray(value, order="C")
        out.append((key, host, attrs))
    return out, to_copy


def _to_keep(plan: SaveContents, out: list[tuple[str, Any, dict[str, Any]]],
             ) -> tuple[list[str], list[Variable], list[dict[str, Any]]] | None:
    """What :func:`_snapshot_again` needs of this snapshot: its keys, variables (each a
    plain :class:`Variable`, else ``None``) and attributes."""
    variables = [v for v in plan.variables.values() if type(v) is Variable]
    if len(variables) != len(out):
        return None
    return list(plan.variables), variables, [a for _, _, a in out]


def _snapshot_again(plan: SaveContents, into: SnapshotBuffer,
                    processes: int) -> list[tuple[str, np.ndarray, dict[str, Any]]] | None:
    """:func:`host_arrays`' snapshot when ``plan`` holds the very variables, under the
    same keys, of ``into``'s last one, each still in a host array; else ``None``."""
    if into.values is None:
        return None
    keys, variables, kept = into.values
    if (len(plan.variables) != len(variables)
            or not all(map(operator.is_, plan.variables.values(), variables))
            or list(plan.variables) != keys):
        return None
    sources = read_buffers(variables)
    if sources is None:
        return None
    return list(zip(keys, into.copy(sources, processes=processes), kept, strict=True))


def metadata(plan: SaveContents, *, save_counter: int | None, user: Any = None) -> dict[str, Any]:
    """The msgpack-able record stored with the arrays."""
    meta: dict[str, Any] = {
        "object_graph": {
            "version": GRAPH_VERSION,
            "aliases": {k: list(v) for k, v in plan.aliases.items()},
            "python_state": dict(plan.python_state),
        }
    }
    if plan.tuples:  # (only then: a record without tuples is the same as before)
        meta["object_graph"]["tuples"] = {k: list(v) for k, v in plan.tuples.items()}
    if plan.namedtuples:
        meta["object_graph"]["namedtuples"] = {k: list(v) for k, v in plan.namedtuples.items()}
    if save_counter is not None:
        meta["save_counter"] = int(save_counter)
    if user is not None:
        meta["user"] = user
    return meta


def read_graph(meta: Any, path: Any,
               ) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """``(alias -> key, key -> encoded state, key -> its tuples' paths)`` from a file's
    metadata (empty if absent)."""
    graph = meta.get("object_graph") if isinstance(meta, dict) else None
    if graph is None:
        return {}, {}, {}
    if not isinstance(graph, dict) or not isinstance(graph.get("aliases", {}), dict):
        raise CorruptCheckpointError(f"The object graph record of {str(path)!r} is malformed.")
    version = graph.get("version", GRAPH_VERSION)
    if not isinstance(version, int) or version > GRAPH_VERSION:
        raise CorruptCheckpointError(
            f"{str(path)!r} has object-graph version {version!r}; this ckptvar reads up to "
            f"{GRAPH_VERSION}. Upgrade ckptvar to restore it."
        )
    alias_to_key: dict[str, str] = {}
    for key, aliases in graph.get("aliases", {}).items():
        for alias in aliases or ():
            alias_to_key[str(alias)] = str(key)
    states = graph.get("python_state", {}) or {}
    if not isinstance(states, dict):
        raise CorruptCheckpointError(f"The Python-state record of {str(path)!r} is malformed.")
    tuples = graph.get("tuples", {})
    if not isinstance(tuples, dict):
        raise CorruptCheckpointError(
            f"The Python-state tuples of {str(path)!r} are not a map of keys to paths.")
    return alias_to_key, dict(states), dict(tuples)


def read_namedtuples(meta: Any) -> dict[str, Any]:
    """``key -> [[path, type name], ...]``: the namedtuples of each stored Python state
    (empty if none; a malformed record is ignored: it only says what was a namedtuple)."""
    graph = meta.get("object_graph") if isinstance(meta, dict) else None
    named = graph.get("namedtuples") if isinstance(graph, dict) else None
    return dict(named) if isinstance(named, dict) else {}
