"""Restoring: plan -> validate everything -> apply, the status object, restore-on-create.

A restore first matches the objects that exist to the file's keys (object-graph
paths, including the aliases of shared variables), then checks every dtype and
shape, then reads and checks every value, and only then changes anything:

- a dtype/shape mismatch raises ``CheckpointMismatchError`` listing every one, and
  no variable has changed;
- damage (a checksum that does not match, a truncated file) raises
  ``CorruptCheckpointError`` before any variable has changed: values for variables
  without memory yet are read (verified) into fresh arrays that the variables then
  adopt; values for variables that already hold memory are read into temporaries
  when they total at most :data:`TEMPORARY_BUDGET` bytes, else every one is verified
  first and then read straight into the variables' own buffers (reading the file
  twice, never holding a second copy of a large model).

Values whose objects do not exist yet wait on their parent trackable
(``Trackable._defer``) and are applied when the object is attached — the variable
is born with the stored value and its initializer never runs. The status object
accounts for those later matches too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import dtype_name
from ..errors import CheckpointMismatchError, MissingKeyError, RestoreAssertionError
from ..storage import ArrayInfo, Reader, backend_for
from ..storage._record import paused_gc
from ..trackable import Trackable
from ..variables import Variable, register_creation_hook
from ._keys import escape_segment, unescape_segment
from ._serialize import decode_state, read_graph
from ._walk import Node, walk

__all__ = [
    "TEMPORARY_BUDGET",
    "RestoreState",
    "RestoreStatus",
    "apply_values",
    "restore_on_create",
]

logger = logging.getLogger("ckptvar")

#: Up to this many bytes of values going into existing variables are read into
#: temporaries (one pass over the file); above it, verify first, then read in place.
TEMPORARY_BUDGET = 64 * 2**20


def _shape_matches(var_shape: tuple[int | None, ...] | None, found: tuple[int, ...]) -> bool:
    if var_shape is None:
        return True
    if len(var_shape) != len(found):
        return False
    return all(a is None or a == b for a, b in zip(var_shape, found, strict=True))


def _fmt_shape(shape: Any) -> str:
    return "unknown" if shape is None else str(tuple(shape))


def check_matches(
    pairs: list[tuple[str, Variable]], infos: Mapping[str, ArrayInfo], path: Any
) -> None:
    """Raise ``CheckpointMismatchError`` listing every variable whose stored value differs."""
    problems = []
    fast = getattr(infos, "shape_and_dtype", None)  # a native reader's record: no ArrayInfo
    for key, var in pairs:
        if fast is not None:
            shape, dtype = fast(key)
            if var.shape == shape and var.dtype == dtype:
                continue
        info = infos[key]
        if var.shape == info.shape and var.dtype == info.dtype:
            continue
        if np.dtype(var.dtype) != info.dtype or not _shape_matches(var.shape, info.shape):
            problems.append(
                f"{key!r} (variable {var.name!r}): expected shape {_fmt_shape(var.shape)} "
                f"dtype {dtype_name(var.dtype)}, found shape {_fmt_shape(info.shape)} "
                f"dtype {dtype_name(info.dtype)}"
            )
    if problems:
        raise CheckpointMismatchError(
            f"Cannot restore from {str(path)!r}: {len(problems)} stored value(s) do not match "
            "their variables; nothing was restored. " + "; ".join(problems) + "."
        )


def _read_fresh(reader: Reader, keys: list[str], verify: bool) -> dict[str, np.ndarray]:
    """Each key's value in a fresh array (packed values: views into one verified read)."""
    unique = list(dict.fromkeys(keys))
    return dict(reader.read_many(unique, verify=verify))


def apply_values(
    reader: Reader,
    pairs: list[tuple[str, Variable]],
    infos: Mapping[str, ArrayInfo],
    *,
    verify: bool = True,
    budget: int | None = None,
) -> None:
    """Validate, read and check all values, then assign them (all or nothing).

    ``pairs`` may name one variable under several keys or one key for several
    variables; each variable takes one value.
    """
    check_matches(pairs, infos, reader.path)
    by_var: dict[int, tuple[str, Variable]] = {}
    for key, var in pairs:
        by_var.setdefault(id(var), (key, var))
    fresh: list[tuple[str, Variable]] = []
    in_place: list[tuple[str, Variable, np.ndarray]] = []
    in_place_bytes = 0
    fast = getattr(infos, "shape_and_dtype", None)
    for key, var in by_var.values():
        buf = var._host_buffer() if var._materialized else None
        if buf is not None and buf.shape == (fast(key)[0] if fast else infos[key].shape):
            in_place.append((key, var, buf))  # _host_buffer: C-contiguous and writeable
            in_place_bytes += buf.nbytes
        else:
            fresh.append((key, var))
    budget = TEMPORARY_BUDGET if budget is None else budget
    # Phase 1: everything that can fail.
    if verify and in_place_bytes <= budget:
        fresh += [(key, var) for key, var, _ in in_place]
        in_place = []
    got = _read_fresh(reader, [key for key, _ in fresh], verify) if fresh else {}
    values: list[tuple[Variable, np.ndarray]] = []
    given: set[str] = set()
    for key, var in fresh:
        value = got[key]
        if key in given:  # one stored value for several variables: each gets its own
            value = value.copy()
        given.add(key)
        values.append((var, value))
    bulk = getattr(reader, "read_into_many", None)
    if verify and in_place:
        verify_many = getattr(reader, "verify_many", None)
        if verify_many is not None:
            verify_many([key for key, _, _ in in_place])
        else:
            for key, _, _ in in_place:
                reader.verify(key)
    # Phase 2: change the variables.
    for var, value in values:
        _give(var, value)
    if in_place:  # materialised, hence already initialized
        if bulk is not None:
            bulk([(key, buf) for key, _, buf in in_place], verify=False)
        else:
            for key, _, buf in in_place:
                reader.read(key, out=buf, verify=False)


def _give(var: Variable, value: np.ndarray) -> None:
    if var._materialized:
        var._restore_value(value)
    else:
        var._set_initial_value_source(lambda value=value: value)


# ----------------------------------------------------------------------------------------
# Object-based restore state
# ----------------------------------------------------------------------------------------


@dataclass
class _Match:
    variables: list[tuple[str, Variable]]
    states: list[tuple[str, Trackable]]
    deferrals: list[tuple[Trackable, str, str]]  # (parent, raw child name, parent key)


class RestoreState:
    """One restore: what the file holds, what has been matched, and pending values.

    Kept alive by its :class:`RestoreStatus` and by the deferred handlers it leaves
    on trackables; holds its reader open while values are still pending.
    """

    def __init__(self, path: str | Path, *, root: Any = None, verify: bool = True) -> None:
        self.path = Path(path)
        self.verify = verify
        self._lock = threading.RLock()
        self._reader: Reader | None = backend_for(self.path).open_reader(self.path)
        self._finalizer = weakref.finalize(self, _close, self._reader)
        reader = self._reader
        self.infos: Mapping[str, ArrayInfo] = _infos(reader)
        meta = reader.metadata()
        self.has_save_counter = isinstance(meta, dict) and "save_counter" in meta
        self.alias_to_key, self.states = read_graph(meta, self.path)
        self.alias_to_key = {a: k for a, k in self.alias_to_key.items() if k in self.infos}
        children: dict[str, set[str]] = {}
        for path_key in [*self.infos, *self.alias_to_key, *self.states]:
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

    # -- reader -----------------------------------------------------------------------
    @property
    def reader(self) -> Reader:
        if self._reader is None:
            self._reader = backend_for(self.path).open_reader(self.path)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close, self._reader)
        return self._reader

    def release_reader(self) -> None:
        """Close the file if no value is pending (it is reopened when needed)."""
        if self._reader is not None and self.pending <= 0:
            self._finalizer()
            self._reader = None

    # -- matching ---------------------------------------------------------------------
    def key_for(self, path_key: str) -> str | None:
        if path_key in self.infos:
            return path_key
        return self.alias_to_key.get(path_key)

    def _match(self, nodes: list[Node]) -> _Match:
        m = _Match([], [], [])
        for node in nodes:
            obj = node.obj
            if isinstance(obj, Variable):
                key = self.key_for(node.key)
                if key is not None:
                    m.variables.append((key, obj))
                continue
            if isinstance(obj, Trackable) and node.first:
                if node.key in self.states and node.key != "":
                    m.states.append((node.key, obj))
                wanted = self.children.get(node.key, ())
                if wanted:
                    present = {
                        n if type(n) is str and n and "%" not in n and "/" not in n
                        else escape_segment(n)
                        for n in obj._trackable_children()
                    }
                    for seg in sorted(wanted - present):
                        m.deferrals.append((obj, unescape_segment(seg), node.key))
        return m

    def restore_nodes(self, nodes: list[Node]) -> None:
        """Restore everything under ``nodes`` now and defer what is missing."""
        with self._lock, paused_gc():
            m = self._match(nodes)
            decoded = [(k, t, decode_state(self.states[k], k, self.path)) for k, t in m.states]
            apply_values(self.reader, m.variables, self.infos, verify=self.verify)
            for key, trackable, state in decoded:
                trackable._restore_python_state(state)
            for key, var in m.variables:
                self.consumed_keys.add(key)
                self._matched[id(var)] = weakref.ref(var)
            for key, trackable, _ in decoded:
                self.consumed_states.add(key)
                self._matched[id(trackable)] = weakref.ref(trackable)
            for parent, name, parent_key in m.deferrals:
                parent._defer(name, _Deferred(self, parent_key))
                self.pending += 1

    def on_attach(self, parent_key: str, name: str, child: Any) -> None:
        with self._lock:
            self.pending -= 1
            seg = escape_segment(name)
            key = f"{parent_key}/{seg}" if parent_key else seg
            try:
                with paused_gc():
                    self.restore_nodes(walk(child, key))
            finally:
                self.release_reader()

    # -- accounting -------------------------------------------------------------------
    def matched(self, obj: Any) -> bool:
        ref = self._matched.get(id(obj))
        return ref is not None and ref() is obj

    def unused(self) -> list[str]:
        """Stored values (keys and Python states) no object has taken yet."""
        keys = [k for k in self.infos if k not in self.consumed_keys]
        keys += [f"{k} (Python state)" for k in self.states if k not in self.consumed_states]
        return keys

    def unmatched_objects(self) -> list[str]:
        """Existing variables and stateful trackables under the root with no stored value."""
        root = self._root() if self._root is not None else None
        if root is None:
            return []
        out = []
        for node in walk(root):
            obj = node.obj
            if isinstance(obj, Variable):
                if not self.matched(obj):
                    out.append(f"{node.key} (variable {obj.name!r})")
            elif (
                isinstance(obj, Trackable)
                and node.first
                and node.parent is not None
                and not self.matched(obj)
                and obj._python_state() is not None
            ):
                out.append(f"{node.key} (Python state of {type(obj).__name__})")
        seen: set[str] = set()
        return [x for x in out if not (x in seen or seen.add(x))]


class _LazyInfos(Mapping[str, ArrayInfo]):
    """``{key: ArrayInfo}`` of a native reader, each made when first asked for.

    A native reader answers from its decoded record, even after it is closed.
    """

    __slots__ = ("_keys", "_reader")

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._keys = reader.keys()

    def __getitem__(self, key: str) -> ArrayInfo:
        if key not in self._keys:
            raise KeyError(key)
        return self._reader.info(key)

    def shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        """``(shape, dtype)`` straight from the record (what a restore checks per value)."""
        return self._reader.shape_and_dtype(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _infos(reader: Reader) -> Mapping[str, ArrayInfo]:
    if hasattr(reader, "read_into_many"):  # a native reader: metadata from its record
        return _LazyInfos(reader)
    return {k: reader.info(k) for k in reader.keys()}


def _close(reader: Reader | None) -> None:
    if reader is not None:
        with contextlib.suppress(Exception):
            reader.close()


class _Deferred:
    """The handler a restore leaves on a trackable for a child that does not exist yet."""

    __slots__ = ("parent_key", "state")

    def __init__(self, state: RestoreState, parent_key: str) -> None:
        self.state = state
        self.parent_key = parent_key

    def __call__(self, parent: Trackable, name: str, child: Any) -> None:
        self.state.on_attach(self.parent_key, name, child)


def _listing(items: list[str], limit: int = 50) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class RestoreStatus:
    """What a restore matched; returned by ``Checkpoint.restore``.

    Values consumed later (variables created after the restore) count too. If the
    status is dropped while stored values are still unused, and neither
    :meth:`expect_partial` nor an assertion was called, a ``UserWarning`` is issued
    once.
    """

    def __init__(
        self, state: RestoreState | None, *, root: Any = None, warn_unused: bool = True
    ) -> None:
        self._state = state
        self._root = root  # the state holds it weakly; the status keeps it alive
        self._silenced = not warn_unused

    @property
    def path(self) -> str | None:
        """The checkpoint this status is about."""
        return None if self._state is None else str(self._state.path)

    def _require_state(self) -> RestoreState:
        self._silenced = True
        if self._state is None:
            raise RestoreAssertionError("No checkpoint was restored (the path was None).")
        return self._state

    def assert_consumed(self) -> RestoreStatus:
        """Every stored value went to an object, and every existing object got a value."""
        state = self._require_state()
        unused, unmatched = state.unused(), state.unmatched_objects()
        if unused or unmatched:
            parts = []
            if unused:
                parts.append(f"values in the checkpoint with no object: {_listing(unused)}")
            if unmatched:
                parts.append(f"objects with no value in the checkpoint: {_listing(unmatched)}")
            raise RestoreAssertionError(
                f"Restore from {str(state.path)!r} is incomplete; " + "; ".join(parts) + "."
            )
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        """Every variable and stateful object that exists now got a stored value."""
        state = self._require_state()
        unmatched = state.unmatched_objects()
        if unmatched:
            raise RestoreAssertionError(
                f"Restore from {str(state.path)!r}: objects with no value in the checkpoint: "
                f"{_listing(unmatched)}."
            )
        return self

    def expect_partial(self) -> RestoreStatus:
        """Silence the warning about unused values."""
        self._silenced = True
        return self

    def __del__(self) -> None:
        if self._silenced or self._state is None:
            return
        try:
            unused = self._state.unused()
        except Exception:
            return
        if not unused:
            return
        msg = (
            f"Restore from {str(self._state.path)!r} left {len(unused)} stored value(s) unused: "
            f"{_listing(unused, 10)}. Call expect_partial() on the status to silence this, or "
            "keep the status and call assert_consumed() once every object exists."
        )
        try:
            warnings.warn(msg, UserWarning, stacklevel=2)
        except Warning:  # warnings are errors here, and __del__ cannot raise: log it
            logger.warning(msg)

    def __repr__(self) -> str:
        return f"<RestoreStatus {self.path!r}>"


# ----------------------------------------------------------------------------------------
# Restore on create (by variable name)
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def restore_on_create(path: str | Path, *, verify: bool = True) -> Iterator[RestoreStatus]:
    """Variables created inside the block whose name is stored in ``path`` take that value.

    Matches the stored variable names (the ``name`` attribute of every value, in
    ``Checkpoint`` and ``Saver`` files alike) against ``cv.Variable(..., name=...)``
    and ``cv.get_variable``; the initializer of a matched variable never runs. Yields
    a :class:`RestoreStatus` whose ``assert_consumed()`` checks that every stored
    value found its variable.
    """
    state = RestoreState(path, verify=verify)
    by_name: dict[str, str] = {}
    for key, info in state.infos.items():
        name = info.attrs.get("name")
        by_name.setdefault(name if isinstance(name, str) else key, key)
    state.pending = 1
    if "save_counter" in state.infos and state.has_save_counter:
        # a Checkpoint's own counter: restored by name if one is created, never required
        state.consumed_keys.add("save_counter")

    def hook(var: Variable) -> None:
        key = by_name.get(var.name)
        if key is None:
            return
        with state._lock:
            apply_values(state.reader, [(key, var)], state.infos, verify=verify)
            state.consumed_keys.add(key)
            state._matched[id(var)] = weakref.ref(var)

    handle = register_creation_hook(hook)
    try:
        yield RestoreStatus(state, warn_unused=False)
    finally:
        handle.remove()
        state.pending = 0
        state.release_reader()


def missing_keys_error(missing: list[str], path: Any) -> MissingKeyError:
    return MissingKeyError(
        f"{len(missing)} variable(s) not found in {str(path)!r}: "
        f"{_listing([repr(k) for k in missing])}; nothing was restored."
    )
