"""What the ``convert_*.py`` scripts share: a thin front over ``ckpt convert``.

Each script names the format it accepts and describes itself in its docstring;
the conversion itself is ``ckpt convert`` (the same streaming code, the same
checks and messages), which also offers ``--rename``, ``--filter`` and more.
"""

from __future__ import annotations

import argparse
import sys

import ckptvar as cv
from ckptvar.cli import main as ckpt


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
    parser.add_argument("--skip-unreadable", action="store_true",
                        help="convert the rest when SRC holds values that are not numbers")
    parser.add_argument("-f", "--force", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    try:
        with cv.open(args.src) as reader:
            found = reader.format
    except (cv.CkptError, OSError, ValueError, TypeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if found != fmt:
        print(f"{parser.prog}: error: {args.src!r} is a {found} checkpoint, not {kind}; "
              "use `ckpt convert` for any format.", file=sys.stderr)
        return 2
    command = ["convert", args.src, args.dst]
    for flag in ("dtype", "format"):
        if getattr(args, flag) is not None:
            command += [f"--{flag}", getattr(args, flag)]
    command += ["--skip-unreadable"] * args.skip_unreadable + ["--force"] * args.force
    return ckpt(command)
