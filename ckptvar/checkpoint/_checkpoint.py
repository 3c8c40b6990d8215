"""``cv.Checkpoint``: object-based checkpoints keyed by object-graph paths.

Owns the save counter, blocking and background saves, and ``restore``. File
naming (``prefix-N.h5``) is ``_steps``'s, writing a file ``_files``'s; how values
are matched, checked and applied is ``_object_restore``'s and ``_apply``'s.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, Unpack, cast

from ..errors import CheckpointMismatchError
from ..storage import paused_gc
from ..trackable import Trackable, trackable_children
from ..variables import PartitionedVariable, Variable
from . import _async, _held  # noqa: F401 - _held: the walk's stand-ins, set on import
from ._collective import collective_write, needs_collective, rank_variables
from ._collective_state import CollectiveRestoreState
from ._files import checkpoint_location, native_backend, write_file
from ._frameworks import (
    StateDictTrackable,
    SupportsStateDict,
    autograd_back,
    autograd_off,
    begin_restores,
    end_restores,
    is_generator,
    trackable_for,
)
from ._incremental import IncrementalSave, Restored
from ._logical import as_target
from ._object_restore import RestoreState
from ._serialize import SaveContents, SnapshotBuffer, gather, host_arrays, metadata
from ._state import record_latest
from ._status import RestoreStatus
from ._steps import split_format, step_name
from ._tree_state import TreeTrackable, is_tree_node
from ._walk import is_array, is_jax_tree, untracked

__all__ = ["Checkpoint", "SaveOptions"]


_COUNTER = "save_counter"


class _Attempt:
    """A numbered save (``save_step``): whether its step got committed, and what its
    failure does (a blocking one's in the caller, a background one's in the writer
    thread, before anyone waiting for it goes on): the save counter gets its number
    back, so the next save takes it (no gap), and the error says which step was not
    saved. ``committed_after_all`` (a manager's) says whether the step is committed
    despite the error (then counted: it is never written again)."""

    __slots__ = ("committed", "committed_after_all", "count", "counter", "number", "path")

    def __init__(self, counter: Variable, count: int, number: int, path: str,
                 committed_after_all: Callable[[], bool] | None) -> None:
        self.counter, self.count, self.number, self.path = counter, count, number, path
        self.committed_after_all = committed_after_all
        self.committed = False

    def on_commit(self, then: Callable[[str], None] | None) -> Callable[[str], None]:
        """``then`` (a save's ``on_commit``), noting first that the step is committed."""

        def committed(final: str) -> None:
            self.committed = True
            if then is not None:
                then(final)

        return committed

    def failed(self, exc: BaseException) -> None:
        if int(self.counter.numpy()) == self.count:  # (unless changed since: a restore)
            self.counter.assign(self.count - 1)
        if self.committed_after_all is not None and self.committed_after_all():
            exc.add_note(f"Step {self.number} ({self.path}) is committed; the error came "
                         "after it (the next save is numbered after it).")
            return
        what = ("was written, but its save failed after" if self.committed else
                "was not saved: nothing is committed under its name")
        exc.add_note(f"Step {self.number} ({self.path}) {what}; the save counter is back "
                     f"at {self.count - 1}, so the next save takes its number.")


def _reporting(job: Callable[[], str], attempt: _Attempt | None) -> Callable[[], str]:
    """``job`` (a background save) telling ``attempt`` of its failure."""
    if attempt is None:
        return job

    @functools.wraps(job)
    def run() -> str:
        try:
            return job()
        except BaseException as exc:
            attempt.failed(exc)
            raise

    return run


class SaveOptions(TypedDict, total=False):
    """The keyword options of :meth:`Checkpoint.save` and :meth:`Checkpoint.write`.

    - ``format``: ``"h5"`` or ``"zarr"`` (default: from the suffix; none: HDF5).
    - ``blocking`` (default ``True``): ``False`` returns at once with a handle whose
      ``wait()`` returns the path once durable; the values are snapshotted first.
    - ``metadata``: msgpack-able data stored with the checkpoint.
    - ``storage_options``: the object-store client's settings for a URL (docs/cloud.md).
    - ``coordinator``: a ``cv.distributed`` coordinator of more than one process: every
      process calls ``save``/``write`` and they write ONE checkpoint together
      (docs/distributed.md).
    - ``timeout``: seconds every collective waits at most (with ``coordinator``).
    - ``pack_threshold``: values under this many bytes are packed into one blob (``0``:
      every value its own array; default: packing only in checkpoints of more than 2,048
      values; docs/FORMAT.md, "Packing").
    """

    format: str | None
    blocking: bool
    metadata: Any
    storage_options: Mapping[str, Any] | None
    coordinator: Any
    timeout: float | None
    pack_threshold: int | None


def _checked(options: Mapping[str, Any], method: str) -> SaveOptions:
    """``options`` when every key is a :class:`SaveOptions` key; ``TypeError`` otherwise."""
    if options.keys() <= SaveOptions.__optional_keys__:
        return cast(SaveOptions, options)
    unknown = set(options) - SaveOptions.__optional_keys__
    if unknown:
        raise TypeError(
            f"Checkpoint.{method}() got an unexpected keyword argument "
            f"{sorted(unknown)[0]!r} (its options: {', '.join(sorted(SaveOptions.__optional_keys__))})."
        )
    return cast(SaveOptions, options)


def _ask(children: dict[str, Any], states: dict[str, bytes]) -> list[Any] | None:
    """Ask each of a checkpoint's ``children`` (variables and state-dict objects) for its
    children once, each object's Python state into ``states``; ``None`` for anything else
    (other trackables, containers, names that need escaping: the checkpoint walks)."""
    key: list[Any] = []
    for name, obj in children.items():
        if not name or "/" in name or "%" in name:
            return None
        if type(obj) is Variable:
            key.append((name, obj))
            continue
        if not isinstance(obj, StateDictTrackable) or any(k[1] is obj for k in key):
            return None
        key.append((name, obj, obj.trackable_children()))
        states[name] = obj.packed_state(name)  # (a state dict's encoding is never None)
    return key


def _check_contents(name: str, container: list[Any] | tuple[Any, ...] | dict[Any, Any]
                    ) -> None:
    """Refuse a container holding arrays (a pytree: ``cv.save`` saves those) or objects
    with ``state_dict()`` (tracked as a checkpoint's own arguments only), and say which
    other values in it a save leaves out (numbers, strings: a trackable's Python state
    holds those)."""
    left = untracked(container, name)
    objects = [(k, v) for k, v in left if isinstance(v, SupportsStateDict)]
    if objects:  # tracked as a checkpoint's own arguments only (restored as a whole)
        shown = ", ".join(f"{k!r} ({type(v).__module__}.{type(v).__qualname__})"
                          for k, v in objects)
        names = [k.rpartition("/")[2] for k, _ in objects]
        names = [n if n.isidentifier() else f"{name}_{n}" for n in names]
        raise TypeError(
            f"Checkpoint({name}=...) holds objects with state_dict() in a container, which "
            f"a checkpoint does not track: {shown}. Pass each as its own argument: "
            f"cv.Checkpoint({', '.join(f'{n}=...' for n in names)}).")
    trees = [(k, v) for k, v in left if is_tree_node(v)]
    if trees:  # restored as a whole, into the attribute: a checkpoint's own arguments only
        shown = ", ".join(f"{k!r} ({type(v).__module__}.{type(v).__qualname__})"
                          for k, v in trees)
        raise TypeError(
            f"Checkpoint({name}=...) holds JAX pytree nodes in a container, which a "
            f"checkpoint does not track: {shown}. Pass each as its own argument "
            "(cv.Checkpoint(state=train_state)), or save the whole tree with "
            "cv.save(path, tree) (docs/frameworks.md).")
    arrays = [(k, v) for k, v in left if is_array(v)]
    if arrays:
        shown = ", ".join(f"{k!r} ({type(v).__module__}.{type(v).__qualname__})"
                          for k, v in arrays[:3])
        more = f" and {len(arrays) - 3} more" if len(arrays) > 3 else ""
        raise TypeError(
            f"Checkpoint({name}=...) holds arrays, which a checkpoint does not track: "
            f"{shown}{more}. Hold each in a cv.Variable, or save a pytree of arrays with "
            "cv.save(path, tree) and cv.load(path, like=tree) (docs/frameworks.md).")
    if left:
        named = ", ".join(repr(k) for k, _ in left[:5]) + (" and more" if len(left) > 5 else "")
        warnings.warn(
            f"Checkpoint({name}=...): {named} {'is' if len(left) == 1 else 'are'} neither a "
            "variable nor a trackable object: a save leaves "
            f"{'it' if len(left) == 1 else 'them'} out.", UserWarning, stacklevel=3)


class Checkpoint(Trackable):
    """Groups trackable objects and saves/restores them by their object-graph paths.

    Args:
        **objects: the top-level objects (modules, trackables, variables, or
            lists/dicts of them); each becomes the first segment of its keys.

    >>> import ckptvar as cv
    >>> ckpt = cv.Checkpoint(step=cv.Variable(3, dtype="int64", name="step"))
    >>> ckpt.step.numpy()
    array(3)
    """

    _cv_handles: list[Any]
    #: held by a save (its blocking part: counter, snapshot, handle; a blocking save's
    #: write), a restore and :meth:`wait`, so that threads take turns (docs/checkpoints.md,
    #: "Thread safety")
    _cv_lock: threading.RLock

    #: whether an incremental manager asked for restores' notes (:meth:`note_restores`),
    #: and what the last restore set
    _cv_noting: bool = False
    _cv_restored: Restored | None = None
    #: the paths whose last restore failed other than by a mismatch (:meth:`failed_restores`)
    _cv_failed: frozenset[str] = frozenset()

    def __init__(self, **objects: Any) -> None:
        object.__setattr__(self, "_cv_handles", [])
        object.__setattr__(self, "_cv_lock", threading.RLock())
        for name, value in objects.items():
            setattr(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_cv_lock"]  # (not picklable) a copy takes its own
        state.pop("_cv_restored", None)  # (weak references) a copy's variables are its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_cv_lock", threading.RLock())

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name == _COUNTER:
            raise ValueError(f"{_COUNTER!r} is reserved: it is the checkpoint's own save counter.")
        jax_tree = is_jax_tree(value)  # a dict/list/tuple of JAX arrays (optax states)
        if jax_tree or (not isinstance(value, Variable | PartitionedVariable | Trackable | list
                                       | tuple | dict | SupportsStateDict)
                        and not is_generator(value)):
            if jax_tree or is_tree_node(value):  # a TrainState, an nnx.State, an eqx Module
                object.__setattr__(self, name, value)
                held = trackable_children(self).get(name)
                if isinstance(held, TreeTrackable):  # the next state of a training loop:
                    held.tree = value  # its unchanged leaves keep their variables
                    return
                self._track(name, TreeTrackable(value, name))
                self._take_trees()  # (restored as it was attached, after a restore)
                return
            raise TypeError(
                f"Checkpoint({name}=...) needs a Variable, a trackable object, an object "
                "with state_dict()/load_state_dict(), a torch.Generator, a registered JAX "
                f"pytree node or a list/tuple/dict of them, got {type(value).__name__}."
            )
        if isinstance(value, list | tuple | dict):
            _check_contents(name, value)
        object.__setattr__(self, name, value)
        self._track(name, trackable_for(value))

    def _take_trees(self) -> None:
        """After a restore: each pytree argument is the tree it restored (a new one)."""
        for name, obj in trackable_children(self).items():
            if isinstance(obj, TreeTrackable) and self.__dict__.get(name) is not obj.tree:
                object.__setattr__(self, name, obj.tree)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        self._untrack(name)
        self.__dict__.pop("_cv_plan", None)  # holds the object until the next save otherwise
        buf = self.__dict__.get("_cv_snapshot")
        if buf is not None:  # so do the last snapshot's variables
            buf.values = None

    # -- the save counter --------------------------------------------------------------
    @property
    def save_counter(self) -> Variable:
        """How many times :meth:`save` ran (an int64 variable, stored as ``save_counter``)."""
        counter = trackable_children(self).get(_COUNTER)
        if counter is None:
            counter = Variable(0, dtype="int64", name=_COUNTER, trainable=False, collections=[])
            self._track(_COUNTER, counter)
        return counter

    # -- saving -----------------------------------------------------------------------
    def save(self, prefix: str | os.PathLike[str], **options: Unpack[SaveOptions]) -> Any:
        """Increment the save counter and write ``prefix-N.<suffix>``.

        Returns the path, or with ``blocking=False`` a handle whose ``wait()`` returns it
        once durable. Once the file is durable it is recorded as its directory's latest
        checkpoint (the state file a ``CheckpointManager`` keeps), where
        ``cv.latest_checkpoint`` finds it. The options (``format``, ``blocking``,
        ``metadata``, ``storage_options``, ``coordinator``, ``timeout``) are
        :class:`SaveOptions`'s.
        """
        return self.save_step(prefix, _checked(options, "save"), on_commit=record_latest)

    def save_step(
        self,
        prefix: str | os.PathLike[str],
        options: SaveOptions,
        *,
        number: int | None = None,
        on_commit: Callable[[str], None] | None = None,
        incremental: Callable[[Mapping[str, Any]], IncrementalSave] | None = None,
        committed_after_all: Callable[[], bool] | None = None,
    ) -> Any:
        """:meth:`save` for an owner of step numbers (``cv.CheckpointManager``).

        Increments the save counter and writes ``prefix-N.<suffix>`` with ``N`` the
        given ``number`` (default: the counter), then calls ``on_commit(path)`` once
        the file is durable instead of recording it as the latest checkpoint. The
        options are checked :class:`SaveOptions`. Returns what :meth:`save` returns.
        A save that fails (in the background too, before its error is raised) gives
        its number back to the save counter, unless ``committed_after_all()`` says
        the step got committed all the same (and counts it).
        """
        with self._cv_lock:  # another thread's save of this checkpoint waits its turn
            self.wait()  # one save in flight per checkpoint; surfaces a background error
            base, fmt, suffix = split_format(prefix, options.get("format"))
            counter = self.save_counter
            counter.assign_add(1)
            count = int(counter.numpy())
            n = count if number is None else int(number)
            attempt = _Attempt(counter, count, n, step_name(base, n, suffix),
                               committed_after_all)
            try:
                return self._write(attempt.path, fmt, options, attempt.on_commit(on_commit),
                                   incremental, attempt=attempt)
            except BaseException as exc:
                attempt.failed(exc)
                raise

    def write(self, path: str | os.PathLike[str], **options: Unpack[SaveOptions]) -> Any:
        """Write exactly ``path`` (the save counter does not change).

        As in TensorFlow, ``write`` neither creates the save counter nor records the
        file for ``cv.latest_checkpoint``: the file holds ``save_counter`` only once
        :meth:`save` ran or the property was read. The suffix picks the format (``.h5``
        or ``.zarr``; none: HDF5); ``format=`` overrides it. A suffix that cannot be
        written raises ``UnsupportedFormatError``. Missing parent directories are created.
        The options are :class:`SaveOptions`'s, as for :meth:`save`.
        """
        options = _checked(options, "write")
        with self._cv_lock:
            self.wait()
            path = os.fspath(path)
            fmt = native_backend(path, options.get("format")).name
            return self._write(path, fmt, options, None)

    def _write(
        self,
        path: str,
        fmt: str,
        options: SaveOptions,
        on_commit: Callable[[str], None] | None,
        incremental: Callable[[Mapping[str, Any]], IncrementalSave] | None = None,
        *,
        attempt: _Attempt | None = None,
    ) -> Any:
        """Write ``path``; ``incremental(variables)`` (a manager's) gives the step to build
        on, called before any value is read. ``attempt``: a numbered save's, told when
        its step is committed and, in the background, of its failure."""
        blocking = options.get("blocking", True)
        coordinator: Any = options.get("coordinator")
        timeout = options.get("timeout")
        children = trackable_children(self)
        counter = children.get(_COUNTER)  # stored only once it exists
        with paused_gc():
            plan = self._gather(children)
            collective = needs_collective(coordinator, plan.variables.values())
            if collective:  # each rank writes its own shard, never an assembled value
                plan.variables = rank_variables(plan.variables)
            else:
                plan.variables = {k: as_target(v) if type(v) is Variable else v
                                  for k, v in plan.variables.items()}
            count = None if counter is None else int(counter.numpy())
            meta = metadata(plan, save_counter=count, user=options.get("metadata"))
            inc = None if incremental is None else incremental(plan.variables)
            # The job drops the snapshot when it ends: the executor's worker still holds
            # the job a moment after its future is done, and a next background save
            # snapshots as soon as it is (two snapshots would then be alive at once).
            # the job's processes may share this machine's CPUs: no copy helpers beyond their share
            snapshot = [host_arrays(plan, copy=not blocking,
                                    into=None if blocking else self._snapshot_buffer(),
                                    processes=coordinator.size if collective else 1)]

        if collective:
            coord = coordinator if blocking else coordinator.background()

            def run_collective() -> str:
                try:
                    with paused_gc():
                        return collective_write(
                            path, fmt, snapshot[0], meta, plan.variables, coord,
                            timeout=timeout, on_commit=on_commit,
                            storage_options=options.get("storage_options"),
                            pack_threshold=options.get("pack_threshold"),
                            incremental=inc,
                        )
                finally:
                    snapshot.clear()

            if blocking:
                return run_collective()
            handle = _async.submit(_reporting(run_collective, attempt), path)
            self._cv_handles.append(handle)
            return handle

        def run() -> str:
            try:
                with paused_gc():
                    final = write_file(path, fmt, snapshot[0], meta,
                                       options.get("storage_options"),
                                       pack_threshold=options.get("pack_threshold"),
                                       base=None if inc is None else inc.base,
                                       known=None if inc is None else inc.known,
                                       rows=None if inc is None else inc.changed_rows(),
                                       pieces=inc is not None,
                                       spare=None if inc is None else inc.spare,
                                       limits=None if inc is None else inc.limits)
            finally:
                snapshot.clear()
            if inc is not None:
                inc.committed(final)
            if on_commit is not None:
                on_commit(final)
            return final

        if blocking:
            return run()
        handle = _async.submit(_reporting(run, attempt), path)
        self._cv_handles.append(handle)
        return handle

    def _gather(self, children: dict[str, Any]) -> SaveContents:
        """``gather(self, targets=False)``, without the walk when the last save's still holds
        (``children``: this checkpoint's, just asked).

        It holds when this checkpoint tracks the same objects under the same names, each
        a variable or a state-dict object that gave back the very children of the last
        save (the same tensors over the same memory: ``StateDictTrackable``). The
        variables and aliases are then the last save's; the Python state is taken anew.
        Anything else (other trackables, containers, names that need escaping) walks.
        """
        states: dict[str, bytes] = {}
        on = autograd_off()  # once a save for every state-dict object (not once each)
        try:
            key = _ask(children, states)
        finally:
            autograd_back(on)
        if key is None:
            return self._gathered(None, gather(self, targets=False))
        last = self.__dict__.get("_cv_plan")
        if last is None or len(last[0]) != len(key) or not all(
                len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
                for a, b in zip(last[0], key, strict=True)):
            # the walk of this checkpoint, over the children just asked for (each object
            # is asked for its state dict once a save): the same keys in the same order
            plan = gather({k[0]: k[-1] for k in key}, targets=False)
            last = key, SaveContents(plan.variables, plan.aliases)
            object.__setattr__(self, "_cv_plan", last)
        return SaveContents(dict(last[1].variables), last[1].aliases, states)

    def _gathered(self, key: list[Any] | None, plan: SaveContents) -> SaveContents:
        """``plan``, kept for the next save's :meth:`_gather` under ``key`` (None: not)."""
        object.__setattr__(self, "_cv_plan", None if key is None else (key, plan))
        return plan

    def _snapshot_buffer(self) -> SnapshotBuffer:
        """The host buffer this checkpoint's background saves snapshot into (kept)."""
        buf = self.__dict__.get("_cv_snapshot")
        if buf is None:
            buf = SnapshotBuffer()
            object.__setattr__(self, "_cv_snapshot", buf)
        return buf

    def wait(self) -> None:
        """Block until this checkpoint's background saves are durable.

        Raises the first background error not reported yet (each error is raised once).
        """
        handles = self.__dict__.get("_cv_handles")
        if not handles:
            return
        with self._cv_lock:  # (a save of another thread appends its handle under it)
            if _async.settled(handles):  # each waited for already: nothing left to report
                handles.clear()
                return
            try:
                _async.wait_all(handles)
            finally:
                handles[:] = [h for h in handles if not h.done()]

    # -- restoring --------------------------------------------------------------------
    def note_restores(self) -> None:
        """Note restores as an incremental ``cv.CheckpointManager`` built on this checkpoint
        needs (it calls this): from now on rows written since a restore are tracked.

        Every successful :meth:`restore` notes what it set (:meth:`last_restore`); the
        manager's next save then knows the restored values unchanged since the restored
        step, and which rows were written since. A restore made before this call is
        taken up now: its values still unwritten have their rows tracked from now on
        (docs/checkpoints.md, "What a restore teaches").
        """
        with self._cv_lock:  # never beside a restore of this checkpoint by another thread
            object.__setattr__(self, "_cv_noting", True)
            restored = self._cv_restored
            if restored is not None:
                restored.track()

    def last_restore(self) -> Restored | None:
        """What the last successful restore set (a new object for each restore; values
        restored on create are added as they are; its ``path`` is absolute)."""
        return self._cv_restored

    def failed_restores(self) -> frozenset[str]:
        """The paths (as given) whose last restore raised for another reason than a
        mismatch with this checkpoint's objects: a damaged or missing file, a failed
        check, another process's failure. Their stored checksums may name bytes that are
        gone, so an incremental manager takes nothing from such a step (docs/
        checkpoints.md, "What a restore teaches"). A later successful restore of the same
        path takes it off."""
        return self._cv_failed

    def _note_outcome(self, path: str | os.PathLike[str], failed: bool) -> None:
        key = os.fspath(path)
        now = self._cv_failed | {key} if failed else self._cv_failed - {key}
        object.__setattr__(self, "_cv_failed", frozenset(now))

    def restore(
        self,
        path: str | os.PathLike[str] | None,
        *,
        verify: bool = True,
        cast: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        coordinator: Any = None,
        timeout: float | None = None,
    ) -> RestoreStatus:
        """Restore every object that exists now; the rest get their values when created.

        Checks all dtypes and shapes first (``CheckpointMismatchError``, nothing changed)
        and verifies checksums before changing anything (``verify=False`` skips that).
        ``None`` restores nothing (the status's assertions then fail). A file without
        a save counter (written by :meth:`write` before any :meth:`save`) neither creates
        nor expects one. ``cast=True`` converts a stored dtype to the variable's under
        the same_kind rules (a float16 or bfloat16 checkpoint into a float32 model), value
        by value, with one ``UserWarning`` naming every key cast.

        With ``coordinator`` (more than one process), every process calls this; each
        reads only the parts of the stored values its variables hold (resharding), and
        if any process cannot restore, every process raises and no variable changes.
        Objects created later take their values when attached, on every process together
        (that step is a collective too: the processes must create them in the same order).
        """
        if path is None:
            return RestoreStatus(None, warn_unused=False)
        try:
            status = self._restore(path, verify, cast, storage_options, coordinator, timeout)
        except CheckpointMismatchError:
            raise  # (the objects, not the step)
        except Exception:
            self._note_outcome(path, failed=True)
            raise
        self._note_outcome(path, failed=False)
        return status

    read = restore

    def _restore(  # noqa: PLR0917
        self, path: str | os.PathLike[str], verify: bool, cast: bool,
        storage_options: Mapping[str, Any] | None, coordinator: Any, timeout: float | None,
    ) -> RestoreStatus:
        with self._cv_lock:  # never beside a save of this checkpoint by another thread
            self.wait()
            # (the object graph is gathered only when a coordinator may make this collective)
            if coordinator is not None and needs_collective(
                    coordinator, gather(self).variables.values()):
                return self._restore_collective(path, coordinator, timeout, verify, cast,
                                                storage_options)
            # one pause from decoding the record to letting it go (release_reader): the
            # collector never scans the record's objects (one per stored value)
            with paused_gc():
                state = RestoreState(path, root=self, verify=verify, cast=cast,
                                     storage_options=storage_options)
                state.restored = Restored(_noted_path(path), tracking=self._cv_noting)
                if state.has_save_counter:
                    self.save_counter  # noqa: B018 - exists before matching: restored too
                nodes, adapters = begin_restores(self, state.states, state.infos, state.path)
                ok = False
                try:
                    state.restore_nodes(nodes)
                    ok = True
                finally:
                    state.release_reader()
                    end_restores(adapters, ok=ok, carry=state.carrier())
            self._take_trees()
            if state.restored is not None:
                object.__setattr__(self, "_cv_restored", state.restored)
            return RestoreStatus(state, root=self)

    def _restore_collective(  # noqa: PLR0917
        self, path: str | os.PathLike[str], coord: Any, timeout: float | None, verify: bool,
        cast: bool, storage_options: Mapping[str, Any] | None,
    ) -> RestoreStatus:
        state: CollectiveRestoreState | None = None
        failure: BaseException | None = None
        adapters: list[Any] = []
        nodes: list[Any] = []
        try:
            with paused_gc():
                state = CollectiveRestoreState(path, coordinator=coord, root=self, verify=verify,
                                               cast=cast, timeout=timeout,
                                               storage_options=storage_options)
                state.restored = Restored(_noted_path(path), tracking=self._cv_noting)
                if state.has_save_counter:
                    self.save_counter  # noqa: B018 - exists before matching: restored too
                nodes, adapters = begin_restores(self, state.states, state.infos, state.path)
        except BaseException as exc:  # noqa: BLE001 - reported through the vote
            failure = exc
        try:
            coord.vote(failure, tag=f"restore:{os.path.basename(os.fspath(path))}:open",
                       timeout=timeout)
        except BaseException:
            end_restores(adapters, ok=False)
            raise
        assert state is not None
        ok = False
        try:
            state.restore_nodes(nodes)
            ok = True
        finally:
            state.release_reader()
            end_restores(adapters, ok=ok, carry=state.carrier())
        self._take_trees()
        if state.restored is not None:
            object.__setattr__(self, "_cv_restored", state.restored)
        return RestoreStatus(state, root=self)

    def __repr__(self) -> str:
        names = ", ".join(n for n in trackable_children(self) if n != _COUNTER)
        return f"<cv.Checkpoint ({names})>"


def _noted_path(path: str | os.PathLike[str]) -> str:
    """The restored step's path as a restore notes it: a local path made absolute (the
    working directory may change before the save that takes the note), a URL as it is."""
    where = checkpoint_location(path)
    return where if isinstance(where, str) else os.path.abspath(where)
