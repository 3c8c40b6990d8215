"""Helpers of the cloud tests: a bucket on the local S3 server, and a fault-injecting proxy.

The fixtures that use them are in ``conftest.py`` beside this file.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from ckptvar.locations import ObjectStoreLocation, open_location


def make_bucket(endpoint: str, name: str) -> None:
    """Create a bucket on the server (moto accepts unsigned requests)."""
    req = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def options_for(endpoint: str, **extra: Any) -> dict[str, Any]:
    """storage_options for the local server: endpoint, dummy keys, plain HTTP, short retries."""
    return {
        "endpoint": endpoint,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "region": "us-east-1",
        "allow_http": True,
        "timeout": "30s",
        "max_retries": 3,
        "retry_timeout": 20,
        "init_backoff": 0.05,
        "max_backoff": 0.5,
        **extra,
    }


@dataclass
class S3Bucket:
    endpoint: str
    name: str
    url: str
    storage_options: dict[str, Any]

    def location(self, sub: str = "", **extra: Any) -> ObjectStoreLocation:
        url = f"{self.url}/{sub}" if sub else self.url
        opts = {**self.storage_options, **extra}
        loc = open_location(url, storage_options=opts)
        assert isinstance(loc, ObjectStoreLocation)
        return loc


def own_bucket(endpoint: str, name: str) -> S3Bucket:
    """A new bucket ``name`` on the server, for a module's job of its own."""
    make_bucket(endpoint, name)
    return S3Bucket(endpoint, name, f"s3://{name}", options_for(endpoint))


def mpi_case(s3: S3Bucket, n: int, script: str, mode: str, url: str, *, timeout: float
             ) -> dict[int, dict[str, Any]]:
    """Run case ``mode`` of ``script`` (tests/mpi) on ``n`` processes against ``s3``
    (``$S3_OPTIONS``), with a hard timeout: what each rank reported for it."""
    from test_distributed_mpi import run_mpi  # noqa: PLC0415 - tests/ is on the path

    proc, got, _ = run_mpi(n, script, mode, url, timeout=timeout,
                           env={"S3_OPTIONS": json.dumps(s3.storage_options)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(got.get(mode, {})) == list(range(n)), (proc.stdout, proc.stderr)
    return got[mode]


class FaultProxy:
    """A real TCP proxy on 127.0.0.1 in front of the S3 server, counting bytes each way.

    ``break_after_upload(n)``: once ``n`` more bytes went client → server, every open
    connection is dropped and new ones are closed at once, until ``heal()``.
    ``drop_requests(pattern)``: the connection of a request whose bytes match the regular
    expression ``pattern`` is dropped (every such request, until ``heal()``).
    ``delay_requests(pattern, s)``: a request whose bytes match the regular expression
    ``pattern`` (say ``rb"^PUT \\S+\\.commit "``) is held ``s`` seconds before it goes on.
    ``stall_requests(pattern)``: such a request never reaches the server, and its connection
    stays open and silent, until ``heal()``.
    ``stall_responses(pattern, after)``: the response to such a request passes its first
    ``after`` bytes (its headers and the start of its body), then the connection stays open
    and silent, until ``heal()``.
    """

    def __init__(self, upstream: str) -> None:
        import socket
        import threading

        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._conns: list[Any] = []
        self.bytes_up = self.bytes_down = self.connections = 0
        #: HTTP GET requests seen going up (request lines starting ``GET /``).
        self.gets = 0
        self._budget: int | None = None
        self._once = False
        self._delay: tuple[bytes, float] | None = None
        self._drop: bytes | None = None
        self._stall_up: bytes | None = None
        self._stall_down: tuple[bytes, int] | None = None
        #: Set while nothing stalls; ``heal()`` and ``close()`` set it, releasing the stalls.
        self._flowing = threading.Event()
        self._flowing.set()
        #: Requests and responses held so far.
        self.stalls = 0
        self.drops = 0
        self.broken = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def reset_counts(self) -> None:
        with self._lock:
            self.bytes_up = self.bytes_down = self.connections = self.gets = 0

    def break_after_upload(self, nbytes: int, *, once: bool = False) -> None:
        """Drop connections once ``nbytes`` more went up; ``once``: drop one, then heal."""
        with self._lock:
            self._budget, self._once = nbytes, once

    def delay_requests(self, pattern: bytes, seconds: float) -> None:
        with self._lock:
            self._delay = (pattern, seconds)

    def drop_requests(self, pattern: bytes) -> None:
        with self._lock:
            self._drop = pattern

    def stall_requests(self, pattern: bytes) -> None:
        with self._lock:
            self._stall_up = pattern
            self._flowing.clear()

    def stall_responses(self, pattern: bytes, after: int) -> None:
        with self._lock:
            self._stall_down = (pattern, after)
            self._flowing.clear()

    def heal(self) -> None:
        with self._lock:
            self._budget, self.broken, self._drop = None, False, None
            self._stall_up = self._stall_down = None
            self._flowing.set()

    def close(self) -> None:
        self._flowing.set()
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            if self.broken:
                client.close()
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._conns += [client, server]
            # The response budget of this connection: bytes the server may still send before
            # the response stalls (None: no stall armed).
            budget: list[int | None] = [None]
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, budget),
                                 daemon=True).start()

    def _hold(self) -> None:
        with self._lock:
            self.stalls += 1
        self._flowing.wait()

    def _pump(self, src: Any, dst: Any, up: bool, budget: list[int | None]) -> None:
        try:
            while data := src.recv(1 << 16):
                drop = False
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                        self.gets += data.startswith(b"GET /") + data.count(b"\r\nGET /")
                        if self._budget is not None:
                            self._budget -= len(data)
                            if self._budget <= 0:
                                drop, self.drops = True, self.drops + 1
                                if self._once:
                                    self._budget = None
                                else:
                                    self.broken = True
                    else:
                        self.bytes_down += len(data)
                if up and self._drop is not None and re.search(self._drop, data, re.MULTILINE):
                    break
                if drop or self.broken:
                    break
                delay = self._delay
                if up and delay is not None and re.search(delay[0], data, re.MULTILINE):
                    time.sleep(delay[1])
                stall_up, stall_down = self._stall_up, self._stall_down
                if up and stall_up is not None and re.search(stall_up, data, re.MULTILINE):
                    self._hold()
                    break
                if up and stall_down is not None and re.search(stall_down[0], data, re.MULTILINE):
                    budget[0] = stall_down[1]
                left = budget[0]
                if not up and left is not None and self._stall_down is not None:
                    if len(data) > left:
                        dst.sendall(data[:left])
                        self._hold()
                        break
                    budget[0] = left - len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
            if self.broken:
                self._drop_all()
