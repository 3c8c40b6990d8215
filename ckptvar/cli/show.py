"""``ckpt show``: print the values of one key, or of a slice of it, reading only that slice."""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ._blocks import is_floating
from ._common import EXIT_OK, UsageError, open_checkpoint
from ._lazy import lazy_module
from ._output import dump_json, escape, plain, shape_str

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
"dtype", "shape", "value"} with NaN and Inf as the strings "nan", "inf".

examples:
  ckpt show runs/ckpt-3.h5 model/dense/kernel
  ckpt show model.safetensors 'embed.weight[0:3, :8]' --precision 3
  ckpt show tf_ckpt/ckpt-1 'model/layers/0/kernel[..., 0]' --json
"""


HELP = "print the values of a key (or a slice of it)"
DESCRIPTION = "Print the values of KEY (or KEY[slice]) of a checkpoint, reading only those."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt show``."""
    p.add_argument("path", metavar="PATH", help="the checkpoint")
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
    p.add_argument("--json", action="store_true", help="print JSON (one object per key)")


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
    with open_checkpoint(args.path) as reader:
        shown = []
        for spec in args.keys:
            key, index, text = _split(spec, reader)
            if key not in reader:
                raise KeyError(f"no key {key!r} in {str(args.path)!r}")
            info = reader.info(key)
            if index is None or math.prod(info.shape) == 0:
                value = np.asarray(reader.read(key))
                value = value if index is None else value[index]
            else:
                try:
                    value = np.asarray(reader[key][index])
                except IndexError as exc:
                    raise UsageError(
                        f"{escape(spec)}: {exc} (the value's shape is {shape_str(info.shape)})"
                    ) from None
            shown.append((key, text, info, value))
    for key, text, info, value in shown:
        if args.json:
            dump_json(
                {
                    "path": str(args.path),
                    "key": key,
                    "index": text or None,
                    "dtype": value.dtype.name,
                    "shape": list(value.shape),
                    "value": plain(
                        value.tolist()
                        if value.dtype.kind != "V"
                        else value.astype(np.float64).tolist()
                    ),
                },
                out,
            )
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
    return EXIT_OK
