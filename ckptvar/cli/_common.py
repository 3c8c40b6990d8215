"""What every ``ckpt`` subcommand shares: exit codes, usage errors, opening, key selection.

Key selection is ``--filter`` / ``--exclude``."""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol, TextIO

import ckptvar as cv

from ._output import escape, one_line
from ._progress import Progress

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_USAGE",
    "Command",
    "Parser",
    "UsageError",
    "add_command",
    "add_quiet",
    "add_selection",
    "add_storage_option",
    "is_url",
    "latest_or_path",
    "note",
    "open_checkpoint",
    "progress_for",
    "resolve_latest",
    "say",
    "select",
    "set_quiet",
    "set_storage_options",
    "storage_options",
]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2

#: diff, verify and inspect --stats show a bar only when they run longer than this (s).
PROGRESS_DELAY = 1.0


class UsageError(Exception):
    """Bad usage found after parsing (exit 2)."""


def say(line: str) -> None:
    """Write ``line`` (and a newline) on stderr; a stderr that is gone (closed, a reader
    that went away) takes nothing, and the exit status still tells."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # None when closed at start; EPIPE
        pass


class _Quiet:
    """Whether ``-q``/``--quiet`` was given: notes on stderr are left out."""

    on = False


def set_quiet(quiet: bool) -> None:
    """``-q``/``--quiet`` for this command: :func:`note` says nothing."""
    _Quiet.on = quiet


def note(line: str) -> None:
    """An informational line on stderr (:func:`say`), left out under ``--quiet``;
    warnings and errors use :func:`say` and are always written."""
    if not _Quiet.on:
        say(line)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``ckpt: error: <what> (see 'ckpt SUB --help')``.

    ``argv`` is what is being parsed: an existing file named like an option (``-x.h5``)
    is taken for one by argparse, and the error says how to name it (``--`` before it).
    """

    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        hint = f"see '{self.prog} --help'"
        args = list(Parser.argv)
        dashed = [a for a in args[: args.index("--") if "--" in args else len(args)]
                  if a.startswith("-") and a != "-" and os.path.lexists(a)]
        if dashed:
            hint = f"{dashed[0]!r} is taken for an option: put -- before a path that starts with '-'"
        say(f"ckpt: error: {one_line(message)} ({hint})")
        raise SystemExit(EXIT_USAGE)


_STORAGE_OPTIONS: dict[str, Any] = {}


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/key``) rather than a local path."""
    return isinstance(path, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


class Command(Protocol):
    """A subcommand module: its help texts, its arguments and what it runs."""

    HELP: str
    DESCRIPTION: str
    EPILOG: str

    def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace, out: TextIO) -> int: ...


def add_command(sub: Any, name: str, command: Command) -> argparse.ArgumentParser:
    """Register ``command`` as ``name`` on the subparsers ``sub`` (the epilog keeps its
    line breaks); ``args.func`` is then its ``run``."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=command.HELP,
        description=command.DESCRIPTION,
        epilog=command.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(parser)
    add_quiet(parser)
    add_storage_option(parser)
    parser.set_defaults(func=command.run)
    return parser


def add_storage_option(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): the object-store client's settings."""
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the object-store client for s3:// (gs://, az://) paths, e.g. "
        "endpoint=http://127.0.0.1:9000 or allow_http=true (repeatable; default: the "
        "AWS_*/GOOGLE_*/AZURE_* environment)",
    )


def set_storage_options(pairs: Iterable[str]) -> None:
    """Parse the ``--storage-option`` values for every URL this command opens."""
    _STORAGE_OPTIONS.clear()
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: expected KEY=VALUE")
        parsed: Any = value
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        elif value.isdigit():
            parsed = int(value)
        _STORAGE_OPTIONS[key.strip()] = parsed


def storage_options() -> dict[str, Any] | None:
    """The ``--storage-option`` settings given (None: none)."""
    return dict(_STORAGE_OPTIONS) or None


def open_checkpoint(path: str | Path) -> Any:
    """``cv.open(path)``, with a hint when ``path`` is a directory of checkpoints."""
    if is_url(path):
        return cv.open(path, storage_options=storage_options())
    try:
        return cv.open(path)
    except cv.UnsupportedFormatError:
        # a directory named as a checkpoint (a .zarr, a multi-process step) is one: its
        # own error (a newer format version, say) is what the user needs to read
        if Path(path).is_dir() and Path(path).suffix.lower() not in (".zarr", ".h5", ".hdf5"):
            raise UsageError(
                f"{str(path)!r} is a directory, not a checkpoint; "
                f"'ckpt ls {path}' lists the checkpoints in it"
            ) from None
        raise


def resolve_latest(path: str | Path) -> tuple[str | Path, str | None]:
    """``path``, or the latest checkpoint when ``path`` is a manager's directory.

    Returns the path to open and, for a directory, a note saying which one was taken.
    """
    named_as_one = str(path).rstrip("/").lower().endswith((".h5", ".hdf5", ".zarr"))
    if is_url(path):
        if named_as_one:
            return path, None
        url = cv.latest_checkpoint(str(path), storage_options=storage_options())
        return (path, None) if url is None else (url, f"the latest checkpoint of {str(path)!r}")
    p = Path(path)
    if not p.is_dir() or named_as_one:  # a step of many processes is a directory too
        return path, None
    try:
        with cv.open(p):
            return path, None  # a checkpoint that is a directory (.zarr)
    except cv.UnsupportedFormatError:
        pass
    latest = cv.latest_checkpoint(p)
    if latest is None:
        return path, None  # open_checkpoint explains
    return latest, f"the latest checkpoint of {str(path)!r}"


def latest_or_path(path: str | Path) -> str | Path:
    """:func:`resolve_latest`'s path, saying on stderr which checkpoint a manager's
    directory stands for (``show``, ``convert``, ``diff`` and ``verify``; ``inspect``
    says it in its output)."""
    resolved, why = resolve_latest(path)
    if why is not None:
        note(f"ckpt: reading {escape(str(resolved))}, {escape(why)}")
    return resolved


def add_quiet(p: argparse.ArgumentParser) -> None:
    """``-q``/``--quiet``, the same in every subcommand (:func:`add_command` adds it)."""
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no notes on stderr (warnings and errors are still said)",
    )


def progress_for(total: int, args: argparse.Namespace) -> Progress:
    """A bar on stderr for a job of ``total`` bytes: on a terminal, after one second."""
    show = sys.stderr.isatty() and not getattr(args, "quiet", False)
    return Progress(total, stream=sys.stderr, enabled=show, delay=PROGRESS_DELAY)


def add_selection(p: argparse.ArgumentParser) -> None:
    """``--filter GLOB`` and ``--exclude GLOB``, both repeatable."""
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="GLOB",
        help="only keys matching this glob (fnmatch, case-sensitive); repeat for the union",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out keys matching this glob (repeatable; wins over --filter)",
    )


def selected(key: str, args: argparse.Namespace) -> bool:
    """True when ``key`` matches some ``--filter`` (or none was given) and no ``--exclude``.

    >>> ns = argparse.Namespace(filter=["a/*", "b/*"], exclude=["*/bias"])
    >>> [selected(k, ns) for k in ("a/w", "b/w", "a/bias", "c/w")]
    [True, True, False, False]
    """
    filters: list[str] = getattr(args, "filter", None) or []
    excludes: list[str] = getattr(args, "exclude", None) or []
    if filters and not any(fnmatch.fnmatchcase(key, p) for p in filters):
        return False
    return not any(fnmatch.fnmatchcase(key, p) for p in excludes)


def describe_selection(args: argparse.Namespace) -> str:
    """``--filter 'a/*' --exclude '*/b'``: the selection as the user typed it."""
    parts = [f"--filter {p!r}" for p in getattr(args, "filter", None) or []]
    parts += [f"--exclude {p!r}" for p in getattr(args, "exclude", None) or []]
    return " ".join(parts)


def select(
    keys: Iterable[str], args: argparse.Namespace, *, where: str = "", allow_empty: bool = False
) -> list[str]:
    """The keys that the selection keeps, in their order.

    A selection that keeps nothing of a non-empty ``keys`` is a usage error (exit 2),
    unless ``allow_empty``.
    """
    keys = list(keys)
    kept = [k for k in keys if selected(k, args)]
    if keys and not kept and not allow_empty:
        raise UsageError(
            f"no key{' of ' + where if where else ''} matches {describe_selection(args)}"
        )
    return kept
