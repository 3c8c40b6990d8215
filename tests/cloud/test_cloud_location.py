"""Object-store locations: URLs, credentials, endpoints, timeouts and the cloud extra.

What every location does (local, ``file://``, S3) is the LocationTests suite's
(tests/conformance/locations.py, run by tests/test_locations.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptvar as cv
from ckptvar.locations import (
    LocalLocation,
    ObjectStoreLocation,
    StorageError,
    is_url,
    open_location,
    split_url,
)

from ._s3 import S3Bucket


def test_parse_paths_and_urls(tmp_path: Path) -> None:
    assert (
        is_url("s3://b/k") and is_url("gs://b") and not is_url("rel/dir") and not is_url(tmp_path)
    )
    assert isinstance(open_location(tmp_path), LocalLocation)
    assert isinstance(open_location(f"file://{tmp_path}"), LocalLocation)
    remote = open_location("s3://bkt/run/", storage_options={"region": "us-east-1"})
    assert isinstance(remote, ObjectStoreLocation)
    assert remote.url == "s3://bkt/run" and remote.join("ckpt-3.h5") == "s3://bkt/run/ckpt-3.h5"
    assert isinstance(remote.url, str)
    parent, key = split_url("s3://bkt/run/ckpt-3.h5", storage_options={"region": "us-east-1"})
    assert (parent.url, key) == ("s3://bkt/run", "ckpt-3.h5")
    with pytest.raises(cv.UnsupportedFormatError, match="ftp://"):
        open_location("ftp://host/x")
    with pytest.raises(ValueError, match="'..'"):
        remote.join("a/../b")


def test_missing_bucket_and_bad_credentials_are_clear(s3: S3Bucket) -> None:
    missing = open_location("s3://no-such-bucket-here/x", storage_options=s3.storage_options)
    with pytest.raises(cv.CkptError, match="no-such-bucket-here"):
        missing.put("k", b"1")


def test_unreachable_endpoint_fails_within_timeout() -> None:
    import socket
    import time

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loc = open_location(
        "s3://b/x",
        storage_options={
            "endpoint": f"http://127.0.0.1:{port}",
            "access_key_id": "a",
            "secret_access_key": "b",
            "region": "us-east-1",
            "allow_http": "true",
            "connect_timeout": "2s",
            "max_retries": 1,
            "retry_timeout": 3,
            "init_backoff": 0.05,
        },
    )
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://b/x/k.*failed after retries"):
        loc.read("k")
    if time.monotonic() - t0 > 60:  # a hang guard, not a speed claim: the retry budget is 3 s
        pytest.fail("an unreachable endpoint kept the read waiting past its retry budget")


def test_credentials_and_endpoint_from_environment(s3: S3Bucket) -> None:
    """Without storage_options the standard AWS_* environment is used (a fresh process)."""
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    code = (
        "import sys\nfrom ckptvar.locations import open_location\n"
        "loc = open_location(sys.argv[1])\nloc.put('env.txt', b'from env')\n"
        "print(loc.read('env.txt').decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, f"{s3.url}/envtest"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "from env"
    assert s3.location("envtest").read("env.txt") == b"from env"


def test_without_the_cloud_extra_a_url_names_the_extra(tmp_path: Path) -> None:
    """A fresh process where obstore cannot be imported: the error names the extra."""
    blocker = tmp_path / "obstore"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('not installed')\n")
    code = (
        "from ckptvar.locations import open_location\n"
        "import ckptvar as cv\n"
        "try:\n    open_location('s3://b/k')\nexcept cv.CkptError as e:\n    print(e)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "pip install 'ckptvar[cloud]'" in out.stdout
