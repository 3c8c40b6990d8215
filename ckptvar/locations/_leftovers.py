"""What dead saves leave, found and reclaimed, with the bytes it holds.

- *temporaries* beside a final name (``.<name>.<hex>.partial``, :mod:`._names`);
- *staging directories* in ``TMPDIR`` (``ckptvar-upload-<host>-<pid>-...``) whose
  process is gone;
- below an object-store (or ``file://``) location: *claims* whose holder is gone
  (:mod:`._claim`) and *uncommitted objects* no save can commit any more
  (:func:`~._commit.clean_uncommitted`'s rule).

Incomplete multipart uploads are not among them: the object-store client cannot
list them (docs/cloud.md recommends the bucket lifecycle rule that aborts them).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from ._base import Location
from ._claim import CLAIM_SUFFIX, process_alive
from ._commit import clean_uncommitted
from ._names import STAGING_PREFIX, is_partial, parse_staging_name, this_host
from ._publish import remove_path

__all__ = ["Leftover", "remove_local", "staging_leftovers", "temporaries", "uncommitted"]


@dataclass(frozen=True)
class Leftover:
    """One thing a dead save left: where it is, the bytes removing it frees, and what it
    is."""

    path: str
    nbytes: int
    what: str


def _size(path: Path) -> int:
    """The bytes removing ``path`` (a file, or a tree; links not followed) frees: a file
    counts once, and only when every name it has is below ``path`` (a hard link of a
    kept step's file frees nothing, e.g. in an incremental Zarr step set aside)."""
    try:
        if not path.is_dir() or path.is_symlink():
            st = path.lstat()
            return st.st_size if st.st_nlink <= 1 else 0
    except FileNotFoundError:
        return 0
    names: dict[tuple[int, int], list[int]] = {}  # inode -> [names here, links, size]
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(root, name))
                seen = names.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
                seen[0] += 1
    return sum(size for here, links, size in names.values() if here >= links)


def temporaries(directory: Path, prefixes: tuple[str, ...] = ("",),
                skip: Collection[str] = ()) -> list[Leftover]:
    """The temporaries in ``directory`` whose names start with one of ``prefixes`` (but
    for the names in ``skip``)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        # the names first (a manager looks after every step, in a directory of many
        # steps), then only the temporaries sorted and measured
        names = sorted(entry.name for entry in os.scandir(directory)
                       if entry.name.startswith(prefixes) and entry.name not in skip
                       and is_partial(entry.name))
        for name in names:
            path = Path(directory, name)
            found.append(Leftover(os.fspath(path), _size(path), "temporary"))
    return found


def staging_leftovers(tmpdir: str | None = None) -> list[Leftover]:
    """Staging directories in ``tmpdir`` (default ``TMPDIR``) of this host's dead processes."""
    where = Path(tmpdir or tempfile.gettempdir())
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in _staging_names(where):
            owner = parse_staging_name(name)
            if owner is None or owner[0] != this_host() or process_alive(owner[1]):
                continue
            path = where / name
            if os.path.lexists(path):
                found.append(Leftover(os.fspath(path), _size(path), "staging directory"))
    return found


#: ``TMPDIR`` -> (its mtime, the staging names in it): a manager looks before every save,
#: and a shared ``TMPDIR`` holds thousands of names; listed again when it changed.
_LISTED: dict[str, tuple[int, list[str]]] = {}


def _staging_names(where: Path) -> list[str]:
    """The names in ``where`` that start like a staging directory's, sorted."""
    key = os.fspath(where)
    mtime = os.stat(where).st_mtime_ns
    cached = _LISTED.get(key)
    # an mtime within the last second may not show a change made in the same tick
    if cached is not None and cached[0] == mtime and time.time_ns() - mtime > 1_000_000_000:
        return cached[1]
    names = sorted(n for n in os.listdir(where) if n.startswith(STAGING_PREFIX))
    _LISTED[key] = (mtime, names)
    return names


def remove_local(leftovers: Iterable[Leftover]) -> None:
    """Delete local leftovers (files or trees)."""
    for left in leftovers:
        remove_path(Path(left.path))


def uncommitted(
    location: Location, prefix: str = "", *, dry_run: bool = False
) -> list[Leftover]:
    """Claims of dead writers and uncommitted objects below ``location`` (deleted unless
    ``dry_run``), by the manager's rule: a save in flight is never touched."""
    keys = clean_uncommitted(location, prefix, older_than_latest=True, dry_run=True)
    found = []
    for key in keys:
        size = sum(o.size for o in location.list(key + "/"))
        if location.exists(key):
            size += location.size(key)
        what = "claim of a dead writer" if key.endswith(CLAIM_SUFFIX) else "uncommitted object"
        found.append(Leftover(location.join(key), size, what))
    if not dry_run and keys:
        clean_uncommitted(location, prefix, older_than_latest=True)
    return found
