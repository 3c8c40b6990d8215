"""The jax.distributed coordinator: collectives through the coordination service's key-value store.

After ``jax.distributed.initialize(...)`` every process holds a client of the
coordination service. Each collective here sets ``<prefix>/<seq>/<rank>`` (bytes)
and reads the keys it needs with ``blocking_key_value_get_bytes(key, timeout_ms)``
against one deadline; on timeout it checks which keys are still absent
(``key_value_try_get_bytes``) and names those ranks.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from typing import Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Coordinator

__all__ = ["JaxCoordinator", "jax_client"]


def jax_client() -> Any:
    """The initialised jax.distributed client, or ``None``."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return distributed.global_state.client


class JaxCoordinator(Coordinator):
    """A coordinator for a job that ran ``jax.distributed.initialize``."""

    def __init__(
        self,
        *,
        client: Any = None,
        rank: int | None = None,
        size: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = "ckptvar",
    ) -> None:
        super().__init__(timeout=timeout)
        if client is None:
            client = jax_client()
            if client is None:
                raise DistributedError(
                    "jax.distributed is not initialised: call jax.distributed.initialize(...) "
                    "first, or pass client=, rank=, size="
                )
            import jax

            rank = jax.process_index() if rank is None else rank
            size = jax.process_count() if size is None else size
        if rank is None or size is None:
            raise ValueError("JaxCoordinator(client=...) needs rank= and size=")
        self._client = client
        self._rank = int(rank)
        self._size = int(size)
        self._prefix = prefix
        self._seq = 0
        self._mine: list[str] = []
        self._lock = threading.Lock()
        self._background: JaxCoordinator | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, obj: Any, *, tag: str, timeout: float | None = None) -> list[Any]:
        got = self._exchange("allgather", tag, obj, True, list(range(self._size)), timeout=timeout)
        return [got[r] for r in range(self._size)]

    def broadcast(self, obj: Any, root: int = 0, *, tag: str, timeout: float | None = None) -> Any:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is not a rank of {self._size} processes")
        if self._rank == root:
            self._exchange("broadcast", tag, obj, True, [], timeout=timeout)
            return obj
        return self._exchange("broadcast", tag, None, False, [root], timeout=timeout)[root]

    def barrier(self, *, tag: str, timeout: float | None = None) -> None:
        self._exchange("barrier", tag, None, True, list(range(self._size)), timeout=timeout)

    def background(self) -> JaxCoordinator:
        with self._lock:
            if self._background is None:
                self._background = JaxCoordinator(
                    client=self._client,
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
        recv_from: list[int],
        *,
        timeout: float | None,
    ) -> dict[int, Any]:
        seconds = self._resolve(timeout)
        end = time.monotonic() + seconds
        with self._lock:
            self._seq += 1
            seq = self._seq
            if send:
                key = self._key(seq, self._rank)
                self._client.key_value_set_bytes(key, pickle.dumps((kind, tag, obj), protocol=5))
                self._mine.append(key)
            got: dict[int, Any] = {}
            for r in recv_from:
                if r == self._rank and send:
                    got[r] = obj
                    continue
                left_ms = max(1, int((end - time.monotonic()) * 1000))
                try:
                    raw = self._client.blocking_key_value_get_bytes(self._key(seq, r), left_ms)
                except Exception as exc:
                    missing = self._missing(seq, [x for x in recv_from if x not in got])
                    if not missing:
                        raise DistributedError(
                            f"{kind}(tag={tag!r}) on rank {self._rank}: the jax "
                            f"coordination service failed: {exc}"
                        ) from exc
                    raise DistributedTimeoutError(
                        f"{kind}(tag={tag!r}) timed out after {seconds:g} s on rank "
                        f"{self._rank}: nothing arrived from "
                        + ", ".join(f"rank {m}" for m in missing),
                        collective=kind,
                        tag=tag,
                        timeout=seconds,
                        ranks=tuple(missing),
                    ) from None
                s_kind, s_tag, payload = pickle.loads(raw)
                if s_kind != kind or s_tag != tag:
                    raise DistributedError(
                        f"rank {r} called {s_kind}(tag={s_tag!r}) while rank {self._rank} "
                        f"called {kind}(tag={tag!r}): the processes are running different "
                        "collective steps",
                        ranks=(r,),
                    )
                got[r] = payload
            if kind != "broadcast":
                for old in [k for k in self._mine if k != self._key(seq, self._rank)]:
                    # a key left behind is harmless; the client raises its own error types
                    with contextlib.suppress(Exception):
                        self._client.key_value_delete(old)
                    self._mine.remove(old)
            return got

    def _missing(self, seq: int, ranks: list[int]) -> list[int]:
        missing = []
        for r in ranks:
            try:
                self._client.key_value_try_get_bytes(self._key(seq, r))
            except Exception:  # noqa: BLE001 - NOT_FOUND (or a service that is gone)
                missing.append(r)
        return missing
