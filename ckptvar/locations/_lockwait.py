"""Taking an advisory ``flock`` with a deadline: no wait on a lock is forever.

A lock held by a process that is stopped (``SIGSTOP``, a debugger) or hung is never
released by the kernel, so a blocking ``flock`` would wait for it forever. Here the
lock is polled (non-blocking, with a short sleep that backs off from 1 ms to 50 ms)
for at most :data:`LOCK_TIMEOUT` seconds; past it, a :class:`LockTimeoutError` names
the file and, where ``/proc/locks`` tells it, the process that holds the lock.
"""

from __future__ import annotations

import fcntl
import os
import time

from ..errors import CkptError

__all__ = ["LOCK_TIMEOUT", "LockTimeoutError", "wait_for_lock"]

#: How long (seconds) a lock is waited for before :class:`LockTimeoutError`.
LOCK_TIMEOUT = 300.0


class LockTimeoutError(CkptError, TimeoutError):
    """A lock file was not free within :data:`LOCK_TIMEOUT` seconds."""


def wait_for_lock(fd: int, how: int, what: str) -> None:
    """``flock(fd, how)``, waiting at most :data:`LOCK_TIMEOUT` seconds; ``what`` names
    the locked file in the error. ``how`` is ``LOCK_SH`` or ``LOCK_EX``."""
    timeout = LOCK_TIMEOUT
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
            by = f" (held by process {', '.join(map(str, holder))})" if holder else ""
            raise LockTimeoutError(
                f"The lock {what!r} was not free after {timeout:g} s{by}: another "
                "process holds it and does not go on (stopped or hung?); end or continue "
                "that process and try again.")
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
