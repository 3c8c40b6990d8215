"""The names a save gives what it leaves: steps, temporaries, local staging directories.

One grammar each, here in the lowest layer, so that the writers, the readers, the
manager and the clean-up (``ckpt gc``) all read names by the same rule:

- a *step* is ``<prefix>-<N><suffix>`` (``ckpt-7.h5``, ``ckpt-12.zarr``), the dash
  required: every writer puts it there, and a name without it (a user's
  ``dup2.h5``, ``step_00000003``) is no step, never listed, pruned nor reclaimed;
- a *temporary* is ``.<final name>.<32 hex>.partial``, beside its final name;
- a *staging directory* (a save's local copy before an upload) is
  ``ckptvar-upload-<host>-<pid>-<random>`` in ``TMPDIR``: whoever finds one can
  tell whether the process that made it is still alive.

>>> parse_step_name("ckpt-7.h5")
StepName(prefix='ckpt', step=7, suffix='.h5')
>>> parse_step_name("ckpt-7.h5", prefix="other") is None
True
>>> step_number("run/ckpt-3.zarr"), step_number("run/dup2.h5"), step_number("notes.txt")
(3, None, None)
>>> is_partial(".ckpt-3.h5.0123456789abcdef0123456789abcdef.partial"), is_partial("ckpt-3.h5")
(True, False)
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "STAGING_PREFIX",
    "StepName",
    "is_partial",
    "parse_staging_name",
    "parse_step_name",
    "partial_path",
    "staging_directory",
    "step_name",
    "step_number",
    "this_host",
]

#: What every local staging directory's name starts with.
STAGING_PREFIX = "ckptvar-upload-"

#: ``prefix-N.suffix``: the dash is the grammar's (``step_name`` writes it), so a user's
#: ``dup2.h5`` is no step, never listed, pruned nor reclaimed as one
_STEP_RE = re.compile(r"(?P<prefix>[^/]*?)-(?P<step>\d+)(?P<suffix>(?:\.[^/]*)?)", re.DOTALL)
#: ``.x.<hex>.partial``, and ``.x.partial-<hex>`` (what local locations named them before)
_PARTIAL_RE = re.compile(r"^\..+\.(?:[0-9a-f]{32}\.partial|partial-[0-9a-f]{32})$", re.DOTALL)
_STAGING_RE = re.compile(
    re.escape(STAGING_PREFIX) + r"(?P<host>[A-Za-z0-9.-]*)-(?P<pid>\d+)-[A-Za-z0-9_]+"
)


class StepName(NamedTuple):
    """A parsed ``prefix-N.suffix`` name."""

    prefix: str
    step: int
    suffix: str


def step_name(prefix: str, step: int, suffix: str) -> str:
    """``prefix-step`` + ``suffix`` (``prefix`` may include a directory)."""
    return f"{prefix}-{int(step)}{suffix}"


def parse_step_name(
    name: str, *, prefix: str | None = None, suffixes: Iterable[str] | None = None
) -> StepName | None:
    """Read ``name`` (no directory) as ``prefix-N.suffix``; ``None`` if it is not one
    (``dup2.h5``: no dash before the number).

    ``prefix`` requires exactly that prefix followed by ``-``; ``suffixes``, one of
    those suffixes (default: any suffix, or none).
    """
    if prefix is not None:
        head = prefix + "-"
        if not name.startswith(head):
            return None
        m = re.match(r"\d+", name[len(head):])
        if m is None:
            return None
        found = StepName(prefix, int(m.group()), name[len(head) + m.end():])
        if found.suffix and not found.suffix.startswith("."):
            return None
    else:
        full = _STEP_RE.fullmatch(name)
        if full is None:
            return None
        found = StepName(full["prefix"], int(full["step"]), full["suffix"])
    if suffixes is not None and found.suffix not in tuple(suffixes):
        return None
    return found


def step_number(key: str) -> int | None:
    """The step number of a step's key: the digits after the dash ending its stem
    (``run/ckpt-12.h5`` -> 12; ``run/dup2.h5`` -> None)."""
    parsed = parse_step_name(key.rstrip("/").rsplit("/", 1)[-1])
    return parsed.step if parsed is not None else None


#: The longest file name common file systems take (ext4, XFS, APFS, NTFS: 255 bytes).
NAME_MAX = 255
#: ``.`` + ``.<32 hex>.partial``: what a temporary's name adds to its final name.
_PARTIAL_EXTRA = len(".") + len(".") + 32 + len(".partial")


def partial_path(final: Path) -> Path:
    """A fresh temporary sibling of ``final`` (not created). A final name too long to
    carry whole (over 213 bytes) is cut, so the temporary stays a legal name: the random
    part keeps it unique, and the grammar (:func:`is_partial`) holds.

    >>> len(partial_path(Path("x" * 250 + ".h5")).name.encode())
    255
    """
    name = final.name
    room = NAME_MAX - _PARTIAL_EXTRA
    if len(name.encode("utf-8", "surrogateescape")) > room:
        name = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return final.with_name(f".{name}.{uuid.uuid4().hex}.partial")


def is_partial(name: str | os.PathLike[str]) -> bool:
    """True when ``name`` (a file or directory name) is a ckptvar temporary."""
    return bool(_PARTIAL_RE.match(os.path.basename(os.fspath(name))))


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "", socket.gethostname())[:64]


def staging_directory() -> tempfile.TemporaryDirectory[str]:
    """A fresh local staging directory in ``TMPDIR``, named after this host and process."""
    return tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{_host()}-{os.getpid()}-")


def parse_staging_name(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the process that made the staging directory ``name``, or ``None``
    (not one of ours, or one named before staging names carried their owner)."""
    m = _STAGING_RE.fullmatch(name)
    return (m["host"], int(m["pid"])) if m else None


def this_host() -> str:
    """This machine's name as staging names and claims spell it."""
    return _host()
