"""Restore on create: ``with cv.restore_on_create(path):`` matches new variables by name.

Variables created inside the block whose name is stored in the file take the
stored value through a creation hook, and their initializer never runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ..variables import Variable, register_creation_hook
from ._apply import apply_values
from ._object_restore import RestoreState
from ._status import RestoreStatus

__all__ = ["restore_on_create"]


@contextlib.contextmanager
def restore_on_create(
    path: str | Path, *, verify: bool = True, cast: bool = False
) -> Iterator[RestoreStatus]:
    """Variables created inside the block whose name is stored in ``path`` take that value.

    Matches the stored variable names (the ``name`` attribute of every value, in
    ``Checkpoint`` and ``Saver`` files alike) against ``cv.Variable(..., name=...)``
    and ``cv.get_variable``; the initializer of a matched variable never runs. Yields
    a :class:`RestoreStatus` whose ``assert_consumed()`` checks that every stored
    value found its variable. ``cast=True`` converts a stored dtype to the variable's
    under the same_kind rules (float16 -> float32, ...), with a warning naming it.
    """
    state = RestoreState(path, verify=verify, cast=cast)
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
            apply_values(state.reader, [(key, var)], state.infos, verify=verify, cast=cast)
            state.mark_consumed(key, var)

    handle = register_creation_hook(hook)
    try:
        yield RestoreStatus(state, warn_unused=False)
    finally:
        handle.remove()
        state.pending = 0
        state.release_reader()
