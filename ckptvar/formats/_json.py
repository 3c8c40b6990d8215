"""Metadata as JSON text, shared by the writers that keep it in a JSON string or member.

Owns: :func:`jsonable` (the ``default=`` hook: bytes as ``{"__bytes__": base64}``,
NumPy scalars and arrays as plain numbers and lists) and :func:`loads_json`, its inverse.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["jsonable", "loads_json"]


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


def _unbytes(obj: dict[str, Any]) -> Any:
    if set(obj) == {"__bytes__"} and isinstance(obj["__bytes__"], str):
        return base64.b64decode(obj["__bytes__"])
    return obj
