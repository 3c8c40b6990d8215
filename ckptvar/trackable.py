"""The trackable protocol: how an object takes part in a checkpoint.

Owns :class:`Trackable`, the base of every object the checkpoint walk visits
(``cv.Module`` and ``cv.Checkpoint`` included). An object takes part through three
small hooks, all optional:

- ``_trackable_children()`` -> an ordered ``{name: child}`` dict. A child is a
  ``cv.Variable``, a ``cv.PartitionedVariable`` (stored as one logical variable),
  another ``Trackable``, or a list/tuple/dict of those (nested
  containers too). The default returns the children registered with
  :meth:`Trackable._track`.
- ``_python_state()`` -> any msgpack-able value (``None``: no state), and
  ``_restore_python_state(state)`` to take it back. This is how an int step
  counter, an RNG state or a config dict is checkpointed.

Deferred restores: a restore that finds a checkpoint value for a child that does
not exist yet leaves a handler on the parent (:meth:`Trackable._defer`); when the
child is attached later with :meth:`Trackable._track`, the handler gives it the
stored value (restore as initialization). This module knows nothing about files.

>>> class Step(Trackable):
...     def __init__(self):
...         self.n = 0
...     def _python_state(self):
...         return {"n": self.n}
...     def _restore_python_state(self, state):
...         self.n = state["n"]
>>> s = Step(); s._restore_python_state({"n": 7}); s.n
7
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Trackable"]

#: A deferred-restore handler: ``handler(parent, name, child)``.
DeferredHandler = Callable[["Trackable", str, Any], None]


class Trackable:
    """Base class of objects with checkpointable children and/or Python state."""

    # Instance bookkeeping lives in ``__dict__`` under these names (created lazily so
    # subclasses need not call ``super().__init__()``).
    _CV_CHILDREN = "_cv_children"
    _CV_DEFERRED = "_cv_deferred"

    # -- children ---------------------------------------------------------------------
    def _trackable_children(self) -> dict[str, Any]:
        """The named children, in the order they were tracked."""
        return dict(self.__dict__.get(self._CV_CHILDREN, {}))

    def _track(self, name: str, value: Any) -> Any:
        """Register ``value`` as the child ``name`` (replacing one of that name); returns it.

        A pending restore for ``name`` is applied to ``value`` here.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"A tracked child needs a non-empty string name, got {name!r}.")
        children = self.__dict__.get(self._CV_CHILDREN)
        if children is None:
            children = {}
            object.__setattr__(self, self._CV_CHILDREN, children)
        children[name] = value
        self._child_attached(name, value)
        return value

    def _untrack(self, name: str) -> None:
        """Forget the child ``name`` (no error if there is none)."""
        self.__dict__.get(self._CV_CHILDREN, {}).pop(name, None)

    # -- Python state -----------------------------------------------------------------
    def _python_state(self) -> Any:
        """A msgpack-able value stored with the checkpoint; ``None`` means no state."""
        return None

    def _restore_python_state(self, state: Any) -> None:
        """Take back a value produced by :meth:`_python_state` (lists come back as lists)."""
        raise TypeError(
            f"{type(self).__name__} stores Python state but does not define "
            "_restore_python_state(state)."
        )

    # -- deferred restores ------------------------------------------------------------
    def _defer(self, name: str, handler: DeferredHandler) -> None:
        """Call ``handler(self, name, child)`` when a child ``name`` is attached.

        The newest handler for a name wins (a later restore supersedes an earlier one).
        """
        deferred = self.__dict__.get(self._CV_DEFERRED)
        if deferred is None:
            deferred = {}
            object.__setattr__(self, self._CV_DEFERRED, deferred)
        deferred[name] = handler

    def _deferred_names(self) -> list[str]:
        """Names of children a restore is still waiting for."""
        return list(self.__dict__.get(self._CV_DEFERRED, {}))

    def _child_attached(self, name: str, value: Any) -> None:
        """Run (once) the pending restore waiting for child ``name``, if any."""
        deferred = self.__dict__.get(self._CV_DEFERRED)
        if deferred:
            handler = deferred.pop(name, None)
            if handler is not None:
                handler(self, name, value)
