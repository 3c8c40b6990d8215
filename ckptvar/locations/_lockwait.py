"""Taking an advisory ``flock`` with a deadline: no wait on a lock is forever.

A lock held by a process that is stopped (``SIGSTOP``, a debugger) or hung is never
released by the kernel, so a blocking ``flock`` would wait for it forever. Here the
lock is polled (non-blocking, with a short sleep that backs off from 1 ms to 50 ms)
for at most :data:`LOCK_TIMEOUT` seconds (or what :func:`lock_timeout` sets for a block
of code: a manager's ``lock_timeout=``); past it, a :class:`LockTimeoutError` names the
file and, where ``/proc/locks`` tells it, the process (and host) that holds the lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import math
import os
import socket
import time
from collections.abc import Iterator

from ..errors import CkptError

__all__ = ["LOCK_TIMEOUT", "LockTimeoutError", "checked_lock_timeout", "lock_timeout",
           "wait_for_lock"]

#: How long (seconds) a lock is waited for before :class:`LockTimeoutError`, by default.
LOCK_TIMEOUT = 300.0

#: the wait :func:`lock_timeout` set for the code running now (``None``: the default)
_chosen: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "ckptvar_lock_timeout", default=None)


class LockTimeoutError(CkptError, TimeoutError):
    """A lock file was not free within the time waited (:data:`LOCK_TIMEOUT` by default)."""


def checked_lock_timeout(seconds: object) -> float | None:
    """``seconds`` as a lock wait (``None``: the default); ``ValueError`` unless it is a
    number above 0 (``math.inf``: wait forever).

    >>> checked_lock_timeout(2)
    2.0
    >>> checked_lock_timeout(0)
    Traceback (most recent call last):
    ...
    ValueError: lock_timeout must be None or a number of seconds above 0, got 0.
    """
    if seconds is None:
        return None
    try:
        value = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(seconds, bool) or not value > 0:
        raise ValueError(f"lock_timeout must be None or a number of seconds above 0, got "
                         f"{seconds!r}.")
    return value


@contextlib.contextmanager
def lock_timeout(seconds: float | None) -> Iterator[None]:
    """Locks taken in the block wait at most ``seconds`` (``None``: :data:`LOCK_TIMEOUT`):
    in this thread, and in background saves submitted from it (they run in a copy of
    its context)."""
    token = _chosen.set(seconds)
    try:
        yield
    finally:
        _chosen.reset(token)


def wait_for_lock(fd: int, how: int, what: str) -> None:
    """``flock(fd, how)``, waiting at most :data:`LOCK_TIMEOUT` seconds (or what
    :func:`lock_timeout` chose); ``what`` names the locked file in the error. ``how`` is
    ``LOCK_SH`` or ``LOCK_EX``."""
    chosen = _chosen.get()
    timeout = LOCK_TIMEOUT if chosen is None else chosen
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            holder = _holders(fd)
            by = (f" (held by process {', '.join(map(str, holder))} on host "
                  f"{socket.gethostname()})" if holder else " (its holder is not known "
                  "here: another host's, or a file system that does not say)")
            where = (f"on the directory {what!r}" if os.path.isdir(what) else
                     f"{what!r} (in {os.path.dirname(what.rstrip('/')) or '.'!r})")
            raise LockTimeoutError(
                f"The lock {where} was not free after {timeout:g} s{by}: another process "
                "holds it and does not go on (stopped or hung?); end or continue that "
                "process and try again, or wait longer (CheckpointManager(..., "
                f"lock_timeout=seconds); the default is {LOCK_TIMEOUT:g} s).")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.05)


def _holders(fd: int) -> list[int]:
    """The processes ``/proc/locks`` lists as holding a lock on ``fd``'s file (empty
    where it cannot tell)."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return []
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[5] == key and fields[4].isdigit():
            pid = int(fields[4])
            if pid != os.getpid() and pid not in pids:
                pids.append(pid)
    return pids
