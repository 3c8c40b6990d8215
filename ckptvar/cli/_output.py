"""What the ``ckpt`` command prints: terminal escaping, aligned tables, strict JSON.

Every name and metadata string read from a file goes through :func:`escape` before
it reaches a terminal; tables align by display width (CJK and other wide characters
take two cells); JSON is strict (non-finite numbers are ``null``, non-ASCII escaped).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ckptvar import CkptError

from ._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")

__all__ = [
    "display_width",
    "dtype_str",
    "dump_json",
    "escape",
    "finite_or_none",
    "json_text",
    "natural_key",
    "num",
    "one_line",
    "shape_str",
    "summary",
    "table",
]

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def escape(text: Any) -> str:
    """``text`` made safe for a terminal: control and format characters become escapes.

    >>> escape("model/dense/kernel"), escape("a\\x1b[31mb"), escape("x\\u202ey")
    ('model/dense/kernel', 'a\\\\x1b[31mb', 'x\\\\u202ey')
    """
    text = str(text)
    if text.isprintable():
        return str(text)
    out = []
    for ch in text:
        if unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            o = ord(ch)
            if o < 0x100:
                out.append(f"\\x{o:02x}")
            else:
                out.append(f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
        else:
            out.append(ch)
    return "".join(out)


def one_line(message: Any) -> str:
    """An error message on one escaped line (a ``KeyError``'s key without its quotes)."""
    text = str(message)
    if isinstance(message, KeyError) and not isinstance(message, CkptError) and message.args:
        text = str(message.args[0])
    return escape(" ".join(text.split()))


def shape_str(shape: Sequence[int] | None) -> str:
    """``(3,)``, ``(2, 3)``, ``()``; ``?`` when unknown."""
    if shape is None:
        return "?"
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def dtype_str(dtype: Any) -> str:
    return str(np.dtype(dtype).name)


def num(x: float | None) -> str:
    """A statistic for a table: ``-`` for none, integers exact, floats to 4 digits."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def display_width(text: str) -> int:
    """Terminal cells ``text`` takes: wide (East Asian W/F) characters count two.

    >>> display_width("abc"), display_width("模型/权重")
    (3, 9)
    """
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(ch) else (2 if unicodedata.east_asian_width(ch) in "WF" else 1)
        for ch in text
    )


def table(rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Left-aligned columns (right-aligned for the indices in ``right``), two spaces apart.

    >>> table([["KEY", "N"], ["模型", "1"], ["ab", "22"]], right=frozenset({1}))
    ['KEY    N', '模型   1', 'ab    22']
    """
    if not rows:
        return []
    widths = [max(display_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = []
        for i, (c, w) in enumerate(zip(r, widths, strict=True)):
            pad = " " * (w - display_width(c))
            cells.append(pad + c if i in right else c + pad)
        lines.append("  ".join(cells).rstrip())
    return lines


_NUMBER_LIST = re.compile(r"\[\n\s+([^\[\]{}\"]*?)\n\s*\]")


def dump_json(obj: Any, out: TextIO) -> None:
    """Indented strict JSON with lists of numbers (shapes) kept on one line.

    ``ensure_ascii``: every non-ASCII or control character is a ``\\u`` escape, so the
    output is valid JSON and harmless on a terminal; ``allow_nan=False``: a non-finite
    number would be an error (callers turn them into ``None`` or strings).
    """
    out.write(json_text(obj) + "\n")


def json_text(obj: Any, level: int = 0) -> str:
    """:func:`dump_json`'s text of ``obj`` as it reads nested ``level`` deep (no newline).

    >>> json_text([[1, 2], [3, "nan"]], level=1)
    '[\\n    [1, 2],\\n    [\\n      3,\\n      "nan"\\n    ]\\n  ]'
    """
    text = json.dumps(obj, ensure_ascii=True, allow_nan=False, indent=2, default=_jsonable)
    # A raw newline only occurs between tokens (strings escape theirs), so a "[" followed by
    # a newline opens a list; collapse those holding no string, list or object.
    text = _NUMBER_LIST.sub(
        lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",\n")) + "]", text
    )
    return text.replace("\n", "\n" + "  " * level) if level else text


def _jsonable(obj: Any) -> Any:
    """Metadata and attribute values that JSON has no type for."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": len(obj)}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def plain(obj: Any) -> Any:
    """``obj`` with non-finite floats made strings (``"nan"``, ``"inf"``) for strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return plain(obj.item())
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist())
    return obj


def summary(value: Any, limit: int = 70) -> str:
    """A one-line, escaped, shortened rendering of a metadata value."""
    if isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k}: {summary(v, limit)}" for k, v in value.items()) + "}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(summary(v, limit) for v in value) + "]"
    elif isinstance(value, (bytes, bytearray)):
        text = f"<{len(value)} bytes>"
    else:
        text = str(value)
    text = escape(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> tuple[Any, ...]:
    """Sort key putting ``vars/2`` before ``vars/10``.

    >>> sorted(["vars/10", "vars/2", "b", "a/1"], key=natural_key)
    ['a/1', 'b', 'vars/2', 'vars/10']
    """
    return tuple((0, int(p), p) if p.isdigit() else (1, 0, p) for p in _DIGITS.split(key) if p)
