"""Preemption: a signal makes the next step boundary a committed save, then is re-delivered.

:class:`SignalSave` is what ``CheckpointManager(save_on_signal=...)`` and
``mgr.save_on_signal(...)`` install. Its handler only notes the signal: a training
step the signal interrupts may be half applied, so nothing is saved from inside the
handler. At the next step boundary (the manager's next :meth:`~CheckpointManager.save`
or :meth:`~CheckpointManager.reached_preemption`) every process learns whether any
process got a signal (one small collective), and if one did, all of them save the
current state as one committed step (collectively), a background save in flight
finished first and the new one finished before going on. Then the previous handlers
are put back and the signal is raised again, so the process ends as it would have
(``SIGTERM``'s default action: killed by ``SIGTERM``), or the user's own handler runs.
A process that ends without reaching a step boundary still gets its signal back, at exit.
"""

from __future__ import annotations

import atexit
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, TypeVar

__all__ = ["SignalSave"]

T = TypeVar("T")

#: The tag of the step boundary's collective ("did any process get a signal?").
TAG = "save_on_signal"


class SignalSave:
    """The signals a manager saves on, the first one received, and its re-delivery."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self.received: int | None = None
        self._saving = False
        self._at_exit = False

    @property
    def signals(self) -> tuple[int, ...]:
        """The signals being watched (none once one was re-delivered)."""
        return tuple(self._previous)

    def install(self, signals: Iterable[int]) -> None:
        """Watch ``signals`` (from the main thread, as Python's ``signal.signal`` requires)."""
        wanted = [signal.Signals(s) for s in signals]
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "save_on_signal must be set up from the main thread (Python runs signal "
                "handlers there only)"
            )
        for signum in wanted:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._note)
        if not self._at_exit:
            self._at_exit = True
            atexit.register(self._redeliver_at_exit)

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def due(self, coordinator: Any, timeout: float | None) -> int | None:
        """At a step boundary: the signal some process got (the same on all), or ``None``.

        With a coordinator of several processes this is a collective: every process
        of a manager that saves on signals must reach the same boundaries.
        """
        if not self._previous or self._saving:
            return None
        if coordinator is not None and coordinator.size > 1:
            got = coordinator.allgather(self.received, tag=TAG, timeout=timeout)
            return next((s for s in got if s is not None), None)
        return self.received

    def save_then_redeliver(self, signum: int, save: Callable[[], T],
                            finish: Callable[[], object]) -> T:
        """``save()``, ``finish()`` (wait until it is committed), then re-deliver ``signum``."""
        self._saving = True
        try:
            result = save()
            finish()
        finally:
            self._saving = False
        self.redeliver(signum)
        return result

    def redeliver(self, signum: int) -> None:
        """Put the previous handlers back, then raise ``signum`` in this process."""
        previous = dict(self._previous)
        self._previous.clear()
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self.received = None
        signal.raise_signal(signum)

    def _redeliver_at_exit(self) -> None:
        if self.received is not None and self._previous:
            self.redeliver(self.received)
