"""``ckpt diff``: two checkpoints compared value by value, block by block."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any, TextIO

from ._blocks import value_blocks
from ._common import (
    EXIT_MISMATCH,
    EXIT_OK,
    UsageError,
    add_selection,
    describe_selection,
    latest_or_path,
    open_checkpoint,
    progress_for,
    selected,
)
from ._lazy import lazy_module
from ._output import dtype_str, dump_json, escape, num, plain, shape_str, table

if TYPE_CHECKING:
    import numpy as np
else:  # loaded on first use: `ckpt --help` imports no NumPy
    np = lazy_module("numpy")

EPILOG = """\
Compares every key present in both checkpoints, block by block. An element
differs when |a - b| > atol + rtol * |b| (B is the reference). NaN equals NaN
and an infinity the same infinity; a number against an infinity differs whatever
the tolerances; NaN against a number is a difference, and that value's max
abs/rel difference is reported as nan (text and --json alike; --json writes
"nan" and "inf" as strings). Integers are compared exactly, even near 2**63 (max_abs is then an
exact integer). The defaults (atol = rtol = 0) ask for exact equality. Keys
only in one file, a changed shape or a changed dtype are differences too;
--ignore-dtype compares the values across dtypes instead and shows the dtype
change on its own line. --filter/--exclude (globs, repeatable) restrict the
keys compared; a selection matching nothing is an error.

exit status: 0 equal (within tolerance), 1 different, 2 unreadable input.

examples:
  ckpt diff runs/ckpt-2.h5 runs/ckpt-3.h5
  ckpt diff model.h5 model.safetensors --atol 1e-3 --json
  ckpt diff model-bf16.safetensors model.h5 --ignore-dtype --rtol 1e-2
  ckpt diff a.h5 b.h5 --filter 'model/*' --exclude '*/bias'
"""


HELP = "compare two checkpoints value by value"
DESCRIPTION = (
    "Compare two checkpoints: per-key max abs/rel difference,\n"
    "missing and extra keys, shape and dtype changes."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt diff``."""
    p.add_argument("a", metavar="A", help="the first checkpoint")
    p.add_argument("b", metavar="B", help="the second (reference) checkpoint")
    for name, what in (("--atol", "absolute"), ("--rtol", "relative")):
        p.add_argument(
            name, type=_non_negative, default=0.0, metavar="X", help=f"{what} tolerance (default 0)"
        )
    p.add_argument(
        "--ignore-dtype",
        action="store_true",
        help="compare the values of keys whose dtype changed (e.g. a bfloat16 export against "
        "its float32 source); the change is still shown, on its own line",
    )
    add_selection(p)
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _abs_diff(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, bool]:
    """``|a - b|`` elementwise and whether it is exact integer arithmetic.

    Integers are subtracted exactly (as uint64 modulo 2**64, which is exact since
    the distance fits; as Python integers when a negative meets an unsigned value);
    everything else in float64 (complex128 for complex values).
    """
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        a = a.astype(np.int64) if a.dtype.kind == "b" else a
        b = b.astype(np.int64) if b.dtype.kind == "b" else b
        mixed = a.dtype.kind != b.dtype.kind
        if not mixed or not (
            (a.dtype.kind == "i" and (a < 0).any()) or (b.dtype.kind == "i" and (b < 0).any())
        ):
            au, bu = a.astype(np.uint64).ravel(), b.astype(np.uint64).ravel()
            signed = a.dtype.kind == "i" and b.dtype.kind == "i"
            ge = (a >= b).ravel() if signed else au >= bu
            return np.where(ge, au - bu, bu - au), True
        return np.abs(a.astype(object).ravel() - b.astype(object).ravel()), True
    cplx = a.dtype.kind == "c" or b.dtype.kind == "c"
    wide = np.complex128 if cplx else np.float64
    a64, b64 = a.astype(wide).ravel(), b.astype(wide).ravel()
    d = np.abs(a64 - b64)
    d[np.isnan(a64) & np.isnan(b64)] = 0.0  # NaN equals NaN
    d[a64 == b64] = 0.0  # inf equals inf
    return d, False


def _compare(
    ra: Any, rb: Any, key: str, args: argparse.Namespace, on_bytes: Any = None
) -> dict[str, Any]:
    """Per-key comparison record; values compared block by block, B is the reference.

    ``max_abs`` is an int when both sides are integers (exact, even near 2**63), and
    NaN when some element is NaN on one side only (``nan_mismatch`` counts them).
    """
    ia, ib = ra.info(key), rb.info(key)
    rec: dict[str, Any] = {
        "key": key,
        "dtype_a": dtype_str(ia.dtype),
        "dtype_b": dtype_str(ib.dtype),
        "shape_a": [int(d) for d in ia.shape],
        "shape_b": [int(d) for d in ib.shape],
        "max_abs": None,
        "max_rel": None,
        "beyond_tolerance": None,
        "nan_mismatch": None,
    }
    rec["dtype_changed"] = rec["dtype_a"] != rec["dtype_b"]
    if tuple(ia.shape) != tuple(ib.shape):
        rec["status"] = "shape"
        return rec
    atol, rtol = args.atol, args.rtol
    max_abs: float = 0
    max_rel = 0.0
    beyond = nan_mismatch = 0
    with np.errstate(all="ignore"):
        for (_, a), (_, b) in zip(
            value_blocks(ra, key, ia, on_bytes), value_blocks(rb, key, ib, on_bytes), strict=True
        ):
            if not a.size:
                continue
            d, exact = _abs_diff(a, b)
            ref = np.abs(b.astype(np.complex128 if b.dtype.kind == "c" else np.float64)).ravel()
            if exact:
                max_abs = max(max_abs, int(d.max()))
                df = d.astype(np.float64)
                out = d != 0 if atol == 0 and rtol == 0 else df > atol + rtol * ref
            else:
                one_nan = np.isnan(d)
                nan_mismatch += int(np.count_nonzero(one_nan))
                df = d
                # an infinite distance (a number against an infinity, or the two
                # infinities; equal infinities are 0) is beyond any tolerance, even where
                # rtol * |b| is NaN or inf
                out = (d > atol + rtol * ref) | one_nan | np.isinf(d)
                finite_d = d[~one_nan]
                if finite_d.size:
                    max_abs = max(max_abs, float(finite_d.max()))
            rel = np.where(df == 0, 0.0, np.where(np.isinf(df), np.inf, df / ref))
            rel = rel[~np.isnan(rel)]
            if rel.size:
                max_rel = max(max_rel, float(rel.max()))
            beyond += int(np.count_nonzero(out))
    rec["nan_mismatch"] = nan_mismatch
    rec["max_abs"] = math.nan if nan_mismatch else max_abs
    rec["max_rel"] = math.nan if nan_mismatch else max_rel
    rec["beyond_tolerance"] = beyond
    if rec["dtype_changed"] and not args.ignore_dtype:
        rec["status"] = "dtype"
    elif beyond:
        rec["status"] = "different"
    elif max_abs == 0:
        rec["status"] = "equal"
    else:
        rec["status"] = "close"
    return rec


def _rows_of(r: dict[str, Any]) -> list[list[str]]:
    """The table rows of one compared value: none when equal (bar an ignored dtype change)."""
    rows = []
    if r["dtype_changed"] and r["status"] != "dtype":  # --ignore-dtype: said on its own line
        rows.append(["dtype", escape(r["key"]), f"{r['dtype_a']} -> {r['dtype_b']} (ignored)"])
    if r["status"] == "equal":
        return rows
    if r["status"] == "shape":
        change = f"{shape_str(r['shape_a'])} -> {shape_str(r['shape_b'])}"
        return [*rows, ["shape", escape(r["key"]), change]]
    detail = (
        f"max abs {num(r['max_abs'])}  max rel {num(r['max_rel'])}  "
        f"{r['beyond_tolerance']:,} of {math.prod(r['shape_a']):,} elements beyond tolerance"
    )
    if r["nan_mismatch"]:
        detail += f" ({r['nan_mismatch']:,} NaN against a number)"
    if r["status"] == "dtype":
        detail = f"{r['dtype_a']} -> {r['dtype_b']}  {detail}"
    return [*rows, [r["status"], escape(r["key"]), detail]]


def run(args: argparse.Namespace, out: TextIO) -> int:
    args.a, args.b = latest_or_path(args.a), latest_or_path(args.b)
    with open_checkpoint(args.a) as ra, open_checkpoint(args.b) as rb:
        keys_a = [k for k in ra if selected(k, args)]
        keys_b = [k for k in rb if selected(k, args)]
        set_a, set_b = set(keys_a), set(keys_b)
        only_a = [k for k in keys_a if k not in set_b]
        only_b = [k for k in keys_b if k not in set_a]
        if not keys_a and not keys_b and (args.filter or args.exclude):
            raise UsageError(
                f"no key of {str(args.a)!r} or {str(args.b)!r} matches {describe_selection(args)}"
            )
        shared = [k for k in keys_a if k in set_b]
        total = sum(ra.info(k).nbytes + rb.info(k).nbytes for k in shared)
        with progress_for(total, args) as bar:
            records = []
            for k in shared:
                records.append(_compare(ra, rb, k, args, bar.bytes_of(k)))
                bar.update(0, k)
    differing = [r for r in records if r["status"] in ("shape", "dtype", "different")]
    equal = not (only_a or only_b or differing)
    if args.json:
        dump_json(
            {
                "a": str(args.a),
                "b": str(args.b),
                "atol": args.atol,
                "rtol": args.rtol,
                "equal": equal,
                "only_in_a": only_a,
                "only_in_b": only_b,
                "ignore_dtype": args.ignore_dtype,
                "values": plain(records),
            },
            out,
        )
        return EXIT_OK if equal else EXIT_MISMATCH

    rows = [["only in A", escape(k), ""] for k in only_a]
    rows += [["only in B", escape(k), ""] for k in only_b]
    for r in records:
        rows += _rows_of(r)
    for line in table([[status.ljust(9), key, detail] for status, key, detail in rows]):
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
