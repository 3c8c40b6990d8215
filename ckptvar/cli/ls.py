"""``ckpt ls``: the checkpoints of a CheckpointManager directory, with the latest marked."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import ckptvar as cv

from ._common import EXIT_OK, UsageError
from ._output import dump_json, escape, one_line, table
from ._progress import human_size

EPILOG = """\
Lists the checkpoints of a CheckpointManager directory (files named
PREFIX-STEP.h5, PREFIX-STEP.zarr or TensorFlow PREFIX-STEP.index) with their
step, modification time and size on disk, and marks the latest.

example:
  ckpt ls runs/
"""


def add_parser(sub: Any) -> None:
    """Register ``ls`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "ls",
        help="list a checkpoint manager's directory",
        description="List a CheckpointManager directory: step, time, size, and the latest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", metavar="DIRECTORY", help="the manager's directory")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    p.set_defaults(func=run)


#: The files a CheckpointManager directory holds: ``PREFIX-STEP`` + one of these.
_SUFFIXES = (".h5", ".hdf5", ".zarr", ".index")


def _step_of(name: str) -> cv.checkpoint.StepName | None:
    """``name`` read as ``PREFIX-STEP.suffix`` by the library's own rule, or ``None``."""
    return cv.checkpoint.parse_step_name(name, suffixes=_SUFFIXES)


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
        m = _step_of(entry.name)
        if m is None:
            continue
        path = entry.with_name(entry.name[: -len(".index")]) if m.suffix == ".index" else entry
        found.append((m.step, entry.stat().st_mtime, path))
    found.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in found]


def run(args: argparse.Namespace, out: TextIO) -> int:
    directory = Path(args.directory)
    if not directory.exists():
        raise cv.CheckpointNotFoundError(f"No directory {str(directory)!r}.")
    if not directory.is_dir():
        raise UsageError(f"{str(directory)!r} is not a directory")
    paths = _manager_checkpoints(directory)
    with warnings.catch_warnings(record=True) as caught:  # e.g. a damaged state file
        warnings.simplefilter("always")
        try:
            latest = cv.latest_checkpoint(directory)
        except cv.CkptError as exc:  # an unreadable state: still list what is on disk
            sys.stderr.write(
                f"ckpt: warning: {one_line(exc).rstrip('.')}; marking the highest step latest\n"
            )
            latest = None
    for w in caught:
        sys.stderr.write(f"ckpt: warning: {one_line(str(w.message))}\n")
    latest_path = Path(latest) if latest else (paths[-1] if paths else None)
    rows: list[dict[str, Any]] = []
    for p in paths:
        m = _step_of(p.name if p.exists() else p.name + ".index")
        stat_target = p if p.exists() else p.with_name(p.name + ".index")
        mtime = stat_target.stat().st_mtime
        rows.append(
            {
                "path": str(p),
                "step": m.step if m else None,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(mtime)),
                "mtime": mtime,
                "size": _disk_size(stat_target),
                "latest": latest_path is not None and _same(p, latest_path),
            }
        )
    if args.json:
        dump_json(
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
    rows_out = [["STEP", "SAVED", "SIZE", "CHECKPOINT", ""]]
    for r in rows:
        rows_out.append(
            [
                str(r["step"]),
                r["time"].replace("T", " "),
                human_size(r["size"]),
                escape(Path(r["path"]).name),
                "(latest)" if r["latest"] else "",
            ]
        )
    for line in table(rows_out, right=frozenset({0, 2})):
        print(line, file=out)
    total = sum(r["size"] for r in rows)
    print(f"\n{len(rows)} checkpoint{'s' if len(rows) != 1 else ''}, {human_size(total)}", file=out)
    return EXIT_OK


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
