"""Modules the CLI loads on first use, so ``ckpt --help`` starts in a blink.

Owns :func:`lazy_module`: ``np = lazy_module("numpy")`` binds a module whose code runs at
the first attribute access (:class:`importlib.util.LazyLoader`), so building the parser
and printing help never import NumPy; a command that computes does, when it first needs it.

>>> json = lazy_module("json")
>>> json.dumps([1])
'[1]'
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = ["lazy_module"]


def lazy_module(name: str) -> ModuleType:
    """``name``, imported already or loaded at its first attribute access."""
    found = sys.modules.get(name)
    if found is not None:
        return found
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
