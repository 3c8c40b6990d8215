"""Freeing a manager's pruned steps in the background, one deletion at a time.

Waited for with a bound, every failure logged.

A manager renames a pruned step away from its final name itself (atomic, before
``save()`` returns); what is left is a temporary (``.ckpt-3.h5.<hex>.partial``), whose
bytes a :class:`BackgroundDeletes` frees on its own thread, as Orbax's background delete
does. A deletion never fails a save: what it could not remove is said in the log and
stays a temporary, which the next manager opened on the directory, or ``ckpt gc``,
removes (so does whatever a killed process left). The interpreter's exit waits for the
deletions in flight for at most :data:`WAIT_S` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from ..locations import remove_path

__all__ = ["WAIT_S", "BackgroundDeletes", "free"]

logger = logging.getLogger("ckptvar")

#: The longest a save, ``wait_until_finished()`` without a timeout, or the interpreter's
#: exit waits for a deletion in flight; past it the deletion goes on (said in the log).
WAIT_S = 120.0


def free(paths: Iterable[Path]) -> None:
    """Remove these temporaries of pruned steps; one that stays is said in the log."""
    for path in paths:
        try:
            remove_path(path)
        except OSError as exc:
            logger.error("Could not free the pruned step %s: %s (a temporary: the next "
                         "manager on this directory or `ckpt gc` removes it).", path, exc)
            continue
        if os.path.lexists(path):
            logger.error("Could not free all of the pruned step %s (a temporary: the next "
                         "manager on this directory or `ckpt gc` removes it).", path)


class BackgroundDeletes:
    """A manager's deletions of pruned steps, run one at a time on their own thread.

    :meth:`submit` first waits for the deletion before it (so at most one step's bytes
    wait to be freed, the backlog of one prune), then starts the new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._names: frozenset[str] = frozenset()
        #: per thread: the deletions held back until :meth:`deferred` ends, or None
        self._held = threading.local()
        _LIVE.add(self)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Deletions submitted on this thread in the block start when it ends (a blocking
        save's own prune: freed once the save is done, not beside its last steps)."""
        self._held.queue = []
        try:
            yield
        finally:
            queue, self._held.queue = self._held.queue, None
            for work, names in queue:
                self.submit(work, names)

    def busy(self) -> frozenset[str]:
        """The names of the temporaries being freed now (never reclaimed by another path
        of this manager meanwhile)."""
        with self._lock:
            return self._names if self._thread is not None and self._thread.is_alive() \
                else frozenset()

    def submit(self, work: Callable[[], None], names: Collection[str]) -> None:
        """Run ``work`` (it frees the temporaries ``names``) in the background, after the
        deletion before it; its errors are logged, never raised."""
        queue = getattr(self._held, "queue", None)
        if queue is not None:
            queue.append((work, names))
            return
        self.wait()
        thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                  name="ckptvar-delete")
        with self._lock:
            self._thread, self._names = thread, frozenset(names)
        thread.start()

    def _run(self, work: Callable[[], None]) -> None:  # self: alive while it runs
        try:
            work()
        except Exception:  # a deletion never fails a save; it is said, not lost
            logger.exception("A background deletion of pruned steps failed (what it left "
                             "is a temporary: the next manager or `ckpt gc` removes it).")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the deletion in flight, at most ``timeout`` seconds (default
        :data:`WAIT_S`); ``False`` (and said in the log) if it still runs."""
        with self._lock:
            thread, names = self._thread, self._names
        if thread is None:
            return True
        # a thread whose start was interrupted (a KeyboardInterrupt in submit) frees
        # nothing: its temporaries are reclaimed as any leftover
        with contextlib.suppress(RuntimeError):
            thread.join(WAIT_S if timeout is None else timeout)
        if thread.is_alive():
            logger.warning(
                "Still freeing pruned steps (%s) after %.0f s; going on without waiting "
                "(a temporary left by it is removed by the next manager or `ckpt gc`).",
                ", ".join(sorted(names)), WAIT_S if timeout is None else timeout)
            return False
        with self._lock:
            if self._thread is thread:
                self._thread, self._names = None, frozenset()
        return True


_LIVE: weakref.WeakSet[BackgroundDeletes] = weakref.WeakSet()


def _finish_at_exit() -> None:
    """Let the deletions in flight end (at most :data:`WAIT_S` in all)."""
    deadline = time.monotonic() + WAIT_S
    for deletes in list(_LIVE):
        deletes.wait(max(0.0, deadline - time.monotonic()))


# An ``atexit`` handler runs after the background saves ended (their exit hook runs
# earlier, with the thread pools': a save's prune may start a deletion), before the
# interpreter stops this daemon thread.
atexit.register(_finish_at_exit)
