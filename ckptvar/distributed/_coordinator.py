"""The coordinator interface: rank, size and four collectives, each with a tag and a timeout.

A :class:`Coordinator` is how the processes of one job agree on a checkpoint step.
Every collective names itself with a ``tag`` (so processes that run different steps
are caught, not mixed up) and waits at most ``timeout`` seconds, then raises
:class:`~ckptvar.errors.DistributedTimeoutError`. :meth:`Coordinator.vote` is the
all-or-nothing step built on :meth:`Coordinator.allgather`. This module also holds
the single-process coordinator, the default when no engine is running.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Self

from ..errors import DistributedError, DistributedTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "Coordinator",
    "RankedCoordinator",
    "SingleProcessCoordinator",
    "describe_failure",
]

#: Seconds a collective waits when its caller gives no ``timeout``.
DEFAULT_TIMEOUT = 300.0


def describe_failure(outcome: BaseException | bool | None) -> str | None:
    """``None`` for a success (``None``/``True``), else a one-line ``Type: message``."""
    if outcome is None or outcome is True:
        return None
    if outcome is False:
        return "failed (no exception given)"
    if isinstance(outcome, BaseException):
        text = str(outcome)
        return f"{type(outcome).__name__}: {text}" if text else type(outcome).__name__
    raise TypeError(
        f"vote() takes None/True (success), False or an exception, not {type(outcome).__name__}"
    )


def _rank_list(ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


class Coordinator(ABC):
    """The processes of one job, as seen from one of them.

    Subclasses implement :meth:`allgather`, :meth:`broadcast`, :meth:`barrier` and
    :meth:`background`; every collective must be called by every process, in the
    same order, with the same ``tag``. ``timeout=None`` means :attr:`timeout`
    (the coordinator's default); a collective never waits longer.
    """

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = self._check_timeout(timeout)

    @staticmethod
    def _check_timeout(timeout: float) -> float:
        t = float(timeout)
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(
                f"timeout must be a positive, finite number of seconds, got {timeout!r}"
            )
        return t

    def _resolve(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else self._check_timeout(timeout)

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's number, ``0 <= rank < size``."""

    @property
    @abstractmethod
    def size(self) -> int:
        """How many processes take part."""

    @abstractmethod
    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        """Every process's ``obj`` (picklable), indexed by rank, on every process."""

    @abstractmethod
    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        """``root``'s ``obj`` on every process (the others' ``obj`` is ignored)."""

    @abstractmethod
    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        """Return once every process has reached this barrier."""

    @abstractmethod
    def background(self) -> Coordinator:
        """A coordinator on a separate channel, for a save that runs in a background thread.

        Its collectives never match the foreground's, so a background save and the
        training loop's own collectives can run at the same time. Every process must
        call it (the first call may be collective); later calls return the same object.
        """

    def raise_if_given_up(self) -> None:  # noqa: B027 - one process: no one gives up
        """Raise the :class:`~ckptvar.errors.DistributedTimeoutError` of the last collective
        this process received in, if another process has since posted that it gave up on it.

        Every collective checks this once as it completes; a process about to make a
        step visible (the commit) checks again, for a notice posted just after.
        """

    def close(self) -> None:  # noqa: B027 - an optional hook: nothing to release by default
        """Release what this coordinator holds (it does not end the engine)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_primary(self) -> bool:
        """True on rank 0, the process that commits."""
        return self.rank == 0

    def vote(
        self,
        outcome: BaseException | bool | None,
        *,
        tag: str,
        timeout: float | None = None,
    ) -> None:
        """The all-or-nothing step: every process reports success or its error.

        ``outcome`` is ``None`` or ``True`` for success, an exception (or ``False``)
        for failure. Returns only if every process succeeded. Otherwise a process
        whose ``outcome`` is an exception raises that exception, as it would alone (a
        note names the failing ranks; a ``DistributedError`` outcome is chained to the
        vote's), so a user's ``except`` clause works the same on
        one process and many; every other process raises
        :class:`~ckptvar.errors.DistributedError` naming the failing ranks and their
        messages.
        """
        mine = describe_failure(outcome)
        reports = self.allgather(mine, tag=f"vote:{tag}", timeout=timeout)
        failures = {r: msg for r, msg in enumerate(reports) if msg is not None}
        if not failures:
            return
        ranks = tuple(sorted(failures))
        detail = "; ".join(f"rank {r}: {failures[r]}" for r in ranks)
        error = DistributedError(
            f"{tag!r} failed on {len(ranks)} of {self.size} processes "
            f"({_rank_list(ranks)}): {detail}",
            ranks=ranks,
            failures=failures,
        )
        if isinstance(outcome, DistributedError):  # already a many-process failure
            raise error from outcome
        if isinstance(outcome, BaseException):
            outcome.add_note(f"(on rank {self.rank}: {error})")
            raise outcome
        raise error

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


#: What each part of a collective carries: when its sender sent it (``time.time()``) and
#: the sender's timeout, so a receiver knows when the sender gives up.
Stamp = tuple[float, float]
#: Seconds at most a process that completed a collective looks for a notice it may be
#: about to get (:meth:`RankedCoordinator._gave_up`).
NOTICE_WAIT = 1.0


def stamp(timeout: float) -> Stamp:
    """The stamp of a part sent now by a process that waits ``timeout`` seconds."""
    return time.time(), timeout


def _skew(timeout: float) -> float:
    """How far apart two processes' clocks (and the moment a timeout is seen) may be."""
    return min(0.5, timeout / 4)


#: A "gave up on collective N" notice: (rank that gave up, kind, tag, its timeout, the
#: ranks it still waited for).
Notice = tuple[int, str, str, float, tuple[int, ...]]


class RankedCoordinator(Coordinator):
    """A coordinator whose ``rank`` and ``size`` are fixed when it is made.

    Subclasses set ``self._rank`` and ``self._size`` in ``__init__``, and say how a
    process that timed out in collective ``seq`` posts its notice (:meth:`_post_gave_up`)
    and how a process that completed it finds one (:meth:`_notice`): a process stopped
    past the others' timeout that then continues finds every part already sent, and
    would pass the collective the others failed; the notice makes it fail too.
    """

    _rank: int
    _size: int
    #: The last collective this process received in (what :meth:`raise_if_given_up` checks).
    _received = 0
    #: Seconds a notice posted may take to be seen by a peer that looks for it.
    _DELIVERY = 0.0
    #: When (``time.monotonic()``) this process's last collective ended.
    _done_at = 0.0

    def _post_gave_up(self, seq: int, notice: Notice) -> None:
        """Tell every peer this process gave up on collective ``seq`` (never raises)."""

    def _notice(self, seq: int) -> Notice | None:
        """A peer's notice that it gave up on collective ``seq``, if one was posted."""
        return None

    def _gave_up(self, seq: int, stamps: Sequence[Stamp], timeout: float) -> None:
        """Called as collective ``seq`` (this process's ``timeout``) completes, with the
        stamps of the parts this process received in it: raise if a peer gave up on it.

        One look for a notice. Only where a sender's deadline (its stamp) has passed, or
        nearly (:func:`_skew`), may its notice still be on its way: then look again
        until that deadline is safely past and a notice posted then has had
        :attr:`_DELIVERY` seconds to arrive (at most :data:`NOTICE_WAIT` seconds in all);
        it comes, or the sender had this process's part in time. A process that received
        nothing (a broadcast's root) counts from when its previous collective ended,
        when the others could start waiting for it.
        """
        if self._size == 1:
            return
        wall, now = time.time(), time.monotonic()
        late = [sent + limit + _skew(limit) - wall for sent, limit in stamps
                if wall >= sent + limit - _skew(limit)]
        if not stamps and self._done_at and now - self._done_at >= timeout - _skew(timeout):
            late.append(self._done_at + timeout + _skew(timeout) - now)
        if stamps:
            self._received = seq
        self._done_at = now
        notice = self._notice(seq)
        if notice is None and late:
            wait = Deadline(min(max(0.0, *late) + self._DELIVERY, NOTICE_WAIT))
            while notice is None and not wait.expired():
                wait.pause()
                notice = self._notice(seq)
        if notice is not None:
            raise self._given_up(notice)

    def raise_if_given_up(self) -> None:
        if self._received:
            notice = self._notice(self._received)
            if notice is not None:
                raise self._given_up(notice)

    def _given_up(self, notice: Notice) -> DistributedTimeoutError:
        """The error of a process that completed a collective another gave up on."""
        rank, kind, tag, seconds, missing = notice
        return DistributedTimeoutError(
            f"{kind}(tag={tag!r}) timed out on rank {rank} after {seconds:g} s (nothing had "
            f"arrived from {_rank_list(missing)}): rank {rank} gave up on it, so it fails on "
            f"rank {self._rank} too, as on every process",
            collective=kind,
            tag=tag,
            timeout=seconds,
            ranks=tuple(missing),
        )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _check_step(self, src: int, s_kind: str, s_tag: str, kind: str, tag: str) -> None:
        """Raise if rank ``src`` sent ``s_kind``/``s_tag`` for this rank's ``kind``/``tag``."""
        if s_kind != kind or s_tag != tag:
            raise DistributedError(
                f"rank {src} called {s_kind}(tag={s_tag!r}) while rank {self._rank} "
                f"called {kind}(tag={tag!r}): the processes are running different "
                "collective steps",
                ranks=(src,),
            )

    def _timed_out(
        self, kind: str, tag: str, seconds: float, missing: Sequence[int], seq: int
    ) -> DistributedTimeoutError:
        """The error for collective ``seq`` whose ``missing`` ranks sent nothing in
        ``seconds``; the peers are told this process gave up on it first."""
        self._post_gave_up(seq, (self._rank, kind, tag, seconds, tuple(missing)))
        return DistributedTimeoutError(
            f"{kind}(tag={tag!r}) timed out after {seconds:g} s on rank "
            f"{self._rank}: nothing arrived from " + _rank_list(missing),
            collective=kind,
            tag=tag,
            timeout=seconds,
            ranks=tuple(missing),
        )


class SingleProcessCoordinator(Coordinator):
    """One process: every collective returns at once (the default outside any engine)."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)
        self._background: SingleProcessCoordinator | None = None

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        self._resolve(timeout)
        return [obj]

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        self._resolve(timeout)
        if root != 0:
            raise ValueError(f"broadcast root must be 0 with one process, got {root}")
        return obj

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        self._resolve(timeout)

    def background(self) -> SingleProcessCoordinator:
        if self._background is None:
            self._background = SingleProcessCoordinator(timeout=self.timeout)
        return self._background


class Deadline:
    """A point in time ``timeout`` seconds from now, and a sleep that backs off while polling."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout
        self._delay = 1e-5

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def reset_backoff(self) -> None:
        self._delay = 1e-5

    def pause(self) -> None:
        """Sleep a little (10 µs doubling up to 2 ms), never past the deadline."""
        time.sleep(max(0.0, min(self._delay, self.remaining())))
        self._delay = min(self._delay * 2, 2e-3)
