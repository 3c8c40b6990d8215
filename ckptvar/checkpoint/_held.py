"""Other libraries' objects a trackable holds: the trackable that stands for each in a checkpoint.

A torch module, optimizer, LR scheduler or GradScaler (an object with
``state_dict()``/``load_state_dict()``) or a registered JAX pytree node (a flax
``TrainState``, a ``jax.tree_util.register_dataclass`` class) that a ``cv.Module`` holds
as a public attribute, or that a ``cv.Trackable`` tracks (``track(name, obj)``, or its
``trackable_children``), takes part in a checkpoint as ``cv.Checkpoint(name=obj)`` makes
it take part: under its name, with the keys a checkpoint's own argument gets below it
(``net/backbone/fc.weight``, ``net/state/params/...``), restored as a whole. The
stand-in is kept on the holder (``trackable.stand_ins``), so every save and restore
meets the same one. A pytree is immutable: its restore builds a new tree, which becomes
the holder's attribute (or child) in the old one's place.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from ..trackable import SupportsStateDict, Trackable, stand_ins, trackable_children
from ._frameworks import StateDictTrackable
from ._tree_state import TreeTrackable
from ._walk import set_stand_in

__all__ = ["stand_in"]


def stand_in(holder: Trackable, name: str, value: Any) -> Trackable:
    """The trackable standing for ``value``, the object of another library ``holder``
    holds under ``name``: the one made before for it, else a new one (kept)."""
    held = stand_ins(holder)
    hit = held.get(name)
    if isinstance(hit, StateDictTrackable) and hit.obj is value:
        return hit
    if isinstance(hit, TreeTrackable):  # the next state of a training loop: its unchanged
        hit.tree = value  # leaves keep their variables
        return hit
    made: Trackable
    if isinstance(value, SupportsStateDict):
        made = StateDictTrackable(value)
    else:
        tree = TreeTrackable(value, name)
        tree.given = _giver(holder, name)
        made = tree
    held[name] = made
    return made


def _giver(holder: Trackable, name: str) -> Any:
    """``give(old, new)``: put the restored tree ``new`` where ``holder`` held ``old``."""
    ref = weakref.ref(holder)

    def give(old: Any, new: Any) -> None:
        obj = ref()
        if obj is None:
            return
        placed = False
        if obj.__dict__.get(name) is old:  # a module's attribute
            object.__setattr__(obj, name, new)
            placed = True
        if type(obj).trackable_children is Trackable.trackable_children and \
                trackable_children(obj).get(name) is old:  # a tracked child
            obj.track(name, new)
            placed = True
        if not placed:
            warnings.warn(
                f"The tree {name!r} of {type(obj).__qualname__} was restored into a new "
                f"tree, which {type(obj).__qualname__} cannot be given (it is neither its "
                "attribute nor its tracked child): it still holds the tree it had. Track "
                f"the tree (self.track({name!r}, tree)) or hold it as a cv.Module's "
                "attribute (docs/frameworks.md).", UserWarning, stacklevel=2)

    return give


set_stand_in(stand_in)
