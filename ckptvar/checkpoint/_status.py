"""What a restore reports: :class:`RestoreStatus`, its assertions and its warnings.

The status answers for one restore (``Checkpoint.restore`` or
``restore_on_create``): which stored values found no object, which existing
objects found no value. The "values left unused" warning belongs to the restore
itself, not to the status (as in TensorFlow): it is given once, when the restore
ends (its status is gone and no value is waiting for its object any more) with
values unused, unless :meth:`RestoreStatus.expect_partial` or an assertion was
called. A value still waiting for an object that may yet be created is not unused.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Protocol

from ..errors import MissingKeyError, RestoreAssertionError

__all__ = ["RestoreStatus", "listing", "missing_keys_error", "warn_unused"]

logger = logging.getLogger("ckptvar")


class Accounting(Protocol):
    """What a status asks of the restore it reports on."""

    path: Any
    silenced: bool

    def unused(self) -> list[str]: ...

    def unmatched_objects(self) -> list[str]: ...

    def consumed(self) -> list[str]: ...


def listing(items: list[str], limit: int = 50) -> str:
    """``a, b, c, ... (N more)``: at most ``limit`` items, then a count."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def warn_unused(path: Any, unused: list[str]) -> None:
    """The one warning for stored values no object took (logged where it cannot be raised)."""
    msg = (
        f"Restore from {str(path)!r} left {len(unused)} stored value(s) unused: "
        f"{listing(unused, 10)}. Call expect_partial() on the status to silence this, or "
        "keep the status and call assert_consumed() once every object exists."
    )
    try:
        warnings.warn(msg, UserWarning, stacklevel=3)
    except Warning:  # warnings are errors here, and a finalizer cannot raise: log it
        logger.warning(msg)


def missing_keys_error(missing: list[str], path: Any) -> MissingKeyError:
    """The error of a name-based restore whose keys are not all in the file."""
    return MissingKeyError(
        f"{len(missing)} variable(s) not found in {str(path)!r}: "
        f"{listing([repr(k) for k in missing])}; nothing was restored."
    )


class RestoreStatus:
    """What a restore matched; returned by ``Checkpoint.restore``.

    Values consumed later (variables created after the restore) count too. If the
    restore ends (this status is dropped and no value waits for an object any more)
    while stored values are still unused, and neither :meth:`expect_partial` nor an
    assertion was called, a ``UserWarning`` is issued once.
    """

    def __init__(
        self, state: Accounting | None, *, root: Any = None, warn_unused: bool = True
    ) -> None:
        self._state = state
        self._root = root  # the state holds it weakly; the status keeps it alive
        if state is not None:  # a restore that failed before its status existed says nothing
            state.silenced = not warn_unused

    @property
    def path(self) -> str | None:
        """The checkpoint this status is about."""
        return None if self._state is None else str(self._state.path)

    def _require_state(self) -> Accounting:
        if self._state is None:
            raise RestoreAssertionError("No checkpoint was restored (the path was None).")
        self._state.silenced = True
        return self._state

    def assert_consumed(self) -> RestoreStatus:
        """Every stored value went to an object, and every existing object got a value."""
        state = self._require_state()
        unused, unmatched = state.unused(), state.unmatched_objects()
        if unused or unmatched:
            parts = []
            if unused:
                parts.append(f"values in the checkpoint with no object: {listing(unused)}")
            if unmatched:
                parts.append(f"objects with no value in the checkpoint: {listing(unmatched)}")
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
                f"{listing(unmatched)}."
            )
        return self

    def assert_nontrivial_match(self) -> RestoreStatus:
        """Some stored value other than the save counter went to an object (TensorFlow's:
        not only the root matched); values taken by objects created later count too."""
        state = self._require_state()
        if not [key for key in state.consumed() if key != "save_counter"]:
            raise RestoreAssertionError(
                f"Restore from {str(state.path)!r} matched nothing but the save counter: no "
                "stored value went to an object (are the checkpoint's object paths or the "
                "variable names those of this program?)."
            )
        return self

    def expect_partial(self) -> RestoreStatus:
        """Silence the warning about unused values."""
        if self._state is not None:
            self._state.silenced = True
        return self

    def __repr__(self) -> str:
        return f"<RestoreStatus {self.path!r}>"
