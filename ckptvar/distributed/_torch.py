"""The torch.distributed coordinator: collectives through the process group's key-value store.

gloo and NCCL collectives have one timeout for the whole process group, fixed at
``init_process_group``, and do not say which rank is missing. This coordinator
instead exchanges its (small, pickled) objects through the group's c10d ``Store``
(TCPStore or FileStore, whatever ``init_process_group`` made): each process sets
``<prefix>/<seq>/<rank>`` and polls ``store.check(keys)`` for the keys it needs
until a deadline. So every call has its own timeout and, on timeout, the coordinator
checks which keys are missing and names those ranks. The store is shared state,
so a process that timed out and moved on never confuses a late one. While it
waits it also reads, a few times a second, whether a rank it waits for posted
that it ended (see :mod:`._kv`).

A store call itself can block for good: when the process that hosts a TCPStore
(rank 0) is stopped or hung, its socket stays open and the reply never comes (the
store's own timeout does not end it). So every store call runs on the coordinator's
own (daemon) thread and is waited for only until the collective's deadline: past it
the collective raises ``DistributedTimeoutError`` saying that the store did not answer.

The store lives in rank 0's process (``tcp://``, ``env://``): rank 0 returns from a
collective only once the other ranks have read their parts (:meth:`_await_reads`), so
its exit right after the last one does not cut their reads off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Deadline
from ._kv import KeyValueCoordinator

__all__ = ["TorchCoordinator"]

#: Seconds between two looks for a rank that posted its end, while a collective waits.
_DOWN_EVERY = 0.1
#: The rank whose process hosts the store, and the seconds at most it waits at the end
#: of a collective for the other ranks to have read their parts (:meth:`_await_reads`).
_HOST = 0
_READS_WAIT = 5.0
def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DistributedError("the torch coordinator needs PyTorch: pip install torch") from exc
    return dist


class TorchCoordinator(KeyValueCoordinator):
    """A coordinator for a job that runs ``torch.distributed`` (the default process group).

    ``store`` defaults to the default group's store; pass one (with ``rank`` and
    ``size``) to coordinate without a process group.
    """

    _SERVICE = "the c10d store"

    def __init__(
        self,
        *,
        store: Any = None,
        rank: int | None = None,
        size: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = "ckptvar",
    ) -> None:
        if store is None:
            dist = _dist()
            if not (dist.is_available() and dist.is_initialized()):
                raise DistributedError(
                    "torch.distributed is not initialised: call "
                    "torch.distributed.init_process_group(...) first, or pass store=, rank=, size="
                )
            store = dist.distributed_c10d._get_default_store()
            rank = dist.get_rank() if rank is None else rank
            size = dist.get_world_size() if size is None else size
        if rank is None or size is None:
            raise ValueError("TorchCoordinator(store=...) needs rank= and size=")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        super().__init__(rank=rank, size=size, timeout=timeout, prefix=prefix)
        self._store = store
        self._reads: list[str] = []  # this rank's read keys that rank 0 may still look for
        self._announce()

    def _twin(self, prefix: str) -> TorchCoordinator:
        return TorchCoordinator(
            store=self._store, rank=self._rank, size=self._size, timeout=self.timeout, prefix=prefix
        )

    def _set(self, key: str, data: bytes) -> None:
        try:
            self._call(lambda: self._store.set(key, data))
        except DistributedTimeoutError:
            raise
        except (RuntimeError, OSError) as exc:  # a store that is gone (its host killed)
            raise self._store_failed(exc) from exc

    def _store_failed(self, exc: BaseException) -> DistributedError:
        """The error of a store call of the current collective that failed with ``exc``."""
        kind, tag = (getattr(self._op, "now", None) or ("store", ""))[:2]
        return DistributedError(
            f"{kind}(tag={tag!r}) on rank {self._rank}: the c10d store failed: {exc}")

    def _check(self, keys: list[str]) -> bool:
        return bool(self._call(lambda: self._store.check(keys)))

    def _try_get(self, key: str) -> bytes | None:
        return self._get(key) if self._check([key]) else None

    def _delete(self, key: str) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # a store without delete keeps it
            self._call(lambda: self._store.delete_key(key))

    def _fetch(
        self, kind: str, tag: str, wanted: dict[int, str], deadline: Deadline
    ) -> dict[int, bytes]:
        self._wait(kind, tag, wanted, deadline)
        try:
            return {r: self._get(key) for r, key in wanted.items()}
        except DistributedTimeoutError:
            raise
        except (RuntimeError, OSError) as exc:  # the store went since the keys were seen
            raise self._store_failed(exc) from exc

    def _get(self, key: str) -> bytes:
        return bytes(self._call(lambda: self._store.get(key)))

    def _wait(self, kind: str, tag: str, wanted: dict[int, str], deadline: Deadline) -> None:
        """Poll ``store.check`` until every wanted key exists or the deadline passes.

        (``store.wait(keys, timeout)`` rounds its timeout up to whole seconds on a
        FileStore, so it is not used.)
        """
        keys = list(wanted.values())
        look = time.monotonic() + _DOWN_EVERY
        while True:
            try:
                if self._check(keys):
                    return
            except DistributedTimeoutError:
                raise
            except (RuntimeError, OSError) as exc:  # a store that is gone or broken
                raise self._store_failed(exc) from exc
            if deadline.expired():
                missing = self._missing(wanted)
                if not missing:
                    return
                raise self._timed_out(kind, tag, deadline.timeout, missing, self._seq)
            if time.monotonic() >= look:
                self._check_down(kind, tag, self._missing(wanted))
                look = time.monotonic() + _DOWN_EVERY
            deadline.pause()

    def _have_read(self, seq: int, kind: str) -> None:
        """Tell the store's host (rank 0) that this rank has read its parts of collective
        ``seq``. An allgather or barrier has its parts only once rank 0 finished every
        earlier collective, and so saw this rank's earlier keys: they are deleted."""
        if self._rank == _HOST:
            return
        if kind != "broadcast":
            for key in self._reads:
                self._delete(key)
            self._reads = []
        key = self._read_key(seq, self._rank)
        with contextlib.suppress(Exception):  # rank 0 then waits at most _READS_WAIT
            self._set(key, b"")
            self._reads.append(key)

    def _await_reads(self, seq: int, kind: str, recv_from: Sequence[int],
                     deadline: Deadline) -> None:
        """On rank 0, which hosts the TCPStore that ``init_process_group`` makes
        (``tcp://``, ``env://``): wait until every other rank has read its parts of
        collective ``seq``, so that rank 0 may exit as soon as its last collective
        returns without cutting the others' reads off (they would raise "the c10d store
        failed" on a step that succeeded). A rank that posted its end or was killed is
        not waited for, nor any once one gave up on the collective (a late rank 0), and
        none longer than :data:`_READS_WAIT` seconds: this wait never fails the
        collective."""
        if self._rank != _HOST:
            return
        keys = {r: self._read_key(seq, r) for r in range(self._size)
                if r != self._rank and (kind != "broadcast" or r not in recv_from)}
        end = min(deadline.end, time.monotonic() + _READS_WAIT)
        look = time.monotonic() + _DOWN_EVERY
        deadline.reset_backoff()
        try:
            while keys and not self._check(list(keys.values())):
                if time.monotonic() >= end:
                    return
                if time.monotonic() >= look:  # who is missing, and did it end or give up?
                    if self._notice(seq) is not None:
                        return
                    keys = {r: k for r, k in keys.items()
                            if not self._check([k]) and not self._ended(r)}
                    look = time.monotonic() + _DOWN_EVERY
                deadline.pause()
        except Exception:  # noqa: BLE001 - the store is this process's: nothing to wait for
            return

    def _read_key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/read/{seq}/{rank}"

    def _ended(self, rank: int) -> bool:
        """Whether ``rank`` posted its end or was killed (one look)."""
        return self._try_get(self._down_key(rank)) is not None or self._killed(rank)

    def _missing(self, wanted: dict[int, str]) -> list[int]:
        missing = []
        for r, key in sorted(wanted.items()):
            try:
                present = self._check([key])
            except DistributedTimeoutError:
                raise  # the store does not answer: which ranks are missing is not known
            except (RuntimeError, OSError):  # a store that is gone: count the key as missing
                present = False
            if not present:
                missing.append(r)
        return missing
