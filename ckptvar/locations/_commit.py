"""Commit by marker: how a step becomes visible where no atomic rename exists.

A *step* is a key below a location: one object (``run/ckpt-3.h5``) or a prefix of
objects (``run/ckpt-3.zarr/...``). A save

1. writes the data objects (any order, any number of writers),
2. writes the index/record that binds the data's checksums,
3. calls :func:`commit`, which creates ``<step>.commit`` with a create-only
   conditional write (``If-None-Match: *``). Its JSON content binds the index's
   checksum and names the key that holds the data (the step itself by default;
   a writer that may race others writes to its own ``data`` key instead, so the
   committed step holds only the winner's bytes) and, if the index is also stored
   as an object of its own, that object's key (``index``), so that a reader finds
   it without reading the data.

The marker is the last object a save writes. Readers, ``latest_checkpoint`` and
the manager list only steps with a marker (:func:`list_committed_steps`);
:func:`prune` deletes the marker first and the data after, so a step is never
visible without its data; :func:`clean_uncommitted` removes leftovers of failed
saves that are older than the latest committed step. Of two writers committing
one step, exactly one create-only write succeeds; the other raises
:class:`CheckpointExistsError` naming the step. The same protocol serves the
multi-process save: every rank writes its data, one rank writes the index and
calls :func:`commit`.

Marker content (UTF-8 JSON, one object)::

    {"ckptvar_commit": 1, "step": "run/ckpt-3.h5", "data": "run/ckpt-3.h5",
     "index_checksum": "record-crc32c:1a2b3c4d", "writer": "<uuid4 hex>", "time": 1764036000.0}

``index_checksum`` (named so since the first version) holds a
:class:`~._publish.Binding`: ``bytes-``, ``record-`` or ``index-crc32c:<hex>``.

(plus ``"index": "<key>"`` when the index is an object of its own; pruning deletes it
with the data.)
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
)
from ._base import Location, clean_key
from ._claim import CLAIM_SUFFIX, read_claim
from ._names import step_number
from ._publish import Binding

logger = logging.getLogger("ckptvar")

__all__ = [
    "MARKER_SUFFIX",
    "CommitRecord",
    "clean_uncommitted",
    "commit",
    "committed_in_save_order",
    "is_committed",
    "latest_committed_step",
    "list_committed_steps",
    "marker_key",
    "prune",
    "read_commit",
    "refuse_committed",
    "step_number",
]

MARKER_SUFFIX = ".commit"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class CommitRecord:
    """What a commit marker says: the step, where its data is, and the bound index checksum."""

    step: str
    data: str
    index_checksum: str
    writer: str
    time: float
    #: The key of the index stored as an object of its own ("" if none).
    index: str = ""

    @property
    def binding(self) -> Binding | None:
        """What the marker binds, read from ``index_checksum`` (every spelling ever written)."""
        return Binding.parse(self.index_checksum)

    def to_json(self) -> bytes:
        doc: dict[str, object] = {
            "ckptvar_commit": _FORMAT_VERSION,
            "step": self.step,
            "data": self.data,
            "index_checksum": self.index_checksum,
            "writer": self.writer,
            "time": self.time,
        }
        if self.index:
            doc["index"] = self.index
        return json.dumps(doc, sort_keys=True).encode()


def marker_key(step: str) -> str:
    """The key of a step's commit marker: a sibling, ``<step>.commit``."""
    return clean_key(step) + MARKER_SUFFIX


def _has_data(location: Location, data: str) -> bool:
    if location.exists(data):
        return True
    return bool(location.list(data + "/"))


def commit(
    location: Location,
    step_prefix: str,
    index_checksum: str,
    *,
    data: str | None = None,
    writer: str | None = None,
    index: str | None = None,
) -> CommitRecord:
    """Make ``step_prefix`` visible: create its marker with a create-only write.

    Call it after every data object and the index are written. ``data`` is the key
    holding the step's bytes (default: ``step_prefix``); ``index`` the key of the
    index stored as an object of its own, if it is. Raises
    ``CheckpointExistsError`` naming the step if it is already committed (by another
    writer), and ``CkptError`` if there is no data to commit.
    """
    step = clean_key(step_prefix)
    data = clean_key(data) if data is not None else step
    if not _has_data(location, data):
        raise CkptError(
            f"cannot commit step {location.join(step)}: no data at {location.join(data)} "
            "(write the data and the index before the commit marker)"
        )
    record = CommitRecord(
        step, data, index_checksum, writer or uuid.uuid4().hex, time.time(),
        clean_key(index) if index else "",
    )
    try:
        location.put(marker_key(step), record.to_json(), create_only=True)
    except CheckpointExistsError:
        existing = read_commit(location, step)
        # A retried request whose first attempt did succeed finds its own marker.
        if existing is not None and existing.writer == record.writer:
            return existing
        who = f" by writer {existing.writer}" if existing else ""
        raise CheckpointExistsError(
            f"step {location.join(step)} is already committed{who}; a step is written once: "
            "save under a new step, or prune this one first"
        ) from None
    _verify_unclaimed(location, step, record)
    return record


def _verify_unclaimed(location: Location, step: str, record: CommitRecord) -> None:
    """After the marker: check that the objects beside the step it names are still there.

    They are not below a claim (only a step's own key is), so a cleanup of a step no
    newer than the latest committed one (a manager's save, ``ckpt gc``) may have
    deleted them while this writer was between its upload and its marker. Then the
    marker goes again and ``CkptError`` says so: never a committed step without data.
    """
    gone = [key for key in (record.data, record.index)
            if key and key != step and not key.startswith(step + "/")
            and not location.exists(key)]
    if gone:
        location.delete(marker_key(step))
        raise CkptError(
            f"cannot commit step {location.join(step)}: {location.join(gone[0])} was deleted "
            "while it was being saved (a cleanup of uncommitted objects, by a "
            "CheckpointManager's save or `ckpt gc` at the same location, counted it a "
            "leftover as the step is not newer than the latest committed one); nothing is "
            "committed: save it again"
        )


def refuse_committed(location: Location, step: str) -> None:
    """Raise ``CheckpointExistsError`` naming ``step`` if it is committed (a writer checks
    this before it writes anything; the create-only marker checks it again)."""
    if read_commit(location, step) is not None:
        raise CheckpointExistsError(
            f"step {location.join(step)} is already committed; a step is written once: save "
            "under a new step, or prune this one first"
        )


def read_commit(location: Location, step: str) -> CommitRecord | None:
    """The step's commit record, or ``None`` if it has no marker."""
    key = marker_key(step)
    try:
        raw = location.read(key)
    except CheckpointNotFoundError:
        return None
    try:
        obj = json.loads(raw)
        if obj.get("ckptvar_commit") != _FORMAT_VERSION:
            raise ValueError(f"unknown marker version {obj.get('ckptvar_commit')!r}")
        return CommitRecord(
            str(obj["step"]),
            clean_key(str(obj["data"])),
            str(obj["index_checksum"]),
            str(obj["writer"]),
            float(obj["time"]),
            clean_key(str(obj.get("index") or "")),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{location.join(key)}: damaged commit marker: {exc}"
        ) from None


def is_committed(location: Location, step: str, index_checksum: str | None = None) -> bool:
    """Whether ``step`` has a commit marker.

    With ``index_checksum``, a marker binding another checksum raises
    ``CorruptCheckpointError`` naming the step (its index was replaced after the commit).
    """
    record = read_commit(location, step)
    if record is None:
        return False
    if index_checksum is not None and record.index_checksum != index_checksum:
        raise CorruptCheckpointError(
            f"step {location.join(step)}: its commit marker binds index checksum "
            f"{record.index_checksum}, but the index has {index_checksum}"
        )
    return True


def list_committed_steps(location: Location, prefix: str = "") -> list[str]:
    """Keys of the committed steps directly below ``prefix``, by step number then name.

    One listing request: only markers count, so an uncommitted step is never listed.
    """
    _, objects = location.list_dir(prefix)
    steps = [o.key[: -len(MARKER_SUFFIX)] for o in objects if o.key.endswith(MARKER_SUFFIX)]
    return sorted(steps, key=lambda s: (step_number(s) is None, step_number(s) or 0, s))


def committed_in_save_order(location: Location, prefix: str = "", *,
                            known: MutableMapping[tuple[str, str], float] | None = None
                            ) -> list[str]:
    """Keys of the committed steps directly below ``prefix``, in the order they were saved.

    A step was saved when it committed: the ``time`` its marker records orders them
    (one listing, one read of each marker), then the step number. A damaged marker
    counts as the oldest (a restore skips its step, a prune takes it first). ``known``
    caches ``(step, etag) -> time`` of markers read before: a marker is written once,
    so a caller listing again (a manager, at every save) reads only the new ones.
    """
    _, objects = location.list_dir(prefix)
    times: dict[str, float] = {}
    for obj in objects:
        if not obj.key.endswith(MARKER_SUFFIX):
            continue
        step = obj.key[: -len(MARKER_SUFFIX)]
        tag = (step, obj.etag) if obj.etag else None
        when = known.get(tag) if known is not None and tag is not None else None
        if when is None:
            try:
                record = read_commit(location, step)
            except CorruptCheckpointError:
                times[step] = -math.inf
                continue
            if record is None:  # pruned while listed
                continue
            when = record.time
            if known is not None and tag is not None:
                known[tag] = when
        times[step] = when
    return sorted(times, key=lambda s: (times[s], step_number(s) or 0, s))


def latest_committed_step(location: Location, prefix: str = "") -> str | None:
    """The numbered committed step saved last (:func:`committed_in_save_order`), or ``None``."""
    numbered = [s for s in committed_in_save_order(location, prefix)
                if step_number(s) is not None]
    return numbered[-1] if numbered else None


def _delete_data(location: Location, data: str) -> None:
    location.delete(data)
    location.delete_prefix(data)


def prune(location: Location, step: str) -> None:
    """Delete a step: its marker first (it stops being visible), then its data.

    A step whose marker is damaged (which names its data no more) goes with every object
    named like it: the step's own key and the ``<step>.<...>`` objects beside it.
    """
    step = clean_key(step)
    try:
        record = read_commit(location, step)
    except CorruptCheckpointError as exc:
        logger.warning("%s; pruned with every object named like its step", exc)
        location.delete(marker_key(step))
        _delete_data(location, step)
        parent = step.rpartition("/")[0]
        _, objects = location.list_dir(parent)
        location.delete([o.key for o in objects if o.key.startswith(step + ".")])
        return
    location.delete(marker_key(step))
    _delete_data(location, record.data if record else step)
    if record and record.index:
        location.delete(record.index)
    if record and record.data != step:
        _delete_data(location, step)


def clean_uncommitted(
    location: Location, prefix: str = "", *, older_than_latest: bool = True,
    dry_run: bool = False,
) -> list[str]:
    """Delete leftovers of failed saves below ``prefix``; returns the keys deleted.

    A leftover is a step-numbered object or prefix that no marker commits (as step,
    data or index), or a claim whose holder is gone (:mod:`._claim`) with what it
    left below its step. With ``older_than_latest`` (the manager's rule) an
    uncommitted object goes only if its step number is at most the latest committed
    one (no save can commit it any more), or its step's claim is dead: a save in
    flight for a newer step is never touched. With ``dry_run`` nothing is deleted.
    """
    dirs, objects = location.list_dir(prefix)
    markers = {o.key for o in objects if o.key.endswith(MARKER_SUFFIX)}
    claims = {o.key[: -len(CLAIM_SUFFIX)] for o in objects if o.key.endswith(CLAIM_SUFFIX)}
    protected, latest, damaged = _committed(location, markers)
    dead = _dead_claims(location, claims)
    removed = [step + CLAIM_SUFFIX for step in sorted(dead)]
    if not dry_run:
        location.delete(removed)
    live = claims - dead
    for key in dirs + [o.key for o in objects if o.key not in markers]:
        n = step_number(key)
        if key in protected or n is None or key.endswith(CLAIM_SUFFIX):
            continue
        if any(key == s or key.startswith(s + ".") for s in damaged):
            continue  # what a damaged marker names is unknown: all of its step is kept
        step = next((s for s in claims if key == s or key.startswith(s + ".")), None)
        if step in live:
            continue  # a writer is still at it
        if older_than_latest and step is None and (latest is None or n > latest):
            continue
        if not dry_run:
            _delete_data(location, key)
        removed.append(key)
    return removed


def _committed(location: Location, markers: set[str]
               ) -> tuple[set[str], int | None, set[str]]:
    """The keys committed steps use (step, data, index), the latest step number, and the
    steps whose marker is damaged (logged; a cleanup keeps every key of such a step)."""
    committed = [m[: -len(MARKER_SUFFIX)] for m in markers]
    protected = set(committed)
    damaged = set()
    for step in committed:
        try:
            record = read_commit(location, step)
        except CorruptCheckpointError as exc:
            logger.warning("%s; its step's objects are kept (prune it, or delete the marker "
                           "to let them be reclaimed)", exc)
            damaged.add(step)
            continue
        if record is not None:
            protected.add(record.data)
            if record.index:
                protected.add(record.index)
    numbers = [n for n in map(step_number, committed) if n is not None]
    return protected, max(numbers) if numbers else None, damaged


def _dead_claims(location: Location, steps: set[str]) -> set[str]:
    """The steps among ``steps`` whose claim's holder is gone."""
    dead = set()
    for step in steps:
        exists, holder = read_claim(location, step)
        if exists and (holder is None or holder.gone()):
            dead.add(step)
    return dead
