"""JSON text in other tools' files: metadata, and objects read with every key once.

Owns: :func:`jsonable` (the ``default=`` hook: bytes as ``{"__bytes__": base64}``,
NumPy scalars and arrays as plain numbers and lists), :func:`loads_json`, its inverse,
and :func:`unique_keys`, the one refusal of a JSON object naming a key twice (a
safetensors header, a Hugging Face index).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["jsonable", "loads_json", "unique_keys"]


def jsonable(obj: Any) -> Any:
    """``json.dumps(default=jsonable)``: what JSON cannot hold natively, or ``TypeError``."""
    if isinstance(obj, bytes | bytearray | memoryview):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"Cannot store {type(obj).__name__} in JSON metadata.")


def loads_json(text: str, path: Path | str) -> Any:
    """Parse metadata written with :func:`jsonable`; damage is a ``CorruptCheckpointError``."""
    try:
        return json.loads(text, object_hook=_unbytes)
    except ValueError as exc:
        raise CorruptCheckpointError(f"Bad ckptvar metadata in {str(path)!r}: {exc}.") from None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads(object_pairs_hook=unique_keys)``: a JSON object whose keys all differ.

    JSON's parsers keep the last of a key named twice, so a reader would take one of
    two values (two shards, two offsets) silently; a ``CorruptCheckpointError`` says
    which key instead (the caller adds the file: ``The index 'x' is refused: ...``).

    >>> json.loads('{"a": 1, "a": 2}', object_pairs_hook=unique_keys)
    Traceback (most recent call last):
    ...
    ckptvar.errors.CorruptCheckpointError: it names the key 'a' twice.
    """
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CorruptCheckpointError(f"it names the key {key!r} twice.")
        out[key] = value
    return out


def _unbytes(obj: dict[str, Any]) -> Any:
    if set(obj) == {"__bytes__"} and isinstance(obj["__bytes__"], str):
        return base64.b64decode(obj["__bytes__"])
    return obj
