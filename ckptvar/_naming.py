"""Pure helpers for variable and scope names (no imports from the rest of ckptvar).

Owns TensorFlow's name uniquification (:class:`NameRegistry`, as ``Graph.unique_name``:
names compare case-insensitively, ``x`` then ``x_1``, ``x_2``; a composed name is marked
as used, so a later explicit ``x_1`` becomes ``x_1_1``), scope joining, and the checks
on scope names. Checkpoint-key escaping lives with the checkpoint layer.

>>> r = NameRegistry()
>>> [r.unique_name("x"), r.unique_name("X"), r.unique_name("x_1")]
['x', 'X_1', 'x_1_1']
"""

from __future__ import annotations

import re
import threading

__all__ = ["NameRegistry", "join", "valid_scope_name"]

# TensorFlow's rules: a root name starts with a letter, digit or '.'; nested ones may also
# start with '_', '-', '>' or '\'.
_ROOT_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
_NESTED_NAME = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")


def join(prefix: str, name: str) -> str:
    """``prefix/name``, or ``name`` when ``prefix`` is empty.

    >>> join("", "v"), join("a/b", "v")
    ('v', 'a/b/v')
    """
    return f"{prefix}/{name}" if prefix else name


def valid_scope_name(name: str, *, nested: bool) -> bool:
    """Whether ``name`` may name a scope or variable.

    TensorFlow's op-name rules, plus any Python identifier (as TensorFlow 2 accepts for
    ``tf.Module``): a module's default name comes from its class name, and a private
    class ``_Block`` gives ``__block``.

    >>> valid_scope_name("__block/dense", nested=False), valid_scope_name("_x y", nested=False)
    (True, False)
    """
    if (_NESTED_NAME if nested else _ROOT_NAME).match(name):
        return True
    first, _, rest = name.partition("/")
    return first.isidentifier() and bool(_NESTED_NAME.match(rest))


class NameRegistry:
    """The set of names used in one namespace, with TensorFlow's uniquification.

    Thread-safe. Comparison is case-insensitive, as in TensorFlow (names must stay
    distinct on case-insensitive file systems).
    """

    def __init__(self) -> None:
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()

    def unique_name(self, name: str, *, mark_as_used: bool = True) -> str:
        """``name`` if unused, else ``name_1``, ``name_2``, ... (the first unused)."""
        with self._lock:
            key = name.lower()
            i = self._in_use.get(key, 0)
            if mark_as_used:
                self._in_use[key] = i + 1
            if i > 0:
                base = key
                while key in self._in_use:
                    key = f"{base}_{i}"
                    i += 1
                if mark_as_used:
                    self._in_use[key] = 1
                name = f"{name}_{i - 1}"
            return name

    def mark_used(self, name: str) -> None:
        """Record ``name`` as used without renaming it (for exact, absolute names)."""
        with self._lock:
            key = name.lower()
            self._in_use[key] = max(self._in_use.get(key, 0), 1)

    def is_used(self, name: str) -> bool:
        with self._lock:
            return name.lower() in self._in_use
