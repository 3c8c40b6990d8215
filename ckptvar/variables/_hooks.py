"""Creation hooks, deferred initialization and variable ids.

Owns :func:`register_creation_hook` / :class:`CreationHookHandle` (callbacks run at the end of
every ``Variable.__init__``, in every thread: the checkpoint layer's restore-on-create uses
them), :func:`deferred_init` (variables created inside get a dtype and shape but no value),
and the process-wide counter behind ``Variable._uid``.

>>> seen = []
>>> with register_creation_hook(seen.append):
...     run_creation_hooks("v")
>>> run_creation_hooks("w")
>>> seen
['v']
>>> with deferred_init():
...     deferring()
True
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "CreationHookHandle",
    "deferred_init",
    "deferring",
    "next_uid",
    "register_creation_hook",
    "run_creation_hooks",
]

#: A creation hook, called with the new ``Variable`` (typed as ``Any``: this module sits
#: below :mod:`._variable`, which imports it, so it does not name the class).
Hook = Callable[[Any], None]

_hooks: list[Hook] = []
_hooks_lock = threading.Lock()


class CreationHookHandle:
    """Returned by :func:`register_creation_hook`; ``remove()`` unregisters the hook."""

    def __init__(self, fn: Hook) -> None:
        self._fn = fn

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        with _hooks_lock:
            for i, hook in enumerate(_hooks):
                if hook is self._fn:
                    del _hooks[i]
                    break

    def __enter__(self) -> CreationHookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_creation_hook(fn: Hook) -> CreationHookHandle:
    """Call ``fn(variable)`` at the end of every ``Variable.__init__`` (all threads).

    When a hook runs, the variable's name, shape, dtype, device and ``trainable`` are set
    and it is in its collections; a variable built from an initializer has not run it yet
    (nothing is materialised), so the hook may supply the value with
    ``ckptvar.variables.set_initial_value_source(variable, fn)``. Hooks run in registration order.
    """
    with _hooks_lock:
        _hooks.append(fn)
    return CreationHookHandle(fn)


def run_creation_hooks(variable: Any) -> None:
    """Call every registered hook on ``variable`` (a snapshot of the list: hooks may unregister)."""
    with _hooks_lock:
        hooks = list(_hooks)
    for hook in hooks:
        hook(variable)


_deferred = threading.local()


@contextmanager
def deferred_init() -> Iterator[None]:
    """Variables created inside get a dtype and shape but no value until initialized.

    Reading such a variable raises :class:`UninitializedVariableError`; ``initialize()``,
    :func:`global_variables_initializer`, a full ``assign`` or a restore gives it a value.
    A variable built from an initializer allocates nothing meanwhile.
    """
    _deferred.depth = getattr(_deferred, "depth", 0) + 1
    try:
        yield
    finally:
        _deferred.depth -= 1


def deferring() -> bool:
    """Whether this thread is inside :func:`deferred_init`."""
    return getattr(_deferred, "depth", 0) > 0


_uids = itertools.count(1)
_uid_lock = threading.Lock()


def next_uid() -> int:
    """A new process-wide variable id (never reused)."""
    with _uid_lock:
        return next(_uids)
