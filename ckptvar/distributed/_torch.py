"""The torch.distributed coordinator: collectives through the process group's key-value store.

gloo and NCCL collectives have one timeout for the whole process group, fixed at
``init_process_group``, and do not say which rank is missing. This coordinator
instead exchanges its (small, pickled) objects through the group's c10d ``Store``
(TCPStore or FileStore, whatever ``init_process_group`` made): each process sets
``<prefix>/<seq>/<rank>`` and polls ``store.check(keys)`` for the keys it needs
until a deadline. So every call has its own timeout and, on timeout, the coordinator
checks which keys are missing and names those ranks. The store is shared state,
so a process that timed out and moved on never confuses a late one.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Coordinator, Deadline

__all__ = ["TorchCoordinator"]


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DistributedError("the torch coordinator needs PyTorch: pip install torch") from exc
    return dist


class TorchCoordinator(Coordinator):
    """A coordinator for a job that runs ``torch.distributed`` (the default process group).

    ``store`` defaults to the default group's store; pass one (with ``rank`` and
    ``size``) to coordinate without a process group.
    """

    def __init__(
        self,
        *,
        store: Any = None,
        rank: int | None = None,
        size: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = "ckptvar",
    ) -> None:
        super().__init__(timeout=timeout)
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
        self._store = store
        self._rank = int(rank)
        self._size = int(size)
        self._prefix = prefix
        self._seq = 0
        self._mine: list[str] = []
        self._lock = threading.Lock()
        self._background: TorchCoordinator | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        got = self._exchange("allgather", tag, obj, True, range(self._size), timeout=timeout)
        return [got[r] for r in range(self._size)]

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is not a rank of {self._size} processes")
        if self._rank == root:
            self._exchange("broadcast", tag, obj, True, [], timeout=timeout)
            return obj
        return self._exchange("broadcast", tag, None, False, [root], timeout=timeout)[root]

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        self._exchange("barrier", tag, None, True, range(self._size), timeout=timeout)

    def background(self) -> TorchCoordinator:
        with self._lock:
            if self._background is None:
                self._background = TorchCoordinator(
                    store=self._store,
                    rank=self._rank,
                    size=self._size,
                    timeout=self.timeout,
                    prefix=f"{self._prefix}/background",
                )
            return self._background

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/{seq}/{rank}"

    def _exchange(
        self,
        kind: str,
        tag: str,
        obj: Any,
        send: bool,
        recv_from: Any,
        *,
        timeout: float | None,
    ) -> dict[int, Any]:
        seconds = self._resolve(timeout)
        with self._lock:
            self._seq += 1
            seq = self._seq
            if send:
                key = self._key(seq, self._rank)
                self._store.set(key, pickle.dumps((kind, tag, obj), protocol=5))
                self._mine.append(key)
            wanted = {r: self._key(seq, r) for r in recv_from}
            if wanted:
                self._wait(kind, tag, wanted, seconds)
            got: dict[int, Any] = {}
            for r, key in wanted.items():
                if r == self._rank and send:
                    got[r] = obj
                    continue
                s_kind, s_tag, payload = pickle.loads(self._store.get(key))
                if s_kind != kind or s_tag != tag:
                    raise DistributedError(
                        f"rank {r} called {s_kind}(tag={s_tag!r}) while rank {self._rank} "
                        f"called {kind}(tag={tag!r}): the processes are running different "
                        "collective steps",
                        ranks=(r,),
                    )
                got[r] = payload
            if kind != "broadcast":
                self._forget_before(seq)
            return got

    def _wait(self, kind: str, tag: str, wanted: dict[int, str], seconds: float) -> None:
        """Poll ``store.check`` until every wanted key exists or ``seconds`` pass.

        (``store.wait(keys, timeout)`` rounds its timeout up to whole seconds on a
        FileStore, so it is not used.)
        """
        deadline = Deadline(seconds)
        keys = list(wanted.values())
        while True:
            try:
                if self._store.check(keys):
                    return
            except (RuntimeError, OSError) as exc:  # a store that is gone or broken
                raise DistributedError(
                    f"{kind}(tag={tag!r}) on rank {self._rank}: the c10d store failed: {exc}"
                ) from exc
            if deadline.expired():
                missing = self._missing(wanted)
                if not missing:
                    return
                raise DistributedTimeoutError(
                    f"{kind}(tag={tag!r}) timed out after {seconds:g} s on rank "
                    f"{self._rank}: nothing arrived from "
                    + ", ".join(f"rank {r}" for r in missing),
                    collective=kind,
                    tag=tag,
                    timeout=seconds,
                    ranks=tuple(missing),
                )
            deadline.pause()

    def _missing(self, wanted: dict[int, str]) -> list[int]:
        missing = []
        for r, key in sorted(wanted.items()):
            try:
                present = self._store.check([key])
            except (RuntimeError, OSError):  # a store that is gone: count the key as missing
                present = False
            if not present:
                missing.append(r)
        return missing

    def _forget_before(self, seq: int) -> None:
        """Delete this rank's keys of earlier steps: everyone has read them by now."""
        keep = self._key(seq, self._rank)
        for key in [k for k in self._mine if k != keep]:
            with contextlib.suppress(RuntimeError, OSError):  # a store without delete keeps it
                self._store.delete_key(key)
            self._mine.remove(key)
