"""The ``ckpt`` command: inspect, show, convert, diff, verify, list and clean up checkpoints.

Built on the public API only (``import ckptvar as cv``: ``cv.storage``'s declared
reader abilities, ``cv.checkpoint.parse_step_name``, ``cv.checkpoint.gc``). This module owns the top-level
parser and the mapping of errors to exit statuses; each subcommand is a module
(``inspect``, ``show``, ``convert``, ``diff``, ``verify``, ``ls``, ``gc``) with ``HELP``,
``DESCRIPTION``, ``EPILOG``, ``add_arguments`` and ``run`` (``_common.Command``),
``_output`` owns what is printed and ``_blocks`` the block-wise reading and statistics.

``main(argv) -> int`` returns the exit status: 0 success, 1 a mismatch or
verification failure, 2 bad usage or unreadable/missing input. Errors print one
line, ``ckpt: error: ...``, on stderr and never a traceback. Every name and
metadata string read from a file is escaped before it reaches a terminal
(control characters shown as ``\\x1b``), and ``--json`` output is strict JSON.

>>> main(["--version"])  # doctest: +ELLIPSIS
ckpt (ckptvar) ...
0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import ckptvar as cv

from . import convert, diff, gc, inspect, ls, show, verify
from ._blocks import Stats, iter_blocks
from ._common import (
    EXIT_USAGE,
    Command,
    Parser,
    UsageError,
    add_command,
    say,
    set_quiet,
    set_storage_options,
)
from ._lazy import load_now
from ._output import escape, one_line

__all__ = ["Stats", "build_parser", "escape", "iter_blocks", "main"]

_COMMANDS: dict[str, Command] = {
    "inspect": inspect,
    "show": show,
    "convert": convert,
    "diff": diff,
    "verify": verify,
    "ls": ls,
    "gc": gc,
}

_MAIN_EPILOG = """\
exit status: 0 success, 1 a difference or damaged value found, 2 bad usage or
unreadable input (an object store that does not answer included; one line on stderr,
'ckpt: error: ...'), 130 interrupted (Ctrl-C).

A manager's directory stands for its latest checkpoint in inspect, show, convert,
diff and verify; a path that starts with '-' needs '--' before it.

examples:
  ckpt inspect runs/ckpt-3.h5
  ckpt inspect model.safetensors --stats --filter 'encoder/*'
  ckpt show runs/ckpt-3.h5 'model/dense/kernel[0:2]'
  ckpt convert model.pt model.h5 --dtype bfloat16
  ckpt diff runs/ckpt-2.h5 runs/ckpt-3.h5 --atol 1e-6
  ckpt verify runs/ckpt-3.h5
  ckpt ls runs/
  ckpt gc runs/ --dry-run
  ckpt inspect s3://bucket/run/ckpt-3.h5 --storage-option endpoint=http://127.0.0.1:9000
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``ckpt`` argument parser (used by :func:`main` and the docs)."""
    parser = Parser(
        prog="ckpt",
        description="Inspect, convert, compare and verify ckptvar checkpoints\n"
        "(and TensorFlow, PyTorch and DCP, safetensors and Hugging Face shards,\n"
        "Orbax, Keras and .npz files).",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckpt (ckptvar) {cv.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(_subparsers=sub.choices)
    for name, command in _COMMANDS.items():
        add_command(sub, name, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckpt`` with ``argv`` (``sys.argv[1:]`` by default); returns the exit status."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if callable(reconfigure):
            reconfigure(errors="backslashreplace")
    args = _parse(argv)
    if isinstance(args, int):
        return args
    try:
        set_quiet(args.quiet)
        set_storage_options(args.storage_option)
        return int(args.func(args, sys.stdout))
    except UsageError as exc:
        say(f"ckpt: error: {one_line(exc)}")
    except (cv.CkptError, OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        say(f"ckpt: error: {one_line(exc)}")
    except MemoryError as exc:  # numpy's says how much it could not allocate
        say(f"ckpt: error: not enough memory: {one_line(exc) or 'out of memory'}")
    except KeyboardInterrupt:
        return _interrupted(command=argv is None)
    return EXIT_USAGE


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The arguments, or the exit status when there is nothing to run (``--help``, a
    usage error said, Ctrl-C: parsing may load the storage registry, convert's --format)."""
    Parser.argv = sys.argv[1:] if argv is None else argv
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, so the hint names its --help
            args._subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        load_now()
    except SystemExit as exc:  # --help, --version, or a usage error already reported
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted(command=argv is None)
    return args


def _interrupted(*, command: bool) -> int:
    """Ctrl-C: said, and exit status 130; the ``ckpt`` command itself (``command``), its
    work cleaned up by then, ends at once (:func:`_exit_now`)."""
    say("ckpt: error: interrupted")
    if command:
        _exit_now(130)
    return 130


def _exit_now(code: int) -> None:
    """End the process at once with ``code``, its output flushed.

    Ctrl-C can land while a thread pool is starting a worker, after the thread started
    and before CPython registers it to be told to stop at exit: the interpreter's exit
    would then wait for that idle worker forever (``ckpt convert`` hung after saying
    "interrupted"). Every context of the command has closed by then (temporaries and
    scratch files are gone), so nothing is left for the exit to do.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _broken_pipe() -> int:
    # The reader went away (`ckpt inspect ... | head`): stop quietly, like other tools.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    return 141
