"""``ckpt show``: print the values of one key, or of a slice of it, reading only that slice."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ._blocks import is_floating
from ._common import EXIT_OK, UsageError, latest_or_path, open_checkpoint
from ._lazy import lazy_module
from ._output import escape, json_text, plain, shape_str

if TYPE_CHECKING:
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")

EPILOG = """\
KEY may end with a NumPy slice in brackets: 'model/kernel[0:2, :4]',
'emb[10]', 'w[..., -1]', 'x[::2]' (integers, start:stop:step and ...).
Only the slice is read from the file (through the lazy array), so a row of a
huge embedding costs a row. A key that itself ends in brackets is taken as a
key first. Values print with NumPy's print options: --precision digits after
the point, --threshold elements before the output is summarised with '...'
(--threshold 0 never summarises). --json prints {"path", "key", "index",
"dtype", "shape", "value"} with NaN and Inf as the strings "nan", "inf"; several
keys print a JSON list of such objects, one per key, in order.

examples:
  ckpt show runs/ckpt-3.h5 model/dense/kernel
  ckpt show model.safetensors 'embed.weight[0:3, :8]' --precision 3
  ckpt show tf_ckpt/ckpt-1 'model/layers/0/kernel[..., 0]' --json
"""


HELP = "print the values of a key (or a slice of it)"
DESCRIPTION = "Print the values of KEY (or KEY[slice]) of a checkpoint, reading only those."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt show``."""
    p.add_argument(
        "path", metavar="PATH", help="the checkpoint, or a manager's directory (its latest)"
    )
    p.add_argument("keys", metavar="KEY[SLICE]", nargs="+", help="a key, optionally sliced")
    p.add_argument(
        "--precision",
        type=_count,
        default=None,
        metavar="N",
        help="digits after the decimal point (NumPy's default: 8)",
    )
    p.add_argument(
        "--threshold",
        type=_count,
        default=None,
        metavar="N",
        help="summarise with '...' beyond N elements (NumPy's default: 1000; 0: never)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (a list for several keys)"
    )


_INT = re.compile(r"[+-]?\d+")


def _count(text: str) -> int:
    """A whole number of at least 0 (checked while parsing, before anything prints)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _part(text: str) -> Any:
    text = text.strip()
    if text == "...":
        return Ellipsis
    if _INT.fullmatch(text):
        return int(text)
    pieces = text.split(":")
    if len(pieces) in (2, 3) and all(not p.strip() or _INT.fullmatch(p.strip()) for p in pieces):
        return slice(*(int(p) if p.strip() else None for p in pieces))
    raise UsageError(f"{text!r} is not an index (integers, start:stop:step or ...)")


def parse_index(text: str) -> tuple[Any, ...]:
    """The index tuple of a slice text, as NumPy reads it.

    >>> parse_index("0:2, :4"), parse_index("..., -1"), parse_index("::2")
    ((slice(0, 2, None), slice(None, 4, None)), (Ellipsis, -1), (slice(None, None, 2),))
    """
    if not text.strip():
        return ()
    return tuple(_part(p) for p in text.split(","))


def _split(spec: str, keys: Any) -> tuple[str, tuple[Any, ...] | None, str]:
    """``(key, index, slice text)``: a key that exists as written wins over a slice."""
    if spec in keys or not spec.endswith("]") or "[" not in spec:
        return spec, None, ""
    at = spec.rindex("[")
    return spec[:at], parse_index(spec[at + 1 : -1]), spec[at:]


def run(args: argparse.Namespace, out: TextIO) -> int:
    threshold = sys.maxsize if args.threshold == 0 else args.threshold
    args.path = latest_or_path(args.path)
    with open_checkpoint(args.path) as reader:
        # Every key and slice is checked before anything prints; then one value at a time.
        picked = []
        for spec in args.keys:
            key, index, text = _split(spec, reader)
            if key not in reader:
                raise KeyError(f"no key {key!r} in {str(args.path)!r}")
            info = reader.info(key)
            try:  # the slice's shape, on a view that holds no elements
                np.broadcast_to(np.zeros((), bool), info.shape)[() if index is None else index]
            except IndexError as exc:
                raise UsageError(
                    f"{escape(spec)}: {exc} (the value's shape is {shape_str(info.shape)})"
                ) from None
            picked.append((spec, key, index, text, info))
        # --json: one object, or a list of them for several keys (one JSON text either way)
        level = int(args.json and len(picked) > 1)
        if level:
            out.write("[\n")
        for n, (spec, key, index, text, info) in enumerate(picked):
            if args.json:
                out.write(",\n" * bool(n) + "  " * level)
            if args.json and _streamed(info.dtype, info.shape, index):
                _stream_json(args.path, key, index, text, reader[key], out=out, level=level)
                continue
            value = _read(reader, spec, key, index, info)
            if args.json:
                doc = _json_doc(
                    args.path, key, text, value.dtype, value.shape, shown=_json_value(value)
                )
                out.write(json_text(doc, level))
                continue
            what = f" of {shape_str(info.shape)}" if text else ""
            print(
                f"{escape(key)}{escape(text)}  {value.dtype.name} {shape_str(value.shape)}{what}",
                file=out,
            )
            # bfloat16, float8: printed through float32, which honours --precision
            printable = (value.astype(np.float32)
                         if is_floating(value.dtype) and value.dtype.kind == "V" else value)
            with np.printoptions(precision=args.precision, threshold=threshold):
                print(np.array2string(printable, separator=", "), file=out)
        if args.json:
            out.write("\n]\n" if level else "\n")
    return EXIT_OK


def _read(reader: Any, spec: str, key: str, index: Any, info: Any) -> np.ndarray:
    if index is None or math.prod(info.shape) == 0:
        value = np.asarray(reader.read(key))
        return value if index is None else value[index]
    try:
        return np.asarray(reader[key][index])
    except IndexError as exc:
        raise UsageError(
            f"{escape(spec)}: {exc} (the value's shape is {shape_str(info.shape)})"
        ) from None


def _json_doc(
    path: Any, key: str, text: str, dtype: Any, shape: tuple[int, ...], *, shown: Any
) -> dict[str, Any]:
    return {
        "path": str(path),
        "key": key,
        "index": text or None,
        "dtype": dtype.name,
        "shape": list(shape),
        "value": shown,
    }


def _json_value(value: np.ndarray) -> Any:
    """The value as JSON numbers: nested lists, NaN and Inf as strings."""
    return plain(value.tolist() if value.dtype.kind != "V" else value.astype(np.float64).tolist())


#: Beyond this many elements ``--json`` writes a value piece by piece, reading this many
#: at a time: a value never becomes Python numbers or one JSON text all at once.
JSON_BLOCK = 1 << 14


def _streamed(dtype: Any, shape: tuple[int, ...], index: Any) -> bool:
    """Whether ``--json`` streams this value: a large one of numbers (others read whole)."""
    if not (dtype.kind in "biuf" or (dtype.kind == "V" and is_floating(dtype))):
        return False
    view = np.broadcast_to(np.zeros((), bool), shape)[() if index is None else index]
    return view.size > JSON_BLOCK


class _Selection:
    """A basic index as one ``int`` or ``range`` per stored dimension, read in pieces."""

    def __init__(self, lazy: Any, picks: list[int | range]) -> None:
        self.lazy = lazy
        self.picks = picks

    @classmethod
    def of(cls, lazy: Any, index: Any) -> _Selection:
        shape = lazy.shape
        parts = list(index or ())
        if any(p is Ellipsis for p in parts):
            at = next(i for i, p in enumerate(parts) if p is Ellipsis)
            parts[at : at + 1] = [slice(None)] * (len(shape) - len(parts) + 1)
        parts += [slice(None)] * (len(shape) - len(parts))
        picks: list[int | range] = [
            range(n)[p] if isinstance(p, slice) else (p + n if p < 0 else p)
            for p, n in zip(parts, shape, strict=True)
        ]
        return cls(lazy, picks)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.picks if isinstance(p, range))

    def first(self, pick: int | range) -> _Selection:
        """The selection with its first selected dimension narrowed to ``pick``."""
        at = next(i for i, p in enumerate(self.picks) if isinstance(p, range))
        return _Selection(self.lazy, [*self.picks[:at], pick, *self.picks[at + 1 :]])

    def read(self) -> np.ndarray:
        index: list[int | slice] = []
        flip: list[int] = []
        for p in self.picks:
            if isinstance(p, int):
                index.append(p)
                continue
            forwards = p
            if p.step < 0:  # read forwards, turn around here
                flip.append(sum(isinstance(q, slice) for q in index))
                forwards = p[::-1]
            index.append(slice(forwards.start, forwards[-1] + 1, forwards.step))
        value = np.asarray(self.lazy[tuple(index)])
        value = np.flip(value, tuple(flip)) if flip else value
        return value.astype(np.float64) if value.dtype.kind == "V" else value


def _stream_json(
    path: Any, key: str, index: Any, text: str, lazy: Any, *, out: TextIO, level: int = 0
) -> None:
    """``json_text``'s text of the value's object at ``level``, written piece by piece."""
    sel = _Selection.of(lazy, index)
    shape = sel.shape
    head = json_text(_json_doc(path, key, text, lazy.dtype, shape, shown=0), level)
    end = "0\n" + "  " * level + "}"
    assert head.endswith('"value": ' + end)
    out.write(head[: -len(end)])
    _write_nested(sel, level + 1, out)
    out.write(end[1:])


def _write_nested(sel: _Selection, level: int, out: TextIO) -> None:
    """The JSON list of ``sel`` at nesting ``level``, reading ``JSON_BLOCK`` elements at once."""
    shape = sel.shape
    if len(shape) == 1:
        _write_row(sel, level, out)
        return
    rows = sel.picks[next(i for i, p in enumerate(sel.picks) if isinstance(p, range))]
    assert isinstance(rows, range)
    per_row = math.prod(shape[1:])
    pad = "  " * (level + 1)
    out.write("[\n")
    if per_row > JSON_BLOCK:
        for i, r in enumerate(rows):
            out.write((",\n" if i else "") + pad)
            _write_nested(sel.first(r), level + 1, out)
    else:
        step = max(1, JSON_BLOCK // max(per_row, 1))
        for lo in range(0, len(rows), step):
            block = sel.first(rows[lo : lo + step]).read()
            for i, row in enumerate(block):
                out.write((",\n" if lo or i else "") + pad + json_text(plain(row.tolist()), level + 1))
    out.write("\n" + "  " * level + "]")


def _write_row(sel: _Selection, level: int, out: TextIO) -> None:
    """A one-dimensional list: on one line, or one number a line when it holds NaN or Inf."""
    (n,) = sel.shape
    (cols,) = (p for p in sel.picks if isinstance(p, range))
    pieces = [sel.first(cols[lo : lo + JSON_BLOCK]) for lo in range(0, n, JSON_BLOCK)]
    finite = all(
        bool(np.isfinite(p.read()).all()) for p in pieces
    ) if sel.lazy.dtype.kind in "fV" else True
    pad = "  " * (level + 1)
    out.write("[" if finite else "[\n" + pad)
    for i, piece in enumerate(pieces):
        values = piece.read().tolist()
        if finite:
            out.write((", " if i else "") + json.dumps(values, allow_nan=False)[1:-1])
        else:
            out.write((",\n" + pad if i else "") + (",\n" + pad).join(
                json_text(plain(v)) for v in values))
    out.write("]" if finite else "\n" + "  " * level + "]")
