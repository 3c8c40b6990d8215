"""The registry of checkpoint formats: which backend reads or writes a path.

Owns ``register_backend`` (a backend adds itself on import), ``known_formats`` and
``backend_for`` (explicit format, else suffix, else sniffing, and the hand-over of a
file the chosen backend does not recognise to one that does). Re-exported by
:mod:`ckptvar.storage`; the backends import it from here.

>>> from ckptvar.storage.registry import known_formats
>>> "safetensors" in known_formats()
True
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, UnsupportedFormatError
from .base import Backend

__all__ = [
    "backend_for",
    "is_own_checkpoint",
    "known_formats",
    "register_backend",
    "sniff_order",
    "writable_formats",
]

#: ckptvar's own formats: what a checkpoint it wrote is (one file, a Zarr tree, or the
#: multi-process layout).
_OWN = ("h5", "zarr", "sharded")

_BACKENDS: dict[str, type[Backend]] = {}

#: ``backend_for(path, format, mode="w")`` by all it depends on: the format asked for, the
#: end of the name that the suffixes are matched against, and whether the name has a
#: suffix (a background save asks at every call); emptied when a backend is registered
_WRITERS: dict[tuple[str | None, str, bool], type[Backend]] = {}
#: the longest registered suffix, and whether every suffix starts with a dot
_SUFFIXES: list[Any] = [0, True]
#: how many times a backend was registered: an answer worked out before a registration
#: is not kept (under ``_KEEP``, with the registration's update of ``_WRITERS``)
_GENERATION = [0]
_KEEP = threading.Lock()


def register_backend(cls: type[Backend], *, override: bool = False) -> type[Backend]:
    """Add a format; refuses to replace a registered name unless ``override=True``."""
    if cls.name in _BACKENDS and not override and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"A backend named {cls.name!r} is already registered.")
    with _KEEP:
        _BACKENDS[cls.name] = cls
        _GENERATION[0] += 1
        _WRITERS.clear()
        suffixes = [s for c in _BACKENDS.values() for s in c.suffixes]
        _SUFFIXES[:] = [max(map(len, suffixes), default=0),
                        all(s[:1] == "." for s in suffixes)]
    return cls


def _writer_key(path: str, format: str | None) -> tuple[str | None, str, bool] | None:
    """What ``backend_for(path, format, mode="w")`` depends on, taken from the string
    (``None`` where the name is not plainly the part after the last ``/``: elsewhere
    than POSIX, or a path ending in ``/`` or ``.``).

    The end of the name is from its first ``.`` that a registered suffix may start at
    (``ckpt-7.h5``: ``.h5``), so the steps of one prefix share a key.

    >>> _writer_key("/tmp/run/ckpt-7.h5", None) == _writer_key("/tmp/run/ckpt-8.h5", None)
    True
    >>> _writer_key("/tmp/run/ckpt-7.H5", "zarr")
    ('zarr', '.h5', True)
    """
    if os.sep != "/" or os.altsep:
        return None
    name = path.rpartition("/")[2]
    if not name or name[-1] == ".":
        return None
    longest, dotted = _SUFFIXES
    lower = name.lower()
    if dotted:
        start = lower.find(".", max(0, len(lower) - longest))
        tail = "" if start < 0 else lower[start:]
    else:  # a suffix without a dot: the last characters, as long as the longest suffix
        tail = lower[-longest:] if longest else ""
    return format, tail, 0 < name.rfind(".") < len(name) - 1


def is_own_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is, by its content, a checkpoint ckptvar wrote (any own format).

    A missing path, another tool's file or an unrelated directory is not.

    >>> is_own_checkpoint("/nonexistent/ckpt-1.h5")
    False
    """
    path = Path(path)
    return any(name in _BACKENDS and _BACKENDS[name].sniff(path) for name in _OWN)


def known_formats() -> dict[str, tuple[str, ...]]:
    """Registered format names and their suffixes."""
    return {name: cls.suffixes for name, cls in _BACKENDS.items()}


def writable_formats() -> list[str]:
    """The registered formats that can be written, in registration order.

    >>> writable_formats()[:2]
    ['h5', 'zarr']
    """
    return [name for name, cls in _BACKENDS.items() if cls.can_write]


def _describe() -> str:
    """The known formats, with their suffixes where they have some (a directory layout
    found by its content has none)."""
    return ", ".join(f"{n} ({'/'.join(s)})" if s else n for n, s in known_formats().items())


def _cannot_write(path: Path, why: str) -> UnsupportedFormatError:
    """The one message for a destination no writer takes (cv.save and ckpt convert)."""
    return UnsupportedFormatError(
        f"Cannot write {str(path)!r}: {why}; writable: {', '.join(writable_formats())}."
    )


def backend_for(path: str | Path, format: str | None = None, *, mode: str = "r") -> type[Backend]:
    """The backend for ``path``: the explicit ``format``, else the suffix, else sniffing.

    ``mode="w"`` only accepts writable formats and defaults to HDF5 when the suffix
    says nothing. When reading, a path the chosen backend does not recognise goes to
    another backend that does, if the chosen one allows it
    (``Backend.hands_over_unrecognised``: a Keras ``.h5`` file). Raises
    ``UnsupportedFormatError`` naming the known formats.
    """
    key = _writer_key(os.fspath(path), format) if mode == "w" else None
    if key is not None:
        hit = _WRITERS.get(key)
        if hit is not None:
            return hit
        generation = _GENERATION[0]
    path = Path(path)
    if mode == "r":
        _refuse_special(path)
    if format is not None:
        cls = _BACKENDS.get(format.lower().lstrip("."))
        if cls is None and mode == "w":
            raise _cannot_write(path, f"unknown format {format!r}")
        if cls is None:
            raise UnsupportedFormatError(f"Unknown format {format!r}; known: {_describe()}.")
    else:
        cls = _guess(path, mode)
    if mode == "w" and not cls.can_write:
        raise _cannot_write(path, f"the {cls.name} format is read-only")
    if mode == "r" and cls.hands_over_unrecognised:
        cls = _claimant(cls, path) or cls
    if key is not None:
        _keep(key, cls, generation)
    return cls


def _keep(key: tuple[str | None, str, bool], cls: type[Backend], generation: int) -> None:
    """Keep ``cls`` as the writer for ``key``, unless a backend was registered since it
    was worked out (at ``generation``)."""
    with _KEEP:
        if generation == _GENERATION[0]:
            if len(_WRITERS) >= 64:  # names with dots of their own (``step.1000.h5``)
                _WRITERS.clear()
            _WRITERS[key] = cls


_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_special(path: Path) -> None:
    """Refuse a pipe, device or socket: opening a pipe waits for a writer and a device
    may never end, so no reader could finish with one."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # absent (or a URL): the backend says so
    for test, what in _SPECIAL:
        if test(mode):
            raise UnsupportedFormatError(
                f"{str(path)!r} is {what}, not a regular file; a checkpoint is read from a "
                "file or a folder."
            )


def _guess(path: Path, mode: str) -> type[Backend]:
    """The backend of ``path`` by its suffix, else (reading) by sniffing, else (writing) HDF5
    when it has no suffix; raises naming the known (or writable) formats."""
    cls = _by_suffix(path)
    if cls is None and mode == "r":
        if not path.exists() and not _has_sidecars(path):
            raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}.")
        cls = next((c for c in sniff_order() if c.sniff(path)), None)
    if cls is None and mode == "w":
        if path.suffix:
            raise _cannot_write(path, f"unknown suffix {path.suffix!r}")
        cls = _BACKENDS["h5"]
    if cls is None and path.is_dir():
        raise UnsupportedFormatError(
            f"{str(path)!r} is a directory, not a checkpoint (none of the known formats "
            f"holds it: {_describe()})."
        )
    if cls is None:
        raise UnsupportedFormatError(f"Cannot tell the format of {str(path)!r}; known: {_describe()}.")
    return cls


def _claimant(chosen: type[Backend], path: Path) -> type[Backend] | None:
    """Another backend that claims ``path`` when ``chosen`` does not (None otherwise)."""
    if not (path.is_file() or path.is_dir()) or chosen.sniff(path):
        return None
    for cls in sniff_order():
        if cls is chosen:
            continue
        try:
            ok = cls.sniff(path)
        except Exception:  # noqa: BLE001 - a sniffer that fails just does not claim the file
            ok = False
        if ok:
            return cls
    return None


def sniff_order() -> list[type[Backend]]:
    """The registered backends in the order they sniff a path (``Backend.sniff_priority``,
    then registration order): declared, never the order of an import line."""
    return sorted(_BACKENDS.values(), key=lambda c: c.sniff_priority)


def _by_suffix(path: Path) -> type[Backend] | None:
    name = path.name.lower()
    best: tuple[int, type[Backend]] | None = None
    for cls in _BACKENDS.values():
        for suffix in cls.suffixes:
            if name.endswith(suffix) and (best is None or len(suffix) > best[0]):
                best = (len(suffix), cls)
    return best[1] if best else None


def _has_sidecars(path: Path) -> bool:
    # A TensorFlow checkpoint is named by a prefix: "ckpt-1" for ckpt-1.index + data files.
    return Path(str(path) + ".index").exists()
