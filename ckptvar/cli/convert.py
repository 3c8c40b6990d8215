"""``ckpt convert``: any readable checkpoint to .h5, .zarr, .safetensors or .npz.

The scripts in ``scripts/convert_*.py`` run this same conversion.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import ckptvar as cv

from ._blocks import is_floating
from ._common import EXIT_OK, UsageError, add_selection, open_checkpoint, select
from ._output import escape
from ._progress import Progress, human_size

#: ``convert`` shows its progress bar by itself (on a terminal) from this many bytes on.
PROGRESS_MIN_BYTES = 16 << 20

EPILOG = """\
Writes DST in the format its suffix names (.h5, .zarr, .safetensors, .npz) or
--format, with SRC's per-value name and trainable flag and its metadata (so a
converted ckptvar checkpoint still restores with Checkpoint.restore). Each value
is read, cast and handed to the writer once. Only floating values are cast by
--dtype (integers, booleans and complex values keep their dtype).
--rename FROM=TO applies re.sub(FROM, TO, key) to every key; give it several
times to apply several substitutions in order (the first '=' splits FROM from
TO). A progress bar appears on stderr for large conversions when stderr is a
terminal, or always with --progress.

examples:
  ckpt convert pytorch_model.bin model.h5
  ckpt convert runs/ckpt-3.h5 model.safetensors --dtype bfloat16
  ckpt convert tf_ckpt/ckpt-1 model.zarr --rename '^model/=' --rename 'kernel$=weight'
"""


def add_parser(sub: Any) -> None:
    """Register ``convert`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to .h5, .zarr, .safetensors or .npz",
        description="Convert any readable checkpoint to .h5, .zarr, .safetensors or .npz.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="the checkpoint to read")
    p.add_argument("dst", metavar="DST", help="the file or .zarr directory to write")
    p.add_argument(
        "--dtype",
        type=_parse_dtype,
        metavar="DTYPE",
        help=f"cast floating values to DTYPE ({', '.join(_FLOAT_TARGETS)})",
    )
    p.add_argument(
        "--rename",
        type=_parse_rename,
        action="append",
        default=[],
        metavar="FROM=TO",
        help="regex substitution on keys (repeatable, applied in order)",
    )
    p.add_argument(
        "--format",
        metavar="FMT",
        help="output format (h5, zarr, safetensors, npz); default: DST's suffix",
    )
    add_selection(p)
    p.add_argument(
        "--no-metadata",
        action="store_true",
        help="do not copy SRC's metadata (object graph, counters, user metadata)",
    )
    p.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr (default: for large conversions on a terminal)",
    )
    p.set_defaults(func=run)


_FLOAT_TARGETS = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def _parse_dtype(name: str) -> np.dtype:
    if name not in _FLOAT_TARGETS:
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a floating dtype; choose one of {', '.join(_FLOAT_TARGETS)}"
        )
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _parse_rename(spec: str) -> tuple[re.Pattern[str], str]:
    pattern, sep, repl = spec.partition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"wants FROM=TO (a regex and a replacement), got {spec!r}")
    try:
        return re.compile(pattern), repl
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{pattern!r} is not a valid regex: {exc}") from None


_KEPT_ATTRS = ("name", "trainable")


class _Converted(Mapping[str, np.ndarray]):
    """The output values of a conversion, each read (and cast) only when asked for."""

    def __init__(
        self,
        reader: Any,
        plan: dict[str, str],
        dtype: np.dtype | None,
        progress: Progress,
    ) -> None:
        self._reader = reader
        self._plan = plan  # output key -> source key
        self._dtype = dtype
        self._progress = progress

    def __getitem__(self, key: str) -> np.ndarray:
        src = self._plan[key]
        value = np.asarray(self._reader.read(src))
        if self._dtype is not None and is_floating(value.dtype) and value.dtype != self._dtype:
            value = value.astype(self._dtype)
        self._progress.update(value.nbytes, key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def run(args: argparse.Namespace, out: TextIO) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if src.resolve() == dst.resolve():
        raise UsageError(f"source and destination are the same path {str(src)!r}")
    if (dst.exists() or dst.is_symlink()) and not args.force:
        raise UsageError(f"{str(dst)!r} exists; pass --force to replace it")
    with open_checkpoint(src) as reader:
        plan: dict[str, str] = {}
        attrs: dict[str, dict[str, Any]] = {}
        total = 0
        for key in select(reader, args):
            new = key
            for pattern, repl in args.rename:
                try:
                    new = pattern.sub(repl, new)
                except re.error as exc:  # a bad group reference in TO, e.g. \2 with one group
                    raise UsageError(f"--rename {pattern.pattern}={repl}: {exc}") from None
            if not new:
                raise UsageError(f"--rename maps {key!r} to an empty key")
            if new in plan:
                raise UsageError(f"--rename maps both {plan[new]!r} and {key!r} to {new!r}")
            plan[new] = key
            info = reader.info(key)
            kept = {a: info.attrs[a] for a in _KEPT_ATTRS if a in (info.attrs or {})}
            if kept:
                attrs[new] = kept
            size = math.prod(info.shape)
            itemsize = info.dtype.itemsize
            if args.dtype is not None and is_floating(np.dtype(info.dtype)):
                itemsize = args.dtype.itemsize
            total += size * itemsize
        if not plan:
            raise UsageError(f"nothing to convert: no key of {str(src)!r} matches {args.filter!r}")
        show = (
            args.progress
            if args.progress is not None
            else (sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES)
        )
        metadata = None if args.no_metadata else (reader.metadata() or None)
        with Progress(total, stream=sys.stderr, enabled=bool(show)) as progress:
            values = _Converted(reader, plan, args.dtype, progress)
            written = cv.save(
                dst, values, format=args.format, attrs=attrs or None, metadata=metadata
            )
        src_format = reader.format
    n = len(plan)
    print(
        f"Wrote {n} value{'s' if n != 1 else ''} ({human_size(total)}) from "
        f"{escape(src)} ({escape(src_format)}) to {escape(written)}",
        file=out,
    )
    return EXIT_OK
