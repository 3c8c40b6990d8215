"""``cv.Saver``: name-based (TF1-style) checkpoints keyed by variable names.

Owns the mapping from ``var_list`` (``None``: the global variables at save time; a
list: keyed by each variable's name; a dict: by its keys; the parts of a partitioned
variable are one logical variable keyed by its full name), ``prefix-<step>.h5``
naming and ``max_to_keep`` / ``keep_checkpoint_every_n_hours`` for the files this
saver wrote.
"""

from __future__ import annotations

import os
import time
from collections.abc import Container, Mapping, Sequence
from typing import Any

from ..errors import CheckpointNotFoundError
from ..graph import global_variables
from ..locations import is_url
from ..storage import paused_gc
from ..variables import PartitionedVariable, Variable
from ._apply import stored_infos
from ._collective import collective_write, needs_collective, rank_variables
from ._collective_restore import collective_restore
from ._files import discard, open_checkpoint_reader, write_file
from ._logical import Logical, apply_targets, group_by_name
from ._serialize import SaveContents, host_arrays, metadata
from ._state import record_latest
from ._status import missing_keys_error
from ._steps import split_format, step_name

__all__ = ["Saver"]


class Saver:
    """Saves and restores variables by name.

    Args:
        var_list: ``None`` (the global variables, looked up at each save/restore), a
            list of variables (keyed by their names) or a ``{key: Variable}`` dict.
        max_to_keep: how many of the newest files this saver wrote to keep; ``None``
            or ``0`` keeps all.
        keep_checkpoint_every_n_hours: as TensorFlow's: of the files ``max_to_keep``
            would delete, one every this many hours (counted from the saver's creation)
            is kept for good instead, and leaves :attr:`last_checkpoints`.
    """

    def __init__(
        self,
        var_list: Sequence[Variable | PartitionedVariable]
        | Mapping[str, Variable | PartitionedVariable] | None = None,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 0:
            raise ValueError(f"max_to_keep must be None or >= 0, got {max_to_keep}.")
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError("keep_checkpoint_every_n_hours must be None or > 0, got "
                             f"{keep_checkpoint_every_n_hours}.")
        self._keep_every = (None if keep_checkpoint_every_n_hours is None
                            else keep_checkpoint_every_n_hours * 3600.0)
        self._next_keep = time.time() + (self._keep_every or 0.0)
        self._saved_at: dict[str, float] = {}
        self._var_list = var_list
        if var_list is not None:
            self._mapping()  # validate now
        self.max_to_keep = max_to_keep
        self._last: list[str] = []

    @property
    def last_checkpoints(self) -> list[str]:
        """Files this saver wrote that it still keeps, oldest first."""
        return list(self._last)

    def recover_last_checkpoints(
        self, checkpoint_paths: Sequence[str | os.PathLike[str]]
    ) -> None:
        """Take ``checkpoint_paths`` (oldest first) as the files this saver wrote, as
        TensorFlow's ``Saver.recover_last_checkpoints`` does after a restart: they become
        :attr:`last_checkpoints`, and ``max_to_keep`` prunes them with the next saves.

        A local path that does not exist is left out (another process may have deleted
        it); a file's modification time counts as its save time for
        ``keep_checkpoint_every_n_hours``. Object-store URLs are taken as given.
        """
        last: list[str] = []
        saved_at: dict[str, float] = {}
        for given in checkpoint_paths:
            path = os.fspath(given)
            if is_url(path):
                when = time.time()
            else:
                try:
                    when = os.stat(path).st_mtime
                except FileNotFoundError:
                    continue
            if path in saved_at:
                last.remove(path)
            last.append(path)
            saved_at[path] = when
        self._last, self._saved_at = last, saved_at

    def _mapping(self) -> dict[str, Variable | Logical]:
        var_list = self._var_list
        if var_list is None:
            var_list = global_variables()
        items: list[tuple[Any, Any]]
        if isinstance(var_list, Mapping):
            items = list(var_list.items())
        else:
            items = [(getattr(v, "name", None), v) for v in var_list]
        for key, var in items:
            if not isinstance(var, (Variable, PartitionedVariable)):  # a tuple: faster than a union
                raise TypeError(f"Saver var_list entry {key!r} is not a Variable: {var!r}.")
            if not isinstance(key, str) or not key:
                raise ValueError(f"Saver keys must be non-empty strings, got {key!r}.")
        return group_by_name(items)

    def save(
        self,
        prefix: str | os.PathLike[str],
        global_step: int | Variable | None = None,
        *,
        format: str | None = None,
        coordinator: Any = None,
        timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        pack_threshold: int | None = None,
    ) -> str:
        """Write ``prefix-<global_step>.h5`` (or ``prefix.h5`` without a step); returns it.

        ``pack_threshold``: values under this many bytes are packed into one blob (``0``:
        every value its own array; default: docs/FORMAT.md, "Packing").

        With ``coordinator`` (more than one process) every process calls this and they
        write one checkpoint together (docs/distributed.md); ``timeout`` bounds each step.
        ``prefix`` may be an object-store URL (``storage_options``: its client's settings).

        The file is then recorded as its directory's latest checkpoint
        (``cv.latest_checkpoint`` returns it), as TensorFlow's ``Saver`` does.
        """
        base, fmt, suffix = split_format(prefix, format)
        if global_step is not None:
            step = int(global_step.numpy() if isinstance(global_step, Variable) else global_step)
            path = step_name(base, step, suffix)
        else:
            path = base + suffix
        with paused_gc():  # tens of thousands of small objects, none cyclic
            return self._save(path, fmt, coordinator, timeout, storage_options,
                              pack_threshold=pack_threshold)

    def _save(self, path: str, fmt: str, coordinator: Any, timeout: float | None,
              storage_options: Mapping[str, Any] | None, *, pack_threshold: int | None) -> str:
        mapping = self._mapping()
        if not mapping:
            raise ValueError("Saver has no variables to save.")
        collective = needs_collective(coordinator, mapping.values())
        if collective:
            mapping = rank_variables(mapping)
        plan = SaveContents(variables=mapping)
        meta = metadata(plan, save_counter=None) | {"saver": {"version": 1}}
        if collective:
            primary = coordinator.is_primary
            path = collective_write(path, fmt, host_arrays(plan, copy=False), meta, mapping,
                                    coordinator, timeout=timeout, on_commit=record_latest,
                                    storage_options=storage_options,
                                    pack_threshold=pack_threshold)
        else:
            primary = True
            path = write_file(path, fmt, host_arrays(plan, copy=False), meta, storage_options,
                              pack_threshold=pack_threshold)
        if path in self._last:
            self._last.remove(path)
        self._last.append(path)
        self._saved_at[path] = time.time()
        if self.max_to_keep:
            while len(self._last) > self.max_to_keep:
                old = self._last.pop(0)
                saved_at = self._saved_at.pop(old, 0.0)
                if self._keep_every is not None and saved_at >= self._next_keep:
                    self._next_keep += self._keep_every  # kept for good, as TensorFlow does
                    continue
                if primary:  # in a multi-process save, rank 0 alone deletes
                    discard(old, storage_options)
        if not collective:  # a collective save recorded it when committing
            record_latest(path)
        return path

    def restore(
        self,
        path: str | os.PathLike[str] | None,
        *,
        verify: bool = True,
        cast: bool = False,
        coordinator: Any = None,
        timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Restore every variable by its key (a missing key: ``KeyError``, nothing changed).

        ``cast=True`` converts same_kind dtypes (float16 -> float32, ...) with a warning.
        With ``coordinator``, all processes restore together, all or nothing. ``path``
        ``None`` (``cv.latest_checkpoint`` of a directory without one) raises
        ``CheckpointNotFoundError``, as TensorFlow's ``Saver`` refuses it.
        """
        if path is None:
            raise CheckpointNotFoundError(
                "Saver.restore got path None: there is no checkpoint to restore "
                "(cv.latest_checkpoint returns None for a directory without one)."
            )
        with paused_gc():  # tens of thousands of small objects, none cyclic
            self._restore(path, verify=verify, cast=cast, coordinator=coordinator,
                          timeout=timeout, storage_options=storage_options)

    def _restore(self, path: str | os.PathLike[str], *, verify: bool, cast: bool,
                 coordinator: Any, timeout: float | None,
                 storage_options: Mapping[str, Any] | None) -> None:
        mapping = self._mapping()
        if needs_collective(coordinator, mapping.values()):
            collective_restore(path, list(rank_variables(mapping).items()), coordinator,
                               timeout=timeout, verify=verify, cast=cast,
                               storage_options=storage_options)
            return
        with open_checkpoint_reader(path, storage_options) as reader:
            infos = stored_infos(reader)
            keys = reader.keys()  # answers `in` without a Python call per key
            mapping = _stored_as_parts(mapping, keys)
            missing = [k for k in mapping if k not in keys]
            if missing:
                raise missing_keys_error(missing, path)
            apply_targets(reader, list(mapping.items()), infos, verify=verify, cast=cast)

    def __repr__(self) -> str:
        return f"<cv.Saver max_to_keep={self.max_to_keep}>"


def _stored_as_parts(mapping: dict[str, Variable | Logical], keys: Container[str]) -> dict[
        str, Variable | Logical]:
    """Parts stored under their own names (``emb/table/part_0``, ...) restore by those names
    when the file has no logical value for them (as ckptvar wrote before it stored one)."""
    out: dict[str, Variable | Logical] = {}
    for key, target in mapping.items():
        if (isinstance(target, Logical) and key not in keys
                and all(p.name in keys for p in target.parts)):
            out.update((p.name, p) for p in target.parts)
        else:
            out[key] = target
    return out
