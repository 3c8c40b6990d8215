"""``ckpt diff``: two checkpoints compared value by value, block by block."""

from __future__ import annotations

import argparse
import math
from typing import Any, TextIO

import numpy as np

from ._blocks import value_blocks
from ._common import EXIT_MISMATCH, EXIT_OK, open_checkpoint
from ._output import dtype_str, dump_json, escape, finite_or_none, num, shape_str, table

EPILOG = """\
Compares every key present in both checkpoints, block by block. An element
differs when |a - b| > atol + rtol * |b| (B is the reference); NaN equals NaN.
The defaults (atol = rtol = 0) ask for exact equality. Keys only in one file,
a changed shape or a changed dtype are differences too.

exit status: 0 equal (within tolerance), 1 different, 2 unreadable input.

examples:
  ckpt diff runs/ckpt-2.h5 runs/ckpt-3.h5
  ckpt diff model.h5 model.safetensors --atol 1e-3 --json
"""


def add_parser(sub: Any) -> None:
    """Register ``diff`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "diff",
        help="compare two checkpoints value by value",
        description="Compare two checkpoints: per-key max abs/rel difference,\n"
        "missing and extra keys, shape and dtype changes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="the first checkpoint")
    p.add_argument("b", metavar="B", help="the second (reference) checkpoint")
    for name, what in (("--atol", "absolute"), ("--rtol", "relative")):
        p.add_argument(
            name, type=_non_negative, default=0.0, metavar="X", help=f"{what} tolerance (default 0)"
        )
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.set_defaults(func=run)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _compare(
    ra: Any, rb: Any, key: str, ia: Any, ib: Any, atol: float, rtol: float
) -> dict[str, Any]:
    """Per-key comparison record; values compared block by block, B is the reference."""
    rec: dict[str, Any] = {
        "key": key,
        "dtype_a": dtype_str(ia.dtype),
        "dtype_b": dtype_str(ib.dtype),
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
        for (_, a), (_, b) in zip(
            value_blocks(ra, key, ia), value_blocks(rb, key, ib), strict=True
        ):
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


def run(args: argparse.Namespace, out: TextIO) -> int:
    with open_checkpoint(args.a) as ra, open_checkpoint(args.b) as rb:
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
            r["max_abs"] = finite_or_none(r["max_abs"])
            r["max_rel"] = finite_or_none(r["max_rel"])
        dump_json(
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
            change = f"{shape_str(r['shape_a'])} -> {shape_str(r['shape_b'])}"
            rows.append(["shape", escape(r["key"]), change])
            continue
        detail = (
            f"max abs {num(r['max_abs'])}  max rel {num(r['max_rel'])}  "
            f"{r['beyond_tolerance']:,} of {math.prod(r['shape_a']):,} elements beyond tolerance"
        )
        if r["status"] == "dtype":
            detail = f"{r['dtype_a']} -> {r['dtype_b']}  {detail}"
        rows.append([r["status"], escape(r["key"]), detail])
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
