"""Modules the CLI loads on first use, so ``ckpt --help`` starts in a blink.

Owns :func:`lazy_module`: ``np = lazy_module("numpy")`` binds a module whose code runs at
the first attribute access (:class:`importlib.util.LazyLoader`), so building the parser
and printing help never import NumPy; a command that computes does, when it first needs it.
Ctrl-C during that first load waits until the module is whole (an import cut short
leaves a half-made module that every later use trips on), and a command loads them with
:func:`load_now` before anything else can: Python's ``import numpy`` of a module still
lazy loads it through an attribute lookup whose errors CPython drops, so a Ctrl-C
there went unraised and the command crashed on the half-made NumPy.

>>> json = lazy_module("json")
>>> json.dumps([1])
'[1]'
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import signal
import sys
import threading
from types import FrameType, ModuleType
from typing import Any

__all__ = ["lazy_module", "load_now"]

#: the modules bound by :func:`lazy_module` (loaded or not)
_BOUND: list[ModuleType] = []


def lazy_module(name: str) -> ModuleType:
    """``name``, imported already or loaded at its first attribute access."""
    found = sys.modules.get(name)
    if found is not None:
        return found
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(_Whole(spec.loader))
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    _BOUND.append(module)
    return module


def load_now() -> None:
    """Load every module bound lazily so far, where a Ctrl-C raises as it should."""
    for module in _BOUND:
        getattr(module, "__name__")  # noqa: B009 (an attribute lookup of Python's own)


class _Whole(importlib.abc.Loader):
    """``loader``, its ``exec_module`` run to the end before a Ctrl-C is acted on."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's interface
        return getattr(self.loader, name)  # (get_resource_reader, get_data, is_package, ...)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.loader.exec_module(module)  # signals are handled in the main thread only
            return
        held: list[tuple[int, FrameType | None]] = []
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
        try:
            self.loader.exec_module(module)
        finally:
            signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])  # the Ctrl-C, now that the module is whole
