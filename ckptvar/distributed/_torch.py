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
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Deadline
from ._kv import KeyValueCoordinator

__all__ = ["TorchCoordinator"]

#: Seconds between two looks for a rank that posted its end, while a collective waits.
_DOWN_EVERY = 0.1
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
