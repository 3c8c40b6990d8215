"""The restore of a checkpoint by many processes: each reads only what it holds, all or nothing.

Each rank maps the boxes its variables hold onto the stored boxes and reads only the
overlapping parts (:func:`stage_reads`), checking keys, dtypes, shapes, coverage and
checksums; then every rank votes, and only when all succeeded does any variable
change (:meth:`Staged.apply`). As in one process (:mod:`._apply`), values for
variables that already hold memory are read into temporaries when they total at most
``TEMPORARY_BUDGET`` bytes on this rank; above it, the stored boxes they overlap are
verified first and the values read straight into the variables' own buffers after
the vote (reading twice, never holding a second copy of the rank's shards). From an
object store, where a second pass is a second download, the values above the budget are
read once, verified as they stream, into a spool file (an unlinked temporary in
``TMPDIR``: page cache, not process memory, and nothing left behind by a crash), and
copied from it into the variables after the vote.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._dtypes import can_cast_same_kind, dtype_name
from .._staging import fill_device_rows, fillable, upload
from ..distributed import Box, Coordinator
from ..errors import CheckpointMismatchError, MissingValueError
from ..locations import is_url
from ..storage import ShardedReader
from ..variables import Variable, device_value, host_buffer
from ._apply import TEMPORARY_BUDGET, check_cast_fits, give_value, warn_cast
from ._files import open_checkpoint_reader
from ._logical import Logical

__all__ = ["Pair", "Staged", "collective_restore", "restore_pairs", "stage_reads"]

#: ``(key, variable)``: the variable reads its own box of the stored value ``key``.
Pair = tuple[str, Variable]


def restore_pairs(items: Iterable[tuple[str, Variable | Logical]]) -> list[Pair]:
    """``(key, variable)`` for every variable holding a box of ``items``' values."""
    out: list[Pair] = []
    for key, target in items:
        parts = target.parts if isinstance(target, Logical) else (target,)
        out.extend((key, part) for part in parts)
    return out


class Staged:
    """Values read by one rank for a restore, not applied yet (:func:`stage_reads`)."""

    def __init__(self) -> None:
        self.values: list[tuple[Variable, np.ndarray]] = []
        #: ``(key, stored dtype, variable)`` of each value converted (``cast=True``)
        self.casts: list[tuple[str, np.dtype, Variable]] = []
        #: ``(key, box, variable's buffer)``: checked already, read into place at apply
        self.in_place: list[tuple[str, Box, np.ndarray]] = []
        #: the reader the values in place are read from at :meth:`apply` (still open then)
        self.reader: Any = None
        #: ``(spooled value, variable's buffer)``: read and verified once, copied at apply
        self.spooled: list[tuple[np.ndarray, np.ndarray]] = []
        #: ``(key, box, GPU tensor)``: checked already, read into the tensor at apply
        #: through the pinned staging buffer (a CUDA DTensor's local shard)
        self.on_device: list[tuple[str, Box, Any]] = []
        self._spool: Any = None

    def apply(self, path: Any) -> None:
        """Give every variable its value (after the vote), then say what was cast.

        Values read in place come from the reader :func:`stage_reads` was given, which
        must still be open.
        """
        for var, value in self.values:
            give_value(var, value)
        for key, box, buf in self.in_place:
            self.reader.read_box_into(key, box, buf, verify=False)  # verified when staged
        for value, buf in self.spooled:
            np.copyto(buf, value)
        for key, box, dst in self.on_device:
            _fill_box(self.reader, key, box, dst)
        self.close()
        if self.casts:
            warn_cast(path, self.casts)

    def spool(self, nbytes: int) -> Any:
        """An unlinked temporary file of ``nbytes`` bytes for values read once (kept open
        until :meth:`close`)."""
        self._spool = tempfile.TemporaryFile(prefix="ckptvar-spool-")  # noqa: SIM115
        self._spool.truncate(nbytes)
        return self._spool

    def close(self) -> None:
        """Drop the spooled values and their file (a failed vote leaves them unused)."""
        self.spooled = []
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()


def stage_reads(
    reader: Any, pairs: Sequence[Pair], path: Any, *, verify: bool = True, cast: bool = False
) -> Staged:
    """Read each variable's box of its stored value, checking everything first.

    Every mismatch (dtype, full shape) is reported at once in one
    ``CheckpointMismatchError`` before anything is read; with ``cast``, a stored dtype
    that converts to the variable's under ``same_kind`` is read and converted. Nothing
    is changed: the caller votes, then :meth:`Staged.apply`.
    """
    problems: list[str] = []
    could_cast = False
    staged = Staged()
    plans: list[tuple[str, Variable, Box, np.dtype]] = []
    for key, var in pairs:
        info = reader.info(key)
        stored, want = np.dtype(info.dtype), np.dtype(var.dtype)
        # a plain variable holds all of the value (its box is not asked: that could
        # run its initializer when its shape is not fully defined)
        box = var.logical_box if (var.shard is not None or var.save_slice_info is not None) \
            else None
        shape_ok = (_fits(var.shape, tuple(info.shape)) if box is None
                    else tuple(box.full_shape) == tuple(info.shape))
        dtype_ok = stored == want
        hint = ""
        if not dtype_ok:
            castable = can_cast_same_kind(stored, want)
            if cast and castable:
                dtype_ok = True
                staged.casts.append((key, stored, var))
            elif cast:
                hint = " (not a same_kind cast)"
            elif castable:
                could_cast = True
        if not (shape_ok and dtype_ok):
            what = (f"shape {var.shape}" if box is None
                    else f"a box of a {tuple(box.full_shape)} value")
            problems.append(f"{key!r} (variable {var.name!r}): expected {what} of dtype "
                            f"{dtype_name(want)}, found shape {tuple(info.shape)} dtype "
                            f"{dtype_name(stored)}{hint}")
            continue
        target = Box.full(info.shape) if box is None else Box(box.offset, box.shape)
        plans.append((key, var, target, want))
    if problems:
        more = " (restore(..., cast=True) converts same_kind dtypes)" if could_cast else ""
        raise CheckpointMismatchError(
            f"Cannot restore from {str(path)!r}: {len(problems)} stored value(s) do not match "
            f"their variables{more}; nothing was restored. " + "; ".join(problems) + "."
        )
    _stage(reader, staged, plans, verify)
    return staged


def _stage(
    reader: Any, staged: Staged, plans: list[tuple[str, Variable, Box, np.dtype]], verify: bool
) -> None:
    """Read (or, for the variables read in place later, verify) every planned box."""
    in_place = _in_place(reader, plans) if isinstance(reader, ShardedReader) else []
    if verify and sum(buf.nbytes for _, _, _, buf in in_place) <= TEMPORARY_BUDGET:
        in_place = []  # small: one pass into temporaries
    direct = {id(var) for var, _, _, _ in in_place}
    on_device = _on_device(reader, plans)
    direct.update(id(var) for var, _, _, _ in on_device)
    for _, key, target, _ in on_device:  # checked now, read into the device at apply
        if verify:
            _verify_box(reader, key, target)
    staged.on_device = [(key, target, dst) for _, key, target, dst in on_device]
    for key, var, target, want in plans:
        if id(var) not in direct:
            value = _read_for(reader, key, target, verify)
            if value.dtype != want:  # no number changes class (wrapped, made inf): refused
                check_cast_fits(reader, key, value, want)
                value = value.astype(want)
            staged.values.append((var, value))
    if in_place and verify and is_url(os.fspath(reader.path)):
        _spool_reads(reader, staged, in_place)  # one download, not a verify and a read
        in_place = []
    for _, key, target, _ in in_place:
        if verify:
            reader.verify_box(key, target)
    staged.in_place = [(key, target, buf) for _, key, target, buf in in_place]
    staged.reader = reader


def _spool_reads(reader: Any, staged: Staged,
                 in_place: list[tuple[Variable, str, Box, np.ndarray]]) -> None:
    """Read each box once, verified, into the staged spool file (copied at apply)."""
    offsets, total = [], 0
    for *_, buf in in_place:
        offsets.append(total)
        total += -(-buf.nbytes // 4096) * 4096  # page-aligned views
    f = staged.spool(total)
    for (_, key, target, buf), at in zip(in_place, offsets, strict=True):
        if not buf.nbytes:
            continue
        view = np.memmap(f, dtype=buf.dtype, mode="r+", offset=at, shape=buf.shape)
        reader.read_box_into(key, target, view, verify=True)
        staged.spooled.append((view, buf))


def _in_place(
    reader: ShardedReader, plans: list[tuple[str, Variable, Box, np.dtype]]
) -> list[tuple[Variable, str, Box, np.ndarray]]:
    """The plans whose variable's own buffer can take the stored box as it is."""
    out = []
    seen: set[int] = set()
    for key, var, target, want in plans:
        buf = host_buffer(var)
        if (buf is not None and id(var) not in seen and buf.shape == tuple(target.shape)
                and buf.dtype == want == reader.info(key).dtype):
            seen.add(id(var))
            out.append((var, key, target, buf))
    return out


def _on_device(
    reader: Any, plans: list[tuple[str, Variable, Box, np.dtype]]
) -> list[tuple[Variable, str, Box, Any]]:
    """The plans whose variable stands for a GPU tensor (a CUDA DTensor's local shard)
    that can take the stored box in place: C-contiguous, of the box's shape and the
    stored dtype (a cast goes through the host)."""
    out = []
    seen: set[int] = set()
    for key, var, target, want in plans:
        dst = device_value(var)
        if (dst is not None and id(var) not in seen and fillable(dst)
                and tuple(dst.shape) == tuple(target.shape)
                and want == np.dtype(reader.info(key).dtype)):
            seen.add(id(var))
            out.append((var, key, target, dst))
    return out


def _verify_box(reader: Any, key: str, target: Box) -> None:
    """Verify what a later ``verify=False`` read of box ``target`` of ``key`` reads."""
    if isinstance(reader, ShardedReader):
        reader.verify_box(key, target)
    else:
        reader.verify(key)


def _fill_box(reader: Any, key: str, target: Box, dst: Any) -> None:
    """Read box ``target`` of stored ``key`` (verified already) into GPU tensor ``dst``
    through the pinned staging buffer, a slab of its rows at a time; a box whose one row
    does not fit the buffer is read to the host whole, then copied."""
    dtype = np.dtype(reader.info(key).dtype)
    offset, shape = tuple(target.offset), tuple(target.shape)

    def read_rows(first: int, out: np.ndarray) -> None:
        if not shape:
            out[...] = _read_for(reader, key, target, False)
            return
        slab = Box((offset[0] + first, *offset[1:]), (out.shape[0], *shape[1:]))
        if isinstance(reader, ShardedReader):
            reader.read_box_into(key, slab, out, verify=False)
        else:
            np.copyto(out, reader[key][slab.slices()])

    if not fill_device_rows(read_rows, dtype, dst):
        upload(_read_for(reader, key, target, False), dst)


def _fits(var_shape: Any, stored: tuple[int, ...]) -> bool:
    if var_shape is None:
        return True
    shape = tuple(var_shape)
    return len(shape) == len(stored) and all(
        s is None or s == t for s, t in zip(shape, stored, strict=True))


def collective_restore(
    path: str | os.PathLike[str],
    pairs: Sequence[tuple[str, Variable | Logical]],
    coord: Coordinator,
    *,
    timeout: float | None = None,
    verify: bool = True,
    optional: Sequence[str] = (),
    cast: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore ``pairs`` (key, variable) from ``path`` on every rank, all or nothing.

    Each rank reads only the parts of the stored boxes that overlap what its variables
    hold. Every check (keys, dtypes, shapes, coverage, checksums) runs before any
    variable changes; a failure on any rank makes every rank raise ``DistributedError``.
    Keys in ``optional`` may be absent. ``cast``: as :func:`stage_reads` (each rank
    warns, once, naming what it converted). ``storage_options``: for a URL ``path``.
    Returns the checkpoint's metadata.
    """
    tag = f"restore:{os.path.basename(os.fspath(path).rstrip('/'))}"
    staged = Staged()
    failure: BaseException | None = None
    meta: dict[str, Any] = {}
    reader: Any = None
    try:
        try:
            reader = open_checkpoint_reader(path, storage_options)
            meta = reader.metadata()
            missing = [k for k, _ in pairs if k not in reader and k not in optional]
            if missing:
                raise MissingValueError(
                    f"{str(path)!r} has no value for {', '.join(map(repr, missing))}."
                )
            present = restore_pairs((k, v) for k, v in pairs if k in reader)
            staged = stage_reads(reader, present, path, verify=verify, cast=cast)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
        coord.vote(failure, tag=tag, timeout=timeout)
        staged.apply(path)
    finally:
        staged.close()
        if reader is not None:
            reader.close()
    return meta


def _read_for(reader: Any, key: str, target: Box, verify: bool) -> np.ndarray:
    """The box ``target`` of the stored value ``key`` (in its stored dtype), verified."""
    if isinstance(reader, ShardedReader):
        return reader.read_box(key, target, verify=verify)
    if target == Box.full(reader.info(key).shape):
        return np.asarray(reader.read(key, verify=verify))
    if verify:
        reader.verify(key)
    return np.asarray(reader[key][target.slices()])
