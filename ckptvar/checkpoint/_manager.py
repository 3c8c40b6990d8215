"""``cv.CheckpointManager``: numbered checkpoints in a directory, with retention.

Owns the manager's section of the directory's state file (``_state``), the
``max_to_keep`` / ``keep_checkpoint_every_n_hours`` / ``checkpoint_interval``
rules (TensorFlow's), and recovery after a restart (temporaries left by a crash,
deletions that did not finish).

The state has one section per ``checkpoint_name``; a manager only ever deletes
files listed in its own section, i.e. files it wrote. A checkpoint is listed only
after its file is durable under its final name, and removed from the list before
its file is deleted, so every listed checkpoint is complete.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
import os
import shutil
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    DestinationExistsError,
    DistributedError,
    DistributedTimeoutError,
    UnsupportedFormatError,
)
from ..locations import (
    Location,
    StorageError,
    checked_lock_timeout,
    clean_uncommitted,
    committed_in_save_order,
    fsync_all,
    fsync_path,
    is_committed,
    is_url,
    lock_timeout,
    open_location,
    prune,
    publish,
    remove_local,
    temporaries,
    temporary_sibling,
)
from ..storage import (
    BaseFileLost,
    is_own_checkpoint,
    is_partial,
    known_formats,
    remote_external_files,
    save_remote,
)
from ..variables import Variable
from . import _async
from ._checkpoint import Checkpoint, SaveOptions
from ._collective_targets import Nodes, register_nodes
from ._deletes import WAIT_S, BackgroundDeletes, free
from ._files import NATIVE_FORMATS, cut_down, retire
from ._incremental import Incremental, Restored, held, missing_references
from ._incremental_options import IncrementalOptions, incremental_options
from ._preemption import SignalSave
from ._reclaim import idle, open_saving_lock, reclaim_staging, share_saving_lock
from ._state import (
    STATE_FILE,
    STATE_VERSION,
    exists,
    latest_checkpoint,
    locked,
    read_state,
    save_order,
    writable,
    write_state,
)
from ._status import RestoreStatus
from ._steps import parse_step_name, step_name
from ._tiers import discover_nodes, persist_parts, restore_order

__all__ = ["STATE_FILE", "CheckpointManager", "latest_checkpoint"]

logger = logging.getLogger("ckptvar")

#: What ``restore_or_initialize`` skips a checkpoint for (also as another process's failure).
_SKIPPED = ("CorruptCheckpointError", "CheckpointNotFoundError", "UnsupportedFormatError")


@functools.lru_cache(maxsize=4096)
def _own_number(name: str, prefix: str, suffix: str) -> int:
    """The step number of ``name`` as ``<prefix>-N<suffix>``, or -1 (a manager asks of the
    same few names several times a step: the directory's, the state file's)."""
    parsed = parse_step_name(name, prefix=prefix, suffixes=(suffix,))
    return parsed.step if parsed is not None else -1


def _step_time(path: str) -> float:
    """A committed step's time: its file's (or directory's) modification time, what a
    state file rebuilt from the directory sees too (now, if it cannot be read)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return time.time()


#: Linux's ``CLOCK_REALTIME_COARSE`` (Python names no constant for it): the clock file
#: times are taken from (or a finer one), so a file written later is never older.
_COARSE_CLOCK = 5


def _file_clock_now() -> float:
    """Now, as a file written now would be dated: never after a later step's time (the
    wall clock may be a clock tick ahead of file times)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            return time.clock_gettime(_COARSE_CLOCK)
    return time.time()


#: The largest step number: the save counter is an int64, and the next save adds one.
_MAX_NUMBER = 2**63 - 2


def _step_number(checkpoint_number: Any) -> int | None:
    """``checkpoint_number`` as the int a step's name holds; ``ValueError`` for a value
    no manager could list (negative), that is not a whole number, or that overflows the
    save counter."""
    if checkpoint_number is None:
        return None
    try:
        number = operator.index(checkpoint_number)
    except TypeError:
        try:  # a float, a 0-d array or variable, a numeric string
            as_float = float(checkpoint_number)
        except (TypeError, ValueError):
            as_float = float("nan")
        if not as_float.is_integer():
            raise ValueError(f"checkpoint_number must be a whole number; got "
                             f"{checkpoint_number!r}.") from None
        number = int(as_float)
    if not 0 <= number <= _MAX_NUMBER:
        raise ValueError(f"checkpoint_number must be from 0 to {_MAX_NUMBER} (a step's "
                         f"number, held by the int64 save counter); got {number}.")
    return number


def _check_arguments(
    checkpoint: Any, max_to_keep: int | None, checkpoint_name: str, format: str,
    keep_hours: float | None = None, *, lock_timeout: float | None = None,
) -> float | None:
    """Raise on a manager argument that can never work (before anything is touched);
    returns ``lock_timeout``, checked."""
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"CheckpointManager needs a cv.Checkpoint, got {checkpoint!r}.")
    if max_to_keep is not None and max_to_keep < 1:
        raise ValueError(f"max_to_keep must be None or >= 1, got {max_to_keep}.")
    if keep_hours is not None and not keep_hours >= 0:  # 0: off (TensorFlow's); NaN none
        raise ValueError("keep_checkpoint_every_n_hours must be None, 0 (both: off) or > 0, "
                         f"got {keep_hours}.")
    if not checkpoint_name or "/" in checkpoint_name or checkpoint_name.startswith("."):
        raise ValueError(f"Bad checkpoint_name {checkpoint_name!r}.")
    lowered = checkpoint_name.lower()
    for suffix in (s for suffixes in known_formats().values() for s in suffixes):
        if lowered.endswith(suffix):  # a save would drop it: steps named apart from the name
            raise ValueError(
                f"Bad checkpoint_name {checkpoint_name!r}: it ends in {suffix!r}, which a "
                "save takes as a format and leaves out of the step's file name, so this "
                "manager would never find its steps. Name it without the suffix and "
                "choose the format with format=."
            )
    if format not in NATIVE_FORMATS or format not in known_formats():
        raise UnsupportedFormatError(
            f"CheckpointManager writes {' or '.join(NATIVE_FORMATS)}, not {format!r}."
        )
    return checked_lock_timeout(lock_timeout)


_P = ParamSpec("_P")
_B = TypeVar("_B", Path, str)  # a step on a file system, or its URL


def _one_at_a_time(save: Callable[Concatenate[CheckpointManager, _P], str | None],
                   ) -> Callable[Concatenate[CheckpointManager, _P], str | None]:
    """``save`` under the manager's lock: saves from several threads take turns, each
    numbered after the one before (docs/checkpoints.md, "Thread safety")."""

    @functools.wraps(save)
    def one_at_a_time(self: CheckpointManager, /, *args: _P.args,
                      **kwargs: _P.kwargs) -> str | None:
        with self._save_lock, self._locks():
            return save(self, *args, **kwargs)

    return one_at_a_time


def _copy_checkpoint(src: Path, dst: Path, *, durable: bool = False) -> None:
    """Copy the checkpoint file or directory ``src`` to ``dst`` (fsynced when ``durable``)."""
    if src.is_dir():
        shutil.copytree(src, dst)
        if durable:
            fsync_all([p for p in dst.rglob("*") if p.is_file()],
                      [dst, *(p for p in dst.rglob("*") if p.is_dir())])
        return
    shutil.copyfile(src, dst)
    if durable:
        fsync_path(dst)


#: With several processes, rank 0's persistent copies are waited for in rounds of this
#: many seconds, each ending in a small collective (well inside any coordinator timeout).
_PERSIST_POLL_S = 5.0


#: A manager's saves look for dead processes' staging directories in ``TMPDIR`` at most
#: this often (``ckpt gc`` and a new manager look whenever they run).
_STAGING_EVERY_S = 30.0


class CheckpointManager:
    """Saves numbered checkpoints of ``checkpoint`` into ``directory`` and prunes old ones.

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where files and the state file live (created if missing).
        max_to_keep: keep this many checkpoints, those saved last (``None``: all).
        keep_checkpoint_every_n_hours: additionally keep (unlisted, never deleted) one
            checkpoint per this many hours among those pruned (``None`` or ``0``: none,
            as TensorFlow's manager).
        checkpoint_name: file name prefix (``ckpt`` -> ``ckpt-7.h5``).
        step_counter: a variable or int-returning callable giving the current step, for
            ``checkpoint_interval``.
        checkpoint_interval: save only if at least this many steps passed since the last
            checkpoint (needs ``step_counter`` or a ``checkpoint_number``).
        init_fn: called by :meth:`restore_or_initialize` when there is nothing to restore.
        format: ``"h5"`` or ``"zarr"``.
        async_save: write in the background (see ``Checkpoint.save(blocking=False)``).
        coordinator: a ``cv.distributed`` coordinator: every process creates the manager
            and calls :meth:`save` (``timeout=`` bounds each collective); they write one
            checkpoint, rank 0 keeps the state file and prunes.
        pack_threshold: the writer's (``0``: every value its own array; default:
            docs/FORMAT.md, "Packing"), for every save.
        save_on_signal: signals (e.g. ``(signal.SIGTERM,)``) that make the next step
            boundary a save, then are re-delivered: see :meth:`save_on_signal`.
        incremental: write only the values that changed since this manager's latest
            step; the others refer to the bytes stored already (docs/checkpoints.md,
            "Incremental checkpoints"). A pruned step whose bytes a kept step refers to
            stays on disk (``pending_delete`` with ``held_for`` in the state file) until
            no kept step does. With a coordinator, each process's file refers to its
            own file in the base step (same processes and layout, else written whole).
            A :class:`IncrementalOptions` instead of ``True`` chooses the trade-off
            between bytes written and restore time (``True``: its defaults;
            docs/checkpoints.md, "Choosing the trade-off").

    Tiers (keyword-only): with ``local_directory`` every step is saved there (fast,
    blocking) and every ``persistent_every``-th is also copied to ``directory`` (a
    path or URL) in the background; ``local_max_to_keep`` steps stay local, a step
    never pruned there before its persistent copy is committed. Restore takes the
    newest step committed in either tier (the local copy first); a process that lost
    its local tier restores from the persistent one. :meth:`wait_until_finished`
    waits for the background copies. A preemption save (``save_on_signal``) is
    persisted too, before the signal is re-delivered. With ``async_save`` the local
    save runs in the background as well. With a coordinator of several processes the
    local tier is one directory they share (rank 0 persists) or one per node (found by
    looking: each node holds its processes' part of a step, every process copies its
    own part, rank 0 commits the copy; restore takes the newest step complete on every
    node or persisted); :meth:`wait_until_finished` is then a collective
    (docs/checkpoints.md, "Tiers").

    ``lock_timeout`` (keyword-only): how long (seconds, above 0; ``math.inf``: forever)
    this manager waits for a lock on its directory (the state file's, a save's, a
    clean-up's) that another process holds, in its saves, background ones included,
    and its listings; past it a ``CkptError`` (also a ``TimeoutError``) names the lock
    file, its holder where known, and the time waited. ``None``: 300 s.

    A read-only directory can be opened (``read_only`` is then True):
    :attr:`checkpoints`, :attr:`latest_checkpoint` and :meth:`restore_or_initialize`
    work, crash leftovers are left alone, and :meth:`save` raises ``CkptError``.
    """

    #: saves even at the step saved last (``_numbers``): a preemption save, and a local
    #: tier per node, whose steps the tiered manager's collective decides on
    _always_save: bool = False

    def __init__(  # noqa: PLR0917 - TensorFlow's CheckpointManager argument list (API.md)
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Variable | Callable[[], int] | None = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        format: str = "h5",
        async_save: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        coordinator: Any = None,
        pack_threshold: int | None = None,
        save_on_signal: Sequence[int] = (),
        incremental: bool | IncrementalOptions = False,
        *,
        local_directory: str | os.PathLike[str] | None = None,
        local_max_to_keep: int | None = None,
        persistent_every: int = 1,
        lock_timeout: float | None = None,
    ) -> None:
        #: seconds a lock on the directory is waited for (``None``: 300 s, the default)
        self.lock_timeout = _check_arguments(checkpoint, max_to_keep, checkpoint_name,
                                             format, keep_checkpoint_every_n_hours,
                                             lock_timeout=lock_timeout)
        #: frees the pruned steps' bytes in the background (:meth:`_delete`)
        self._deletes = BackgroundDeletes()
        self._init_incremental(incremental, checkpoint)
        #: an object store's incremental HDF5 steps: the steps each one reads values from
        self._references: dict[str, frozenset[str]] = {}
        #: an object store's commit markers read: ``(step, etag) -> the time it records``
        self._marker_times: dict[tuple[str, str], float] = {}
        self._checkpoint = checkpoint
        self._location: Location | None = None
        self._storage_options = storage_options
        self.pack_threshold = pack_threshold
        if is_url(directory):
            if keep_checkpoint_every_n_hours:
                raise CkptError(
                    "keep_checkpoint_every_n_hours is not supported on an object store "
                    f"({directory!r}): every committed step is listed, so a preserved one "
                    "could not be told apart from a kept one."
                )
            self._location = open_location(directory, storage_options=storage_options)
        self.directory: Any = self._location.url if self._location else Path(directory)
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours or None  # 0: off
        self.checkpoint_name = checkpoint_name
        self.format = format
        self._suffix = known_formats()[format][0]
        self._step_counter = step_counter
        self.checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self.async_save = async_save
        #: a ``cv.distributed`` coordinator: saves are collective, rank 0 keeps the state
        self.coordinator = coordinator
        primary = self._keeps_directory()
        self.restore_status: RestoreStatus | None = None
        self.skipped: list[tuple[str, str]] = []
        self._section: dict[str, Any] = {}
        self._created = _file_clock_now()  # the hours rule's start (steps: file times)
        reclaim_staging()  # this host's staging directories of dead saves
        self._on_signal = SignalSave()
        if save_on_signal:
            self._on_signal.install(save_on_signal)
        self._local_tier: CheckpointManager | None = None
        self.local_max_to_keep = local_max_to_keep
        self.persistent_every = persistent_every
        self._persisting: dict[int, Future[None]] = {}
        #: steps due a persistent copy outside ``persistent_every`` (preemption saves)
        self._also_persisted: set[int] = set()
        self._tier_lock = threading.Lock()
        self._save_lock = threading.RLock()  # held by :meth:`save` (a preemption save's too)
        self._pool: ThreadPoolExecutor | None = None
        if local_directory is not None:
            self._init_tiers(local_directory, step_counter, checkpoint_interval)
        if self._location is not None:
            self._init_remote(self._location, primary)
            return
        self._init_local(Path(directory), primary)

    def _init_remote(self, location: Location, primary: bool) -> None:
        self.read_only = False
        self._section = self._empty_section()
        committed = committed_in_save_order(location, known=self._marker_times)
        self._section["checkpoints"] = self._remote_list(committed=committed)
        if not self._section["checkpoints"]:  # the same listing: no request more
            self._say_other_formats(location.url, committed, stacklevel=4)
        if primary:
            clean_uncommitted(location, older_than_latest=True)

    def _locks(self) -> contextlib.AbstractContextManager[None]:
        """The block's waits for a lock last at most ``lock_timeout`` (this thread's, and
        those of the background saves it submits)."""
        return lock_timeout(self.lock_timeout)

    def _init_incremental(self, incremental: bool | IncrementalOptions,
                          checkpoint: Checkpoint) -> None:
        #: ``incremental=``: what the user chose (None: not incremental)
        self._incremental_options = options = incremental_options(incremental)
        #: ``incremental=True``: the last committed step this manager builds on
        self._incremental = None if options is None else Incremental(options.limits())
        #: the checkpoint's last restore, once this manager's memory took it (:meth:`_learn`)
        self._taught: Restored | None = None
        #: steps of this directory found to have lost a file an incremental save took
        #: bytes from (name -> what was lost): never built on (:meth:`_note_lost`)
        self._lost: dict[str, str] = {}
        if self._incremental is not None:
            checkpoint.note_restores()  # the next save learns what a restore set (one
            # made before this manager too: its variables' rows are tracked from now)
        #: which steps an incremental manager writes whole (``whole_every``; a local
        #: tier's: also those due a persistent copy, so that the copy stands alone)
        self._whole_steps: Callable[[int], bool] | None = None
        if self._incremental is not None and options is not None and options.whole_every:
            state, every = self._incremental, options.whole_every
            self._whole_steps = lambda _number: state.whole_due(every)

    def _init_local(self, directory: Path, primary: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.read_only = not writable(directory)
        with self._locks(), locked(directory, shared=self.read_only):
            state = read_state(directory, repair=not self.read_only)
            # the file's section as read: recovery edits the state's section in place
            stored = copy.deepcopy(state["sections"].get(self.checkpoint_name))
            self._section = self._recover(state)
            if not self.read_only and primary:  # recovery writes; read-only: left as is
                self._clean_temporaries()
                stored_now = self._finish_deletions(state)
                if not stored_now and stored != self._section:  # under the directory's lock
                    self._store(state)  # the cache now says what the directory holds
        if not self._section.get("checkpoints"):
            names: list[str] = []
            with contextlib.suppress(OSError):
                names = [entry.name for entry in os.scandir(directory)]
            self._say_other_formats(os.fspath(directory), names, stacklevel=4)

    def _say_other_formats(self, where: str, names: Iterable[str], *, stacklevel: int) -> None:
        """This manager lists none of its steps: say which of ``names`` (the entries of
        ``where``) are steps of its name in another format (a run saved as Zarr restarted
        by a manager left at h5 would otherwise start from scratch without a word)."""
        others = {fmt: known_formats()[fmt] for fmt in NATIVE_FORMATS if fmt != self.format}
        found: dict[str, list[tuple[int, str]]] = {}
        for name in names:
            for fmt, suffixes in others.items():
                parsed = parse_step_name(name, prefix=self.checkpoint_name, suffixes=suffixes)
                if parsed is not None:
                    found.setdefault(fmt, []).append((parsed.step, name))
        for fmt, steps in found.items():
            newest = max(steps)[1]
            warnings.warn(
                f"{where!r} holds {len(steps)} {fmt} step(s) named "
                f"{self.checkpoint_name!r} (the newest {newest!r}) and no {self.format} "
                f"step: this manager (format={self.format!r}) does not list, restore or "
                f"prune them. To continue that run, pass format={fmt!r}.",
                UserWarning, stacklevel=stacklevel)

    def _make_again(self) -> None:
        """The directory was removed under this manager (a scratch purge, a clean-up by
        hand): made again, empty, as the manager made it first, and said in the log."""
        logger.warning("Checkpoint directory %s was removed while this manager used it; "
                       "made again (the steps it held are gone).", os.fspath(self.directory))
        self.directory.mkdir(parents=True, exist_ok=True)

    # -- an object store: the commit markers are the state ------------------------------
    def _remote_list(self, *, every: bool = False,
                     committed: list[str] | None = None) -> list[dict[str, Any]]:
        """This manager's committed steps in save order, oldest first (one listing
        request, and a read of each marker not read before;
        ``locations.committed_in_save_order``).

        An incremental HDF5 manager lists only the newest ``max_to_keep`` (unless
        ``every``): an older step still committed is held, kept because a listed step
        reads values from its object (docs/checkpoints.md, "Incremental checkpoints").
        ``committed``: that listing, made already by the caller.
        """
        assert self._location is not None
        if committed is None:
            committed = committed_in_save_order(self._location, known=self._marker_times)
        entries: list[dict[str, Any]] = []
        for key in committed:
            parsed = parse_step_name(key, prefix=self.checkpoint_name, suffixes=(self._suffix,))
            if parsed is not None:
                entries.append({"path": key, "step": parsed.step})
        if (not every and self.max_to_keep is not None and self._incremental is not None
                and self.format == "h5"):
            return entries[-self.max_to_keep:] if self.max_to_keep else []
        return entries

    def _record_remote(self, step: int) -> None:
        """After a commit: prune beyond ``max_to_keep`` (marker first), clean leftovers."""
        assert self._location is not None
        entries = self._remote_list(every=True)
        if self.max_to_keep is not None and len(entries) > self.max_to_keep:
            doomed = [e["path"] for e in entries[: -self.max_to_keep]]
            kept = [e["path"] for e in entries[-self.max_to_keep:]]
            holding = (held(self._location, kept, doomed, self._remote_references)
                       if self._incremental is not None and self.format == "h5" else {})
            self._note_holds(holding, doomed)
            entries = entries[-self.max_to_keep:]
            self._section["checkpoints"] = entries
            try:
                for name in doomed:
                    if name in holding:  # a kept incremental step reads its bytes from there
                        continue
                    self._references.pop(name, None)
                    prune(self._location, name)
            except StorageError as exc:  # the step is committed: the next save prunes again
                logger.warning("Step %d is committed; pruning the steps before it failed (the "
                               "next save prunes them): %s", step, exc)
                return
        try:
            clean_uncommitted(self._location, older_than_latest=True)
        except StorageError as exc:
            logger.warning("Step %d is committed; reclaiming what failed saves left failed "
                           "(the next save does): %s", step, exc)
        self._section["checkpoints"] = entries

    def _remote_references(self, name: str) -> frozenset[str]:
        """The steps whose objects hold bytes of the committed step ``name``'s values (an
        incremental HDF5 step; a committed step never changes, so read once)."""
        refs = self._references.get(name)
        if refs is None:
            refs = frozenset(remote_external_files(self._full(name), self._storage_options))
            self._references[name] = refs
        return refs

    def _full(self, name: str) -> str:
        if self._location is not None:
            return str(self._location.join(name))
        return os.fspath(Path(self.directory) / name)

    # -- state ------------------------------------------------------------------------
    def _empty_section(self) -> dict[str, Any]:
        return {
            "checkpoints": [],
            "preserved": [],
            "pending_delete": [],
            "last_preserved_time": self._created,
        }

    def _recover(self, state: dict[str, Any], mine: str | None = None) -> dict[str, Any]:
        """This manager's section: the state file's, checked against the directory.

        The committed files are the record, the state file a cache of them: a listed
        file that is gone is dropped, and a committed step of this manager's naming
        that the state does not know (a crash between the rename and the state
        write, a state file lost, damaged or stale) is listed, with its file's time.
        Steps are in save order: as the state file lists them, one it does not know
        placed by its file's time (``_state.save_order``). ``mine``: the step this
        manager just committed,
        which the caller lists itself (not opened to be told it is a checkpoint).
        """
        section = state["sections"].get(self.checkpoint_name)
        rebuilt = section is None  # the state file lost (or never written for this name)
        section = section or self._empty_section()
        for name in ("checkpoints", "preserved", "pending_delete"):
            section[name] = [e for e in section.get(name, []) if self._own(e)]
        on_disk = self._committed_on_disk()
        # A file that vanished (deleted by hand) is no longer listed: a listed name is
        # one of this listing's (a symbolic link: if it leads somewhere, as ``exists``).
        there = {name for name, _, link in on_disk
                 if not link or exists(self.directory / name)}
        section["checkpoints"] = [e for e in section["checkpoints"] if e["path"] in there]
        known = {e["path"] for name in ("checkpoints", "preserved", "pending_delete")
                 for e in section[name]}
        if mine is not None:
            known.add(mine)
        unknown = {}
        for name, number, _ in on_disk:
            if name in known:
                continue
            path = self.directory / name
            if not is_own_checkpoint(path):
                continue
            with contextlib.suppress(FileNotFoundError):  # pruned by another process
                unknown[name] = {"path": name, "step": number, "time": path.stat().st_mtime}
        if unknown:  # placed by the one rule of save order (``_state.save_order``)
            entries = {e["path"]: e for e in section["checkpoints"]} | unknown
            section["checkpoints"] = [entries[name] for name in save_order(
                self.directory, [e["path"] for e in section["checkpoints"]], unknown)]
            if rebuilt:  # no step known kept: the hours rule starts at the oldest found
                section["last_preserved_time"] = 0.0
        self._keep_for_hours(section)
        return section

    def _keep_for_hours(self, section: dict[str, Any],
                        leaving: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """``keep_checkpoint_every_n_hours`` (TensorFlow's rule): each step leaving the
        window, oldest saved first, is kept (moved to ``preserved``: unlisted, never
        deleted) if that many hours passed between the step kept last and its time (its
        file's modification time); returns the others (to prune).

        Without ``leaving``: the listed steps beyond ``max_to_keep`` (a state file rebuilt
        from the directory, a lower ``max_to_keep``), those not kept staying listed for
        the next save to prune. The rule depends only on the steps' times and order, so a
        state file rebuilt from the directory keeps the steps it kept."""
        hours = self.keep_checkpoint_every_n_hours
        listed = section["checkpoints"]
        if leaving is None:
            if hours is None or self.max_to_keep is None or len(listed) <= self.max_to_keep:
                return []
            excess = len(listed) - self.max_to_keep
            section["checkpoints"] = self._keep_for_hours(section, listed[:excess]) + \
                listed[excess:]
            return []
        doomed = []
        for old in leaving:
            if hours is not None and old["time"] - section["last_preserved_time"] >= (
                    hours * 3600):
                section["last_preserved_time"] = old["time"]
                section["preserved"].append(old)
            else:
                doomed.append(old)
        return doomed

    def _committed_on_disk(self) -> list[tuple[str, int, bool]]:
        """``(name, number, is a symbolic link)`` of every file or directory of this
        manager's naming that is under its final name (a committed step, or a user's file
        of that name): one listing of the directory, no ``stat``."""
        found = []
        for entry in os.scandir(self.directory):
            number = self._number(entry.name)
            if number >= 0 and not is_partial(entry.name):
                found.append((entry.name, number, entry.is_symlink()))
        return found

    def _number(self, name: str) -> int:
        return _own_number(name, self.checkpoint_name, self._suffix)

    def _own(self, entry: Any) -> bool:
        return isinstance(entry, dict) and self._is_own_name(str(entry.get("path", "")))

    def _is_own_name(self, name: str) -> bool:
        """``name`` is ``<checkpoint_name>-N<suffix>``: a file this manager writes."""
        return _own_number(name, self.checkpoint_name, self._suffix) >= 0

    def _clean_temporaries(self, prefixes: tuple[str, ...] | None = None) -> None:
        """Remove temporaries of this manager's files left by a crash (under the state lock).

        State-file temporaries are only written under the state lock, so any found now is
        a leftover. Checkpoint temporaries are removed only when no manager, in any
        process, is saving into the directory (see :meth:`save`), so a save still in
        flight keeps its temporary. ``prefixes`` picks temporaries that are dead whoever
        saves (those of a step just committed).
        """
        if prefixes is not None:
            remove_local(temporaries(self.directory, prefixes))
            return
        with idle(self.directory) as nobody_saving:
            mine: tuple[str, ...] = (f".{STATE_FILE}.",)
            if nobody_saving:
                mine += (f".{self.checkpoint_name}-",)
            skip = self._deletes.busy() | (
                frozenset() if self._spare is None else {self._spare.name})
            remove_local(temporaries(self.directory, mine, skip=skip))

    #: the local tier of a tiered manager on a node's own disk: its first rank keeps it
    _node_leader = False
    #: the local tier on per-node disks: which processes share each node's directory
    _nodes: Nodes | None = None
    #: this manager's last background save (``async_save``), for its tier's copy
    _pending_save: Any = None

    def _keeps_directory(self) -> bool:
        """Whether this process keeps the directory (state file, clean-up, pruning): the
        one process, rank 0, or on a per-node local tier each node's first rank."""
        return self.coordinator is None or self.coordinator.is_primary or self._node_leader

    def _reclaim(self) -> None:
        """Before a save: remove what dead saves left (temporaries in the directory, on
        the primary process; staging directories of this host's dead processes, looked
        for at most every :data:`_STAGING_EVERY_S` seconds; a new manager always looks)."""
        reclaim_staging(every=_STAGING_EVERY_S)
        if self._keeps_directory() and self._location is None:
            with locked(self.directory):
                self._clean_temporaries()

    def _refuse_foreign(self, number: int) -> None:
        """Raise if the step's name is taken by something that is not a ckptvar checkpoint.

        A user's own file named like this manager's step is never written over (and so
        never listed, never pruned).
        """
        final = self.directory / step_name(self.checkpoint_name, number, self._suffix)
        if os.path.lexists(final) and not is_own_checkpoint(final):
            raise DestinationExistsError(
                f"Cannot save step {number} to {os.fspath(final)!r}: something that is not a "
                "ckptvar checkpoint is there, and this manager never writes over or deletes "
                "what it did not write. Move it away, or give the manager another directory "
                "or checkpoint_name."
            )

    def _committed_numbers(self) -> set[int]:
        """The numbers of this manager's committed steps (listed, or kept by the hours rule)."""
        entries = self._section["checkpoints"] + self._section.get("preserved", [])
        return {self._number(e["path"]) for e in entries}

    def _held_numbers(self) -> set[int]:
        """The numbers of this manager's steps that are committed but no longer listed,
        kept because listed incremental steps refer to their bytes (``held``)."""
        if self._location is not None:
            return {int(e["step"]) for e in self._remote_list(every=True)}
        return {self._number(e["path"]) for e in self._section.get("pending_delete", [])
                if e.get("held_for")}

    def _next_number(self, number: int, committed: set[int] | None = None,
                     where: Callable[[int], str] | None = None) -> int:
        """``number`` (the save counter's next), or past the newest committed step if it is
        not past it (a job that did not restore, a counter behind the directory).

        A committed step is never written again, and a step numbered by the counter is
        never numbered below the newest one (a job that did not restore goes on past what
        the directory holds, its numbers rising with its saves; a number given by hand
        is saved as given). The save counter moves with the step so that the file holds
        its own number. Said in the log, naming where the step is (``where(step)``, with
        tiers; this manager's directory by default).
        """
        committed = self._committed_numbers() if committed is None else committed
        if not committed or number > max(committed):
            return number
        after = max(committed) + 1
        taken = number in committed or number in self._held_numbers()
        logger.warning(
            "Step %d is %s in %s; this save continues past the newest committed step, as "
            "step %d (restore_or_initialize() first to go on from it).",
            number, "committed already" if taken else "older than the newest committed step",
            (where or (lambda _: os.fspath(self.directory)))(number if taken else after - 1),
            after,
        )
        self._checkpoint.save_counter.assign(after - 1)
        return after

    def _count_if_committed(self, number: int) -> bool:
        """After a save that raised (in the background too): if its step got committed all
        the same (an error after the rename or the marker), the save counter counts it,
        so the next save goes on; says whether so."""
        done = False
        with contextlib.suppress(OSError, CkptError):
            name = step_name(self.checkpoint_name, number, self._suffix)
            done = (is_committed(self._location, name) if self._location is not None
                    else is_own_checkpoint(self.directory / name))
            if done:
                counter = self._checkpoint.save_counter
                counter.assign(max(int(counter.numpy()), number))
        return done

    def _refuse_committed(self, number: int) -> None:
        """Raise ``CheckpointExistsError`` if step ``number`` is committed already.

        A step is written once, by one process or many, locally or on an object store
        (as Orbax does): an explicit ``checkpoint_number`` that is committed is refused; a
        number from the save counter continues past it (:meth:`_next_number`). Every
        process decides from the same record, so all do the same.
        """
        name = step_name(self.checkpoint_name, number, self._suffix)
        if any(e["path"] == name for e in self._section["checkpoints"]) or (
            self._location is None and os.path.lexists(self.directory / name)
        ):
            raise CheckpointExistsError(
                f"Cannot save step {number}: {self._full(name)!r} is committed already, and a "
                "step is written once. Restore it (restore_or_initialize) and save the next, "
                "save under another checkpoint_number, or prune it first."
            )

    def _finish_deletions(self, state: dict[str, Any]) -> bool:
        """Delete the pending steps no step refers to now; whether the state was stored."""
        pending = self._section.get("pending_delete", [])
        if not pending:
            return False
        still, unheld = self._split_held(pending)
        self._delete(unheld)
        if still == pending:  # all held, as before: nothing to record
            return False
        self._section["pending_delete"] = still
        self._store(state)
        return True

    def _split_held(self, pending: list[dict[str, Any]]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``pending`` split into the steps a step on disk refers to (each with
        ``held_for``: those steps) and the others, which can be deleted."""
        if not pending:
            return [], []
        doomed = [e["path"] for e in pending]
        holding = held(self.directory, self._steps_on_disk(exclude=doomed), doomed)
        self._note_holds(holding, doomed)
        still = [{**e, "held_for": holding[e["path"]]} for e in pending if e["path"] in holding]
        return still, [e for e in pending if e["path"] not in holding]

    #: the next incremental save writes every value (:meth:`_note_holds`)
    _whole_next = False

    def _note_holds(self, holding: Mapping[str, list[str]], doomed: list[str]) -> None:
        """After a prune's ``held`` (pruned step -> the steps that refer to it): when more
        pruned steps are kept only because other pruned steps refer to them than are kept
        for the steps that stay, plus a few, the next incremental save writes every value,
        so that the prune after it frees them all. A held step is kept whole, and what it
        refers to with it: without this, such chains grow with the run."""
        gone = set(doomed)
        direct = sum(1 for by in holding.values() if not gone.issuperset(by))
        if len(holding) - direct > direct + 8:
            self._whole_next = True

    def _delete(self, entries: list[dict[str, Any]], *, keep_spare: bool = False) -> None:
        """Delete these pruned steps (never what is not a ckptvar checkpoint).

        Each is renamed away from its final name here (no final name is ever
        half-deleted); its bytes are freed in the background (:class:`BackgroundDeletes`:
        one deletion at a time, the next prune waits for the one before; a failure is
        logged, and what it left is a temporary that the next manager or ``ckpt gc``
        removes). With ``keep_spare`` (after a step of a local incremental Zarr manager),
        one of them is set aside for the next save to take over instead (``set_aside``:
        the array directories it shares with the kept steps by hard link, which that save
        would otherwise make and link again; cut down to them in the background); an
        earlier spare is deleted.
        """
        retired: list[Path] = []
        spare: Path | None = None
        for entry in entries:
            path = self.directory / entry["path"]
            if os.path.lexists(path) and not is_own_checkpoint(path):
                logger.warning(
                    "Not pruning %s: it is not a ckptvar checkpoint (left as it is).", path
                )
                continue
            tmp = retire(path)
            if tmp is None:
                continue
            if keep_spare and self._uses_spare() and tmp.is_dir():
                if self._spare is not None:
                    retired.append(self._spare)
                self._spare = spare = tmp
                continue
            retired.append(tmp)
        if not retired and spare is None:
            return

        def work(spare: Path | None = spare) -> None:
            if spare is not None and cut_down(spare) is None and self._spare == spare:
                self._spare = None  # nothing worth keeping: removed
            free(retired)

        names = [p.name for p in retired] + ([] if spare is None else [spare.name])
        self._deletes.submit(work, names)

    #: a pruned step set aside for the next save (:meth:`_delete`), or None
    _spare: Path | None = None

    def _uses_spare(self) -> bool:
        """Whether this manager's saves take a pruned step over: local incremental Zarr
        steps of one process."""
        return (self._incremental is not None and self.format == "zarr"
                and self._location is None and self.coordinator is None
                and self._local_tier is None and not self._node_leader)

    def _take_spare(self) -> Path | None:
        """The spare for the save about to start (it owns it from now on), if any."""
        if self._deletes.busy():  # still cut down (its wait timed out): not written into
            self._spare = None  # (a temporary, reclaimed once its deletion ended)
        spare, self._spare = self._spare, None
        if spare is not None and not os.path.isdir(spare):
            return None  # reclaimed meanwhile (``ckpt gc``, another process)
        return spare

    def _steps_on_disk(self, exclude: list[str]) -> list[str]:
        """This manager's step names in the directory, listed or not (a step committed
        just before a crash is not listed yet), but for ``exclude``."""
        skip = set(exclude)
        return sorted(e.name for e in os.scandir(self.directory)
                      if e.name not in skip and self._is_own_name(e.name))

    def _store(self, state: dict[str, Any], *, durable: bool = True) -> None:
        state["version"] = STATE_VERSION
        state["sections"][self.checkpoint_name] = self._section
        if self._section["checkpoints"]:
            state["latest"] = self._section["checkpoints"][-1]["path"]
        elif state.get("latest") and self._is_own_name(str(state["latest"])):
            state["latest"] = None
        write_state(self.directory, state, durable=durable)

    def _record(self, path: str, step: int) -> None:
        """Called once ``path`` is durable: list it, prune, write the state file once, then
        delete the pruned steps that no step refers to.

        Those are in the state neither as listed nor as pending (a crash before they
        are deleted leaves them committed and unlisted: :meth:`_recover` lists them
        again and the next save prunes them); a held one is pending. The state file
        is a cache of the directory, so it is written without fsync unless it holds
        what the directory cannot tell: a step newly kept by
        ``keep_checkpoint_every_n_hours`` (docs/checkpoints.md, "CheckpointManager").
        """
        name = Path(path).name
        now = _step_time(path)
        with self._locks(), locked(self.directory):
            state = read_state(self.directory, repair=True)
            section = self._recover(state, mine=name)
            preserved = len(section["preserved"])
            section["checkpoints"] = [e for e in section["checkpoints"] if e["path"] != name]
            section["checkpoints"].append({"path": name, "step": int(step), "time": now})
            doomed = []
            if self.max_to_keep is not None and len(section["checkpoints"]) > self.max_to_keep:
                excess = len(section["checkpoints"]) - self.max_to_keep
                doomed = self._keep_for_hours(section, section["checkpoints"][:excess])
                section["checkpoints"] = section["checkpoints"][excess:]
            section["pending_delete"], unheld = self._split_held(
                section.get("pending_delete", []) + doomed)
            self._section = section
            self._store(state, durable=len(section["preserved"]) != preserved)
            self._delete(unheld, keep_spare=True)
            self._clean_temporaries((f".{name}.",))  # a dead save's of this step

    # -- public -----------------------------------------------------------------------
    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def _sync(self) -> None:
        """Wait for this manager's background save, then read the record (every process:
        the committed steps, through the state file's cache where there is one)."""
        self._wait_checkpoint()
        if self._location is not None:  # the commit markers are the state
            self._section["checkpoints"] = self._remote_list()
            return
        if not self.directory.is_dir():  # removed under this manager: no step is left
            self._section = self._empty_section()
            return
        with self._locks(), locked(self.directory, shared=True):
            self._section = self._recover(read_state(self.directory))

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints in save order, oldest first (waits for a background save of
        this manager)."""
        self._sync()
        if self._local_tier is not None:
            return [path for _, path in self._tiered()]
        return [self._full(e["path"]) for e in self._section["checkpoints"]]

    @property
    def latest_checkpoint(self) -> str | None:
        """The durable checkpoint saved last, or ``None`` (as TensorFlow's: the last of
        :attr:`checkpoints`, whatever its number)."""
        listed = self.checkpoints
        return listed[-1] if listed else None

    def _current_step(self, checkpoint_number: int | None) -> int:
        if checkpoint_number is not None:
            return int(checkpoint_number)
        counter = self._step_counter
        if counter is None:
            raise ValueError(
                "checkpoint_interval needs a step: pass step_counter= to the manager or "
                "checkpoint_number= to save()."
            )
        value = counter.numpy() if isinstance(counter, Variable) else counter()
        return int(value)

    @_one_at_a_time
    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        timeout: float | None = None,
    ) -> str | None:
        """Save ``<directory>/<checkpoint_name>-N<suffix>``; returns its path.

        ``N`` is ``checkpoint_number`` if given, else the checkpoint's save counter after
        incrementing. With ``checkpoint_interval`` set (and ``check_interval``), returns
        ``None`` without saving when fewer steps than the interval passed since the last
        checkpoint; without ``check_interval`` too, when the step counter's step is the
        one saved last (TensorFlow's). With ``async_save`` the path is returned before it
        is durable; it is listed once it is. After a signal of :meth:`save_on_signal`, this save is the
        preemption save (whatever the interval), then the signal is re-delivered.
        With a local tier, the step is saved there and, every
        ``persistent_every`` steps, copied to ``directory`` in the background.
        """
        checkpoint_number = _step_number(checkpoint_number)
        signum = self._on_signal.due(self.coordinator, timeout)
        if signum is not None:
            return self._on_signal.save_then_redeliver(
                signum, lambda: self._preemption_save(checkpoint_number, timeout),
                self._finish_preemption)
        if self._local_tier is not None:
            return self._save_tiered(checkpoint_number, check_interval, timeout)
        if self._location is None and not self.read_only and not self.directory.is_dir():
            self._make_again()
        self._sync()
        if self._location is None and not writable(self.directory):
            raise CkptError(
                f"Cannot save into {os.fspath(self.directory)!r}: the directory is read-only "
                "(this manager can list and restore its checkpoints, not write new ones)."
            )
        self._deletes.wait()  # the last prune's bytes freed (a backlog of one step at most)
        self._reclaim()
        numbers = self._numbers(checkpoint_number, check_interval)
        if numbers is None:
            return None
        number, step = numbers
        if self._location is not None:
            self._refuse_committed(number)
            result = self._save_remote_once_more(number, step, timeout)
            if self.coordinator is not None and not self.async_save:
                self._sync()
            return result
        self._refuse_foreign(number)
        self._refuse_committed(number)
        try:
            return self._save_local(number, step, timeout)
        except BaseFileLost as exc:  # a file of the base deleted by hand: written whole,
            if not self._note_lost(exc) or self.async_save:  # once (a background
                raise  # save's error is the user's to see: its next save is whole)
        return self._save_local(number, step, timeout)

    def _save_local(self, number: int, step: int, timeout: float | None) -> str:
        """Write step ``number`` into this (local) directory (the save counter's ``step``)."""
        prefix = self.directory / self.checkpoint_name
        incremental = None if self._incremental is None else self._incremental_base(number)

        def on_commit(path: str, step: int = step) -> None:
            self._lost.clear()  # the latest step is another now
            self._record(path, step)

        saving = open_saving_lock(self.directory)  # shared: "a save is in flight here"
        try:
            share_saving_lock(saving, self.directory)
            options: SaveOptions = {"format": self.format, "blocking": not self.async_save,
                                    "coordinator": self.coordinator, "timeout": timeout,
                                    "pack_threshold": self.pack_threshold}
            with self._deletes.deferred():  # its prune's freeing starts as it returns
                result = self._checkpoint.save_step(
                    prefix, options, number=number, on_commit=on_commit,
                    incremental=incremental,
                    committed_after_all=functools.partial(self._count_if_committed, number))
        except BaseException:
            os.close(saving)
            raise
        if isinstance(result, str):
            os.close(saving)
            if self.coordinator is not None:
                self._sync()
            return result
        result.add_done_callback(lambda _h, fd=saving: os.close(fd))
        self._pending_save = result
        path: str = result.path
        return path

    def _numbers(self, checkpoint_number: int | None, check_interval: bool
                 ) -> tuple[int, int] | None:
        """``(N of the file name, step)`` of the next save; ``None``: the interval says skip
        (decided before ``N``, so that a skipped save says nothing about its number)."""
        step: int | None = None
        if self.checkpoint_interval is not None and check_interval:
            step = self._current_step(checkpoint_number)
            last = self._last_step()
            if last is not None and step < last + self.checkpoint_interval:
                return None
        elif self._step_counter is not None and checkpoint_number is None:
            step = self._current_step(None)
        if (self.checkpoint_interval is not None and checkpoint_number is None
                and not self._always_save and step is not None and step == self._last_step()):
            return None  # TensorFlow's: the step counter's step is saved once, even with
            # check_interval=False (an explicit number saved already is refused instead)
        number = checkpoint_number
        if number is None:
            number = self._next_number(int(self._checkpoint.save_counter.numpy()) + 1)
        return int(number), int(number) if step is None else step

    def _last_step(self) -> int | None:
        """The step of the checkpoint saved last (``None``: none, or not known)."""
        entries = self._section["checkpoints"]
        return entries[-1].get("step") if entries else None

    def save_on_signal(self, *signals: int) -> None:
        """On any of ``signals`` (default ``SIGTERM``), save at the next step boundary.

        The handler only notes the signal. At the next :meth:`save` or
        :meth:`reached_preemption` (on every process: a small collective), the current
        state is saved as a committed step (a background save in flight finished first,
        the new one finished before going on); then the previous handlers are put back
        and the signal is re-delivered, so the process ends as it would have.
        """
        self._on_signal.install(signals or (signal.SIGTERM,))

    def reached_preemption(self, checkpoint_number: int | None = None,
                           *, timeout: float | None = None) -> bool:
        """A step boundary between saves: if a signal of :meth:`save_on_signal` arrived
        (on any process), save step ``checkpoint_number`` now and re-deliver the signal.

        Returns ``False`` when no signal arrived; ``True`` after the save if the
        re-delivered signal did not end the process (its handler returned).
        """
        checkpoint_number = _step_number(checkpoint_number)
        signum = self._on_signal.due(self.coordinator, timeout)
        if signum is None:
            return False
        with self._locks():
            self._on_signal.save_then_redeliver(
                signum, lambda: self._preemption_save(checkpoint_number, timeout),
                self._finish_preemption)
        return True

    def _preemption_save(self, checkpoint_number: int | None,
                         timeout: float | None) -> str | None:
        """The preemption save: whatever the interval; with tiers also persisted (the
        local disk may not outlive the preemption), whatever ``persistent_every`` says.

        Step ``checkpoint_number`` committed already as the latest step (the signal came
        during its save, or before the first step after a restore) is that state: it is
        not written again (a step is written once), the signal is re-delivered."""
        if self._local_tier is not None:
            if checkpoint_number is not None:
                path = self._local_tier._latest_numbered(int(checkpoint_number))
                if self._nodes is not None:
                    path = self._agree_latest(int(checkpoint_number), path, timeout)
                elif path is not None:
                    self._persist_latest(int(checkpoint_number), path)
                if path is not None:
                    return path
            return self._save_tiered(checkpoint_number, False, timeout, persist=True)
        if checkpoint_number is not None:
            path = self._latest_numbered(int(checkpoint_number))
            if path is not None:
                return path
        self._always_save = True  # the current state, even at the step saved last
        try:
            return self.save(checkpoint_number, check_interval=False, timeout=timeout)
        finally:
            self._always_save = False

    def _latest_numbered(self, number: int) -> str | None:
        """The path of the latest step when it is step ``number``, else ``None``."""
        self._sync()
        entries = self._section["checkpoints"]
        if entries and self._number(entries[-1]["path"]) == number:
            return self._full(entries[-1]["path"])
        return None

    def _persist_latest(self, number: int, local: str) -> None:
        """A tiered manager's preemption save of the local tier's latest step ``number``,
        committed already: its persistent copy, unless made or under way."""
        assert self._pool is not None
        if number in self._persisting or number in self._committed_numbers():
            return
        self._also_persisted.add(number)
        if self._primary():
            self._persisting[number] = self._pool.submit(self._persist, number, local, None)

    def _agree_latest(self, number: int, local: str | None,
                      timeout: float | None) -> str | None:
        """Per-node tiers' preemption save of step ``number`` committed already as every
        node's latest (``local``: this node's, or ``None``): its persistent copy, every
        process copying its part, unless made or under way. Decided alike on every
        process; ``None`` (a save, refused) unless every node holds it as its latest."""
        made = (number in self._persisting or number in self._done_persists
                or number in self._committed_numbers())
        seen = self.coordinator.allgather((local is not None, made), tag="tiers-preempted",
                                          timeout=timeout)
        if local is None or not all(latest for latest, _ in seen):
            return None
        if not any(m for _, m in seen):
            self._also_persisted.add(number)
            self._persisting[number] = self._persist_parts(number, local, timeout)
        return local

    def _finish_preemption(self) -> None:
        """Before the signal is re-delivered: the save committed, with tiers its
        persistent copy too."""
        self._sync()
        if self._local_tier is not None:
            self.wait_until_finished()

    def _learn(self) -> None:
        """Before an incremental save: take what the checkpoint's last restore set, once
        (docs/checkpoints.md, "What a restore teaches the next save")."""
        assert self._incremental is not None
        restored = self._checkpoint.last_restore()
        if restored is None or restored is self._taught:
            return
        self._taught = restored
        self._incremental.learn(self._own_step(restored.path), restored.versions)

    def _own_step(self, path: str) -> str | None:
        """The name of the step at ``path`` when it is one of this manager's (its naming,
        in its directory); else None."""
        path = path.rstrip("/")  # a Zarr step's directory may be named with a "/"
        name = path.rpartition("/")[2]
        if not self._is_own_name(name):
            return None
        if self._location is not None:
            return name if path == self._full(name).rstrip("/") else None
        try:
            same = os.path.samefile(os.path.dirname(path) or ".", self.directory)
        except OSError:
            return None
        return name if same else None

    def _incremental_base(self, number: int) -> Any:
        """What an incremental save of step ``number`` builds on (the latest kept step)."""
        assert self._incremental is not None
        self._learn()
        name = step_name(self.checkpoint_name, number, self._suffix)
        entries = self._section["checkpoints"]
        base = self.directory / entries[-1]["path"] if entries else None
        if base is not None and base.name == name:
            base = None  # written again: a full step
        if base is not None and (gone := missing_references(base)):
            logger.warning("Step %d is written whole: the latest step %s refers to %s, "
                           "which no longer exist(s) (deleted by hand?).", number, base.name,
                           ", ".join(gone))
            base = None
        if base is not None and base.name in self._lost:
            logger.warning("Step %d is written whole: %s", number, self._lost[base.name])
            base = None
        base = self._base_or_whole(number, base)
        if os.path.lexists(self.directory / name) and held(
                self.directory, self._steps_on_disk(exclude=[name]), [name]):
            raise CkptError(
                f"Cannot save step {number} again: kept incremental steps refer to the bytes "
                f"of {os.fspath(self.directory / name)!r}; save under a new number."
            )
        spare = self._take_spare() if base is not None and self._uses_spare() else None
        return functools.partial(self._incremental.start, base, spare=spare)

    def _note_lost(self, exc: BaseFileLost) -> bool:
        """A save (of one process) found a file gone from the step it built on (``exc``):
        when that step is one of this directory's, the next save does not build on it
        (written whole); says whether so."""
        if self.coordinator is not None:  # many processes: rank 0 picks the base; a
            return False  # save that failed on one fails on all, nothing retried alone
        name = self._own_step(exc.base)
        if name is not None:
            self._lost[name] = str(exc)
        return name is not None

    def _wait_checkpoint(self) -> None:
        """Wait for the checkpoint's background save; one that failed on a file gone from
        its base makes the next save write every value (:meth:`_note_lost`)."""
        try:
            self._checkpoint.wait()
        except BaseFileLost as exc:
            self._note_lost(exc)
            raise

    def _save_remote_once_more(self, number: int, step: int, timeout: float | None) -> str:
        """:meth:`_save_remote`, again with every value written whole when an object of
        the base was deleted by hand (nothing of the failed attempt is left)."""
        try:
            return self._save_remote(number, step, timeout)
        except BaseFileLost as exc:
            if not self._note_lost(exc) or self.async_save:
                raise
        return self._save_remote(number, step, timeout)

    def _save_remote(self, number: int, step: int, timeout: float | None) -> str:
        options: SaveOptions = {"format": self.format, "blocking": not self.async_save,
                                "storage_options": self._storage_options,
                                "coordinator": self.coordinator, "timeout": timeout,
                                "pack_threshold": self.pack_threshold}
        result = self._checkpoint.save_step(
            self._full(self.checkpoint_name),
            options,
            number=number,
            on_commit=lambda _path: self._committed_remote(step),
            incremental=(None if self._incremental is None
                         else functools.partial(self._remote_base, number)),
            committed_after_all=functools.partial(self._count_if_committed, number),
        )
        return str(result) if isinstance(result, str) else str(result.path)

    def _committed_remote(self, step: int) -> None:
        """A step at the URL committed: what was lost of an older one is moot; prune."""
        self._lost.clear()  # the latest step is another now
        self._record_remote(step)

    def _remote_base(self, number: int, variables: Mapping[str, Any]) -> Any:
        """An incremental save of step ``number`` on an object store: its base is the
        latest committed step (read when the save starts, after the one before it
        committed; with several processes, rank 0's), or none when it is written whole."""
        assert self._incremental is not None
        self._learn()
        entries = self._section["checkpoints"]
        base = self._full(entries[-1]["path"]) if entries else None
        if base is not None and (lost := self._lost.get(entries[-1]["path"])):
            logger.warning("Step %d is written whole: %s", number, lost)
            base = None
        return self._incremental.start(self._base_or_whole(number, base), variables)

    def _base_or_whole(self, number: int, base: _B | None) -> _B | None:
        """``base`` (the latest step, a path or a URL) for step ``number`` to build on, or
        None when the step is written whole: ``whole_every`` (or a persistent copy due)
        says so, ``base`` failed its last restore, or pruned steps kept only for other
        pruned steps are due to be freed (any whole step frees them)."""
        if base is not None and self._whole_steps is not None and self._whole_steps(number):
            logger.debug("Step %d is written whole (whole_every, or a persistent copy is "
                         "due).", number)
            base = None
        if base is not None and self._damaged_base(number, os.fspath(base)):
            base = None
        if base is not None and self._whole_next:
            logger.info("Step %d is written whole: pruned steps kept only for other pruned "
                        "steps are freed once no kept step refers to them.", number)
            base = None
        self._whole_next = self._whole_next and base is not None
        return base

    def _damaged_base(self, number: int, base: str) -> bool:
        """Whether ``base``, the latest step, failed its last restore (by
        ``restore_or_initialize()``, or the user's ``ckpt.restore``; not a mismatch): its
        recorded checksums may name bytes that are gone or damaged, so step ``number``
        takes nothing from it (written whole; said in the log)."""
        name = base.rstrip("/").rpartition("/")[2]
        if not any(self._own_step(p) == name for p in self._checkpoint.failed_restores()):
            return False
        logger.warning("Incremental save of step %d: writing every value: the latest step "
                       "%s did not load when restoring, so nothing is taken from it.",
                       number, base)
        return True

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint that loads; else call ``init_fn``. Returns the path.

        A checkpoint that is damaged or gone is skipped (logged, and listed in
        ``self.skipped`` as ``(path, reason)``) in favour of the next older one.
        """
        self.skipped = []
        order = (self._restore_order() if self._local_tier is not None
                 else list(reversed(self.checkpoints)))
        for path in order:
            try:
                self.restore_status = self._checkpoint.restore(
                    path, storage_options=self._storage_options, coordinator=self.coordinator
                )
            except DistributedTimeoutError:
                raise
            except (CorruptCheckpointError, CheckpointNotFoundError, UnsupportedFormatError,
                    DistributedError) as exc:  # a file it wrote that no longer reads
                if isinstance(exc, DistributedError) and not all(
                        m.startswith(_SKIPPED) for m in exc.failures.values()):
                    raise  # another process failed otherwise (a mismatch, its end)
                logger.warning("Skipping checkpoint %s: %s", path, exc)
                self.skipped.append((path, str(exc)))  # (the checkpoint notes it: never a base)
                continue
            return path
        if self._init_fn is not None:
            self._init_fn()
        return None

    # -- tiers: every step on a fast local tier, every N-th also persisted ----------------
    def _init_tiers(self, local_directory: str | os.PathLike[str],
                    step_counter: Variable | Callable[[], int] | None,
                    checkpoint_interval: int | None) -> None:
        if self.persistent_every < 1:
            raise ValueError(f"persistent_every must be >= 1, got {self.persistent_every}.")
        if self.local_max_to_keep is not None and self.local_max_to_keep < 1:
            raise ValueError(
                f"local_max_to_keep must be None or >= 1, got {self.local_max_to_keep}.")
        tier: type[CheckpointManager] = CheckpointManager
        if self._many():  # one shared directory, or one per node: found by looking
            nodes = discover_nodes(self.coordinator, Path(local_directory))
            register_nodes(local_directory, nodes)
            if len(nodes.groups) > 1:
                if self._incremental is not None:  # decided alike on every process
                    raise CkptError(
                        f"incremental=True is not supported yet with a local tier on each "
                        f"node's own disk ({os.fspath(local_directory)!r} is "
                        f"{len(nodes.groups)} directories): use one shared local directory, "
                        "or incremental=False.")
                self._nodes = nodes
                if nodes.leads(self.coordinator.rank):
                    tier = _NodeLocalTier
        # the local tier prunes only through this manager (never a step still to persist)
        self._local_tier = tier(
            self._checkpoint, local_directory, max_to_keep=None,
            checkpoint_name=self.checkpoint_name, step_counter=step_counter,
            checkpoint_interval=checkpoint_interval, format=self.format,
            async_save=self.async_save, coordinator=self.coordinator,
            incremental=self._incremental_options or False, lock_timeout=self.lock_timeout,
        )
        #: the local save of a preemption: persisted whatever ``persistent_every`` says
        self._persist_next = False
        # an incremental local tier writes a step due a persistent copy whole: the copy
        # then stands alone (it refers to no local step), and later local steps build on it
        own = self._local_tier._whole_steps  # whole_every's
        self._local_tier._whole_steps = (
            lambda n: self._persist_next or n % self.persistent_every == 0
            or (own is not None and own(n)))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptvar-persist")
        _TIERED.add(self)  # its copies in flight are waited for at exit
        #: steps whose persistent copy this process saw committed (per-node tiers)
        self._done_persists: set[int] = set()

    def _many(self) -> bool:
        return self.coordinator is not None and self.coordinator.size > 1

    def _tiered(self, *, every_copy: bool = False) -> list[tuple[int, str]]:
        """``(number, path)`` of the steps committed in either tier, oldest first: the local
        copy where there is one (``every_copy``: then the persistent one too)."""
        assert self._local_tier is not None
        local = [(self._number(Path(p).name), p) for p in self._local_tier.checkpoints]
        persistent = [(self._number(e["path"]), self._full(e["path"]))
                      for e in self._section["checkpoints"]]
        if every_copy:  # the newest step first from the local tier, then the persistent
            return sorted(persistent + local, key=lambda e: (e[0], e in local))
        merged = dict(persistent) | dict(local)
        return sorted(merged.items())

    def _restore_order(self) -> list[str]:
        """The paths a tiered restore tries, newest first, the same steps on every process."""
        assert self._local_tier is not None
        if not self._many():
            return [p for _, p in reversed(self._tiered(every_copy=True))]
        if self._nodes is None:  # one shared local tier: rank 0's order
            order = [p for _, p in reversed(self._tiered(every_copy=True))]
            return list(self.coordinator.broadcast(order, tag="tiers-order"))
        # per-node disks: a local step counts where every node committed it
        self._sync()
        local = self._local_tier
        local._sync()
        mine = sorted(self._number(e["path"]) for e in local._section["checkpoints"])
        everyone = self.coordinator.allgather(mine, tag="tiers-local-steps")
        persistent = self.coordinator.broadcast(
            sorted(self._committed_numbers()), tag="tiers-persistent-steps")
        return [os.fspath(local.directory / step_name(self.checkpoint_name, n, self._suffix))
                if tier == "local" else self._full(step_name(self.checkpoint_name, n,
                                                             self._suffix))
                for n, tier in restore_order(everyone, persistent)]

    def _save_tiered(self, checkpoint_number: int | None, check_interval: bool,
                     timeout: float | None, *, persist: bool = False) -> str | None:
        assert self._local_tier is not None and self._pool is not None
        if self._nodes is not None:  # every process's copy ended the same (a collective)
            self._agree_node_persists(timeout)
        elif self._many():  # rank 0 copies: every process learns of a failed copy
            self._agree_persisted(timeout)
        else:
            self._raise_persist_error()
        self._local_tier._wait_checkpoint()  # the persistent tier's list is kept by its copies
        if not self._agree_number(checkpoint_number, check_interval, timeout):
            return None  # per-node tiers: the interval, decided the same everywhere
        if self.async_save:  # the last save is done (waited above): prune before the next
            self._prune_local()
        self._persist_next = persist
        # per-node tiers: every node's tier saves what the collective decided (a node that
        # lost its tier must not skip a step the others save)
        self._local_tier._always_save = persist or self._nodes is not None
        try:
            path = self._local_tier.save(checkpoint_number,
                                         check_interval and self._nodes is None,
                                         timeout=timeout)
        finally:
            self._persist_next = self._local_tier._always_save = False
        if path is None:
            return None
        number = self._number(Path(path).name)
        due = persist or number % self.persistent_every == 0
        if due and number % self.persistent_every:
            self._also_persisted.add(number)
        if due and self._nodes is not None:  # every process copies its own part
            self._persisting[number] = self._persist_parts(number, path, timeout)
        elif due and self._primary():  # the committed step is shared: rank 0 persists it
            pending = self._local_tier._pending_save if self.async_save else None
            self._persisting[number] = self._pool.submit(self._persist, number, path, pending)
        if not self.async_save:
            self._prune_local()
        return path

    def _agree_number(self, checkpoint_number: int | None, check_interval: bool,
                      timeout: float | None) -> bool:
        """Move the save counter past every step committed in either tier (on any node),
        the same on every process; refuse an explicit number committed on some node.

        Per-node tiers: returns ``False`` (on every process) when ``checkpoint_interval``
        says skip, judged from the newest step any node or the persistent tier holds."""
        local = self._local_tier
        assert local is not None
        here, persisted = local._committed_numbers(), self._committed_numbers()
        committed = persisted | here
        if self._nodes is not None:  # a step committed on any node is never reused
            entries = local._section["checkpoints"] + self._section["checkpoints"]
            last = max((int(e["step"]) for e in entries if e.get("step") is not None),
                       default=None)
            gathered = self.coordinator.allgather((committed, last), tag="tiers-committed",
                                                  timeout=timeout)
            committed = set().union(*(c for c, _ in gathered))
            lasts = [n for _, n in gathered if n is not None]
            if self.checkpoint_interval is not None and check_interval and lasts and (
                    local._current_step(checkpoint_number)
                    < max(lasts) + self.checkpoint_interval):
                return False
        elif self._many():
            committed = self.coordinator.broadcast(committed, tag="tiers-committed",
                                                   timeout=timeout)

        def where(step: int) -> str:  # the tier that holds ``step``, for the messages
            if step in here or step in local._held_numbers():
                return str(local.directory)
            if step in persisted or step in self._held_numbers() or self._nodes is None:
                return str(self.directory)
            return "another node's local tier"

        if checkpoint_number is None:  # a step committed in either tier is never reused
            self._next_number(int(self._checkpoint.save_counter.numpy()) + 1, committed, where)
        elif self._nodes is not None and int(checkpoint_number) in committed:
            raise CheckpointExistsError(  # on every process: no node writes it again
                f"Cannot save step {checkpoint_number}: it is committed already (in "
                f"{where(int(checkpoint_number))}), and a step is written once.")
        return True

    def _agree_node_persists(self, timeout: float | None) -> None:
        """Per-node tiers, before a save: a persistent copy that failed on any process
        (they end alike, within moments of each other) is raised on every process."""
        failed = sorted(n for n, f in self._persisting.items()
                        if f.done() and f.exception() is not None)
        everyone = self.coordinator.allgather(failed, tag="tiers-copies", timeout=timeout)
        for number in sorted(set().union(*everyone)):
            future = self._persisting.get(number)
            if future is not None:
                futures_wait([future], timeout=timeout)
        self._raise_persist_error()

    def _persist(self, number: int, local: str, pending: Any = None) -> None:
        """Copy the local tier's committed step ``number`` to this directory as step
        ``number`` (background thread), record it and prune by ``max_to_keep``.
        ``pending``: the local tier's background save of that step, waited for first
        (a step it did not commit is not copied: its save reports its error)."""
        with self._locks():  # (a pool's thread: the context is not the saver's)
            self._persist_step(number, local, pending)

    def _persist_step(self, number: int, local: str, pending: Any) -> None:
        if pending is not None:
            written = threading.Event()
            pending.add_done_callback(lambda _h: written.set())
            written.wait()
            if not is_own_checkpoint(local):
                return
        name = step_name(self.checkpoint_name, number, self._suffix)
        src = Path(local)
        if self._location is not None:
            save_remote(self._full(name), lambda tmp: _copy_checkpoint(src, tmp),
                        self._storage_options)
            self._record_remote(number)
        else:
            final = self.directory / name
            saving = open_saving_lock(self.directory)
            try:
                share_saving_lock(saving, self.directory)
                with temporary_sibling(final) as tmp:
                    _copy_checkpoint(src, tmp, durable=True)
                    publish(tmp, final, create_only=True)
                self._record(os.fspath(final), number)
            finally:
                os.close(saving)
        self._prune_local()

    def _persist_parts(self, number: int, local: str, timeout: float | None
                       ) -> Future[None]:
        """Per-node local tiers: the persistent copy of step ``number``, a collective of
        every process on the coordinator's background channel, run in the background
        save thread (after this process's local save of it, never beside another
        collective of that channel). Its future ends the same way on every process."""
        done: Future[None] = Future()
        coord = self.coordinator.background()
        name = step_name(self.checkpoint_name, number, self._suffix)

        def on_commit(final: str) -> None:  # rank 0
            if self._location is not None:
                self._record_remote(number)
            else:
                self._record(final, number)

        def job() -> str:
            try:
                here = coord.allgather(is_own_checkpoint(local), tag=f"persist:{name}:local",
                                       timeout=timeout)
                if not all(here):
                    raise CkptError(
                        f"Step {number} is not committed on every node's local tier (not on "
                        f"ranks {[r for r, ok in enumerate(here) if not ok]}): not persisted.")
                saving = None if self._location is not None else open_saving_lock(
                    self.directory)
                try:
                    if saving is not None:
                        share_saving_lock(saving, self.directory)
                    persist_parts(coord, Path(local), self._full(name), self.format,
                                  self._storage_options, on_commit, timeout)
                finally:
                    if saving is not None:
                        os.close(saving)
                self._done_persists.add(number)
                done.set_result(None)
                self._prune_local()
            except BaseException as exc:  # noqa: BLE001 - the future reports it
                if not done.done():
                    done.set_exception(exc)
            return local

        _async.submit(job, local)
        return done

    def _persisted(self, number: int) -> bool:
        if number in self._done_persists:
            return True
        future = self._persisting.get(number)
        if future is None:
            return number in self._committed_numbers()
        return future.done() and future.exception() is None

    def _keeps_local(self) -> bool:
        """Whether this process prunes the local tier it sees (rank 0 of a shared one, each
        node's first rank of per-node ones)."""
        if self._nodes is not None:
            return self._nodes.leads(self.coordinator.rank)
        return self._primary()

    def _prune_local(self) -> None:
        """Keep ``local_max_to_keep`` local steps; a step due a persistent copy stays until
        that copy, or a newer step's, is committed (and so do the newer ones)."""
        assert self._local_tier is not None
        if self.local_max_to_keep is None or not self._keeps_local():
            return
        with self._tier_lock:
            local = self._local_tier
            local._read_record()  # never waits: a background save reports its own error
            names = [e["path"] for e in local._section["checkpoints"]]
            newest = max(self._committed_numbers() | self._done_persists, default=-1)
            for name in names[: max(0, len(names) - self.local_max_to_keep)]:
                number = self._number(name)
                due = number % self.persistent_every == 0 or number in self._also_persisted
                if due and not self._persisted(number) and number >= newest:
                    break
                local._drop(name)

    def _read_record(self) -> None:
        """Read this directory's committed steps (not waiting for a background save)."""
        with self._locks(), locked(self.directory, shared=True):
            self._section = self._recover(read_state(self.directory))

    def _drop(self, name: str) -> None:
        """Delete this manager's step ``name`` (local directory), state first."""
        with self._locks(), locked(self.directory):
            state = read_state(self.directory, repair=True)
            section = self._recover(state)
            doomed = [e for e in section["checkpoints"] if e["path"] == name]
            section["checkpoints"] = [e for e in section["checkpoints"] if e["path"] != name]
            section["pending_delete"] = section.get("pending_delete", []) + doomed
            self._section = section
            self._store(state)
            self._finish_deletions(state)

    def _raise_persist_error(self) -> None:
        for number, future in list(self._persisting.items()):
            if future.done():
                if future.exception() is None:
                    del self._persisting[number]
                    continue
                del self._persisting[number]
                raise future.exception()  # type: ignore[misc]

    def _finish_persists(self, timeout: float) -> None:
        """At exit: wait for the persistent copies in flight (at most ``timeout``
        seconds); one that failed, or still runs, is said in the log (nobody else
        waits for it now)."""
        pending = list(self._persisting.items())
        futures_wait([f for _, f in pending], timeout=timeout)
        for number, future in pending:
            if not future.done():
                logger.error("Still copying step %d to %s at exit after %.0f s; not "
                             "waiting (the copy may be missing there).", number,
                             self._full(""), timeout)
            elif future.exception() is not None:
                logger.error("Copying step %d to %s failed and nobody waited for it: %r",
                             number, self._full(""), future.exception())

    def _primary(self) -> bool:
        return self.coordinator is None or self.coordinator.is_primary

    def _agree_persisted(self, timeout: float | None, *, wait: bool = False) -> None:
        """Many processes: rank 0's persistent copies (waited for and the local tier
        pruned, with ``wait``); every process raises a failed one's error (a collective).

        A long copy is waited for in rounds of :data:`_PERSIST_POLL_S` seconds, each
        ending in a small collective, so that no process waits past the coordinator's
        timeout for rank 0's upload."""
        while True:
            said: str | None = None  # None: done; else "pending" or rank 0's error
            failure: BaseException | None = None
            if self._primary():
                pending = [f for f in self._persisting.values() if not f.done()]
                if wait and pending:
                    futures_wait(pending, timeout=_PERSIST_POLL_S)
                    pending = [f for f in pending if not f.done()]
                if wait and pending:
                    said = "pending"
                else:
                    try:
                        if wait:
                            self._prune_local()
                        self._raise_persist_error()
                    except Exception as exc:  # noqa: BLE001 - said on every process, below
                        failure, said = exc, f"{type(exc).__name__}: {exc}"
            said = self.coordinator.broadcast(said, tag="tiers-persisted", timeout=timeout)
            if said != "pending":
                break
        if said is not None:
            raise CkptError(
                f"A persistent copy of a local step failed on rank 0: {said}") from failure

    def wait_until_finished(self, *, timeout: float | None = None) -> None:
        """Block until every save of this manager is durable, background persistent copies
        included; raises the first error of one not reported yet. With tiers and a
        coordinator of several processes, a collective: every process returns once rank
        0's copies are committed (and raises a failed one's error).

        Then waits for the background freeing of pruned steps (this process's), at most
        ``timeout`` seconds (default 120 s); one still
        running past it is said in the log, never raised."""
        try:
            self._wait_for_saves(timeout)
        finally:
            self._deletes.wait(timeout)
            if self._local_tier is not None:
                self._local_tier._deletes.wait(timeout)

    def _wait_for_saves(self, timeout: float | None) -> None:
        self._wait_checkpoint()
        if self._nodes is not None:  # every process waits for its part of each copy
            for future in list(self._persisting.values()):
                futures_wait([future])
            try:
                self._raise_persist_error()
            finally:
                self._prune_local()
                self.coordinator.barrier(tag="tiers-finished", timeout=timeout)
                self._sync()
                assert self._local_tier is not None
                self._local_tier._sync()
            return
        if self._local_tier is not None and self._many():
            self._agree_persisted(timeout, wait=True)
            self._sync()  # every process lists what rank 0 copied and pruned
            self._local_tier._sync()
            return
        for future in list(self._persisting.values()):
            with contextlib.suppress(BaseException):
                future.result()
        self._raise_persist_error()
        if self._local_tier is not None:
            self._prune_local()

    def __repr__(self) -> str:
        return f"<cv.CheckpointManager {os.fspath(self.directory)!r} name={self.checkpoint_name!r}>"


#: the tiered managers alive, whose persistent copies in flight the exit waits for
_TIERED: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _finish_persists_at_exit() -> None:
    """Let every tiered manager's persistent copies in flight finish (at most
    :data:`WAIT_S` in all), while the thread pools they use still take work."""
    deadline = time.monotonic() + WAIT_S
    for manager in list(_TIERED):
        manager._finish_persists(max(0.0, deadline - time.monotonic()))


# The interpreter's thread-pool shutdown (concurrent.futures' exit hook, imported above)
# runs before ``atexit`` handlers and makes every pool refuse new work, which would fail
# a copy still queued (its upload's threads); hooks registered here run in reverse
# order, so this one runs before it.
threading._register_atexit(_finish_persists_at_exit)  # type: ignore[attr-defined]


class _NodeLocalTier(CheckpointManager):
    """The local tier of a tiered manager on a node's own disk, on the node's first rank:
    it keeps that directory (state file, clean-up), as rank 0 keeps a shared one."""

    _node_leader = True
