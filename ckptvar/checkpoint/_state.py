"""A checkpoint directory's state file ``checkpoint_state.json`` and :func:`latest_checkpoint`.

The state file only caches what is committed in the directory (the manager checks
it against the step files). It is replaced atomically (``locations.publish``:
temporary sibling, rename; fsynced, then the directory, where it holds what the files
cannot tell) and updated under an advisory lock file (``.checkpoint_state.lock``)
so that several managers, in any process, can share a directory. It has one
section per ``checkpoint_name`` (a manager's own list of checkpoints) and the
directory's ``latest`` checkpoint, which :func:`latest_checkpoint` returns. A
read-only directory (a training job's checkpoints mounted read-only for an
evaluation job) is read under a shared lock, or none where no lock file exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..locations import is_url, list_committed_steps, open_location, write_atomically
from ..storage import is_own_checkpoint, is_partial
from ._steps import StepName, parse_step_name

__all__ = [
    "STATE_FILE",
    "STATE_VERSION",
    "exists",
    "latest_checkpoint",
    "locked",
    "read_state",
    "record_latest",
    "writable",
    "write_state",
]

STATE_FILE = "checkpoint_state.json"
LOCK_FILE = ".checkpoint_state.lock"
STATE_VERSION = 1


def writable(directory: Path) -> bool:
    """Whether files can be created in ``directory`` (False on a read-only mount)."""
    return os.access(directory, os.W_OK | os.X_OK)


@contextlib.contextmanager
def locked(directory: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the directory's state lock for the block (exclusive, or ``shared`` to read).

    A shared lock opens the lock file read-only, so it works in a read-only
    directory; where the lock file does not exist there (nobody can be writing), no
    lock is taken.
    """
    if shared:
        try:
            fd = os.open(directory / LOCK_FILE, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if writable(directory):
                fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            else:
                yield
                return
    else:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_state(directory: Path, *, repair: bool = False) -> dict[str, Any]:
    """The directory's state; from a damaged state file, a state rebuilt from the files.

    The state file is only ever replaced atomically, so damage comes from outside
    (disk errors, hand edits). Rather than make the directory unusable, a warning is
    given and each manager's list is rebuilt from the ``NAME-STEP.h5|.zarr`` files on
    disk. With ``repair`` (a manager, holding the state lock) the damaged file is kept
    as ``checkpoint_state.json.damaged-<time>`` and the rebuilt state written in its place.
    """
    path = directory / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {"version": STATE_VERSION, "sections": {}, "latest": None}
    try:
        state = json.loads(raw)
        if not isinstance(state, dict) or not isinstance(state.get("sections"), dict):
            raise ValueError("not a state record")
    except ValueError as exc:
        state = _rebuild_state(directory, f"it is damaged ({exc})", repair=repair)
        if repair:
            write_state(directory, state)
        return state
    if state.get("version", 0) > STATE_VERSION:
        raise CorruptCheckpointError(
            f"{str(path)!r} has state version {state.get('version')}; this ckptvar reads "
            f"up to {STATE_VERSION}."
        )
    return state


def _rebuild_state(directory: Path, why: str, *, repair: bool) -> dict[str, Any]:
    path = directory / STATE_FILE
    aside = path.with_name(f"{STATE_FILE}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    if repair:
        os.replace(path, aside)
    sections: dict[str, Any] = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        parsed = parse_step_name(entry.name)
        if parsed is None or is_partial(entry.name):
            continue
        section = sections.setdefault(
            parsed.prefix, {"checkpoints": [], "preserved": [], "pending_delete": [],
                            "last_preserved_time": time.time()}
        )
        mtime = entry.stat(follow_symlinks=False).st_mtime
        section["checkpoints"].append({"path": entry.name, "step": parsed.step,
                                       "time": mtime})
    latest = None
    for section in sections.values():
        section["checkpoints"].sort(key=lambda e: (e["step"], e["time"]))
        newest = section["checkpoints"][-1]
        if latest is None or newest["time"] >= latest["time"]:
            latest = newest
    kept = f" It was kept as {aside.name!r}." if repair else ""
    warnings.warn(
        f"The checkpoint state file {str(path)!r} could not be read: {why}.{kept} The list "
        "of checkpoints was rebuilt from the files in the directory.",
        UserWarning,
        stacklevel=3,
    )
    return {"version": STATE_VERSION, "sections": sections,
            "latest": latest["path"] if latest else None}


def write_state(directory: Path, state: dict[str, Any], *, durable: bool = True) -> None:
    """Replace the state file atomically (the caller holds :func:`locked`); ``durable``:
    fsynced too (a cache of the directory need not be, but for what only it holds).

    One line of JSON, keys sorted: Python's C encoder writes it (an indented file goes
    through the pure-Python one, ten times slower, at every step a manager records)."""
    write_atomically(directory / STATE_FILE, json.dumps(state, sort_keys=True).encode() + b"\n",
                     durable=durable)


def exists(path: Path) -> bool:
    """``path`` is there and is not a temporary."""
    return path.exists() and not is_partial(path.name)


def latest_checkpoint(
    directory: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The newest checkpoint a ``CheckpointManager`` recorded in ``directory``, or ``None``.

    At an object-store URL: the committed step with the highest step number (only
    steps with a commit marker count), as a URL ``str``.
    """
    if is_url(directory):
        loc = open_location(directory, storage_options=storage_options)
        steps = [s for s in list_committed_steps(loc) if parse_step_name(s) is not None]
        if not steps:
            return None
        return loc.join(max(steps, key=lambda s: parse_step_name(s).step))  # type: ignore[union-attr]
    directory = Path(directory)
    if not directory.is_dir():
        return None
    latest = read_state(directory).get("latest")
    if not isinstance(latest, str) or not latest or "/" in latest or latest in (".", ".."):
        latest = None
    path = directory / latest if latest else None
    if path is not None and not exists(path):
        path = None
    cached = parse_step_name(latest) if latest else None
    if latest and cached is None and path is not None:
        return os.fspath(path)  # a file saved without a step number (Saver, global_step=None)
    newer = _newest_step(directory, cached)
    if newer is not None and path is not None and _older(newer, path):
        newer = None  # a higher step written before the recorded one: a run gone back to
        # an earlier step saved the recorded latest after it (TensorFlow returns that too)
    if newer is not None:
        return os.fspath(newer)
    return os.fspath(path) if path is not None else None


def _older(path: Path, than: Path) -> bool:
    """Whether ``path`` was last written before ``than`` (modification times)."""
    try:
        return path.stat().st_mtime_ns < than.stat().st_mtime_ns
    except OSError:
        return False


def _newest_step(directory: Path, cached: StepName | None) -> Path | None:
    """The committed step the state file's cache does not know yet, if any: of the cached
    latest's naming with a higher number, or (no cache) the newest step in ``directory``.

    The committed files are the record: a crash between a step's rename and the state
    write, or a lost state file, leaves the cache behind them.
    """
    best: tuple[float, int, Path] | None = None
    for entry in os.scandir(directory):
        if is_partial(entry.name):
            continue
        if cached is not None:
            parsed = parse_step_name(entry.name, prefix=cached.prefix, suffixes=(cached.suffix,))
            if parsed is None or parsed.step <= cached.step:
                continue
        else:
            parsed = parse_step_name(entry.name)
            if parsed is None:
                continue
        path = Path(entry.path)
        if not is_own_checkpoint(path):
            continue
        key = (parsed.step, 0.0) if cached is not None else (0, entry.stat().st_mtime)
        rank = (key[1], key[0], path)
        if best is None or rank[:2] > best[:2]:
            best = rank
    return best[2] if best is not None else None


def record_latest(path: str | os.PathLike[str]) -> None:
    """Record the durable checkpoint ``path`` as its directory's latest.

    What ``Checkpoint.save`` and ``Saver.save`` do after writing, as TensorFlow's
    do: :func:`latest_checkpoint` then returns it. No manager's list changes (a
    manager only ever lists and deletes files it wrote). At an object-store URL the
    commit marker is the record: nothing more is written.
    """
    if is_url(path):
        return
    path = Path(path)
    directory = path.parent
    with locked(directory):
        state = read_state(directory, repair=True)
        state["version"] = STATE_VERSION
        state["latest"] = path.name
        write_state(directory, state)
