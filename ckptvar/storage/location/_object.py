"""``ObjectStoreLocation``: the :class:`Location` interface on S3, GCS and Azure via obstore.

obstore (the optional ``cloud`` extra) does the HTTP: parallel ranged GETs,
multipart uploads, conditional create-only PUTs (``If-None-Match: *``). This
module maps its calls and errors onto ckptvar's:

- every call has a timeout (``timeout``/``connect_timeout`` client options;
  defaults below) and obstore's retry with exponential backoff (5xx, throttling,
  dropped connections; reads also on timeouts). A failure that outlives the
  retries raises :class:`StorageError` naming the operation and the URL;
- a missing object raises ``CheckpointNotFoundError``; a create-only put onto an
  existing key raises ``CheckpointExistsError``;
- large ranged reads are cut into ``part_size`` requests run on a thread pool,
  each copied straight into the caller's buffer as it arrives (at most
  ``max_concurrency`` parts in memory).

``storage_options`` keys: the S3/GCS/Azure config keys of obstore (``endpoint``,
``access_key_id``, ``secret_access_key``, ``region``, ...), client keys
(``allow_http``, ``timeout``, ``connect_timeout``, ...) and retry keys
(``max_retries``, ``retry_timeout``, ``init_backoff``, ``max_backoff``, seconds).
Without them obstore reads the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``GOOGLE_SERVICE_ACCOUNT_KEY``, ``AZURE_STORAGE_ACCOUNT_NAME``, ...);
the client keys (``AWS_ALLOW_HTTP``, ``GOOGLE_ALLOW_HTTP``, ``AZURE_ALLOW_HTTP``, ...) are read
here, for the URL's cloud, since passing client options hides obstore's own reading of them.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
)
from ._base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    Location,
    ObjectInfo,
    ObjectWriter,
    StorageError,
    clean_key,
)

__all__ = ["CLOUD_SCHEMES", "ObjectStoreLocation", "RequestStats"]

#: URL schemes served by obstore.
CLOUD_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure")

_CLIENT_KEYS = {
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "read_timeout",
    "timeout",
    "user_agent",
}
_RETRY_KEYS = {"max_retries", "retry_timeout", "init_backoff", "max_backoff"}
#: This layer's own keys: request size of reads (0: one request per range) and of
#: multipart parts, and requests in flight per call.
_LAYER_KEYS = {"read_part_size", "part_size", "max_concurrency"}
_STREAM_CHUNK = 1024 * 1024
_STREAM_ATTEMPTS = 3
#: Defaults: no network call without a timeout, and a bounded total retry time.
_CLIENT_DEFAULTS = {"timeout": "120s", "connect_timeout": "10s"}
_RETRY_DEFAULTS: dict[str, Any] = {"max_retries": 6, "retry_timeout": 120.0}
#: The environment prefix of each cloud's settings (``GOOGLE_ALLOW_HTTP``, ...).
_ENV_PREFIX = {
    "s3": "AWS", "s3a": "AWS", "gs": "GOOGLE",
    "az": "AZURE", "abfs": "AZURE", "abfss": "AZURE", "azure": "AZURE",
}  # fmt: skip
_BOOL_CLIENT_KEYS = ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only")

T = TypeVar("T")


def _import_obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise CkptError(
            "reading or writing an object-store URL needs obstore: pip install 'ckptvar[cloud]'"
        ) from None
    return obstore


class RequestStats:
    """Counts of requests and payload bytes at this layer's boundary (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.get_requests = self.bytes_read = 0
        self.put_requests = self.bytes_written = 0
        self.other_requests = 0

    def add(self, kind: str, nbytes: int = 0) -> None:
        with self._lock:
            if kind == "get":
                self.get_requests += 1
                self.bytes_read += nbytes
            elif kind == "put":
                self.put_requests += 1
                self.bytes_written += nbytes
            elif kind == "bytes":  # payload of a streamed GET
                self.bytes_read += nbytes
            elif kind == "upload":  # bytes handed to a multipart writer
                self.bytes_written += nbytes
            else:
                self.other_requests += 1

    def reset(self) -> None:
        with self._lock:
            self.get_requests = self.bytes_read = 0
            self.put_requests = self.bytes_written = 0
            self.other_requests = 0


def _store_from_url(
    url: str, config: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]
) -> Any:
    """An obstore store for ``url``. The option keys depend on the cloud, known only at run
    time, so obstore checks them (its typed overloads are per cloud)."""
    from obstore.store import from_url

    make: Callable[..., Any] = from_url
    return make(url, config=config or None, client_options=client, retry_config=retry)


def _split_options(
    options: Mapping[str, Any], scheme: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    config: dict[str, Any] = {}
    client: dict[str, Any] = dict(_CLIENT_DEFAULTS)
    retry_in: dict[str, Any] = dict(_RETRY_DEFAULTS)
    for key, value in options.items():
        if key in _LAYER_KEYS:
            continue
        if key in _CLIENT_KEYS:
            client[key] = value
        elif key in _RETRY_KEYS:
            retry_in[key] = value
        else:
            config[key] = value
    retry: dict[str, Any] = {
        "max_retries": int(retry_in["max_retries"]),
        "retry_timeout": timedelta(seconds=float(retry_in["retry_timeout"])),
    }
    backoff = {
        k: timedelta(seconds=float(retry_in[k]))
        for k in ("init_backoff", "max_backoff")
        if k in retry_in
    }
    if backoff:
        retry["backoff"] = backoff
    # Passing client options hides obstore's own reading of the client keys from the
    # environment (AWS_ALLOW_HTTP, GOOGLE_ALLOW_HTTP, AZURE_ALLOW_HTTP, AZURE_PROXY_URL, ...):
    # read them here, for the URL's cloud, where storage_options do not set the key
    # (plus the bare ALLOW_HTTP, read for every cloud).
    prefix = _ENV_PREFIX.get(scheme, "AWS")
    for key in sorted(_CLIENT_KEYS - options.keys()):
        names = [f"{prefix}_{key.upper()}"] + (["ALLOW_HTTP"] if key == "allow_http" else [])
        found = [os.environ[n] for n in names if n in os.environ]
        if found:
            client[key] = found[0]
    for key in _BOOL_CLIENT_KEYS:
        if key in client and isinstance(client[key], str):
            client[key] = client[key].lower() in ("1", "true", "yes")
    return config, client, retry


class ObjectStoreLocation(Location):
    """Keys are objects below ``scheme://bucket/prefix``.

    ``stats`` counts every request this location makes (shared by its children).
    """

    is_remote = True

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        _store: Any = None,
        _stats: RequestStats | None = None,
    ) -> None:
        super().__init__(url)
        self._obs = _import_obstore()
        parts = urlsplit(self.url)
        if parts.scheme not in CLOUD_SCHEMES or not parts.netloc:
            raise CkptError(f"{url!r} is not an object-store URL like s3://bucket/prefix")
        self.scheme, self.bucket = parts.scheme, parts.netloc
        self.prefix = clean_key(parts.path)
        self.storage_options = dict(storage_options or {})
        self.stats = _stats or RequestStats()
        opts = self.storage_options
        self.part_size = int(opts.get("part_size", DEFAULT_PART_SIZE))
        self.read_part_size = int(opts.get("read_part_size", self.part_size))
        self.max_concurrency = int(opts.get("max_concurrency", DEFAULT_CONCURRENCY))
        if _store is None:
            config, client, retry = _split_options(self.storage_options, self.scheme)
            try:
                _store = _store_from_url(f"{self.scheme}://{self.bucket}", config, client, retry)
            except Exception as exc:  # noqa: BLE001 - obstore's config errors have several types
                raise CkptError(f"cannot configure a client for {self.url}: {exc}") from None
        self.store = _store

    # --- helpers --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        key = clean_key(key)
        return f"{self.prefix}/{key}" if self.prefix and key else (self.prefix or key)

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one obstore call, translating its errors into ckptvar's."""
        exc_mod = self._obs.exceptions
        try:
            return fn()
        except (exc_mod.NotFoundError, FileNotFoundError):
            raise CheckpointNotFoundError(f"{self.join(key)}: no such object ({op})") from None
        except (exc_mod.AlreadyExistsError, exc_mod.PreconditionError, FileExistsError):
            raise CheckpointExistsError(f"{self.join(key)} already exists ({op})") from None
        except (exc_mod.PermissionDeniedError, exc_mod.UnauthenticatedError) as exc:
            raise StorageError(
                f"{op} {self.join(key)}: access denied ({_first_line(exc)}); check the "
                "credentials in storage_options or the AWS_*/GOOGLE_*/AZURE_* environment"
            ) from None
        except CkptError:
            raise
        except Exception as exc:  # obstore and tokio raise many types; all become ours
            raise StorageError(
                f"{op} {self.join(key)} failed after retries: {_first_line(exc)}"
            ) from exc

    def child(self, key: str) -> ObjectStoreLocation:
        return ObjectStoreLocation(
            self.join(key),
            storage_options=self.storage_options,
            _store=self.store,
            _stats=self.stats,
        )

    def zarr_store(self, key: str = "") -> Any:
        """An obstore store rooted at ``key`` (for ``zarr.storage.ObjectStore``)."""
        config, client, retry = _split_options(self.storage_options, self.scheme)
        return _store_from_url(self.join(key), config, client, retry)

    # --- metadata -------------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo:
        self.stats.add("head")
        meta = self._call("HEAD", key, lambda: self._obs.head(self.store, self._key(key)))
        return ObjectInfo(clean_key(key), int(meta["size"]), meta.get("e_tag"))

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except CheckpointNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = self._key(prefix)
        full = full + "/" if full else ""
        self.stats.add("list")

        def run() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            for chunk in self._obs.list(self.store, full or None, chunk_size=1000):
                for meta in chunk:
                    path = meta["path"]
                    if path.startswith(full):
                        out.append(
                            ObjectInfo(self._rel(path), int(meta["size"]), meta.get("e_tag"))
                        )
            return out

        return sorted(self._call("LIST", prefix, run), key=lambda o: o.key)

    def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[ObjectInfo]]:
        full = self._key(prefix)
        self.stats.add("list")
        res = self._call(
            "LIST", prefix, lambda: self._obs.list_with_delimiter(self.store, full or None)
        )
        dirs = sorted(self._rel(p.rstrip("/")) for p in res["common_prefixes"])
        objs = sorted(
            (
                ObjectInfo(self._rel(m["path"]), int(m["size"]), m.get("e_tag"))
                for m in res["objects"]
            ),
            key=lambda o: o.key,
        )
        return dirs, objs

    # --- reads ----------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        def run() -> bytes:
            return bytes(self._obs.get(self.store, self._key(key)).bytes())

        data = self._call("GET", key, run)
        self.stats.add("get", len(data))
        return data

    def read_ranges_into(  # noqa: C901 - split, fetch with resumes, and check, in one piece
        self,
        key: str,
        offsets: Sequence[int],
        outs: Sequence[memoryview | bytearray],
        *,
        part_size: int | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        part_size = self.read_part_size if part_size is None else part_size
        max_concurrency = max_concurrency or self.max_concurrency
        pieces: list[tuple[int, memoryview]] = []
        for offset, out in zip(offsets, outs, strict=True):
            view = memoryview(out).cast("B")
            step = part_size or max(1, view.nbytes)
            for start in range(0, view.nbytes, step):
                pieces.append((offset + start, view[start : start + step]))
        path = self._key(key)

        def fetch(piece: tuple[int, memoryview]) -> None:
            start, dest = piece
            n, done = dest.nbytes, 0
            for attempt in range(_STREAM_ATTEMPTS):  # a body cut mid-stream: fetch the rest
                try:
                    result = self._call(
                        "GET range",
                        key,
                        functools.partial(
                            self._obs.get, self.store, path,
                            options={"range": (start + done, start + n)},
                        ),
                    )
                    self.stats.add("get")
                    for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                        m = len(chunk)
                        if done + m > n:
                            break
                        dest[done : done + m] = memoryview(chunk).cast("B")
                        done += m
                        self.stats.add("bytes", m)
                    break
                except (CkptError, ValueError):
                    raise
                except Exception:  # noqa: BLE001 - a body cut mid-stream: retry from `done`
                    if attempt == _STREAM_ATTEMPTS - 1:
                        raise StorageError(
                            f"GET range {self.join(key)}: the response was cut off "
                            f"{_STREAM_ATTEMPTS} times (bytes {start}..{start + n})"
                        ) from None
            if done != n:
                raise CorruptCheckpointError(
                    f"{self.join(key)}: bytes {start}..{start + n} asked for, {done} returned"
                )

        if len(pieces) <= 1:
            for piece in pieces:
                fetch(piece)
            return
        with ThreadPoolExecutor(min(max_concurrency, len(pieces))) as pool:
            for fut in [pool.submit(fetch, p) for p in pieces]:
                fut.result()

    # --- writes ---------------------------------------------------------------------------
    def put(
        self, key: str, data: bytes | bytearray | memoryview, *, create_only: bool = False
    ) -> None:
        mode = "create" if create_only else "overwrite"
        payload = bytes(data)
        self._call(
            "PUT",
            key,
            lambda: self._obs.put(
                self.store, self._key(key), payload, mode=mode, use_multipart=False
            ),
        )
        self.stats.add("put", len(payload))

    def _open_writer(self, key: str, part_size: int, max_concurrency: int) -> ObjectWriter:
        return _ObjectStoreWriter(self, key, part_size, max_concurrency)

    # --- deletes --------------------------------------------------------------------------
    def delete(self, keys: str | Iterable[str]) -> None:
        paths = [self._key(k) for k in ([keys] if isinstance(keys, str) else keys)]
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            self.stats.add("delete")
            with contextlib.suppress(CheckpointNotFoundError):
                self._call("DELETE", batch[0], functools.partial(self._obs.delete, self.store, batch))


class _ObjectStoreWriter(ObjectWriter):
    """obstore's multipart writer: parts of ``part_size`` upload in the background,
    at most ``max_concurrency`` at once; ``write`` waits for capacity, so memory is bounded."""

    def __init__(
        self, loc: ObjectStoreLocation, key: str, part_size: int, concurrency: int
    ) -> None:
        super().__init__(loc.join(key))
        self._loc, self._key = loc, key
        self._w = loc._call(
            "open writer",
            key,
            lambda: loc._obs.open_writer(
                loc.store, loc._key(key), buffer_size=part_size, max_concurrency=concurrency
            ),
        )

    def _write(self, view: memoryview) -> None:
        try:
            # obstore may keep a reference to the buffer until the part is sent: hand it a
            # copy, so the caller may reuse its buffer as soon as write() returns.
            data = bytes(view)
            self._loc._call("upload", self._key, lambda: self._w.write(data))
        except BaseException:
            self._abort()
            raise
        self._loc.stats.add("upload", view.nbytes)

    def _close(self) -> None:
        try:
            self._loc._call("complete upload", self._key, self._w.close)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        # obstore aborts the multipart upload when its context exits with an exception.
        # Any error: the upload already failed, and nothing was published.
        with contextlib.suppress(Exception):
            self._w.__exit__(RuntimeError, RuntimeError("aborted"), None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
