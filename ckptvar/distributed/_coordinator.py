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


class RankedCoordinator(Coordinator):
    """A coordinator whose ``rank`` and ``size`` are fixed when it is made.

    Subclasses set ``self._rank`` and ``self._size`` in ``__init__``.
    """

    _rank: int
    _size: int

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
        self, kind: str, tag: str, seconds: float, missing: Sequence[int]
    ) -> DistributedTimeoutError:
        """The error for a collective whose ``missing`` ranks sent nothing in ``seconds``."""
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
