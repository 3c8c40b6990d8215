"""The jax.distributed coordinator: collectives through the coordination service's key-value store.

After ``jax.distributed.initialize(...)`` every process holds a client of the
coordination service. Each collective here sets ``<prefix>/<seq>/<rank>`` (bytes)
and reads the keys it needs with ``blocking_key_value_get_bytes(key, timeout_ms)``
in short waits against one deadline; between two waits it reads whether a rank it
waits for posted that it ended (see :mod:`._kv`). On timeout it checks which keys
are still absent (``key_value_try_get_bytes``) and names those ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import DistributedError, DistributedTimeoutError
from ._coordinator import DEFAULT_TIMEOUT, Deadline
from ._kv import KeyValueCoordinator

__all__ = ["JaxCoordinator", "jax_client"]

#: Seconds of one wait for a key, between two looks for a rank that posted its end.
_DOWN_EVERY = 0.1


def jax_client() -> Any:
    """The initialised jax.distributed client, or ``None``."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return distributed.global_state.client


class JaxCoordinator(KeyValueCoordinator):
    """A coordinator for a job that ran ``jax.distributed.initialize``."""

    _SERVICE = "the jax coordination service"

    def __init__(
        self,
        *,
        client: Any = None,
        rank: int | None = None,
        size: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        prefix: str = "ckptvar",
    ) -> None:
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
        super().__init__(rank=rank, size=size, timeout=timeout, prefix=prefix)
        self._client = client
        self._announce()

    def _twin(self, prefix: str) -> JaxCoordinator:
        return JaxCoordinator(
            client=self._client,
            rank=self._rank,
            size=self._size,
            timeout=self.timeout,
            prefix=prefix,
        )

    def _set(self, key: str, data: bytes) -> None:
        self._call(lambda: self._client.key_value_set_bytes(key, data))

    def _try_get(self, key: str) -> bytes | None:
        try:
            return bytes(self._call(lambda: self._client.key_value_try_get_bytes(key)))
        except DistributedTimeoutError:
            raise
        except Exception as exc:
            if "NOT_FOUND" in str(exc):
                return None
            raise

    def _delete(self, key: str) -> None:
        # a key left behind is harmless; the client raises its own error types
        with contextlib.suppress(Exception):
            self._call(lambda: self._client.key_value_delete(key))

    def _fetch(
        self, kind: str, tag: str, wanted: dict[int, str], deadline: Deadline
    ) -> dict[int, bytes]:
        """``blocking_key_value_get_bytes`` for each key in turn, in short waits."""
        got: dict[int, bytes] = {}
        for r, key in wanted.items():
            while r not in got:
                wait_ms = max(1, int(min(deadline.remaining(), _DOWN_EVERY) * 1000))
                try:
                    got[r] = self._blocking_get(key, wait_ms)
                except DistributedTimeoutError:
                    raise
                except Exception as exc:
                    rest = {x: k for x, k in wanted.items() if x not in got}
                    if "DEADLINE_EXCEEDED" in str(exc) and not deadline.expired():
                        self._check_down(kind, tag, list(rest))
                        continue
                    missing = self._missing(rest)
                    if not missing:
                        raise DistributedError(
                            f"{kind}(tag={tag!r}) on rank {self._rank}: the jax "
                            f"coordination service failed: {exc}"
                        ) from exc
                    raise self._timed_out(kind, tag, deadline.timeout, missing, self._seq) from None
        return got

    def _blocking_get(self, key: str, wait_ms: int) -> bytes:
        return bytes(self._call(lambda: self._client.blocking_key_value_get_bytes(key, wait_ms)))

    def _try_get_raw(self, key: str) -> None:
        self._call(lambda: self._client.key_value_try_get_bytes(key))

    def _missing(self, wanted: dict[int, str]) -> list[int]:
        missing = []
        for r, key in wanted.items():
            try:
                self._try_get_raw(key)
            except DistributedTimeoutError:
                raise  # the service does not answer: which ranks are missing is not known
            except Exception:  # noqa: BLE001 - NOT_FOUND (or a service that is gone)
                missing.append(r)
        return missing
