"""Object-based restore: matching objects to stored keys, and deferring the rest.

A restore matches the objects that exist to the file's keys (object-graph paths,
including the aliases of shared variables) and applies their values all or
nothing (``_apply``). Values whose objects do not exist yet wait on their parent
trackable (``Trackable.defer_restore``) and are applied when the object is attached: the
variable is born with the stored value and its initializer never runs.
:class:`RestoreState` keeps the accounting (what was consumed, what is pending)
that the status (``_status``) reports.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import compress, repeat
from pathlib import Path
from typing import Any

import numpy as np

from ..storage import ArrayInfo, Reader, backend_for, paused_gc
from ..trackable import (
    Trackable,
    defer_restore,
    python_state,
    restore_python_state,
)
from ..variables import PartitionedVariable, Variable, unsharded
from ._apply import stored_infos
from ._frameworks import RestoredWhole, end_restores
from ._incremental import Restored
from ._keys import escape_segment, unescape_segment
from ._logical import BoxReader, Logical, apply_targets, as_target, read_boxes
from ._serialize import decode_state, read_graph, read_namedtuples, with_namedtuples
from ._status import warn_unused
from ._walk import Node, child_items, is_framework_object, walk

__all__ = ["Deferred", "RestoreState"]

# of a matched row (key, target, tracked object)
_key_of, _key_target = operator.itemgetter(0), operator.itemgetter(0, 1)
_object_of = operator.itemgetter(2)
_obj_of_node, _key_of_node = operator.attrgetter("obj"), operator.attrgetter("key")


@dataclass
class _Match:
    variables: list[tuple[str, Variable | Logical, Any]]  # (key, target, tracked object)
    states: list[tuple[str, Trackable]]
    deferrals: list[tuple[Trackable, str, str]]  # (parent, raw child name, parent key)


class RestoreState:
    """One restore: what the file holds, what has been matched, and pending values.

    Kept alive by its :class:`RestoreStatus` and by the deferred handlers it leaves
    on trackables; holds its reader open while values are still pending. When it
    dies (nothing can take a value any more) with values unused and not
    ``silenced``, it warns once (``_status.warn_unused``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        root: Any = None,
        verify: bool = True,
        cast: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        from ..locations import is_url  # noqa: PLC0415 - keeps the imports as they are

        # A URL stays a str (Path would mangle "s3://"); its reader reads by ranged GETs.
        self.path: Any = path if is_url(path) else Path(path)
        self._storage_options = storage_options
        self.verify = verify
        self.cast = cast
        self.silenced = True  # until a status that warns takes it over
        #: Serialises reads from the shared reader and the bookkeeping of matches.
        self.lock = threading.RLock()
        self._reader: Reader | None = self._open_reader()
        self._finalizer = weakref.finalize(self, _close, self._reader)
        reader = self._reader
        self.infos: Mapping[str, ArrayInfo] = stored_infos(reader)
        #: the stored keys, for the lookups of matching (a set: no Python call per lookup)
        self._stored: frozenset[str] = frozenset(self.infos)
        meta = reader.metadata()
        self.has_save_counter = isinstance(meta, dict) and "save_counter" in meta
        self.alias_to_key, self.states, self.tuples = read_graph(meta, self.path)
        #: the namedtuples of each Python state (given their types by the restoring object)
        self.namedtuples = read_namedtuples(meta)
        self.alias_to_key = {a: k for a, k in self.alias_to_key.items() if k in self.infos}
        children: dict[str, set[str]] = {}
        # most keys share their parent: their last segments first, then each distinct
        # parent's own prefixes
        parents: set[str] = set()
        for path_key in [*self.infos, *self.alias_to_key, *self.states]:
            parent, _, seg = path_key.rpartition("/")
            known = children.get(parent)
            if known is None:
                children[parent] = {seg}
                parents.add(parent)
            else:
                known.add(seg)
        for path_key in parents:
            if not path_key:
                continue  # the root: no prefix above it
            child = path_key  # every prefix knows its next segment
            while True:
                parent, _, seg = child.rpartition("/")
                known = children.get(parent)
                if known is None:
                    children[parent] = {seg}
                elif seg in known:
                    break  # the parent's own prefixes are known already
                else:
                    known.add(seg)
                if not parent:
                    break
                child = parent
        self.children = children
        self.consumed_keys: set[str] = set()
        self.consumed_states: set[str] = set()
        self._matched: dict[int, weakref.ref[Any]] = {}
        self._root = weakref.ref(root) if root is not None else None
        self.pending = 0
        #: reads boxes of stored values into parts' buffers (a coordinator may replace it)
        self.box_reader: BoxReader = read_boxes
        #: notes the values this restore sets, now and on create (an incremental
        #: manager's next save learns them; None: not noted)
        self.restored: Restored | None = None

    def __del__(self) -> None:
        if self.silenced:
            return
        try:
            unused = self.unused()
            if unused:
                warn_unused(self.path, unused)
        except Exception:  # noqa: BLE001 - a finalizer never raises (e.g. at interpreter exit)
            return

    # -- reader -----------------------------------------------------------------------
    def _open_reader(self) -> Reader:
        return _open_reader(self.path, self._storage_options)

    @property
    def reader(self) -> Reader:
        if self._reader is None:
            self._reader = self._open_reader()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close, self._reader)
        return self._reader

    def release_reader(self) -> None:
        """Close the file if no value is pending (it is reopened when needed), and let
        the decoded record go: a status kept for its assertions holds only the keys."""
        if self._reader is not None and self.pending <= 0:
            self._finalizer()
            self._reader = None
            if not isinstance(self.infos, dict | _ReleasedInfos):
                self.infos = _ReleasedInfos(list(self.infos), self._stored, functools.partial(
                    _open_reader, self.path, self._storage_options))

    # -- matching ---------------------------------------------------------------------
    def key_for(self, path_key: str) -> str | None:
        if path_key in self._stored:
            return path_key
        return self.alias_to_key.get(path_key)

    def _match(self, nodes: list[Node]) -> _Match:
        m = _Match([], [], [])
        objs = list(map(_obj_of_node, nodes))
        plain = list(map(operator.is_, map(type, objs), repeat(Variable)))
        if plain.count(True) > 1:  # many plain variables: matched by columns when every
            variables = list(compress(objs, plain))  # one is stored under its own key
            keys = list(map(_key_of_node, compress(nodes, plain)))
            others = list(compress(nodes, map(operator.not_, plain)))
            if (unsharded(variables) and all(map(self._stored.__contains__, keys))
                    and not any(isinstance(n.obj, Variable | PartitionedVariable)
                                for n in others)):  # (the order of the rows is the walk's)
                m.variables = list(zip(keys, variables, variables, strict=True))
                nodes = others
        self._match_each(nodes, m)
        return m

    def _match_each(self, nodes: list[Node], m: _Match) -> None:
        stored, aliases, add = self._stored, self.alias_to_key, m.variables.append
        for node in nodes:
            obj = node.obj
            if type(obj) is Variable and obj.shard is None:  # the common case: itself
                key = node.key if node.key in stored else aliases.get(node.key)
                if key is not None:
                    add((key, obj, obj))
                continue
            if isinstance(obj, Variable | PartitionedVariable):
                key = self.key_for(node.key)
                if key is not None:
                    add((key, as_target(obj), obj))
                continue
            if isinstance(obj, Trackable) and node.first:
                if node.key in self.states and node.key != "":
                    m.states.append((node.key, obj))
                wanted = self.children.get(node.key, ())
                if wanted:
                    present = {
                        n if type(n) is str and n and "%" not in n and "/" not in n
                        else escape_segment(n)
                        for n, _ in child_items(obj, node.key)
                    }
                    for seg in sorted(wanted - present):
                        m.deferrals.append((obj, unescape_segment(seg), node.key))

    def mark_consumed(self, key: str, var: Variable | PartitionedVariable) -> None:
        """Record that ``var`` took the stored value ``key``."""
        self.consumed_keys.add(key)
        self._matched[id(var)] = weakref.ref(var)

    def carry_match(self, old: Any, new: Any) -> None:
        """``new`` holds the value this restore gave ``old`` (an object copied it):
        matched when ``old`` is."""
        if self.matched(old):
            self._matched[id(new)] = weakref.ref(new)

    def carrier(self) -> Callable[[Any, Any], None]:
        """:meth:`carry_match` through a weak reference (the objects keep it past the
        restore; the status keeps this state alive)."""
        ref = weakref.ref(self)

        def carry(old: Any, new: Any) -> None:
            state = ref()
            if state is not None:
                state.carry_match(old, new)

        return carry

    def restore_nodes(self, nodes: list[Node]) -> None:
        """Restore everything under ``nodes`` now and defer what is missing."""
        with self.lock, paused_gc():
            m = self._match(nodes)
            decoded = [(k, t, decode_state(self.states[k], k, self.path, self.tuples.get(k)))
                       for k, t in m.states]
            apply_targets(self.reader, list(map(_key_target, m.variables)), self.infos,
                          verify=self.verify, cast=self.cast, box_reader=self.box_reader)
            self._settle(m, decoded)

    def _settle(self, m: Any, decoded: list[tuple[str, Any, Any]]) -> None:
        """After the values went in: Python states, what was consumed, the deferrals."""
        for key, trackable, stored in decoded:
            # a namedtuple takes its type from the object's own state
            state = stored if key not in self.tuples else with_namedtuples(
                stored, _own_state(trackable), self.namedtuples.get(key), key)
            restore_python_state(trackable, state)
        if self.restored is not None:
            self.restored.note(self._exact(m.variables))
        self.consumed_keys.update(map(_key_of, m.variables))  # mark_consumed, in bulk (in C)
        objs = list(map(_object_of, m.variables))
        self._matched.update(zip(map(id, objs), map(weakref.ref, objs), strict=True))
        for key, trackable, _ in decoded:
            self.consumed_states.add(key)
            self._matched[id(trackable)] = weakref.ref(trackable)
        for parent, name, parent_key in m.deferrals:
            defer_restore(parent, name, Deferred(self, parent_key))
            self.pending += 1

    def _exact(self, matched: list[tuple[str, Any, Any]]) -> list[tuple[Any, ...]]:
        """``(key, target, ...)`` of the values restored bit for bit (with ``cast``, those
        of the stored dtype: a converted value's bytes are not the stored ones)."""
        if not self.cast:
            return matched
        infos = self.infos
        return [(k, t) for k, t, _ in matched if np.dtype(infos[k].dtype) == np.dtype(t.dtype)]

    def on_attach(self, parent_key: str, name: str, child: Any, parent: Any = None) -> None:
        with self.lock:
            self.pending -= 1
            seg = escape_segment(name)
            key = f"{parent_key}/{seg}" if parent_key else seg
            if parent is not None and is_framework_object(child):  # as the walk meets it
                child = dict(child_items(parent, parent_key)).get(name, child)
            whole = child if isinstance(child, RestoredWhole) and child.restored_on_attach \
                else None
            try:
                with paused_gc():
                    if whole is None:
                        self.restore_nodes(walk(child, key))
                        return
                    blob = self.states.get(key)
                    whole.begin_restore(key, None if blob is None else decode_state(
                        blob, key, self.path), self.infos)
                    ok = False
                    try:
                        self.restore_nodes(walk(child, key))
                        ok = True
                    finally:
                        end_restores([whole], ok=ok)
            finally:
                self.release_reader()

    # -- accounting -------------------------------------------------------------------
    def matched(self, obj: Any) -> bool:
        ref = self._matched.get(id(obj))
        return ref is not None and ref() is obj

    def unused(self) -> list[str]:
        """Stored values (keys and Python states) no object has taken yet."""
        consumed = self.consumed_keys
        # (the common case, every key taken, in one pass in C)
        keys = [] if consumed.issuperset(self.infos) else [
            k for k in self.infos if k not in consumed]
        keys += [f"{k} (Python state)" for k in self.states if k not in self.consumed_states]
        return keys

    def consumed(self) -> list[str]:
        """Stored values (keys and Python states) objects have taken so far."""
        return [*self.consumed_keys, *(f"{k} (Python state)" for k in self.consumed_states)]

    def _own_counter(self, node: Node, root: Any) -> bool:
        """The root's ``save_counter`` while the file holds none (not expected, like TF's read)."""
        return not self.has_save_counter and node.parent is root and node.name == "save_counter"

    def unmatched_objects(self) -> list[str]:
        """Existing variables and stateful trackables under the root with no stored value."""
        root = self._root() if self._root is not None else None
        if root is None:
            return []
        out = []
        for node in walk(root):
            obj = node.obj
            if isinstance(obj, Variable | PartitionedVariable):
                if not self.matched(obj) and not self._own_counter(node, root):
                    out.append(f"{node.key} (variable {obj.name!r})")
            elif (
                isinstance(obj, Trackable)
                and node.first
                and node.parent is not None
                and not self.matched(obj)
                and python_state(obj) is not None
            ):
                out.append(f"{node.key} (Python state of {type(obj).__name__})")
        return list(dict.fromkeys(out))


def _own_state(obj: Trackable) -> Any:
    """``python_state(obj)`` before the restore, where the types of its namedtuples come
    from; ``None`` when it has none to give (it raises: it is not set up yet)."""
    try:
        return python_state(obj)
    except Exception:  # noqa: BLE001 - then no type is given, and the restore says so
        return None


def _open_reader(path: Any, storage_options: Mapping[str, Any] | None) -> Reader:
    if isinstance(path, Path):
        return backend_for(path).open_reader(path)
    from ._files import open_checkpoint_reader  # noqa: PLC0415 - a committed step at a URL

    return open_checkpoint_reader(path, storage_options)  # type: ignore[no-any-return]


class _ReleasedInfos(Mapping[str, ArrayInfo]):
    """A released restore's ``{key: ArrayInfo}``: the keys, in order; an ``ArrayInfo``
    is read from the file again if one is ever asked for (the record is not kept)."""

    __slots__ = ("_keys", "_open", "_set")

    def __init__(self, keys: list[str], known: frozenset[str],
                 open_reader: Callable[[], Reader]) -> None:
        self._keys, self._set, self._open = keys, known, open_reader

    def __getitem__(self, key: str) -> ArrayInfo:
        if key not in self._set:
            raise KeyError(key)
        with contextlib.closing(self._open()) as reader:
            return reader.info(key)

    def __contains__(self, key: object) -> bool:
        return key in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _close(reader: Reader | None) -> None:
    if reader is not None:
        with contextlib.suppress(Exception):
            reader.close()


class Deferred:
    """The handler a restore leaves on a trackable for a child that does not exist yet."""

    __slots__ = ("parent_key", "state")

    def __init__(self, state: RestoreState, parent_key: str) -> None:
        self.state = state
        self.parent_key = parent_key

    def __call__(self, parent: Trackable, name: str, child: Any) -> None:
        self.state.on_attach(self.parent_key, name, child, parent)
