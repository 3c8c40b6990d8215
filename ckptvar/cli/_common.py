"""What every ``ckpt`` subcommand shares: exit codes, usage errors, opening a checkpoint,
and key selection (``--filter`` / ``--exclude``)."""

from __future__ import annotations

import argparse
import fnmatch
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import ckptvar as cv

from ._output import one_line

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_USAGE",
    "Parser",
    "UsageError",
    "add_selection",
    "open_checkpoint",
    "select",
]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad usage found after parsing (exit 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``ckpt: error: <what> (see 'ckpt SUB --help')``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"ckpt: error: {one_line(message)} (see '{self.prog} --help')\n")
        raise SystemExit(EXIT_USAGE)


def open_checkpoint(path: str | Path) -> Any:
    """``cv.open(path)``, with a hint when ``path`` is a directory of checkpoints."""
    try:
        return cv.open(path)
    except cv.UnsupportedFormatError:
        if Path(path).is_dir():
            raise UsageError(
                f"{str(path)!r} is a directory, not a checkpoint; "
                f"'ckpt ls {path}' lists the checkpoints in it"
            ) from None
        raise


def add_selection(p: argparse.ArgumentParser) -> None:
    """``--filter GLOB``."""
    p.add_argument(
        "--filter", metavar="GLOB", help="only keys matching this glob (fnmatch, case-sensitive)"
    )


def select(keys: Iterable[str], args: argparse.Namespace) -> list[str]:
    """The keys that ``--filter`` keeps."""
    pattern: str | None = args.filter
    return [k for k in keys if pattern is None or fnmatch.fnmatchcase(k, pattern)]
