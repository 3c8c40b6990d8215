"""The trackable protocol: how an object takes part in a checkpoint.

Owns :class:`Trackable`, the base of every object the checkpoint walk visits
(``cv.Module`` and ``cv.Checkpoint`` included), and the functions the checkpoint
layer calls it through. A user class takes part by overriding, all optional:

- :meth:`Trackable.trackable_children` -> an ordered ``{name: child}`` dict. A child
  is a ``cv.Variable``, a ``cv.PartitionedVariable`` (stored as one logical
  variable), another ``Trackable``, or a list/tuple/dict of those (nested
  containers too). The default returns the children registered with
  :meth:`Trackable.track`.
- :meth:`Trackable.python_state` -> any msgpack-able value (``None``: no state),
  and :meth:`Trackable.restore_python_state` to take it back. This is how an int
  step counter, an RNG state or a config dict is checkpointed.

An object that is not a trackable but has ``state_dict()``/``load_state_dict()`` (a
torch module or optimizer: :class:`SupportsStateDict`, declared here so that the walk
can name one it leaves out) takes part as a checkpoint's own argument.

Deferred restores: a restore that finds a checkpoint value for a child that does
not exist yet leaves a handler on the parent (:meth:`Trackable.defer_restore`);
when the child is attached later with :meth:`Trackable.track`, the handler gives
it the stored value (restore as initialization). This module knows nothing about
files.

The checkpoint layer calls the module functions :func:`trackable_children`,
:func:`python_state`, :func:`restore_python_state` and :func:`defer_restore`, which
dispatch through the object's class, so an attribute of the same name on an
instance (``Checkpoint(python_state=...)``) never hides the protocol. The private
spellings of earlier versions (``_trackable_children``, ``_python_state``,
``_restore_python_state``) are still honoured when a class overrides them, with a
``DeprecationWarning`` naming the class; ``_track``, ``_untrack`` and ``_defer``
remain as aliases.

>>> class Step(Trackable):
...     def __init__(self):
...         self.n = 0
...     def python_state(self):
...         return {"n": self.n}
...     def restore_python_state(self, state):
...         self.n = state["n"]
>>> s = Step(); restore_python_state(s, {"n": 7}); s.n
7
>>> python_state(s)
{'n': 7}
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "SupportsStateDict",
    "Trackable",
    "defer_restore",
    "python_state",
    "restore_python_state",
    "stand_ins",
    "trackable_children",
]

@runtime_checkable
class SupportsStateDict(Protocol):
    """An object whose state is ``state_dict()`` and goes back by ``load_state_dict(sd)``
    (a torch module or optimizer): a checkpoint tracks it as one of its own arguments."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


#: A deferred-restore handler: ``handler(parent, name, child)``.
DeferredHandler = Callable[["Trackable", str, Any], None]

_warned: set[tuple[type, str]] = set()


def _old_override(cls: type, old: str, new: str) -> bool:
    """Whether ``cls`` overrides the deprecated hook ``old`` (warned once per class)."""
    if getattr(cls, old) is getattr(Trackable, old):
        return False
    if (cls, old) not in _warned:
        _warned.add((cls, old))
        warnings.warn(
            f"{cls.__qualname__} overrides {old}(), the private spelling of the trackable "
            f"protocol; override {new}() instead (the old name is still honoured).",
            DeprecationWarning,
            stacklevel=4,
        )
    return True


class Trackable:
    """Base class of objects with checkpointable children and/or Python state."""

    # Instance bookkeeping lives in ``__dict__`` under these names (created lazily so
    # subclasses need not call ``super().__init__()``).
    _CV_CHILDREN = "_cv_children"
    _CV_DEFERRED = "_cv_deferred"

    # -- children ---------------------------------------------------------------------
    def trackable_children(self) -> dict[str, Any]:
        """The named children, in the order they were tracked (override to name others)."""
        if _old_override(type(self), "_trackable_children", "trackable_children"):
            return self._trackable_children()
        return dict(self.__dict__.get(self._CV_CHILDREN, {}))

    def _trackable_children(self) -> dict[str, Any]:
        """Deprecated spelling of :meth:`trackable_children`."""
        if type(self).trackable_children is not Trackable.trackable_children:
            return self.trackable_children()
        return dict(self.__dict__.get(self._CV_CHILDREN, {}))

    def track(self, name: str, value: Any) -> Any:
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

    def untrack(self, name: str) -> None:
        """Forget the child ``name`` (no error if there is none)."""
        self.__dict__.get(self._CV_CHILDREN, {}).pop(name, None)

    # The aliases the library's own subclasses call (``cv.Module``, ``cv.Checkpoint``
    # track their attributes): a user's attribute named ``track`` cannot hide them.
    _track = track
    _untrack = untrack

    # -- Python state -----------------------------------------------------------------
    def python_state(self) -> Any:
        """A msgpack-able value stored with the checkpoint; ``None`` means no state."""
        if _old_override(type(self), "_python_state", "python_state"):
            return self._python_state()
        return None

    def restore_python_state(self, state: Any) -> None:
        """Take back a value produced by :meth:`python_state` (lists come back as lists)."""
        if _old_override(type(self), "_restore_python_state", "restore_python_state"):
            self._restore_python_state(state)
            return
        raise TypeError(
            f"{type(self).__name__} stores Python state but does not define "
            "restore_python_state(state)."
        )

    def _python_state(self) -> Any:
        """Deprecated spelling of :meth:`python_state`."""
        return None

    def _restore_python_state(self, state: Any) -> None:
        """Deprecated spelling of :meth:`restore_python_state`."""
        raise TypeError(
            f"{type(self).__name__} stores Python state but does not define "
            "restore_python_state(state)."
        )

    # -- deferred restores ------------------------------------------------------------
    def defer_restore(self, name: str, handler: DeferredHandler) -> None:
        """Call ``handler(self, name, child)`` when a child ``name`` is attached.

        The newest handler for a name wins (a later restore supersedes an earlier one).
        """
        deferred = self.__dict__.get(self._CV_DEFERRED)
        if deferred is None:
            deferred = {}
            object.__setattr__(self, self._CV_DEFERRED, deferred)
        deferred[name] = handler

    def deferred_names(self) -> list[str]:
        """Names of children a restore is still waiting for."""
        return list(self.__dict__.get(self._CV_DEFERRED, {}))

    def _child_attached(self, name: str, value: Any) -> None:
        """Run (once) the pending restore waiting for child ``name``, if any."""
        deferred = self.__dict__.get(self._CV_DEFERRED)
        if deferred:
            handler = deferred.pop(name, None)
            if handler is not None:
                handler(self, name, value)

    _defer = defer_restore
    _deferred_names = deferred_names


# --------------------------------------------------------------------------- the calls


def trackable_children(obj: Trackable) -> dict[str, Any]:
    """``obj``'s named children, through its class (an instance attribute cannot hide it)."""
    return type(obj).trackable_children(obj)


def python_state(obj: Trackable) -> Any:
    """``obj``'s Python state (``None``: none), through its class."""
    return type(obj).python_state(obj)


def restore_python_state(obj: Trackable, state: Any) -> None:
    """Give ``obj`` back its Python state, through its class."""
    type(obj).restore_python_state(obj, state)


def defer_restore(obj: Trackable, name: str, handler: DeferredHandler) -> None:
    """Leave ``handler`` on ``obj`` for its child ``name``, once attached, through its class."""
    type(obj).defer_restore(obj, name, handler)


#: ``id(holder) -> {name: stand-in}`` (:func:`stand_ins`), dropped when the holder goes
_STAND_INS: dict[int, dict[str, Any]] = {}


def stand_ins(obj: Trackable) -> dict[str, Any]:
    """The objects that stand for ``obj``'s children and attributes of other libraries (a
    torch module, a JAX pytree) in a checkpoint, by name: kept for ``obj`` so that every
    save and restore meets the same ones (the checkpoint layer makes and reads them).

    They are kept beside ``obj``, never in it: a copy or a pickle of ``obj`` holds none
    (its own are made at its first save), and they go when ``obj`` goes."""
    held = _STAND_INS.get(id(obj))
    if held is None:
        held = _STAND_INS[id(obj)] = {}
        weakref.finalize(obj, _STAND_INS.pop, id(obj), None)
    return held
