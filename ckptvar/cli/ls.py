"""``ckpt ls``: the checkpoints of a CheckpointManager directory, with the latest marked."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import ckptvar as cv

from ._common import EXIT_OK, UsageError, is_url, storage_options
from ._output import dump_json, escape, one_line, table
from ._progress import human_size

EPILOG = """\
Lists the checkpoints of a CheckpointManager directory (files named
PREFIX-STEP.h5, PREFIX-STEP.zarr or TensorFlow PREFIX-STEP.index) with their
step, modification time and size on disk, and marks the latest. At an
object-store URL (s3://bucket/run) only committed steps are listed, with their
commit time and stored size. An HDF5 step whose bytes incremental steps refer to
(an unchanged value, a row delta's base or patch) says which ("holds bytes of
ckpt-5.h5"; in --json: "referred_by"), on disk and at a URL; the manager keeps it
while they do. A file or directory named like a step that ckptvar did not write
(your own ckpt-3.h5) is not listed, as the manager does not list it, and is named
on a last line ("not_checkpoints" in --json). A folder that is a checkpoint
itself (an Orbax run, a DCP or Hugging Face folder) is named as such, with its
format ("checkpoint_format" in --json; null otherwise): 'ckpt inspect' reads it.

example:
  ckpt ls runs/
  ckpt ls s3://bucket/run --storage-option endpoint=http://127.0.0.1:9000
"""


HELP = "list a checkpoint manager's directory"
DESCRIPTION = "List a CheckpointManager directory: step, time, size, and the latest."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ckpt ls``."""
    p.add_argument("directory", metavar="DIRECTORY", help="the manager's directory")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


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


def _manager_checkpoints(directory: Path) -> tuple[list[Path], list[Path]]:
    """The checkpoints of the manager directory, oldest step first, and the entries named
    like a step that are not ckptvar's (``cv.storage.is_own_checkpoint``, the manager's
    own test; a TensorFlow prefix is TensorFlow's). A link to nothing, or a step pruned
    while we look, is neither: the manager does not list it either."""
    found = []
    foreign = []
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue
        m = _step_of(entry.name)
        if m is None:
            continue
        path = entry.with_name(entry.name[: -len(".index")]) if m.suffix == ".index" else entry
        try:
            mtime = entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if m.suffix != ".index" and not cv.storage.is_own_checkpoint(entry):
            foreign.append(entry)
            continue
        found.append((m.step, mtime, path))
    found.sort(key=lambda t: (t[0], t[1]))
    return [p for _, _, p in found], sorted(foreign)


def _committed_steps(url: str) -> list[tuple[str, float, int]]:
    """``[(step_url, commit_time, size), ...]`` of the committed steps directly below ``url``."""
    location = cv.locations
    loc = location.open_location(url, storage_options=storage_options())
    found = []
    for step in location.list_committed_steps(loc):
        record = location.read_commit(loc, step)
        if record is None:  # pruned while we looked
            continue
        objects = loc.list(record.data) if not loc.exists(record.data) else []
        size = sum(o.size for o in objects) if objects else loc.size(record.data)
        found.append((loc.join(step), record.time, size))
    return found


def _remote_rows(url: str) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of the committed steps below ``url``, and the latest one's URL."""
    latest = cv.latest_checkpoint(url, storage_options=storage_options())
    steps = _committed_steps(url)
    holders = _referred_by([u for u, _, _ in steps], storage_options())
    rows = []
    for step_url, when, size in steps:
        m = _step_of(step_url.rsplit("/", 1)[-1])
        if m is None:
            continue
        rows.append(
            {
                "path": step_url,
                "step": m.step,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when)),
                "mtime": when,
                "size": size,
                "latest": step_url == latest,
            }
        )
        name = step_url.rsplit("/", 1)[-1]
        if name in holders:
            rows[-1]["referred_by"] = holders[name]
    rows.sort(key=lambda r: (r["step"], r["mtime"]))
    return rows, latest


def run(args: argparse.Namespace, out: TextIO) -> int:
    if is_url(args.directory):
        return _print(args, out, args.directory, *_remote_rows(args.directory))
    directory = Path(args.directory)
    if not directory.exists():
        raise cv.CheckpointNotFoundError(f"No directory {str(directory)!r}.")
    if not directory.is_dir():
        raise UsageError(f"{str(directory)!r} is not a directory")
    paths, foreign = _manager_checkpoints(directory)
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
    holders = _referred_by(paths)
    rows: list[dict[str, Any]] = []
    for p in paths:
        m = _step_of(p.name if p.exists() else p.name + ".index")
        stat_target = p if p.exists() else p.with_name(p.name + ".index")
        try:
            mtime = stat_target.stat().st_mtime
            size = _disk_size(stat_target)
        except FileNotFoundError:  # pruned by a running manager since it was listed
            continue
        rows.append(
            {
                "path": str(p),
                "step": m.step if m else None,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(mtime)),
                "mtime": mtime,
                "size": size,
                "latest": latest_path is not None and _same(p, latest_path),
            }
        )
        if p.name in holders:
            rows[-1]["referred_by"] = holders[p.name]
    return _print(args, out, directory, rows, str(latest_path) if latest_path else None,
                  foreign=[str(p) for p in foreign], itself=None if rows else _format_of(directory))


def _format_of(directory: Path) -> str | None:
    """The format of ``directory`` when it is a checkpoint itself (an Orbax run, a DCP or
    Hugging Face folder), which ``ckpt inspect`` reads; else None."""
    try:
        with cv.open(directory) as reader:
            return str(reader.format)
    except (cv.CkptError, OSError, ValueError):
        return None


def _print(
    args: argparse.Namespace,
    out: TextIO,
    directory: Path | str,
    rows: list[dict[str, Any]],
    latest: str | None,
    *,
    foreign: list[str] | None = None,
    itself: str | None = None,
) -> int:
    foreign = foreign or []
    if args.json:
        dump_json(
            {
                "directory": str(directory),
                "latest": latest,
                "checkpoints": rows,
                "not_checkpoints": foreign,
                "checkpoint_format": itself,
            },
            out,
        )
        return EXIT_OK
    if not rows:
        print(f"No checkpoints in {escape(directory)}", file=out)
        if itself is not None:
            print(f"{escape(directory)} is itself a checkpoint ({escape(itself)}): "
                  f"'ckpt inspect {escape(directory)}' reads it", file=out)
        _print_foreign(foreign, out)
        return EXIT_OK
    rows_out = [["STEP", "SAVED", "SIZE", "CHECKPOINT", ""]]
    for r in rows:
        rows_out.append(
            [
                str(r["step"]),
                r["time"].replace("T", " "),
                human_size(r["size"]),
                escape(Path(r["path"]).name),
                _note(r),
            ]
        )
    for line in table(rows_out, right=frozenset({0, 2})):
        print(line, file=out)
    total = sum(r["size"] for r in rows)
    print(f"\n{len(rows)} checkpoint{'s' if len(rows) != 1 else ''}, {human_size(total)}", file=out)
    _print_foreign(foreign, out)
    return EXIT_OK


def _print_foreign(foreign: list[str], out: TextIO) -> None:
    if foreign:
        names = ", ".join(escape(Path(p).name) for p in foreign)
        print(f"not listed, named like a step but not a ckptvar checkpoint: {names}", file=out)


def held_steps(path: str) -> list[dict[str, Any]]:
    """The steps at ``path`` (a manager's directory or URL) whose bytes later incremental
    steps refer to, so the manager keeps them: ``[{"path", "referred_by"}, ...]``."""
    steps: list[Path] | list[str]
    if is_url(path):
        steps = [u for u, _, _ in _committed_steps(path)]
        holders = _referred_by(steps, storage_options())
    else:
        steps = _manager_checkpoints(Path(path))[0]
        holders = _referred_by(steps)
    names = [(str(s), str(s).rstrip("/").rsplit("/", 1)[-1]) for s in steps]
    return [{"path": s, "referred_by": holders[n]} for s, n in names if n in holders]


def _referred_by(paths: list[Path] | list[str],
                 options: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """The incremental HDF5 steps' references (local paths or step URLs): holder step
    name -> the steps using its bytes (an external value, a row delta's base or patch)."""
    out: dict[str, set[str]] = {}
    for p in paths:
        name = str(p).rstrip("/").rsplit("/", 1)[-1]
        if not name.endswith(".h5"):  # a step file, or a multi-process step's directory
            continue
        try:
            with cv.open(p, storage_options=options) as reader:
                shared = reader.shared() if isinstance(reader,
                                                       cv.storage.SupportsShared) else {}
        except cv.CkptError:
            continue  # listed as it is; `ckpt verify` says what is wrong
        for names in shared.values():
            for holder in names:
                if holder != name:
                    out.setdefault(holder, set()).add(name)
    return {k: sorted(v) for k, v in out.items()}


def _note(row: dict[str, Any]) -> str:
    notes = ["(latest)"] if row["latest"] else []
    if row.get("referred_by"):
        notes.append(f"(holds bytes of {', '.join(escape(n) for n in row['referred_by'])})")
    return " ".join(notes)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
