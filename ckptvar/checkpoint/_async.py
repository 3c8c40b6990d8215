"""Background saves: one writer thread, handles, and errors that are never lost.

A background save has already taken its host snapshot when it is submitted; the
thread only writes. Each :class:`SaveHandle` reports its error exactly once, to
whichever comes first: ``handle.wait()``, the owner's ``wait()`` or next save, or
:func:`wait_for_pending_saves`. A save still running when the interpreter exits is
finished first (as TensorFlow's async checkpointing does), and an error nobody
collected is logged at exit.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import thread as _pool_threads  # noqa: F401 - see the last line
from typing import Any

from ..errors import CkptError

__all__ = ["SaveHandle", "settled", "submit", "wait_for_pending_saves"]

logger = logging.getLogger("ckptvar")

_lock = threading.Lock()
_outstanding: list[SaveHandle] = []  # not yet successfully waited for, or error unreported


class _Outcome:
    """A background save's result or error, set once by the thread that ran it.

    What a ``concurrent.futures.Future`` gives a save (wait with a timeout, done,
    callbacks), made of one lock held until the outcome is set: a ``Future`` makes a
    ``Condition`` and its lock, 26 against 9 us cold, in the caller's blocking part.
    Nothing cancels a save, so there is no cancelled state.
    """

    __slots__ = ("_callbacks", "_exc", "_finished", "_pending", "_result")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()  # released once the outcome is set
        self._finished = False
        self._result: str | None = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[_Outcome], object]] | None = None

    def done(self) -> bool:
        return self._finished

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until set (``TimeoutError`` after ``timeout`` seconds); its error or None."""
        if not self._finished:
            if not self._pending.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise TimeoutError(f"The background save did not finish in {timeout} s.")
            self._pending.release()  # (the next waiter's turn)
        return self._exc

    def result(self) -> str | None:
        exc = self.exception()
        if exc is not None:
            raise exc
        return self._result

    def set_result(self, result: str) -> None:
        self._set(result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._set(None, exc)

    def _set(self, result: str | None, exc: BaseException | None) -> None:
        with _callbacks_lock:
            self._result, self._exc, self._finished = result, exc, True
            callbacks, self._callbacks = self._callbacks, None
        self._pending.release()
        for fn in callbacks or ():
            _call_back(fn, self)

    def add_done_callback(self, fn: Callable[[_Outcome], object]) -> None:
        """Call ``fn(self)`` once set (at once if it is), on the thread that sets it."""
        with _callbacks_lock:
            if not self._finished:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)


_callbacks_lock = threading.Lock()


def _call_back(fn: Callable[[_Outcome], object], outcome: _Outcome) -> None:
    try:
        fn(outcome)
    except Exception:  # a callback's error is logged, never raised (as a Future's)
        logger.exception("A callback of a background save raised")


class SaveHandle:
    """A save running in the background. ``wait()`` returns its path once durable."""

    def __init__(self, future: _Outcome, path: str) -> None:
        self._future = future
        self.path = path
        self._reported = False

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once the save finished (at once if it has), on whichever
        thread finishes it; ``fn``'s errors are logged, never raised."""
        self._future.add_done_callback(lambda _future: fn(self))

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until durable; re-raise the background error (only the first time).

        Returns the path, or ``None`` if the save failed and its error was reported before.
        """
        exc = self._future.exception(timeout)
        with _lock:
            first_report = exc is not None and not self._reported
            self._reported = True
            if self in _outstanding:
                _outstanding.remove(self)
        if exc is None:
            return self.path
        if first_report:
            raise exc
        return None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveHandle {self.path!r} {state}>"


def _in_context(fn: Callable[[], str], context: contextvars.Context) -> Callable[[], str]:
    def job() -> str:
        return context.run(fn)

    return job


def submit(fn: Callable[[], str], path: str) -> SaveHandle:
    """Run ``fn`` (which writes and returns the final path) in the writer thread."""
    future = _Outcome()
    handle = SaveHandle(future, path)
    fn = _in_context(fn, contextvars.copy_context())  # the caller's (a manager's
    # lock_timeout) goes with the save into the writer thread
    with _lock:  # (the exit wait takes its list under it: a save is either in it or here)
        here = _exiting[0]
        if not here:
            jobs = _writer[0]
            if jobs is None:  # the first background save of this process (or a fork's child)
                jobs = queue.SimpleQueue()
                threading.Thread(target=_write_jobs, args=(jobs,), name="ckptvar-save",
                                 daemon=True).start()
                _writer[0] = jobs  # once its thread runs: an interrupted start (Ctrl-C)
            jobs.put((future, fn))  # leaves no queue nobody reads, no handle with no job
            _outstanding[:] = [h for h in _outstanding if not _succeeded(h)]
            _outstanding.append(handle)
    if here:  # after the exit wait: a job queued now might never run
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
            handle._reported = True
            raise
    return handle


#: the writer thread's queue of ``(future, job)``: the thread is started at the first
#: background save, one a process, and kept (a save hands it a job, not a new thread);
#: a fork's child, which has no such thread, starts its own
_writer: list[Any] = [None]
#: set by the exit wait (:func:`_finish_at_exit`): saves are then written by the caller
_exiting = [False]


def _forget_in_child() -> None:
    """In a fork's child: no writer thread (its first save starts one), and the parent's
    saves not waited for before the fork are the parent's: one in flight never runs here,
    so nothing here waits for them (the exit wait, :func:`wait_for_pending_saves`, the
    owner's next save) and their handles' ``wait()`` returns ``None`` at once (not known
    durable here), their error saying why. (Their futures are not asked whether they are
    done: a thread of the parent may have held a future's lock at the fork.)"""
    global _lock, _callbacks_lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    _callbacks_lock = threading.Lock()
    _writer[0] = None
    pid = os.getppid()
    for handle in _outstanding:
        lost = _Outcome()
        lost.set_exception(CkptError(
            f"The background save to {handle.path!r} was not waited for in process {pid} "
            "before this process forked from it; that process writes it, not this one."))
        handle._future, handle._reported = lost, True
    _outstanding.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _write_jobs(jobs: queue.SimpleQueue[tuple[_Outcome, Callable[[], str]]]) -> None:
    """The writer thread: run each job in turn, its result or error into its outcome."""
    while True:
        future, fn = jobs.get()
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported through the handle
            future.set_exception(exc)
        else:
            future.set_result(result)
        del future, fn  # hold nothing of a finished job (its snapshot) while waiting


def _succeeded(handle: SaveHandle) -> bool:
    return handle.done() and handle._future.exception() is None


def wait_all(handles: list[SaveHandle]) -> None:
    """Wait for every handle; then raise the first error not reported yet (others stay)."""
    if settled(handles):  # each waited for already: nothing to report
        return
    first: BaseException | None = None
    for handle in list(handles):
        handle._future.exception()  # block without reporting
    for handle in list(handles):
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            first = exc
            break
    if first is not None:
        raise first


def settled(handles: list[SaveHandle]) -> bool:
    """Whether each handle was waited for already (its save done, its error reported)."""
    return all(h._reported for h in handles)


def wait_for_pending_saves() -> None:
    """Block until every background save in this process is durable.

    Raises the first background error not reported yet (each error is raised once).
    """
    with _lock:
        handles = list(_outstanding)
    wait_all(handles)


def _report_at_exit() -> None:
    with _lock:
        handles = list(_outstanding)
    for handle in handles:
        if handle.done() and not handle._reported and handle._future.exception() is not None:
            logger.error(
                "Background save to %r failed and nobody waited for it: %r",
                handle.path,
                handle._future.exception(),
            )


def _finish_at_exit() -> None:
    """Let the saves in flight finish before the thread pools they use are shut down;
    later ones (asked for by ``atexit`` handlers) are written on the caller's thread."""
    _exiting[0] = True
    with _lock:
        handles = list(_outstanding)
    for handle in handles:
        handle._future.exception()  # wait, without reporting (reported below, if failed)


atexit.register(_report_at_exit)
# The interpreter's thread-pool shutdown (concurrent.futures' exit hook) runs before
# ``atexit`` handlers and makes every pool refuse new work (the I/O threads a save
# uses), which would fail a save in flight. Hooks registered here run in reverse
# order, so this one, registered after that module's (imported above), runs before it.
threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]
