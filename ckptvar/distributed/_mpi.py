"""The MPI coordinator (mpi4py), with a timeout on every collective.

MPI collectives cannot time out, so each collective here is built from nonblocking
point-to-point messages: a process posts ``isend`` to the ranks that need its
object and polls ``improbe`` for the ranks it needs, sleeping briefly between polls,
until all have arrived or the deadline passes. It then knows exactly which ranks
did not arrive, and names them. Each message carries a sequence number, the
collective's kind and its tag: a late message from an earlier, timed-out collective
is discarded, and processes that call different collectives raise at once.

A process that ends (an uncaught exception, an exit: see :mod:`._failure`) sends
each peer one message on a second tag; a peer polling for that process's part of
a later collective sees it and raises at once, naming it. A process that times out
sends each peer a "gave up on collective N" notice on a third tag; a peer that completes
collective N (it came late) finds it and raises too (:class:`.RankedCoordinator`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Deadline, Notice, RankedCoordinator, Stamp, stamp
from ._failure import forget, peer_failed, watch

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPICoordinator"]

#: The MPI message tag of every ckptvar message (on ckptvar's own communicators).
_MPI_TAG = 0x6376
#: The tag of "this process is ending" messages (see :meth:`MPICoordinator.post_failure`).
_FAIL_TAG = 0x6377
#: The tag of "this process gave up on collective N" notices (see :meth:`_post_gave_up`).
_GAVE_UP_TAG = 0x6378
#: How long an ending process waits for its "ending" messages to leave.
_POST_WAIT = 1.0


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DistributedError(
            "the MPI coordinator needs mpi4py and an MPI library: pip install mpi4py mpich"
        ) from exc
    return MPI


class MPICoordinator(RankedCoordinator):
    """A coordinator over an mpi4py communicator (``MPI.COMM_WORLD`` by default).

    The communicator is duplicated (with a timeout), so ckptvar's messages never
    mix with the application's. :meth:`background` duplicates it again.
    """

    #: A message already sent may need a few polls (MPI progress) to be seen.
    _DELIVERY = 0.25

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        _dup: bool = True,
    ) -> None:
        super().__init__(timeout=timeout)
        mpi = _import_mpi()
        base = mpi.COMM_WORLD if comm is None else comm
        self._comm = _idup(base, Deadline(self.timeout), mpi) if _dup else base
        self._rank = int(self._comm.Get_rank())
        self._size = int(self._comm.Get_size())
        self._seq = 0
        self._early: dict[tuple[int, int], tuple[str, str, Any, Stamp]] = {}
        self._sends: list[Any] = []
        self._lock = threading.Lock()
        self._background: MPICoordinator | None = None
        self._closed = False
        self._mpi = mpi
        self._down: dict[int, tuple[int, str]] = {}
        self._notices: dict[int, Notice] = {}
        watch(self)

    @property
    def comm(self) -> MPI.Comm:
        """The (duplicated) communicator this coordinator talks on."""
        return self._comm

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        others = [r for r in range(self._size) if r != self._rank]
        got = self._exchange("allgather", tag, obj, others, others, timeout=timeout)
        got[self._rank] = obj
        return [got[r] for r in range(self._size)]

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is not a rank of {self._size} processes")
        if self._rank == root:
            others = [r for r in range(self._size) if r != root]
            self._exchange("broadcast", tag, obj, others, [], timeout=timeout)
            return obj
        return self._exchange("broadcast", tag, None, [], [root], timeout=timeout)[root]

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        others = [r for r in range(self._size) if r != self._rank]
        self._exchange("barrier", tag, None, others, others, timeout=timeout)

    def background(self) -> MPICoordinator:
        with self._lock:
            if self._background is None:
                self._background = MPICoordinator(self._comm, timeout=self.timeout)
            return self._background

    def close(self) -> None:
        """Forget pending sends; the duplicated communicators are left to MPI_Finalize."""
        self._closed = True
        forget(self)
        self._sends.clear()
        if self._background is not None:
            self._background.close()

    def post_failure(self, what: str) -> None:
        """Tell every peer this process is ending (``what``), after collective ``seq``."""
        if self._closed or self._mpi.Is_finalized():
            return
        message = (self._rank, self._seq, what)
        requests = [self._comm.isend(message, dest=r, tag=_FAIL_TAG)
                    for r in range(self._size) if r != self._rank]
        end = time.monotonic() + _POST_WAIT
        while not all(r.Test() for r in requests) and time.monotonic() < end:
            time.sleep(1e-3)

    def _post_gave_up(self, seq: int, notice: Notice) -> None:
        """Send every peer ``notice`` on its own tag, and see it leave (a message MPI has
        not pushed yet would wait for this process's next MPI call, and a late peer
        would not find it): at most :data:`_POST_WAIT` seconds, for a peer that cannot
        take it in (a small message is buffered, even by a stopped process)."""
        with contextlib.suppress(Exception):
            requests = [self._comm.isend((seq, notice), dest=r, tag=_GAVE_UP_TAG)
                        for r in range(self._size) if r != self._rank]
            self._sends.extend(requests)
            end = time.monotonic() + _POST_WAIT
            while not all(r.Test() for r in requests) and time.monotonic() < end:
                time.sleep(1e-4)

    def _notice(self, seq: int) -> Notice | None:
        """A peer's notice for collective ``seq``: one ``improbe`` when none has arrived."""
        while True:
            msg = self._comm.improbe(source=self._mpi.ANY_SOURCE, tag=_GAVE_UP_TAG)
            if msg is None:
                break
            s_seq, notice = msg.recv()
            self._notices.setdefault(int(s_seq), notice)
        # (collectives before the last one received in are done with)
        for old in [s for s in self._notices if s < min(seq, self._received)]:
            del self._notices[old]
        return self._notices.get(seq)

    def _peer_failed(self, kind: str, tag: str, seq: int, missing: list[int]) -> None:
        """Raise if a rank in ``missing`` posted that it ended before collective ``seq``."""
        while True:
            msg = self._comm.improbe(source=self._mpi.ANY_SOURCE, tag=_FAIL_TAG)
            if msg is None:
                break
            src, last, what = msg.recv()
            self._down[int(src)] = (int(last), str(what))
        if not self._down:
            return
        error = peer_failed(kind, tag, me=self._rank, seq=seq, waiting_for=missing,
                            down=self._down)
        if error is not None:
            raise error

    # -- the one primitive -----------------------------------------------------------

    def _exchange(
        self,
        kind: str,
        tag: str,
        obj: Any,
        send_to: list[int],
        recv_from: list[int],
        *,
        timeout: float | None,
    ) -> dict[int, Any]:
        if self._closed:
            raise DistributedError(
                f"{kind}(tag={tag!r}) on a closed coordinator (rank {self._rank})"
            )
        deadline = Deadline(self._resolve(timeout))
        with self._lock:
            self._seq += 1
            seq = self._seq
            message = (seq, kind, tag, obj, stamp(deadline.timeout))
            self._sends = [r for r in self._sends if not r.Test()]
            for dest in send_to:
                self._sends.append(self._comm.isend(message, dest=dest, tag=_MPI_TAG))
            got: dict[int, Any] = {}
            stamps: list[Stamp] = []
            missing = list(recv_from)
            while missing:
                progressed = False
                for src in list(missing):
                    found = self._take(src, seq)
                    if found is None:
                        continue
                    s_kind, s_tag, payload, s_stamp = found
                    self._check_step(src, s_kind, s_tag, kind, tag)
                    got[src] = payload
                    stamps.append(s_stamp)
                    missing.remove(src)
                    progressed = True
                if not missing:
                    break
                self._peer_failed(kind, tag, seq, missing)
                if deadline.expired():
                    raise self._timed_out(kind, tag, deadline.timeout, sorted(missing), seq)
                if progressed:
                    deadline.reset_backoff()
                else:
                    deadline.pause()
            self._gave_up(seq, stamps, deadline.timeout)
            return got

    def _take(self, src: int, seq: int) -> tuple[str, str, Any, Stamp] | None:
        """The message of step ``seq`` from ``src`` if it has arrived; drops stale ones."""
        early = self._early.pop((src, seq), None)
        if early is not None:
            return early
        while True:
            msg = self._comm.improbe(source=src, tag=_MPI_TAG)
            if msg is None:
                return None
            s_seq, s_kind, s_tag, payload, s_stamp = msg.recv()
            if s_seq == seq:
                return s_kind, s_tag, payload, s_stamp
            if s_seq > seq:  # the sender is ahead of us (we timed out less quickly)
                self._early[(src, s_seq)] = (s_kind, s_tag, payload, s_stamp)
                return None
            # s_seq < seq: a late message of a collective that already timed out here


def _idup(comm: Any, deadline: Deadline, mpi: Any) -> Any:
    """``comm.Idup()`` waited for at most until ``deadline``."""
    new, request = comm.Idup()
    while not request.Test():
        if deadline.expired():
            raise DistributedTimeoutError(
                f"duplicating the communicator (MPI_Comm_idup) timed out after "
                f"{deadline.timeout:g} s on rank {comm.Get_rank()}: not every process "
                "created its coordinator",
                collective="comm_dup",
                tag="",
                timeout=deadline.timeout,
            )
        deadline.pause()
    return new
