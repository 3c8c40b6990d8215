"""Failures that travel: this process's uncaught exception or exit is told to its peers.

A collective waits for the other processes, and a process that raised in the user's
own code, or called ``sys.exit``, never arrives. So every engine coordinator, when it
is made, registers here (:func:`watch`); the first registration installs two hooks,
each chained with what was there before:

- ``sys.excepthook``: an uncaught exception posts ``"raised Type: message"``;
- ``atexit``: an exit posts ``"exited"`` (once; nothing more after an exception).

Each registered coordinator posts on its own channel, with the number of the last
collective this process took part in (:meth:`FailurePost.post_failure`). A peer
waiting in a later collective for this process's message raises
:class:`~ckptvar.errors.DistributedError` naming it (:func:`peer_failed`); a peer
still in a collective this process finished is not disturbed. A thread's uncaught
exception does not end the process and is not posted.
"""

from __future__ import annotations

import atexit
import sys
import threading
from types import TracebackType
from typing import Protocol, runtime_checkable

from ..errors import DistributedError

__all__ = ["FailurePost", "describe_exit", "forget", "peer_failed", "watch"]

#: What an exit without an exception is posted as.
EXITED = "exited"


@runtime_checkable
class FailurePost(Protocol):
    """A coordinator that can tell its peers this process is ending."""

    def post_failure(self, what: str) -> None:
        """Tell every peer that this process ``what`` (``"exited"``, ``"raised T: m"``).

        Must not block for long (a second at most) and must never raise.
        """


class _Hooks:
    """The registered coordinators and whether the hooks are in and have posted."""

    def __init__(self) -> None:
        #: Held strongly: at exit, a script's own references to its coordinator are gone.
        self.watched: list[FailurePost] = []
        self.lock = threading.Lock()
        self.installed = False
        self.posted = False

    def post_all(self, what: str) -> None:
        with self.lock:
            if self.posted:
                return
            self.posted = True
            coordinators = list(self.watched)
        for coordinator in coordinators:
            try:
                coordinator.post_failure(what)
            except Exception:  # noqa: BLE001 - ending anyway: a peer will time out instead
                continue


_hooks = _Hooks()


def watch(coordinator: FailurePost) -> None:
    """Post this process's failure or exit to ``coordinator``'s peers (hooks installed once)."""
    with _hooks.lock:
        _hooks.watched.append(coordinator)
        if _hooks.installed:
            return
        _hooks.installed = True
    previous = sys.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        text = str(exc)
        _hooks.post_all(
            f"raised {exc_type.__name__}: {text}" if text else f"raised {exc_type.__name__}"
        )
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    atexit.register(_hooks.post_all, EXITED)


def forget(coordinator: FailurePost) -> None:
    """Stop posting to ``coordinator``'s peers (it was closed)."""
    with _hooks.lock:
        _hooks.watched[:] = [c for c in _hooks.watched if c is not coordinator]


def describe_exit(rank: int, what: str) -> str:
    """``rank 1 raised RuntimeError: ...`` / ``rank 1 exited``, for a peer's message."""
    return f"rank {rank} {what}"


def peer_failed(
    kind: str, tag: str, *, me: int, seq: int, waiting_for: list[int],
    down: dict[int, tuple[int, str]],
) -> DistributedError | None:
    """The error for collective ``seq`` if a rank it waits for ended before sending it.

    ``down`` maps a rank that posted its end to ``(last collective it took part in,
    what it posted)``; a rank whose last collective is ``seq`` or later sent its part.
    """
    gone = sorted(r for r in waiting_for if r in down and down[r][0] < seq)
    if not gone:
        return None
    failures = {r: down[r][1] for r in gone}
    detail = "; ".join(describe_exit(r, failures[r]) for r in gone)
    return DistributedError(
        f"{kind}(tag={tag!r}) on rank {me} cannot complete: {detail} "
        "(it ended without taking part in this collective)",
        ranks=tuple(gone),
        failures=failures,
    )
