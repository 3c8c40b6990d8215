"""Incremental saves: what a new step may take from the last one, and what pruning must keep.

Owns :class:`Incremental`, a ``CheckpointManager``'s memory of its last committed step
(its file name and the version of every ``cv.Variable`` whose value it holds; of a
partitioned variable saved as one value, its parts' versions), which turns
into an :class:`IncrementalSave` for each save: the base step and, per key, whether the
value is known unchanged since (same variable, same version) or known changed; the storage
layer compares the rest by block checksums. And :func:`held`: which of the files a prune
would delete are still referred to by a kept step (an HDF5 step's external values, or
those of a multi-process step's per-process files; on an object store, an HDF5 step's
values in older steps' objects), so the manager keeps them until no
kept step does (docs/checkpoints.md, "Incremental checkpoints"). With several processes,
each has its own :class:`Incremental` and takes rank 0's base (:meth:`IncrementalSave.on`).
A restore teaches it too: :class:`Restored` is what a restore set (the step, and the
version of each variable that now holds that step's bytes), which the manager hands to
:meth:`Incremental.learn` at its next save, so the first save after a restart is
incremental like any other (a restore made before the manager was built too:
:meth:`Restored.track`).

>>> inc = Incremental()
>>> inc.start(None, {}).known
{}
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CkptError
from ..storage import DeltaLimits, external_files
from ..variables import (
    Variable,
    is_materialized,
    read_buffer,
    rows_written,
    track_rows,
    write_counts,
    write_version,
)
from ._logical import Logical

__all__ = ["Incremental", "IncrementalSave", "Restored", "held", "missing_references"]

logger = logging.getLogger("ckptvar")


@dataclass
class IncrementalSave:
    """One incremental save: its base step, what is known about each value, the versions."""

    base: Path | str | None  # a local path, or the URL of a step on an object store
    known: dict[str, bool]
    versions: dict[str, Any] = field(default_factory=dict)
    owner: Incremental | None = None
    #: The changed variables and their versions at the base: key -> (variable, version)
    #: (:meth:`changed_rows`; a partitioned variable assembled whole: its parts').
    changed: dict[str, tuple[Variable | Logical, Any]] = field(default_factory=dict)
    #: A pruned step set aside for this save to take over (a local Zarr manager's;
    #: ``checkpoint/_files.set_aside``).
    spare: Path | None = None
    #: The row delta rule's limits (the manager's ``cv.IncrementalOptions``; None: default).
    limits: DeltaLimits | None = None

    def changed_rows(self) -> dict[str, Any]:
        """The changed variables whose written rows are known: key -> the sorted first-axis
        indices written since the base (such a value may be stored as a row delta).

        Ask once the values are read (the snapshot taken): a write that landed after
        :meth:`Incremental.start` is then in the answer, so the rows cover every row
        that differs from the base (an answer may hold more rows, never fewer).
        """
        out = {}
        for key, (var, before) in self.changed.items():
            rows = _rows_since(var, before)
            if rows is not None and rows.size:
                out[key] = rows
        return out

    def on(self, base: Path | str | None) -> IncrementalSave:
        """This save on ``base`` (a multi-process save takes rank 0's base; ``None``:
        none): what is known, and the rows written since, hold only for the step they
        were known for; on another, every value is compared and none is a row delta."""
        same = (base is not None and self.base is not None
                and _name(base) == _name(self.base))
        return IncrementalSave(base, self.known if same else {}, self.versions, self.owner,
                               self.changed if same else {}, limits=self.limits)

    def committed(self, path: str | os.PathLike[str]) -> None:
        """The step is durable: the next save builds on it."""
        if self.owner is not None:
            self.owner.remember(_name(path), self.versions, whole=self.base is None)


class Incremental:
    """A manager's last committed step and the variables' versions it holds (``limits``:
    the row delta rule's, handed to each save)."""

    def __init__(self, limits: DeltaLimits | None = None) -> None:
        self._name: str | None = None
        self._versions: dict[str, Any] = {}
        self.limits = limits
        #: steps committed since the last one written whole (None: not known)
        self._since_whole: int | None = None

    def remember(self, name: str, versions: dict[str, Any], *, whole: bool = False) -> None:
        """The step ``name`` committed, holding ``versions`` (``whole``: it built on no
        step)."""
        self._name, self._versions = name, versions
        if whole:
            self._since_whole = 0
        elif self._since_whole is not None:
            self._since_whole += 1

    def learn(self, name: str | None, versions: Mapping[str, Any]) -> None:
        """A restore set the variables of ``versions`` (key -> version right after it) to
        the values of this manager's step ``name`` (None: a step not this manager's).

        Of the step this manager remembers, the restored values are added; of another,
        the memory is the restored values alone (what was known held for the other
        step); from a step not this manager's, the restored keys are forgotten (compared
        by checksums). When the last whole step was is not changed (``whole_due``).
        """
        if name is None:
            self._versions = {k: v for k, v in self._versions.items() if k not in versions}
        elif name == self._name:
            self._versions = {**self._versions, **versions}
        else:
            self._name, self._versions = name, dict(versions)

    def whole_due(self, every: int) -> bool:
        """Whether the next step is the ``every``-th since the last whole one (or this
        manager does not know when that was: none committed since it started)."""
        return self._since_whole is None or self._since_whole + 1 >= every

    def start(self, base: Path | str | None, variables: Mapping[str, Any], *,
              spare: Path | None = None) -> IncrementalSave:
        """The save of ``variables`` (key -> ``cv.Variable`` or a logical value) on ``base``
        (``spare``: a pruned step it may take over, :class:`IncrementalSave`).

        Call before the values are read: a write that lands after is counted as a change.
        """
        versions: dict[str, Any] = {}
        tracked: dict[str, Variable | Logical] = {}
        for key, var in variables.items():
            version = _version(var)
            if version is not None:
                versions[key] = version
                tracked[key] = var
        known: dict[str, bool] = {}
        changed: dict[str, tuple[Variable | Logical, Any]] = {}
        if base is not None and _name(base) == self._name:
            old = self._versions
            for key, now in versions.items():
                before = old.get(key)
                if before is None:
                    continue
                var = tracked[key]
                if before != now and _no_rows(_rows_since(var, before)):
                    before = now  # written, but no row (``scatter_update`` of no index)
                known[key] = before == now
                if before != now:
                    changed[key] = (var, before)
        return IncrementalSave(base, known, versions, self, changed, spare, self.limits)


class Restored:
    """What a restore of the step at ``path`` set: key -> the version, right after the
    restore, of the value (a ``cv.Variable``, or a partitioned variable's parts) that now
    holds exactly the step's bytes of ``key`` (:meth:`note`, :attr:`versions`). A value
    restored later (restore on create) is noted when set.

    Every restore notes (a path, and a version and a weak reference per value: nothing
    is copied). While ``tracking`` (an incremental manager is built on the checkpoint)
    the rows written since are tracked from the restore on; a note taken before is taken
    up by :meth:`track` when the manager is built: rows are tracked from then on, so the
    rows of a value written between the restore and then are not known (it is compared
    by its checksums or written whole, never patched on a guess).

    >>> Restored("runs/ckpt-3.h5").versions
    {}
    """

    __slots__ = ("_batches", "_untracked", "_versions", "path", "tracking")

    def __init__(self, path: str | os.PathLike[str], *, tracking: bool = True) -> None:
        self.path = os.fspath(path)
        self.tracking = tracking
        self._versions: dict[str, Any] = {}
        #: plain variables noted while not tracking, as a restore gave them (keys, weak
        #: references, write counts), folded into :attr:`versions` when asked for
        self._batches: list[tuple[list[str], list[weakref.ref[Variable]], list[int]]] = []
        #: key -> (whether a partitioned value, its parts) of the values noted while not
        #: tracking: :meth:`track` takes them up (weak: a dropped variable is let go)
        self._untracked: dict[str, tuple[bool, tuple[weakref.ref[Variable], ...]]] = {}

    @property
    def versions(self) -> dict[str, Any]:
        """key -> the version of the value that holds the step's bytes of ``key``, as of
        right after the restore."""
        self._fold()
        return self._versions

    def note(self, values: Iterable[tuple[Any, ...]]) -> None:
        """The values ``(key, variable or logical value, ...)`` now hold the stored bytes
        of their keys (none cast). A value of one shard (a multi-process restore's) is
        noted as its variable, which a multi-process save writes."""
        values = values if isinstance(values, list) else list(values)
        if not self.tracking and self._noted_plain(values):
            return
        for key, given, *_ in values:
            target = given
            if (isinstance(given, Logical) and len(given.parts) == 1
                    and isinstance(given.parts[0], Variable)
                    and given.parts[0].shard is not None):
                target = given.parts[0]
            parts = target.parts if isinstance(target, Logical) else (target,)
            if not all(isinstance(p, Variable) and write_version(p) is not None
                       for p in parts):
                continue  # compared by checksums (a GPU tensor's stays unmaterialized)
            if not self.tracking:
                version = _version(target, track=False)
                if version is not None:
                    self._versions[key] = version
                    self._untracked[key] = (isinstance(target, Logical),
                                            tuple(map(weakref.ref, parts)))
                continue
            for part in parts:  # a value restored into a variable not materialised
                if not is_materialized(part):  # becomes its buffer now (no copy on the
                    read_buffer(part)  # CPU), not at its first use (a whole write then)
            version = _version(target)
            if version is not None:
                self._versions[key] = version

    def _noted_plain(self, values: list[tuple[Any, ...]]) -> bool:
        """Note ``values`` as a batch when every one is a plain variable (a restore's
        common case, many values: in C, no call per value); else fold the batches so
        far (a later note of a key replaces an earlier one) and say no."""
        targets = list(map(_SECOND, values))
        if all(map(operator.is_, map(type, targets), repeat(Variable))):
            self._batches.append((list(map(_FIRST, values)), list(map(weakref.ref, targets)),
                                  write_counts(targets)))
            return True
        self._fold()
        return False

    def _fold(self) -> None:
        """Fold the plain variables noted in batches into :attr:`versions`."""
        batches, self._batches = self._batches, []
        for keys, refs, counts in batches:
            for key, ref, count in zip(keys, refs, counts, strict=True):
                var = ref()
                now = None if var is None else write_version(var)
                if now is None:  # gone, or its buffer handed out (unknown since)
                    self._versions.pop(key, None)
                    self._untracked.pop(key, None)
                    continue
                self._versions[key] = (now[0], count)
                self._untracked[key] = (False, (ref,))

    def track(self) -> None:
        """Note as an incremental manager needs from now on, and take up what was noted
        before: each part still at its restored version has its rows tracked from now
        (a part not materialised yet takes the restored array as its buffer, as
        :meth:`note` does), so its rows written since the restore are known; a part
        written since keeps its restored version, with its rows not known; a value
        whose variable is gone is forgotten."""
        self._fold()
        self.tracking = True
        untracked, self._untracked = self._untracked, {}
        for key, (logical, refs) in untracked.items():
            parts = [ref() for ref in refs]
            noted = self._versions.get(key)
            if noted is None or any(p is None for p in parts):
                self._versions.pop(key, None)
                continue
            now = []
            for part, was in zip(parts, noted if logical else (noted,), strict=True):
                assert part is not None
                version = was
                if write_version(part) == was and not is_materialized(part):
                    read_buffer(part)  # the restored array, adopted: one write, no copy
                    version = write_version(part)
                track_rows(part)
                now.append(version)
            self._versions[key] = tuple(now) if logical else now[0]


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _version(var: Any, *, track: bool = True) -> Any:
    """The version of a value to save (:func:`write_version`; a partitioned variable
    assembled whole: its parts' in order; None: unknown), its rows tracked from now on
    (unless not ``track``)."""
    if isinstance(var, Variable):
        if track:
            track_rows(var)  # from now on its writes say which rows they touch
        return write_version(var)
    if not isinstance(var, Logical) or not var.parts or any(
            not isinstance(p, Variable) or p.shard is not None for p in var.parts):
        return None  # a shard's parts are boxes of their own: compared by checksums
    versions = []
    for part in var.parts:
        if track:
            track_rows(part)
        version = write_version(part)
        if version is None:
            return None
        versions.append(version)
    return tuple(versions)


def _rows_since(var: Variable | Logical, before: Any) -> np.ndarray | None:
    """The rows (first-axis indices of the whole value) written since ``before``; None:
    not known. A part's row ``r`` is the value's row ``r`` + the part's first offset."""
    if isinstance(var, Variable):
        return rows_written(var, before)
    if (not isinstance(before, tuple) or len(before) != len(var.parts)
            or not all(isinstance(was, tuple) for was in before)):
        return None  # the key held another kind of value at the base
    rows = []
    for part, was in zip(var.parts, before, strict=True):
        got = rows_written(part, was)
        if got is None:
            return None
        rows.append(got + int(part.logical_box.offset[0]) if got.size else got)
    return np.unique(np.concatenate(rows))


def _no_rows(rows: Any) -> bool:
    """Whether the writes since a version are known to have touched no row."""
    return rows is not None and not rows.size


def _name(path: str | os.PathLike[str]) -> str:
    """A step's name: the last part of its path or URL."""
    return os.fspath(path).rstrip("/").rpartition("/")[2]


#: ``external_files`` by (path, inode, size, mtime): a committed step never changes.
_REFS: dict[tuple[str, int, int, int], frozenset[str]] = {}
#: Steps ``_REFS`` holds at most (a manager's kept and held steps, with room to spare).
_REFS_KEPT = 64
_REFS_LOCK = threading.Lock()  # managers' saves and prunes may look at once (threads)


def missing_references(path: Path) -> list[str]:
    """The steps beside the committed local step ``path`` that it refers to and that are
    gone (deleted by hand): a step built on it would name bytes that are not there."""
    try:
        refs = _references(path)
    except (CkptError, OSError):
        return []  # (the writer reads the base itself, and says why it cannot)
    return sorted(r for r in refs if r and not os.path.lexists(path.parent / r))


def _references(path: Path) -> frozenset[str]:
    st = os.stat(path)
    ident = (os.fspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _REFS_LOCK:
        refs = _REFS.get(ident)
    if refs is None:
        refs = frozenset(external_files(path))
        with _REFS_LOCK:
            while len(_REFS) >= _REFS_KEPT:  # the oldest first: pruned steps are not asked again
                del _REFS[next(iter(_REFS))]
            _REFS[ident] = refs
    return refs


def held(directory: Any, kept: Iterable[str], doomed: Iterable[str],
         references: Callable[[str], frozenset[str]] | None = None) -> dict[str, list[str]]:
    """Of the file names ``doomed``, those a step in ``kept`` refers to, with its referrers.

    A doomed step that is held is kept whole, so what it refers to is held in turn (every
    file left on disk stays loadable). A step that cannot be read is taken to refer to
    everything doomed (nothing it may need is deleted on a guess); one that is gone
    refers to nothing. ``references(name)``: the steps ``name`` refers to (default: read
    from the file ``directory / name``; an object store's steps are read by the caller).
    """
    refer = references or (lambda name: _references(directory / name))
    gone = frozenset(doomed)
    out: dict[str, list[str]] = {}
    todo = list(kept)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            refs = refer(name)
        except FileNotFoundError:
            continue
        except (CkptError, OSError) as exc:
            logger.warning("Keeping every pruned step: cannot read %s in %s (%s).",
                           name, directory, exc)
            refs = gone
        for ref in sorted(refs & gone):
            out.setdefault(ref, []).append(name)
            todo.append(ref)  # held whole: what it refers to stays too
    return {ref: sorted(by) for ref, by in out.items()}
