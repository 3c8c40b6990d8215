"""Restore on create: ``with cv.restore_on_create(path):`` matches new variables by name.

Variables created inside the block whose name is stored in the file take the
stored value through a creation hook, and their initializer never runs. The parts
``name/part_i`` of a partitioned variable (``get_variable(..., partitioner=)``) whose
logical ``name`` is stored take their own box of the stored value, whatever its layout;
so does a variable holding a ``Shard`` of a stored logical variable.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import dtype_name
from ..errors import CheckpointMismatchError
from ..variables import (
    Variable,
    is_materialized,
    register_creation_hook,
    set_initial_value_source,
)
from ._collective_restore import Staged, stage_reads
from ._logical import (
    BoxRead,
    Logical,
    apply_targets,
    as_target,
    check_logical,
    mismatch_error,
    read_boxes,
)
from ._object_restore import RestoreState
from ._status import RestoreStatus

__all__ = ["restore_on_create"]


@contextlib.contextmanager
def restore_on_create(  # noqa: C901, PLR0915 - the context manager's whole lifecycle in one place
    path: str | Path,
    *,
    verify: bool = True,
    cast: bool = False,
    coordinator: Any = None,
    timeout: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[RestoreStatus]:
    """Variables created inside the block whose name is stored in ``path`` take that value.

    Matches the stored variable names (the ``name`` attribute of every value, in
    ``Checkpoint`` and ``Saver`` files alike) against ``cv.Variable(..., name=...)``
    and ``cv.get_variable``; the initializer of a matched variable never runs. Yields
    a :class:`RestoreStatus` whose ``assert_consumed()`` checks that every stored
    value found its variable. ``cast=True`` converts a stored dtype to the variable's
    under the same_kind rules (float16 -> float32, ...), with a warning naming it.

    With ``coordinator`` (more than one process), every process runs the block and
    creates the same variables in the same order: each matched variable (or each
    group of parts, once their boxes are known) is a collective step in which every
    process reads only its own box and votes; if any process cannot restore it, every
    process raises ``DistributedError`` and no variable takes a stored value.
    ``timeout`` bounds each step. ``path`` may be an object-store URL (a committed step),
    with ``storage_options`` for its client, as for ``Checkpoint.restore``.
    """
    if coordinator is not None and coordinator.size > 1:
        with _collective(path, verify=verify, cast=cast, coord=coordinator,
                         timeout=timeout, storage_options=storage_options) as status:
            yield status
        return
    state = RestoreState(path, verify=verify, cast=cast, storage_options=storage_options)
    by_name: dict[str, str] = {}
    for key, info in state.infos.items():
        name = info.attrs.get("name")
        by_name.setdefault(name if isinstance(name, str) else key, key)
    state.pending = 1
    if "save_counter" in state.infos and state.has_save_counter:
        # a Checkpoint's own counter: restored by name if one is created, never required
        state.consumed_keys.add("save_counter")

    parts: list[tuple[str, Variable]] = []  # materialised parts waiting for their box

    def take_box(key: str, var: Variable) -> np.ndarray:
        """``var``'s box of the stored value ``key`` (its slice info is set by now)."""
        box = var.logical_box
        logical = logical_of_part(var)
        with state.lock:
            info = state.infos[key]
            problems = check_logical([(key, logical)], lambda _: (info.shape, info.dtype),
                                     state.path, cast=cast)
            if problems:
                raise mismatch_error(state.path, problems)
            if np.dtype(info.dtype) != np.dtype(var.dtype):
                warnings.warn(
                    f"Restore from {str(state.path)!r} cast 1 stored value(s) to their "
                    f"variables' dtypes (cast=True): {key!r} ({dtype_name(info.dtype)} -> "
                    f"{dtype_name(var.dtype)}) for {var.name!r}.", UserWarning, stacklevel=2)
            out = np.empty(tuple(box.shape), var.dtype)
            read_boxes(state.reader, [BoxRead(key, tuple(box.offset), out.shape, out)],
                       verify=verify)
            state.mark_consumed(key, var)
        return out

    def restore_parts() -> None:
        with state.lock:
            ready = [(k, v) for k, v in parts if v.save_slice_info is not None]
            parts[:] = [(k, v) for k, v in parts if v.save_slice_info is None]
            if ready:
                apply_targets(state.reader, [(k, logical_of_part(v)) for k, v in ready],
                              state.infos, verify=verify, cast=cast)
                for k, v in ready:
                    state.mark_consumed(k, v)

    def hook(var: Variable) -> None:
        restore_parts()  # parts made earlier know their boxes now
        key = by_name.get(var.name)
        if key is not None:
            with state.lock:
                target = as_target(var)
                apply_targets(state.reader, [(key, target)], state.infos, verify=verify,
                              cast=cast)
                state.mark_consumed(key, var)
            return
        match = _PART.fullmatch(var.name)
        key = by_name.get(match.group(1)) if match else None
        if key is None:
            return
        _check_part_fits(state, key, var)
        if is_materialized(var):  # made from a concrete value: restored once its box is known
            parts.append((key, var))
        else:  # read when first needed; the initializer never runs
            set_initial_value_source(var, functools.partial(take_box, key, var))
            pending_sources.append(var)

    pending_sources: list[Variable] = []
    handle = register_creation_hook(hook)
    try:
        yield RestoreStatus(state, warn_unused=False)
        restore_parts()
        for var in pending_sources:  # read now, while the file is open
            var.initialize()
    finally:
        handle.remove()
        state.pending = 0
        state.release_reader()


_PART = re.compile(r"(.+)/part_[0-9]+")


def logical_of_part(var: Variable) -> Logical:
    box = var.logical_box
    return Logical(box.name, tuple(box.full_shape), np.dtype(var.dtype), (var,))


def _check_part_fits(state: RestoreState, key: str, var: Variable) -> None:
    """Refuse a part that cannot be a box of the stored value, before it takes a source.

    (Its offset is set just after creation; the full check runs when it is read.)
    """
    info = state.infos[key]
    stored, shape = tuple(info.shape), tuple(var.shape or ())
    if len(stored) != len(shape) or any(
            s is None or s > t for s, t in zip(shape, stored, strict=True)) or sum(
            s != t for s, t in zip(shape, stored, strict=True)) > 1:
        problem = (f"{key!r} (partition {var.name!r}): a part of shape {shape} cannot be a "
                   f"box of the stored shape {stored}")
        raise mismatch_error(state.path, [problem])


@contextlib.contextmanager
def _collective(
    path: str | Path, *, verify: bool, cast: bool, coord: Any, timeout: float | None,
    storage_options: Mapping[str, Any] | None,
) -> Iterator[RestoreStatus]:
    """``restore_on_create`` on every rank of ``coord``: each restore step is voted on."""
    name = os.path.basename(os.fspath(path))
    state: RestoreState | None = None
    failure: BaseException | None = None
    try:
        state = RestoreState(path, verify=verify, cast=cast, storage_options=storage_options)
    except BaseException as exc:  # noqa: BLE001 - reported through the vote
        failure = exc
    coord.vote(failure, tag=f"restore_on_create:{name}:open", timeout=timeout)
    assert state is not None
    steps = _Steps(state, coord, f"restore_on_create:{name}", timeout)
    state.pending = 1
    if "save_counter" in state.infos and state.has_save_counter:
        state.consumed_keys.add("save_counter")
    handle = register_creation_hook(steps.hook)
    try:
        yield RestoreStatus(state, warn_unused=False)
        steps.restore_parts()
        steps.taken.clear()
    finally:
        handle.remove()
        state.pending = 0
        state.release_reader()


class _Steps:
    """The collective steps of one ``restore_on_create`` with a coordinator."""

    def __init__(self, state: RestoreState, coord: Any, tag: str, timeout: float | None) -> None:
        self.state = state
        self.coord = coord
        self.tag = tag
        self.timeout = timeout
        self.by_name: dict[str, str] = {}
        for key, info in state.infos.items():
            stored_name = info.attrs.get("name")
            self.by_name.setdefault(stored_name if isinstance(stored_name, str) else key, key)
        self.parts: list[tuple[str, Variable]] = []  # parts waiting for their box
        self.taken: dict[int, np.ndarray] = {}  # values of parts restored, until first used

    def step(self, items: list[tuple[str, Variable]], what: str) -> None:
        """Read each variable's box, vote, then give every variable its value."""
        state = self.state
        staged = Staged()
        failure: BaseException | None = None
        try:
            with state.lock:
                staged = stage_reads(state.reader, items, state.path, verify=state.verify,
                                     cast=state.cast)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
        self.coord.vote(failure, tag=f"{self.tag}:{what}", timeout=self.timeout)
        lazy = {id(var) for var, _ in staged.values if not is_materialized(var)}
        with state.lock:  # values read in place come from the shared reader
            staged.apply(state.path)
        for var, value in staged.values:  # (a materialised variable copied its value)
            if id(var) in lazy:
                self.taken[id(var)] = value
        for key, var in items:
            state.mark_consumed(key, var)

    def restore_parts(self) -> None:
        ready = [(k, v) for k, v in self.parts if v.save_slice_info is not None]
        if ready:
            self.parts[:] = [(k, v) for k, v in self.parts if v.save_slice_info is None]
            self.step(ready, ready[0][1].name)

    def first_use(self, var: Variable) -> np.ndarray:
        """A part used before the next step: that step runs now (on every process)."""
        self.restore_parts()
        value = self.taken.pop(id(var), None)
        if value is None:
            raise CheckpointMismatchError(
                f"Cannot restore {var.name!r} from {str(self.state.path)!r} with a coordinator: "
                "it was read before its box of the stored value was known."
            )
        return value

    def hook(self, var: Variable) -> None:
        self.restore_parts()  # parts made earlier know their boxes now
        key = self.by_name.get(var.name)
        if key is not None:
            self.step([(key, var)], var.name)
            return
        match = _PART.fullmatch(var.name)
        key = self.by_name.get(match.group(1)) if match else None
        if key is not None:  # its box is known once the partitioner has set it
            self.parts.append((key, var))
            if not is_materialized(var):  # the initializer never runs
                set_initial_value_source(var, functools.partial(self.first_use, var))
