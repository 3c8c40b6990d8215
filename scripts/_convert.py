"""What the ``convert_*.py`` scripts share: one argparse front over ``cv.open`` + ``cv.save``.

Each script names the format it accepts and describes itself in its docstring;
``ckpt convert`` does the same for every format and adds ``--rename``, ``--filter``
and a progress bar.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import ckptvar as cv


def floating(dtype: np.dtype) -> bool:
    """True for float16/32/64 and the ml_dtypes floats (bfloat16, float8_*)."""
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("bfloat", "float")))


def cast(value: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """``value`` as ``dtype`` if it is floating, else unchanged (integers, bools, complex)."""
    return value.astype(dtype) if dtype is not None and floating(value.dtype) else value


def run(doc: str | None, *, fmt: str, kind: str, src_help: str,
        argv: list[str] | None = None) -> int:
    """Convert SRC (which must be of format ``fmt``, "a/an ``kind``") to DST; an exit status."""
    doc = (doc or "").strip()
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0],
        epilog=doc.split("\n", 1)[1] if "\n" in doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help=src_help)
    parser.add_argument("dst", metavar="DST", help="output: .h5, .zarr, .safetensors or .npz")
    parser.add_argument("--dtype", help="cast floating values to this dtype (e.g. bfloat16)")
    parser.add_argument("--format", help="output format when DST's suffix does not say")
    args = parser.parse_args(argv)
    try:
        dtype = None
        if args.dtype is not None:
            import ml_dtypes

            dtype = np.dtype(getattr(ml_dtypes, args.dtype, args.dtype))
            if not floating(dtype):
                raise ValueError(f"--dtype {args.dtype!r} is not a floating dtype")
        with cv.open(args.src) as reader:
            if reader.format != fmt:
                raise cv.UnsupportedFormatError(
                    f"{args.src!r} is a {reader.format} checkpoint, not {kind}; "
                    "use `ckpt convert` for any format."
                )
            arrays = {key: cast(np.asarray(reader.read(key)), dtype) for key in reader}
        path = cv.save(args.dst, arrays, format=args.format)
    except (cv.CkptError, OSError, ValueError, TypeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"Wrote {len(arrays)} values from {args.src} to {path}")
    return 0
