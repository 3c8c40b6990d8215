"""The one place where the ``ckpt`` command reaches past ``import ckptvar as cv``.

Each piece here stands in for a library ability that is not public yet; when the
library exposes it, the piece is replaced by the public call and nothing else in
the command changes.

- :func:`skipped_values`: what a reader left out (string/compound HDF5 datasets,
  TF string tensors); readers know it as a ``skipped`` attribute, undeclared.
- :func:`verify_all`: the bulk verify some readers offer, found by name.
- :func:`committed_steps`: the committed steps below an object-store URL, with
  their sizes and commit times (the location layer is not public).
- :data:`CHECKPOINT_NAME`: the manager's ``PREFIX-STEP.suffix`` file-name rule
  (its home is the checkpoint package, where it is private).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["CHECKPOINT_NAME", "committed_steps", "skipped_values", "verify_all"]

#: ``PREFIX-STEP.h5`` / ``.hdf5`` / ``.zarr`` / TensorFlow ``PREFIX-STEP.index``.
CHECKPOINT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d+)(?P<ext>\.h5|\.hdf5|\.zarr|\.index)$")


#: Format bookkeeping a reader lists as skipped that is no user value (TF's object graph).
_BOOKKEEPING = frozenset({"_CHECKPOINTABLE_OBJECT_GRAPH"})


def skipped_values(reader: Any) -> dict[str, str]:
    """``{key: reason}`` for the user values ``reader`` saw but cannot read as numbers."""
    skipped = getattr(reader, "skipped", None) or {}
    return {str(k): str(v) for k, v in dict(skipped).items() if k not in _BOOKKEEPING}


def verify_all(reader: Any) -> Callable[[], Iterable[tuple[str, str]]] | None:
    """The reader's bulk verify (``[(key, reason), ...]`` for damaged values), if it has one."""
    fn = getattr(reader, "verify_all", None)
    return fn if callable(fn) else None


def committed_steps(url: str, storage_options: Any) -> list[tuple[str, float, int]]:
    """``[(step_url, commit_time, size), ...]`` of the committed steps directly below ``url``."""
    from ckptvar.storage.location import list_committed_steps, open_location, read_commit

    loc = open_location(url, storage_options=storage_options)
    rows = []
    for step in list_committed_steps(loc):
        record = read_commit(loc, step)
        if record is None:  # pruned while we looked
            continue
        objects = loc.list(record.data) if not loc.exists(record.data) else []
        size = sum(o.size for o in objects) if objects else loc.size(record.data)
        rows.append((loc.join(step), record.time, size))
    return rows
