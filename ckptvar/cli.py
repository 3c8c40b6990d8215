"""The ``ckpt`` command: inspect, convert, diff, verify and list checkpoints.

Built on the public API only (``import ckptvar as cv``). ``main(argv) -> int``
returns the exit status: 0 success, 1 a mismatch or verification failure, 2 bad
usage or unreadable/missing input. Errors print one line, ``ckpt: error: ...``,
on stderr and never a traceback. Every name and metadata string read from a
file is escaped before it reaches a terminal (control characters shown as
``\\x1b``), and ``--json`` output is strict JSON (non-finite numbers are ``null``).

>>> main(["--version"])  # doctest: +ELLIPSIS
ckpt (ckptvar) ...
0
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import math
import os
import re
import sys
import warnings
import time
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np

import ckptvar as cv
from ckptvar._progress import Progress, human_size

__all__ = ["main"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2

#: Values with more elements than this are read in blocks of about this many elements
#: (``--stats``, ``diff``), so memory stays flat however large a value is.
BLOCK_ELEMENTS = 1 << 20
#: ``convert`` shows its progress bar by itself (on a terminal) from this many bytes on.
PROGRESS_MIN_BYTES = 16 << 20

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


# --------------------------------------------------------------------------- formatting


def escape(text: Any) -> str:
    """``text`` made safe for a terminal: control and format characters become escapes.

    >>> escape("model/dense/kernel"), escape("a\\x1b[31mb"), escape("x\\u202ey")
    ('model/dense/kernel', 'a\\\\x1b[31mb', 'x\\\\u202ey')
    """
    text = str(text)
    if text.isprintable():
        return text
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


def _shape_str(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "?"
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _dtype_str(dtype: Any) -> str:
    return np.dtype(dtype).name


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def _finite_or_none(x: float | int | None) -> float | int | None:
    return x if x is not None and math.isfinite(x) else None


def _table(rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Left-aligned columns (right-aligned for the indices in ``right``), two spaces apart."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


_NUMBER_LIST = re.compile(r"\[\n\s+([^\[\]{}\"]*?)\n\s*\]")


def _dump_json(obj: Any, out: TextIO) -> None:
    """Indented strict JSON with lists of numbers (shapes) kept on one line.

    ``ensure_ascii``: every non-ASCII or control character is a ``\\u`` escape, so the
    output is valid JSON and harmless on a terminal; ``allow_nan=False``: a non-finite
    number would be an error (callers turn them into ``None``).
    """
    text = json.dumps(obj, ensure_ascii=True, allow_nan=False, indent=2)
    # A raw newline only occurs between tokens (strings escape theirs), so a "[" followed by
    # a newline opens a list; collapse those holding no string, list or object.
    text = _NUMBER_LIST.sub(
        lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",\n")) + "]", text
    )
    out.write(text + "\n")


def _summary(value: Any, limit: int = 70) -> str:
    """A one-line, escaped, shortened rendering of a metadata value."""
    if isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k}: {_summary(v, limit)}" for k, v in value.items()) + "}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_summary(v, limit) for v in value) + "]"
    elif isinstance(value, (bytes, bytearray)):
        text = f"<{len(value)} bytes>"
    else:
        text = str(value)
    text = escape(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- streaming reads


def iter_blocks(shape: Sequence[int], budget: int = BLOCK_ELEMENTS) -> Iterator[tuple[slice, ...]]:
    """Index tuples that cover an array of ``shape`` in row blocks of at most ``budget`` elements.

    A block is a run of rows along the first axis whose trailing size fits the budget;
    when even one row is too large the leading axes are walked one index at a time.

    >>> list(iter_blocks((5, 2), budget=4))
    [(slice(0, 2, None),), (slice(2, 4, None),), (slice(4, 5, None),)]
    >>> list(iter_blocks((2, 3), budget=2))[:2]
    [(slice(0, 1, None), slice(0, 2, None)), (slice(0, 1, None), slice(2, 3, None))]
    """
    if not shape:
        yield ()
        return
    if any(d == 0 for d in shape):
        return
    suffix = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        suffix[i] = suffix[i + 1] * shape[i]
    axis = next(i for i in range(len(shape)) if suffix[i + 1] <= budget)
    step = max(1, budget // suffix[axis + 1])
    for outer in itertools.product(*(range(n) for n in shape[:axis])):
        lead = tuple(slice(i, i + 1) for i in outer)
        for start in range(0, shape[axis], step):
            yield (*lead, slice(start, min(start + step, shape[axis])))


def _value_blocks(reader: Any, key: str, info: Any) -> Iterator[np.ndarray]:
    """A value as arrays of at most about ``BLOCK_ELEMENTS`` elements each.

    A small value is read whole (its checksum is checked); a large one is sliced
    through the lazy array, so it is never in memory at once.
    """
    shape = tuple(info.shape)
    size = math.prod(shape)
    if size <= BLOCK_ELEMENTS:
        yield np.asarray(reader.read(key))
        return
    lazy = reader[key]
    for index in iter_blocks(shape, BLOCK_ELEMENTS):
        yield np.asarray(lazy[index])


def _is_floating(dtype: np.dtype) -> bool:
    # ml_dtypes floats (bfloat16, float8_*) have kind "V"; recognise them by name.
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def _as_float64(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "c":
        return np.abs(x).astype(np.float64)
    return x.astype(np.float64)


class Stats:
    """Streaming min/max/mean/std over finite elements, plus NaN and Inf counts.

    Blocks are merged with Chan's parallel formula, so the result does not depend
    on the block size. Complex values are summarised by their magnitude.

    >>> s = Stats()
    >>> s.add(np.array([1.0, np.nan])); s.add(np.array([3.0, np.inf]))
    >>> s.as_dict()
    {'min': 1.0, 'max': 3.0, 'mean': 2.0, 'std': 1.0, 'nan': 1, 'inf': 1}
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min: float | int = math.inf
        self.max: float | int = -math.inf
        self.nan = 0
        self.inf = 0

    def add(self, block: np.ndarray) -> None:
        block = np.asarray(block)
        if block.dtype.kind in "biu" and block.size:  # exact extremes for integers
            lo, hi = int(block.min()), int(block.max())
            self.min = lo if self.n == 0 else min(self.min, lo)
            self.max = hi if self.n == 0 else max(self.max, hi)
            x = block.astype(np.float64).ravel()
            self._add_finite(x, extremes=False)
            return
        x = _as_float64(block).ravel()
        finite = np.isfinite(x)
        if not finite.all():
            nan = int(np.count_nonzero(np.isnan(x)))
            self.nan += nan
            self.inf += int(x.size - np.count_nonzero(finite)) - nan
            x = x[finite]
        self._add_finite(x, extremes=True)

    def _add_finite(self, x: np.ndarray, *, extremes: bool) -> None:
        if x.size == 0:
            return
        n_b = int(x.size)
        mean_b = float(x.mean())
        m2_b = float(np.square(x - mean_b).sum())
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.n * n_b / n
        self.n = n
        if extremes:
            self.min = min(self.min, float(x.min()))
            self.max = max(self.max, float(x.max()))

    def as_dict(self) -> dict[str, Any]:
        """The stats, ``None`` where no finite element exists."""
        has = self.n > 0
        return {
            "min": _finite_or_none(self.min) if has else None,  # an int for integer values
            "max": _finite_or_none(self.max) if has else None,
            "mean": _finite_or_none(self.mean) if has else None,
            "std": _finite_or_none(math.sqrt(self.m2 / self.n)) if has else None,
            "nan": self.nan,
            "inf": self.inf,
        }


# --------------------------------------------------------------------------- inspect


def _variable_record(reader: Any, key: str) -> dict[str, Any]:
    info = reader.info(key)
    attrs = dict(getattr(info, "attrs", {}) or {})
    trainable = attrs.get("trainable")
    return {
        "key": key,
        "name": str(attrs.get("name", key)),
        "dtype": _dtype_str(info.dtype),
        "shape": [int(d) for d in info.shape],
        "nbytes": int(info.nbytes),
        "trainable": bool(trainable) if isinstance(trainable, (bool, np.bool_)) else None,
    }


def _tree_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The keys as a tree of their segments, leaves annotated with dtype/shape/size.

    Segments are split at ``/`` (object-graph keys); PyTorch-style keys with no ``/``
    at all (``model.layers.0.weight``) are split at ``.`` instead.
    """
    keys = [rec["key"] for rec in records]
    sep = "." if not any("/" in k for k in keys) and any("." in k for k in keys) else "/"
    root: dict[str, Any] = {}
    leaves: dict[int, dict[str, Any]] = {}
    for rec in records:
        node = root
        parts = rec["key"].split(sep)
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a key that is also a prefix of another key
                child = node[part + sep] = {}
            node = child
        node[parts[-1] if parts[-1] not in node else parts[-1] + " "] = id(rec)
        leaves[id(rec)] = rec

    lines: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        items = list(node.items())
        for i, (name, child) in enumerate(items):
            last = i == len(items) - 1
            branch = "└── " if last else "├── "
            if isinstance(child, dict):
                lines.append(prefix + branch + escape(name))
                walk(child, prefix + ("    " if last else "│   "))
            else:
                rec = leaves[child]
                detail = f"{rec['dtype']} {_shape_str(rec['shape'])} {human_size(rec['nbytes'])}"
                if rec["trainable"] is False:
                    detail += ", not trainable"
                if rec["name"] != rec["key"] and rec["name"] != name:
                    detail += f", name {escape(repr(rec['name']))}"
                lines.append(f"{prefix}{branch}{escape(name)}  [{detail}]")

    walk(root, "")
    return lines


def _open(path: str | Path) -> Any:
    """``cv.open(path)``, with a hint when ``path`` is a directory of checkpoints."""
    try:
        return cv.open(path)
    except cv.UnsupportedFormatError:
        if Path(path).is_dir():
            raise _UsageError(
                f"{str(path)!r} is a directory, not a checkpoint; "
                f"'ckpt ls {path}' lists the checkpoints in it"
            ) from None
        raise


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    path = args.path
    with _open(path) as reader:
        keys = [k for k in reader if args.filter is None or fnmatch.fnmatchcase(k, args.filter)]
        records = [_variable_record(reader, k) for k in keys]
        if args.stats:
            for rec in records:
                stats = Stats()
                for block in _value_blocks(reader, rec["key"], reader.info(rec["key"])):
                    stats.add(block)
                rec.update(stats.as_dict())
        fmt = str(reader.format)
        metadata = reader.metadata() if not args.json else {}

    if args.json:
        _dump_json({"path": str(path), "format": fmt, "variables": records}, out)
        return EXIT_OK

    print(f"path: {escape(path)}", file=out)
    print(f"format: {escape(fmt)}", file=out)
    if metadata:
        print("metadata:", file=out)
        for mkey, mval in metadata.items():
            print(f"  {escape(mkey)}: {_summary(mval)}", file=out)
    print(file=out)
    if args.tree:
        for line in _tree_lines(records):
            print(line, file=out)
    else:
        header = ["KEY", "DTYPE", "SHAPE", "SIZE", "TRAINABLE"]
        if args.stats:
            header += ["MIN", "MAX", "MEAN", "STD", "NAN", "INF"]
        rows = [header]
        for rec in records:
            tr = rec["trainable"]
            row = [
                escape(rec["key"]),
                rec["dtype"],
                _shape_str(rec["shape"]),
                human_size(rec["nbytes"]),
                "-" if tr is None else ("yes" if tr else "no"),
            ]
            if args.stats:
                row += [_num(rec[f]) for f in ("min", "max", "mean", "std", "nan", "inf")]
            rows.append(row)
        right = frozenset({3} | (set(range(5, 11)) if args.stats else set()))
        for line in _table(rows, right):
            print(line, file=out)
        if len(rows) == 1:
            what = f" match {escape(args.filter)}" if args.filter else ""
            print(f"(no variables{what})", file=out)
    n = len(records)
    elements = sum(math.prod(r["shape"]) for r in records)
    total = sum(r["nbytes"] for r in records)
    trainable = sum(math.prod(r["shape"]) for r in records if r["trainable"])
    line = f"\n{n} variable{'s' if n != 1 else ''}, {elements:,} elements, {human_size(total)}"
    if any(r["trainable"] is not None for r in records):
        line += f" ({trainable:,} trainable elements)"
    print(line, file=out)
    return EXIT_OK


# --------------------------------------------------------------------------- convert

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
        if self._dtype is not None and _is_floating(value.dtype) and value.dtype != self._dtype:
            value = value.astype(self._dtype)
        self._progress.update(value.nbytes, key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if src.resolve() == dst.resolve():
        raise _UsageError(f"source and destination are the same path {str(src)!r}")
    if (dst.exists() or dst.is_symlink()) and not args.force:
        raise _UsageError(f"{str(dst)!r} exists; pass --force to replace it")
    with _open(src) as reader:
        plan: dict[str, str] = {}
        attrs: dict[str, dict[str, Any]] = {}
        total = 0
        for key in reader:
            if args.filter is not None and not fnmatch.fnmatchcase(key, args.filter):
                continue
            new = key
            for pattern, repl in args.rename:
                try:
                    new = pattern.sub(repl, new)
                except re.error as exc:  # a bad group reference in TO, e.g. \2 with one group
                    raise _UsageError(f"--rename {pattern.pattern}={repl}: {exc}") from None
            if not new:
                raise _UsageError(f"--rename maps {key!r} to an empty key")
            if new in plan:
                raise _UsageError(f"--rename maps both {plan[new]!r} and {key!r} to {new!r}")
            plan[new] = key
            info = reader.info(key)
            kept = {a: info.attrs[a] for a in _KEPT_ATTRS if a in (info.attrs or {})}
            if kept:
                attrs[new] = kept
            size = math.prod(info.shape)
            itemsize = info.dtype.itemsize
            if args.dtype is not None and _is_floating(np.dtype(info.dtype)):
                itemsize = args.dtype.itemsize
            total += size * itemsize
        if not plan:
            raise _UsageError(f"nothing to convert: no key of {str(src)!r} matches {args.filter!r}")
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


# --------------------------------------------------------------------------- diff


def _compare(
    ra: Any, rb: Any, key: str, ia: Any, ib: Any, atol: float, rtol: float
) -> dict[str, Any]:
    """Per-key comparison record; values compared block by block, B is the reference."""
    rec: dict[str, Any] = {
        "key": key,
        "dtype_a": _dtype_str(ia.dtype),
        "dtype_b": _dtype_str(ib.dtype),
        "shape_a": [int(d) for d in ia.shape],
        "shape_b": [int(d) for d in ib.shape],
        "max_abs": None,
        "max_rel": None,
        "beyond_tolerance": None,
    }
    if tuple(ia.shape) != tuple(ib.shape):
        rec["status"] = "shape"
        return rec
    max_abs = max_rel = 0.0
    beyond = 0
    exact_ints = (
        atol == 0
        and rtol == 0
        and np.dtype(ia.dtype) == np.dtype(ib.dtype)
        and np.dtype(ia.dtype).kind in "biu"
    )
    with np.errstate(all="ignore"):
        for a, b in zip(_value_blocks(ra, key, ia), _value_blocks(rb, key, ib), strict=True):
            cplx = a.dtype.kind == "c" or b.dtype.kind == "c"
            wide = np.complex128 if cplx else np.float64
            a64 = a.astype(wide).ravel()
            b64 = b.astype(wide).ravel()
            same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
            d = np.abs(a64 - b64)
            d[same] = 0.0
            d[np.isnan(d)] = np.inf  # NaN on one side only
            ref = np.abs(b64)
            rel = np.where(d == 0, 0.0, d / ref)
            out = (d > atol + rtol * ref) | np.isinf(d)
            if exact_ints:
                out |= (a != b).ravel()
            if d.size:
                max_abs = max(max_abs, float(d.max()))
                max_rel = max(max_rel, float(np.nan_to_num(rel, nan=np.inf).max()))
            beyond += int(np.count_nonzero(out))
    rec["max_abs"] = max_abs
    rec["max_rel"] = max_rel
    rec["beyond_tolerance"] = beyond
    if rec["dtype_a"] != rec["dtype_b"]:
        rec["status"] = "dtype"
    elif beyond:
        rec["status"] = "different"
    elif max_abs == 0.0:
        rec["status"] = "equal"
    else:
        rec["status"] = "close"
    return rec


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args.a) as ra, _open(args.b) as rb:
        keys_a, keys_b = list(ra.keys()), list(rb.keys())
        set_a, set_b = set(keys_a), set(keys_b)
        only_a = [k for k in keys_a if k not in set_b]
        only_b = [k for k in keys_b if k not in set_a]
        records = [
            _compare(ra, rb, k, ra.info(k), rb.info(k), args.atol, args.rtol)
            for k in keys_a
            if k in set_b
        ]
    differing = [r for r in records if r["status"] in ("shape", "dtype", "different")]
    equal = not (only_a or only_b or differing)
    if args.json:
        for r in records:
            r["max_abs"] = _finite_or_none(r["max_abs"])
            r["max_rel"] = _finite_or_none(r["max_rel"])
        _dump_json(
            {
                "a": str(args.a),
                "b": str(args.b),
                "atol": args.atol,
                "rtol": args.rtol,
                "equal": equal,
                "only_in_a": only_a,
                "only_in_b": only_b,
                "values": records,
            },
            out,
        )
        return EXIT_OK if equal else EXIT_MISMATCH

    rows = [["only in A", escape(k), ""] for k in only_a]
    rows += [["only in B", escape(k), ""] for k in only_b]
    for r in records:
        if r["status"] == "equal":
            continue
        if r["status"] == "shape":
            change = f"{_shape_str(r['shape_a'])} -> {_shape_str(r['shape_b'])}"
            rows.append(["shape", escape(r["key"]), change])
            continue
        detail = (
            f"max abs {_num(r['max_abs'])}  max rel {_num(r['max_rel'])}  "
            f"{r['beyond_tolerance']:,} of {math.prod(r['shape_a']):,} elements beyond tolerance"
        )
        if r["status"] == "dtype":
            detail = f"{r['dtype_a']} -> {r['dtype_b']}  {detail}"
        rows.append([r["status"], escape(r["key"]), detail])
    for line in _table([[status.ljust(9), key, detail] for status, key, detail in rows]):
        print(line, file=out)
    counts = {s: sum(1 for r in records if r["status"] == s) for s in ("equal", "close")}
    tol = f"atol={args.atol:g}, rtol={args.rtol:g}"
    if equal:
        print(
            f"Equal: {len(records)} values ({counts['equal']} identical, "
            f"{counts['close']} within {tol})",
            file=out,
        )
        return EXIT_OK
    print(
        f"Different: {len(differing)} of {len(records)} shared values differ beyond {tol}; "
        f"{len(only_a)} only in A, {len(only_b)} only in B",
        file=out,
    )
    return EXIT_MISMATCH


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    path = args.path
    try:
        reader = _open(path)
    except cv.CorruptCheckpointError as exc:
        print(f"DAMAGED  {escape(path)}: {_one_line(exc)}", file=out)
        print(f"FAILED: {escape(path)} cannot be read", file=out)
        return EXIT_MISMATCH
    with reader:
        damaged: list[tuple[str, str]] = []
        keys = list(reader.keys())
        try:
            reader.metadata()
        except cv.CorruptCheckpointError as exc:
            damaged.append(("<metadata>", _one_line(exc)))
        verify_all = getattr(reader, "verify_all", None)
        if callable(verify_all):
            try:
                damaged += [(str(k), str(reason)) for k, reason in verify_all()]
            except (cv.CorruptCheckpointError, OSError) as exc:  # damage beyond one value
                damaged.append(("<checkpoint>", _one_line(exc)))
        else:
            for key in keys:
                try:
                    reader.verify(key)
                except (cv.CorruptCheckpointError, OSError) as exc:
                    damaged.append((key, _one_line(exc)))
        unchecked = sum(1 for k in keys if reader.info(k).checksum is None)
    n = len(keys)
    if damaged:
        for key, reason in damaged:
            print(f"DAMAGED  {escape(key)}: {escape(_one_line(reason))}", file=out)
        print(f"FAILED: {len(damaged)} of {n} values damaged in {escape(path)}", file=out)
        return EXIT_MISMATCH
    note = ""
    if unchecked:
        note = f" ({unchecked} without a stored checksum: read and checked for structure only)"
    print(f"OK: {n} value{'s' if n != 1 else ''} verified{note}", file=out)
    return EXIT_OK


# --------------------------------------------------------------------------- ls

_CKPT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d+)(?P<ext>\.h5|\.hdf5|\.zarr|\.index)$")


def _disk_size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    if path.suffix == ".index":  # a TensorFlow prefix: the index and its data shards
        stem = path.name[: -len(".index")]
        return sum(p.stat().st_size for p in path.parent.glob(stem + ".*") if p.is_file())
    return path.stat().st_size


def _manager_checkpoints(directory: Path) -> list[Path]:
    """The checkpoints of the manager directory, oldest step first."""
    found = []
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue
        m = _CKPT_NAME.match(entry.name)
        if m is None:
            continue
        path = entry.with_name(entry.name[: -len(".index")]) if m["ext"] == ".index" else entry
        found.append((int(m["step"]), entry.stat().st_mtime, path))
    found.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in found]


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    directory = Path(args.directory)
    if not directory.exists():
        raise cv.CheckpointNotFoundError(f"No directory {str(directory)!r}.")
    if not directory.is_dir():
        raise _UsageError(f"{str(directory)!r} is not a directory")
    paths = _manager_checkpoints(directory)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a damaged state file
        warnings.simplefilter("always")
        try:
            latest = cv.latest_checkpoint(directory)
        except cv.CkptError as exc:  # an unreadable state: still list what is on disk
            sys.stderr.write(
                f"ckpt: warning: {_one_line(exc).rstrip('.')}; marking the highest step "
                "latest\n"
            )
            latest = None
    for w in caught:
        sys.stderr.write(f"ckpt: warning: {_one_line(str(w.message))}\n")
    latest_path = Path(latest) if latest else (paths[-1] if paths else None)
    rows = []
    for p in paths:
        m = _CKPT_NAME.match(p.name if p.exists() else p.name + ".index")
        stat_target = p if p.exists() else p.with_name(p.name + ".index")
        mtime = stat_target.stat().st_mtime
        rows.append(
            {
                "path": str(p),
                "step": int(m["step"]) if m else None,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(mtime)),
                "mtime": mtime,
                "size": _disk_size(stat_target),
                "latest": latest_path is not None and _same(p, latest_path),
            }
        )
    if args.json:
        _dump_json(
            {
                "directory": str(directory),
                "latest": str(latest_path) if latest_path is not None else None,
                "checkpoints": rows,
            },
            out,
        )
        return EXIT_OK
    if not rows:
        print(f"No checkpoints in {escape(directory)}", file=out)
        return EXIT_OK
    table = [["STEP", "SAVED", "SIZE", "CHECKPOINT", ""]]
    for r in rows:
        table.append(
            [
                str(r["step"]),
                r["time"].replace("T", " "),
                human_size(r["size"]),
                escape(Path(r["path"]).name),
                "(latest)" if r["latest"] else "",
            ]
        )
    for line in _table(table, right=frozenset({0, 2})):
        print(line, file=out)
    total = sum(r["size"] for r in rows)
    print(f"\n{len(rows)} checkpoint{'s' if len(rows) != 1 else ''}, {human_size(total)}", file=out)
    return EXIT_OK


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


# --------------------------------------------------------------------------- parser


class _UsageError(Exception):
    """Bad usage found after parsing (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``ckpt: error: <what> (see 'ckpt SUB --help')``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"ckpt: error: {_one_line(message)} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_USAGE)


_MAIN_EPILOG = """\
exit status: 0 success, 1 a difference or damaged value found, 2 bad usage or
unreadable input (one line on stderr, 'ckpt: error: ...').

examples:
  ckpt inspect runs/ckpt-3.h5
  ckpt inspect model.safetensors --stats --filter 'encoder/*'
  ckpt convert model.pt model.h5 --dtype bfloat16
  ckpt diff runs/ckpt-2.h5 runs/ckpt-3.h5 --atol 1e-6
  ckpt verify runs/ckpt-3.h5
  ckpt ls runs/
"""

_EPILOGS = {
    "inspect": """\
PATH may be a ckptvar checkpoint (.h5, .zarr) or a foreign one: a TensorFlow
checkpoint prefix (ckpt-1 for ckpt-1.index), PyTorch .pt/.pth/.bin,
.safetensors, Keras .weights.h5 or .npz. Nothing is executed while reading.

--stats reads every value in blocks of about a million elements, so memory
stays small whatever the size; min/max/mean/std cover the finite elements only
(complex values: their magnitude) and NaN/Inf are counted.

--json prints one object: {"path", "format", "variables": [{"key", "name",
"dtype", "shape", "nbytes", "trainable"}, ...]}; --stats adds "min", "max",
"mean", "std", "nan", "inf" (null where there is no finite element).

examples:
  ckpt inspect runs/ckpt-3.h5
  ckpt inspect runs/ckpt-3.h5 --tree
  ckpt inspect tf_ckpt/ckpt-1 --filter 'model/*/kernel' --stats
  ckpt inspect model.safetensors --json | python -m json.tool
""",
    "convert": """\
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
""",
    "diff": """\
Compares every key present in both checkpoints, block by block. An element
differs when |a - b| > atol + rtol * |b| (B is the reference); NaN equals NaN.
The defaults (atol = rtol = 0) ask for exact equality. Keys only in one file,
a changed shape or a changed dtype are differences too.

exit status: 0 equal (within tolerance), 1 different, 2 unreadable input.

examples:
  ckpt diff runs/ckpt-2.h5 runs/ckpt-3.h5
  ckpt diff model.h5 model.safetensors --atol 1e-3 --json
""",
    "verify": """\
Reads every value and checks it against its stored checksum (formats without
checksums, such as .npz and .safetensors, are read and checked for structure).
Every damaged value is named, a truncated file included.

exit status: 0 all values intact, 1 damage found, 2 missing or unreadable input.

example:
  ckpt verify runs/ckpt-3.h5
""",
    "ls": """\
Lists the checkpoints of a CheckpointManager directory (files named
PREFIX-STEP.h5, PREFIX-STEP.zarr or TensorFlow PREFIX-STEP.index) with their
step, modification time and size on disk, and marks the latest.

example:
  ckpt ls runs/
""",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``ckpt`` argument parser (used by :func:`main` and the docs)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="ckpt",
        description="Inspect, convert, compare and verify ckptvar checkpoints\n"
        "(and TensorFlow, PyTorch, safetensors, Keras and .npz files).",
        epilog=_MAIN_EPILOG,
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"ckpt (ckptvar) {cv.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(_subparsers=sub.choices)

    p = sub.add_parser(
        "inspect",
        help="list the values of a checkpoint",
        description="List a checkpoint's values: key, dtype, shape, size, trainable.",
        epilog=_EPILOGS["inspect"],
        formatter_class=fmt,
    )
    p.add_argument(
        "path", metavar="PATH", help="the checkpoint (file, .zarr directory or TF prefix)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.add_argument("--stats", action="store_true", help="add min/max/mean/std and NaN/Inf counts")
    p.add_argument("--tree", action="store_true", help="show the keys as the object-graph tree")
    p.add_argument(
        "--filter", metavar="GLOB", help="only keys matching this glob (fnmatch, case-sensitive)"
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "convert",
        help="convert a checkpoint to .h5, .zarr, .safetensors or .npz",
        description="Convert any readable checkpoint to .h5, .zarr, .safetensors or .npz.",
        epilog=_EPILOGS["convert"],
        formatter_class=fmt,
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
    p.add_argument("--filter", metavar="GLOB", help="convert only the keys matching this glob")
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
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "diff",
        help="compare two checkpoints value by value",
        description="Compare two checkpoints: per-key max abs/rel difference,\n"
        "missing and extra keys, shape and dtype changes.",
        epilog=_EPILOGS["diff"],
        formatter_class=fmt,
    )
    p.add_argument("a", metavar="A", help="the first checkpoint")
    p.add_argument("b", metavar="B", help="the second (reference) checkpoint")
    for name, what in (("--atol", "absolute"), ("--rtol", "relative")):
        p.add_argument(
            name, type=_non_negative, default=0.0, metavar="X", help=f"{what} tolerance (default 0)"
        )
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser(
        "verify",
        help="check every value against its checksum",
        description="Check every value of a checkpoint against its stored checksum.",
        epilog=_EPILOGS["verify"],
        formatter_class=fmt,
    )
    p.add_argument("path", metavar="PATH", help="the checkpoint to verify")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "ls",
        help="list a checkpoint manager's directory",
        description="List a CheckpointManager directory: step, time, size, and the latest.",
        epilog=_EPILOGS["ls"],
        formatter_class=fmt,
    )
    p.add_argument("directory", metavar="DIRECTORY", help="the manager's directory")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.set_defaults(func=cmd_ls)
    return parser


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _one_line(message: Any) -> str:
    text = str(message)
    if isinstance(message, KeyError) and not isinstance(message, cv.CkptError) and message.args:
        text = str(message.args[0])
    return escape(" ".join(text.split()))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckpt`` with ``argv`` (``sys.argv[1:]`` by default); returns the exit status."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if callable(reconfigure):
            reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, so the hint names its --help
            args._subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already reported
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.func(args, sys.stdout))
    except _UsageError as exc:
        sys.stderr.write(f"ckpt: error: {_one_line(exc)}\n")
    except (cv.CkptError, OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        sys.stderr.write(f"ckpt: error: {_one_line(exc)}\n")
    except KeyboardInterrupt:
        sys.stderr.write("ckpt: error: interrupted\n")
        return 130
    return EXIT_USAGE


def _broken_pipe() -> int:
    # The reader went away (`ckpt inspect ... | head`): stop quietly, like other tools.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
