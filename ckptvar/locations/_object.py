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
- ranged reads are planned as obstore's ``get_ranges`` plans them (ranges
  less than 1 MiB apart merged into one request; ``read_part_size`` > 0 also
  cuts them into requests of about that size), run ``max_concurrency`` at a
  time, and streamed 1 MiB at a time straight into the caller's buffers (or to a
  sink that hashes them): no response is ever buffered whole.

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
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import crc32c as _crc32c

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
)
from ._base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    Buffers,
    InvalidKeyError,
    Location,
    ObjectInfo,
    ObjectWriter,
    OnRange,
    Sink,
    StorageError,
    clean_key,
)
from ._options import split_options as _split_options
from ._ranges import COALESCE as _COALESCE
from ._ranges import MAX_REQUEST as _MAX_REQUEST
from ._ranges import Cursor as _Cursor
from ._ranges import RequestStats
from ._ranges import SinkError as _SinkError
from ._ranges import plan_requests as _plan_requests

__all__ = ["CLOUD_SCHEMES", "ObjectStoreLocation", "RequestStats"]

#: URL schemes served by obstore.
CLOUD_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure")

#: Writes: a "not found" answer to one means the bucket (not an object) is missing.
_WRITES = ("PUT", "upload")
#: What a missing bucket's error says, in obstore's message of a request with a body
#: (S3's error code, Azure's, GCS's message and its emulator's)
_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "bucket does not exist", "no bucket named")
_STREAM_CHUNK = 1024 * 1024
_STREAM_ATTEMPTS = 3
#: Parts in flight of a file upload (a save): 3 x 8 MiB, under 5% of a 1 GiB checkpoint.
_UPLOAD_CONCURRENCY = 3

T = TypeVar("T")


def _import_obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise CkptError(
            "reading or writing an object-store URL needs obstore: pip install 'ckptvar[cloud]'"
        ) from None
    return obstore


def _store_from_url(
    url: str, config: dict[str, Any], client: dict[str, Any], retry: dict[str, Any]
) -> Any:
    """An obstore store for ``url``. The option keys depend on the cloud, known only at run
    time, so obstore checks them (its typed overloads are per cloud)."""
    from obstore.store import S3Store, from_url

    scheme, _, rest = url.partition("://")
    if scheme in ("s3", "s3a"):  # S3Store takes every S3 key (from_url not aws_endpoint_url_s3)
        bucket, _, prefix = rest.partition("/")
        s3: Callable[..., Any] = S3Store
        return s3(bucket, prefix=prefix or None, config=config or None, client_options=client,
                  retry_config=retry)
    make: Callable[..., Any] = from_url
    return make(url, config=config or None, client_options=client, retry_config=retry)




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
        try:
            self.prefix = clean_key(parts.path)
        except InvalidKeyError as exc:
            raise InvalidKeyError(f"{url!r}: {exc}") from None
        self.storage_options = dict(storage_options or {})
        self.stats = _stats or RequestStats()
        opts = self.storage_options
        self.part_size = int(opts.get("part_size", DEFAULT_PART_SIZE))
        self.read_part_size = int(opts.get("read_part_size", 0))
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
        except (exc_mod.NotFoundError, FileNotFoundError) as exc:
            if op in _WRITES or _says_no_bucket(exc):
                raise StorageError(self._no_bucket(op, key)) from None
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
            if _says_no_bucket(exc):
                raise StorageError(self._no_bucket(op, key)) from None
            raise StorageError(
                f"{op} {self.join(key)} failed after retries: {_first_line(exc)}"
                + self._timed_out(exc, "; the server did not answer within the request's timeout")
                + _no_credentials(exc)
            ) from exc

    def check_bucket(self) -> None:
        """One listing of this location's prefix: a missing bucket is a ``StorageError``
        naming it (a read's not-found says only that the object is missing, where the
        answer has no body); any other failure of the listing leaves the caller's error."""
        exc_mod = self._obs.exceptions
        self.stats.add("list")
        try:
            self._obs.list_with_delimiter(self.store, self.prefix or None)
        except (exc_mod.NotFoundError, FileNotFoundError):
            raise StorageError(self._no_bucket("LIST", "")) from None
        except Exception as exc:  # noqa: BLE001 - only a missing bucket is said here
            if _says_no_bucket(exc):
                raise StorageError(self._no_bucket("LIST", "")) from None

    def _no_bucket(self, op: str, key: str) -> str:
        return (f"{op} {self.join(key)}: the bucket {self.bucket!r} does not exist at this "
                "endpoint: create it, or fix the URL or the endpoint in storage_options")

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

    def read_ranges_into(
        self, key: str, offsets: Sequence[int], outs: Buffers, *,
        part_size: int | None = None, max_concurrency: int | None = None,
        on_filled: OnRange = None,
    ) -> None:
        views = [memoryview(out).cast("B") for out in outs]
        split = self.read_part_size if part_size is None else part_size
        if split:  # cut long ranges, so that they are fetched by parallel requests
            offs: list[int] = []
            pieces: list[memoryview] = []
            owner: list[int] = []
            for i, (offset, view) in enumerate(zip(offsets, views, strict=True)):
                for start in range(0, view.nbytes, split):
                    offs.append(offset + start)
                    pieces.append(view[start : start + split])
                    owner.append(i)
        else:
            offs, pieces, owner = list(offsets), views, list(range(len(views)))
        left = [0] * len(views)
        for i in owner:
            left[i] += 1
        lock = threading.Lock()

        def sink(j: int, pos: int, chunk: memoryview) -> None:
            pieces[j][pos : pos + chunk.nbytes] = chunk

        def done(j: int) -> None:
            i = owner[j]
            with lock:
                left[i] -= 1
                last = left[i] == 0
            if last and on_filled is not None:
                on_filled(i)

        self.stream_ranges(
            key,
            offs,
            [p.nbytes for p in pieces],
            sink,
            on_done=done,
            split=split,
            max_concurrency=max_concurrency,
        )

    def stream_ranges(
        self, key: str, offsets: Sequence[int], lengths: Sequence[int], sink: Sink, *,
        on_done: OnRange = None, size: int | None = None, split: int | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        """Stream ranges to ``sink(i, position_in_range, chunk)``, in order within each range.

        The ranges are planned as obstore's ``get_ranges`` plans them: sorted, and
        merged into one request when less than ``_COALESCE`` apart; a request is cut
        only between ranges, once it reaches ``split`` bytes (``read_part_size``; 0:
        never) or ``_MAX_REQUEST``. Up to ``max_concurrency`` requests are in flight;
        each response is streamed ``_STREAM_CHUNK`` at a time straight to the sink
        (the bytes of gaps are dropped), so nothing is buffered whole. A response
        cut off mid-body is resumed from where it stopped. ``on_done(i)`` is called
        once range ``i`` is complete, on the thread that completed it. ``size``, the
        object's size when the caller knows it, lets a request that spans nearly all of
        it ask for the whole object (no ``Range``: some servers copy the range out).
        """
        split = self.read_part_size if split is None else split
        requests = _plan_requests(offsets, lengths, split or _MAX_REQUEST)
        path = self._key(key)

        def fetch(req: list[int]) -> None:
            cur = _Cursor(req, offsets, lengths, sink, on_done)
            if size is not None and cur.start < _COALESCE and cur.end > size - _COALESCE:
                cur.start = cur.pos = 0
                cur.whole = size
            self._fetch(key, path, cur)

        for j, n in enumerate(lengths):
            if n <= 0 and on_done is not None:
                on_done(j)
        if len(requests) <= 1:
            for req in requests:
                fetch(req)
            return
        workers = min(max_concurrency or self.max_concurrency, len(requests))
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(fetch, r) for r in requests]
        for fut in futures:
            fut.result()

    def _fetch(self, key: str, path: str, cur: _Cursor) -> None:
        """One request's bytes, streamed through ``cur``; a body cut off mid-stream is
        asked for again from where it stopped. An error of the sink ends the request."""
        last: Exception | None = None
        for attempt in range(_STREAM_ATTEMPTS):
            try:
                whole = cur.whole is not None and cur.pos == 0
                result = self._call(
                    "GET" if whole else "GET range",
                    key,
                    functools.partial(
                        self._obs.get,
                        self.store,
                        path,
                        options=None if whole else {"range": (cur.pos, cur.end)},
                    ),
                )
                self.stats.add("get")
                chunks = iter(result.stream(min_chunk_size=_STREAM_CHUNK))
                while cur.pos < cur.end and (raw := next(chunks, None)) is not None:
                    self.stats.add("bytes", cur.feed(memoryview(raw).cast("B")))
                break
            except _SinkError as exc:
                raise exc.__cause__ from None  # type: ignore[misc]
            except CkptError:
                raise
            except Exception as exc:  # noqa: BLE001 - a body cut mid-stream: resume from `pos`
                last = exc
                if attempt == _STREAM_ATTEMPTS - 1:
                    raise StorageError(
                        f"GET range {self.join(key)}: the response was cut off "
                        f"{_STREAM_ATTEMPTS} times (bytes {cur.start}..{cur.end}){self._why(last)}"
                    ) from None
        if cur.pos != cur.end:
            raise CorruptCheckpointError(
                f"{self.join(key)}: bytes {cur.start}..{cur.end} asked for, "
                f"{cur.pos - cur.start} returned (the object ends at {cur.pos})"
            )

    def _why(self, exc: BaseException) -> str:
        """What a cut-off response's last error says, where it says more than "cut off": the
        server stopped sending, and the request ran past its ``timeout``."""
        said = self._timed_out(exc, "; the server stopped sending and each try timed out")
        return said or f"; last: {_first_line(exc)}"

    def _timed_out(self, exc: BaseException, what: str) -> str:
        """``what``, naming the ``timeout`` setting, when ``exc`` is a request that ran past
        it (obstore says so only below its first line); else nothing."""
        text = str(exc)
        if "TimedOut" in text or "kind: Timeout" in text:
            timeout = _split_options(self.storage_options, self.scheme)[1]["timeout"]
            return f"{what} (storage_options timeout: {timeout})"
        return ""

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

    def upload_file(self, local_path: str, key: str, *, part_size: int | None = None) -> int:
        """Stream a local file up: each part read into bytes of its own and handed over
        without a copy, ``_UPLOAD_CONCURRENCY`` parts in flight (memory: about
        ``(_UPLOAD_CONCURRENCY + 1) * part_size``). Returns the file's CRC-32C."""
        part = part_size or self.part_size
        writer = _ObjectStoreWriter(self, key, part, min(self.max_concurrency, _UPLOAD_CONCURRENCY))
        with open(local_path, "rb", buffering=0) as src, writer:
            while data := src.read(part):
                writer.write_owned(data)
        return writer.crc32c

    def copy(self, source: str, key: str) -> None:
        """A server-side copy (S3 ``CopyObject``: up to 5 GiB an object): no byte of it
        passes through this process."""
        self._call("COPY", source,
                   lambda: self._obs.copy(self.store, self._key(source), self._key(key)))
        self.stats.add("copy")

    # --- deletes --------------------------------------------------------------------------
    def delete(self, keys: str | Iterable[str]) -> None:
        paths = [self._key(k) for k in ([keys] if isinstance(keys, str) else keys)]
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            self.stats.add("delete")
            op = "DELETE" if len(batch) == 1 else f"DELETE of {len(batch)} objects, from"
            with contextlib.suppress(CheckpointNotFoundError):
                self._call(op, self._rel(batch[0]),
                           functools.partial(self._obs.delete, self.store, batch))


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

    def write_owned(self, data: bytes) -> None:
        """``write`` of bytes nobody else holds: handed to obstore as they are, no copy."""
        if self.closed:
            raise ValueError(f"write to a closed writer for {self.url}")
        try:
            self._loc._call("upload", self._key, lambda: self._w.write(data))
        except BaseException:
            self._abort()
            raise
        self._loc.stats.add("upload", len(data))
        self.bytes_written += len(data)
        self.crc32c = _crc32c.crc32c(data, self.crc32c)

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


def _says_no_bucket(exc: BaseException) -> bool:
    """Whether an error's message says its bucket does not exist (:data:`_NO_BUCKET`)."""
    text = str(exc)
    return any(sign in text for sign in _NO_BUCKET)


def _no_credentials(exc: BaseException) -> str:
    """What to do, when the S3 client found no credentials and asked the EC2 instance
    metadata service for some, in vain (off EC2: refused, or no route); else nothing."""
    text = _first_line(exc)
    if "/latest/api/token" in text or "/latest/meta-data/" in text:
        return ("; no credentials were found (the client asked the EC2 instance metadata "
                "service): give access_key_id and secret_access_key in storage_options, or "
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
