"""Collectives over a shared key-value store: the common core of the jax and torch coordinators.

Each collective takes the next sequence number; a sending process sets
``<prefix>/<seq>/<rank>`` to its pickled ``(kind, tag, obj)`` and reads the keys of
the ranks it needs before one deadline. A payload whose kind or tag differ from the
caller's raises at once (the processes run different steps); on timeout the missing
ranks are named. Once everyone has read them, a process deletes its earlier keys.
A process that ends (an uncaught exception, an exit: see :mod:`._failure`) sets
``<prefix>/down/<rank>`` to the number of its last collective and what it posted;
a process waiting for its part of a later collective reads that key while it polls
(:meth:`KeyValueCoordinator._check_down`) and raises at once, naming it. A process
killed outright posts nothing: each coordinator also sets ``<prefix>/alive/<rank>``
to where it runs (the kernel's boot id, its pid namespace, its pid); a waiting
process on the same machine and pid namespace sees that the process is gone (or a
zombie) and raises at once. On another machine it raises at its timeout, unless
the launcher ends it first (docs/distributed.md). A process that times out in
collective N sets ``<prefix>/gaveup/<N>``; a process that completes it (it came late)
finds the key and raises too (:class:`.RankedCoordinator`).
Subclasses say how bytes are set, read, waited for and deleted, and how the
background twin is made.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Self

from ..errors import DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Deadline, Notice, RankedCoordinator, Stamp, stamp
from ._failure import peer_failed, watch

__all__ = ["KeyValueCoordinator", "process_gone", "where_am_i"]

#: Seconds a store call may take after its collective's deadline (the last looks), and
#: at most when this process posts that it ends.
_GRACE = 0.2
_POST_WAIT = 1.0


class _StoreCalls:
    """Runs store calls one at a time on a daemon thread; each is waited for only until
    an end time, so a store that never answers cannot hold the caller (nor, being a
    daemon, the interpreter's exit). While a call that timed out still has not returned,
    the next ones time out at once."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._stuck: Future[Any] | None = None
        threading.Thread(target=self._run, name="ckptvar-store", daemon=True).start()

    def _run(self) -> None:
        while True:
            future, fn = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            del future, fn

    def call(self, fn: Callable[[], Any], end: float) -> Any:
        """``fn()``'s result; ``TimeoutError`` if it has not returned by ``end``."""
        stuck = self._stuck
        if stuck is not None and not stuck.done():
            raise TimeoutError("an earlier store call has not returned")
        future: Future[Any] = Future()
        self._jobs.put((future, fn))
        try:
            return future.result(timeout=max(end - time.monotonic(), 0.0))
        except TimeoutError:
            if not future.cancel():  # running: the store does not answer
                self._stuck = future
            raise


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def where_am_i() -> tuple[str, str, int]:
    """(boot id, pid namespace, pid): a pid means the same process only if both others match."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return _read("/proc/sys/kernel/random/boot_id"), namespace, os.getpid()


def process_gone(where: tuple[str, str, int]) -> bool:
    """True if ``where`` (see :func:`where_am_i`) is a process of this machine that ended."""
    boot, namespace, pid = where
    here = where_am_i()
    if not boot or not namespace or (boot, namespace) != here[:2]:
        return False  # another machine or namespace (or unknowable): cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. not permitted: it exists
        return False
    stat = _read(f"/proc/{pid}/stat")
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # a zombie has ended


class KeyValueCoordinator(RankedCoordinator):
    """A coordinator that exchanges objects through a key-value store shared by all ranks."""

    def __init__(
        self, *, rank: int, size: int, timeout: float = DEFAULT_TIMEOUT, prefix: str
    ) -> None:
        super().__init__(timeout=timeout)
        self._rank = int(rank)
        self._size = int(size)
        self._prefix = prefix
        self._seq = 0
        self._mine: list[str] = []
        self._lock = threading.Lock()
        self._background: Self | None = None
        self._down: dict[int, tuple[int, str]] = {}
        self._where: dict[int, tuple[str, str, int] | None] = {}
        self._calls = _StoreCalls()
        self._op = threading.local()  # this thread's collective: (kind, tag, timeout, end)
        watch(self)

    #: What the store calls reach, for the message of one that does not answer.
    _SERVICE = "the key-value store"

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a store call), waited for until the current collective's deadline
        (and :data:`_GRACE` more); past it, ``DistributedTimeoutError``."""
        now = getattr(self._op, "now", None)
        kind, tag, limit, end = now or ("store", "", self.timeout,
                                        time.monotonic() + self.timeout)
        try:
            return self._calls.call(fn, max(end, time.monotonic() + _GRACE))
        except TimeoutError:
            raise DistributedTimeoutError(
                f"{kind}(tag={tag!r}) timed out after {limit:g} s on rank {self._rank}: "
                f"{self._SERVICE} did not answer (the process that hosts it, rank 0, is stopped, "
                "hung or unreachable)",
                collective=kind, tag=tag, timeout=limit) from None

    # -- the hooks -------------------------------------------------------------------

    @abstractmethod
    def _set(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``."""

    @abstractmethod
    def _fetch(
        self, kind: str, tag: str, wanted: dict[int, str], deadline: Deadline
    ) -> dict[int, bytes]:
        """The bytes of every wanted key (by rank), waiting until ``deadline``.

        Raises :class:`DistributedTimeoutError` (see :meth:`_timed_out`) naming the
        ranks whose keys are still missing, or :class:`DistributedError` when the
        store itself fails.
        """

    @abstractmethod
    def _try_get(self, key: str) -> bytes | None:
        """The bytes under ``key`` now, or ``None`` if it is absent (never waits)."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Delete ``key``; a store that cannot keeps it (harmless), without raising."""

    @abstractmethod
    def _twin(self, prefix: str) -> Self:
        """A coordinator on the same store, ranks and timeout, under ``prefix``."""

    # -- the collectives -------------------------------------------------------------

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        got = self._exchange("allgather", tag, obj, True, range(self._size), timeout=timeout)
        return [got[r] for r in range(self._size)]

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is not a rank of {self._size} processes")
        if self._rank == root:
            self._exchange("broadcast", tag, obj, True, [], timeout=timeout)
            return obj
        return self._exchange("broadcast", tag, None, False, [root], timeout=timeout)[root]

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        self._exchange("barrier", tag, None, True, range(self._size), timeout=timeout)

    def background(self) -> Self:
        with self._lock:
            if self._background is None:
                self._background = self._twin(f"{self._prefix}/background")
            return self._background

    def post_failure(self, what: str) -> None:
        """Tell every peer this process is ending (``what``), after collective ``seq``."""
        data = pickle.dumps((self._seq, what), protocol=5)
        # the store may be gone (or not answer): the peers then time out instead
        self._op.now = ("post_failure", "", _POST_WAIT, time.monotonic() + _POST_WAIT)
        try:
            with contextlib.suppress(Exception):
                self._set(self._down_key(self._rank), data)
        finally:
            self._op.now = None

    def _down_key(self, rank: int) -> str:
        return f"{self._prefix}/down/{rank}"

    def _gave_up_key(self, seq: int) -> str:
        return f"{self._prefix}/gaveup/{seq}"

    def _post_gave_up(self, seq: int, notice: Notice) -> None:
        """Set ``<prefix>/gaveup/<seq>`` (the first process that gives up sets it)."""
        with contextlib.suppress(Exception):  # the store may not answer: a late peer then
            self._set(self._gave_up_key(seq), pickle.dumps(notice, protocol=5))  # waits

    def _notice(self, seq: int) -> Notice | None:
        """One look at ``<prefix>/gaveup/<seq>``."""
        try:
            data = self._try_get(self._gave_up_key(seq))
        except (RuntimeError, OSError):  # a store that is gone: the next collective says so
            return None
        if data is None:
            return None
        notice: Notice = pickle.loads(data)
        return notice

    def _alive_key(self, rank: int) -> str:
        return f"{self._prefix}/alive/{rank}"

    def _announce(self) -> None:
        """Say where this process runs (called by a subclass once its store is set)."""
        self._op.now = ("announce", "", self.timeout, time.monotonic() + self.timeout)
        try:
            self._set(self._alive_key(self._rank), pickle.dumps(where_am_i(), protocol=5))
        finally:
            self._op.now = None

    def _killed(self, rank: int) -> bool:
        """True if ``rank`` runs on this machine and its process has ended."""
        if self._where.get(rank) is None:
            data = self._try_get(self._alive_key(rank))
            self._where[rank] = None if data is None else pickle.loads(data)
        where = self._where[rank]
        return where is not None and process_gone(where)

    def _check_down(self, kind: str, tag: str, missing: Sequence[int]) -> None:
        """Raise if a rank in ``missing`` posted that it ended before this collective."""
        for r in missing:
            if r in self._down:
                continue
            try:
                data = self._try_get(self._down_key(r))
                if data is not None:
                    last, what = pickle.loads(data)
                    self._down[r] = (int(last), str(what))
                elif self._killed(r) and self._try_get(self._key(self._seq, r)) is None:
                    pid = self._where[r][2]  # type: ignore[index]
                    self._down[r] = (self._seq - 1, f"was killed (process {pid} is gone)")
            except Exception:  # noqa: BLE001 - the store failing is found by the wait
                continue
        error = peer_failed(
            kind, tag, me=self._rank, seq=self._seq, waiting_for=list(missing), down=self._down
        )
        if error is not None:
            raise error

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/{seq}/{rank}"

    def _exchange(
        self,
        kind: str,
        tag: str,
        obj: Any,
        send: bool,
        recv_from: Sequence[int],
        *,
        timeout: float | None,
    ) -> dict[int, Any]:
        deadline = Deadline(self._resolve(timeout))
        self._op.now = (kind, tag, deadline.timeout, deadline.end)
        try:
            return self._exchange_by(kind, tag, obj, send, recv_from, deadline)
        finally:
            self._op.now = None

    def _exchange_by(self, kind: str, tag: str, obj: Any, send: bool,  # noqa: PLR0917
                     recv_from: Sequence[int], deadline: Deadline) -> dict[int, Any]:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if send:
                key = self._key(seq, self._rank)
                self._set(key, pickle.dumps((kind, tag, obj, stamp(deadline.timeout)),
                                            protocol=5))
                self._mine.append(key)
            wanted = {r: self._key(seq, r) for r in recv_from if not (r == self._rank and send)}
            raw = self._fetch(kind, tag, wanted, deadline) if wanted else {}
            if wanted:
                self._have_read(seq, kind)
            got: dict[int, Any] = {}
            stamps: list[Stamp] = []
            for r in recv_from:
                if r == self._rank and send:
                    got[r] = obj
                    continue
                s_kind, s_tag, payload, s_stamp = pickle.loads(raw[r])
                self._check_step(r, s_kind, s_tag, kind, tag)
                got[r] = payload
                stamps.append(s_stamp)
            if kind != "broadcast":
                self._forget_before(seq)
            self._gave_up(seq, stamps, deadline.timeout)
            self._await_reads(seq, kind, recv_from, deadline)
            return got

    def _have_read(self, seq: int, kind: str) -> None:
        """Hook: this rank has read every part of collective ``seq`` it needs."""

    def _await_reads(self, seq: int, kind: str, recv_from: Sequence[int],
                     deadline: Deadline) -> None:
        """Hook: the end of collective ``seq`` on this rank (a process that hosts the
        store waits here until the others have read their parts)."""

    def _forget_before(self, seq: int) -> None:
        """Delete this rank's keys of earlier steps: everyone has read them by now."""
        keep = self._key(seq, self._rank)
        for key in [k for k in self._mine if k != keep]:
            self._delete(key)
            self._mine.remove(key)
