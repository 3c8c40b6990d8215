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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import CorruptCheckpointError
from ..locations import (
    committed_in_save_order,
    is_url,
    open_location,
    wait_for_lock,
    write_atomically,
)
from ..storage import is_own_checkpoint, is_partial
from ..storage.rawio import NotRegularFile, read_regular
from ._steps import parse_step_name

__all__ = [
    "STATE_FILE",
    "STATE_VERSION",
    "exists",
    "latest_checkpoint",
    "locked",
    "read_state",
    "record_latest",
    "save_order",
    "writable",
    "write_state",
]

STATE_FILE = "checkpoint_state.json"
LOCK_FILE = ".checkpoint_state.lock"
STATE_VERSION = 1
#: The largest state file read (a few hundred bytes a step).
MAX_STATE_BYTES = 256 << 20


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
        wait_for_lock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, os.fspath(directory / LOCK_FILE))
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
    try:  # a named pipe or a device there is damage too: never waited on or read forever
        raw = read_regular(path, MAX_STATE_BYTES)
    except FileNotFoundError:
        return {"version": STATE_VERSION, "sections": {}, "latest": None}
    except NotRegularFile as exc:
        state = _rebuild_state(directory, str(exc), repair=repair)
        if repair:
            write_state(directory, state)
        return state
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
                            "last_preserved_time": 0.0}  # the hours rule: from the oldest
        )
        mtime = entry.stat(follow_symlinks=False).st_mtime
        section["checkpoints"].append({"path": entry.name, "step": parsed.step,
                                       "time": mtime})
    latest = None
    for section in sections.values():
        entries = {e["path"]: e for e in section["checkpoints"]}
        section["checkpoints"] = [entries[name] for name in save_order(directory, [], entries)]
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
    """The checkpoint saved last in ``directory``, or ``None`` (:func:`save_order`).

    A directory with no ckptvar checkpoint but TensorFlow's ``checkpoint`` file gives
    the TensorFlow prefix that file names, as ``tf.train.latest_checkpoint`` does.

    At an object-store URL: the numbered committed step saved last (only steps with a
    commit marker count; ``locations.committed_in_save_order``), as a URL ``str``.
    """
    if is_url(directory):
        loc = open_location(directory, storage_options=storage_options)
        steps = [s for s in committed_in_save_order(loc) if parse_step_name(s) is not None]
        return loc.join(steps[-1]) if steps else None
    directory = Path(directory)
    if not directory.is_dir():
        return None
    state = read_state(directory)
    latest = state.get("latest")
    if not _plain_name(latest):
        latest = None
    recorded = [latest] if latest and exists(directory / latest) else []
    cached = parse_step_name(latest) if latest else None
    if recorded and cached is not None:  # the steps recorded before it, in their order: a
        # copy of the directory (new file times) does not reorder what the record knows
        recorded[:0] = [name for name in _recorded(state, cached.prefix)
                        if name != latest and exists(directory / name)]
    if recorded and cached is None:
        return os.fspath(directory / recorded[0])  # saved without a step number (Saver,
        # global_step=None)
    found = []
    for entry in os.scandir(directory):
        parsed = (parse_step_name(entry.name) if cached is None else parse_step_name(
            entry.name, prefix=cached.prefix, suffixes=(cached.suffix,)))
        if parsed is not None and not is_partial(entry.name):
            found.append(entry.name)
    for name in reversed(save_order(directory, recorded, found)):
        if name in recorded or is_own_checkpoint(directory / name):
            return os.fspath(directory / name)
    return tensorflow_latest(directory)


#: The state file TensorFlow's savers keep in a checkpoint directory (a text proto).
TF_STATE_FILE = "checkpoint"


def tensorflow_latest(directory: Path) -> str | None:
    """The prefix TensorFlow's ``checkpoint`` file names as ``model_checkpoint_path``
    (``tf.train.latest_checkpoint``), when its ``.index`` exists; else ``None``.

    >>> tensorflow_latest(Path("no/such/directory")) is None
    True
    """
    try:
        text = read_regular(directory / TF_STATE_FILE, 1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    for line in text.splitlines():
        field, _, value = line.strip().partition(":")
        if field.strip() != "model_checkpoint_path":
            continue
        try:
            prefix = json.loads(value.strip())  # a quoted string, escaped as JSON escapes
        except ValueError:
            return None
        if not isinstance(prefix, str) or not prefix:
            return None
        path = Path(prefix) if os.path.isabs(prefix) else directory / prefix
        return os.fspath(path) if exists(Path(os.fspath(path) + ".index")) else None
    return None


def _plain_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` (read from the state file) names an entry of its directory."""
    return isinstance(name, str) and bool(name) and "/" not in name and name not in (".", "..")


def _recorded(state: Mapping[str, Any], prefix: str) -> list[str]:
    """The steps the state file lists for the manager of ``prefix``, oldest saved first
    (those preserved by ``keep_checkpoint_every_n_hours``, then the kept ones)."""
    section = state.get("sections", {}).get(prefix)
    if not isinstance(section, dict):
        return []
    names = []
    for part in ("preserved", "checkpoints"):
        entries = section.get(part)
        for entry in entries if isinstance(entries, list) else []:
            name = entry.get("path") if isinstance(entry, dict) else None
            if _plain_name(name) and name not in names:
                names.append(name)
    return names


def save_order(directory: Path, recorded: Sequence[str], found: Iterable[str]) -> list[str]:
    """The steps of ``directory`` in the order they were saved, oldest first.

    The one rule of "latest" in a directory (:func:`latest_checkpoint` takes the last,
    a manager lists and prunes in this order). ``recorded`` is what the state file
    lists, in the order it was saved; ``found``, the step names on disk. A found step
    the record does not know (committed after the last state write: a crash between
    the rename and the state write; or the state file lost) goes after every step
    last modified no later than it (modification times, ``stat`` only then), and
    those alike in time by step number.
    """
    order = list(recorded)
    known = set(order)
    extra = [name for name in found if name not in known]
    if not extra:
        return order
    times = {name: _modified(directory / name) for name in (*order, *extra)}
    for name in sorted(extra, key=lambda n: (times[n], _number(n), n)):
        at = len(order)
        while at > 0 and times[order[at - 1]] > times[name]:
            at -= 1
        order.insert(at, name)
    return order


def _modified(path: Path) -> int:
    """When ``path`` was last written (ns; ``-1``: gone meanwhile)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


def _number(name: str) -> int:
    parsed = parse_step_name(name)
    return parsed.step if parsed is not None else -1


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
