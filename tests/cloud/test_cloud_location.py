"""The Location layer on a local directory and on a real local S3 server (moto)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptvar as cv
from ckptvar.errors import CheckpointExistsError
from ckptvar.storage.location import (
    LocalLocation,
    Location,
    ObjectStoreLocation,
    StorageError,
    is_url,
    open_location,
    split_url,
)

from ._s3 import S3Bucket


@pytest.fixture(params=["local", "s3"])
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return LocalLocation(tmp_path / "root")
    return request.getfixturevalue("s3").location("root")


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


def test_put_stat_read_list_delete(loc: Location) -> None:
    loc.put("a/x.bin", b"hello world")
    loc.put("a/b/y.bin", b"12345")
    loc.put("z.bin", b"")
    assert loc.size("a/x.bin") == 11 and loc.exists("a/x.bin") and not loc.exists("a")
    assert loc.read("a/x.bin") == b"hello world"
    out = bytearray(5)
    loc.read_into("a/x.bin", 6, out)
    assert out == b"world"
    assert loc.read_ranges("a/x.bin", [(0, 5), (6, 5), (4, 0)]) == [b"hello", b"world", b""]
    assert [o.key for o in loc.list()] == ["a/b/y.bin", "a/x.bin", "z.bin"]
    assert [o.key for o in loc.list("a/")] == ["a/b/y.bin", "a/x.bin"]
    loc.put("ab.bin", b"not below a/")
    assert [o.key for o in loc.list("a")] == ["a/b/y.bin", "a/x.bin"]
    assert [o.key for o in loc.list("a/b")] == ["a/b/y.bin"]
    loc.delete("ab.bin")
    dirs, objs = loc.list_dir("a")
    assert dirs == ["a/b"] and [(o.key, o.size) for o in objs] == [("a/x.bin", 11)]
    assert loc.delete_prefix("a") == 2
    loc.delete(["z.bin", "never-existed"])
    assert loc.list() == []
    with pytest.raises(cv.CheckpointNotFoundError, match="x.bin"):
        loc.read("a/x.bin")
    with pytest.raises(cv.CheckpointNotFoundError):
        loc.stat("a/x.bin")


def test_short_range_is_corrupt_not_short(loc: Location) -> None:
    loc.put("k", b"0123456789")
    with pytest.raises(cv.CorruptCheckpointError, match="k"):
        loc.read_into("k", 8, bytearray(4))


def test_create_only_put(loc: Location) -> None:
    loc.put("m", b"first", create_only=True)
    with pytest.raises(CheckpointExistsError, match="m"):
        loc.put("m", b"second", create_only=True)
    assert loc.read("m") == b"first"
    assert isinstance(CheckpointExistsError("x"), cv.CkptError)


def test_streaming_writer_is_atomic_and_checksummed(loc: Location) -> None:
    import crc32c

    part = 5 * 1024 * 1024  # the S3 minimum part size
    payload = os.urandom(3 * part + 1234)
    with loc.open_writer("big.bin", part_size=part, max_concurrency=2) as w:
        for i in range(0, len(payload), 1 << 20):
            w.write(payload[i : i + (1 << 20)])
        assert not loc.exists("big.bin")  # nothing visible before close
    assert w.crc32c == crc32c.crc32c(payload) and w.bytes_written == len(payload)
    assert loc.size("big.bin") == len(payload)
    got = bytearray(len(payload))
    loc.read_into("big.bin", 0, got)
    assert got == payload
    # An exception inside the block aborts: nothing appears, an older object stays.
    with pytest.raises(RuntimeError), loc.open_writer("big.bin", part_size=part) as w2:
        w2.write(b"x" * (2 * part + 1))
        raise RuntimeError("stop")
    assert loc.size("big.bin") == len(payload)
    with pytest.raises(RuntimeError), loc.open_writer("new.bin", part_size=part) as w3:
        w3.write(b"y" * (2 * part + 1))
        raise RuntimeError("stop")
    assert not loc.exists("new.bin") and [o.key for o in loc.list()] == ["big.bin"]


def test_writer_copies_what_it_is_given(loc: Location) -> None:
    """A caller may reuse its buffer as soon as write() returns (as with any file)."""
    part = 5 * 1024 * 1024
    buf = bytearray(part)
    expected = bytearray()
    with loc.open_writer("reuse.bin", part_size=part, max_concurrency=4) as w:
        for i in range(4):
            buf[:] = bytes([i + 1]) * part
            w.write(buf)
            expected += buf
    got = bytearray(len(expected))
    loc.read_into("reuse.bin", 0, got)
    assert got == expected


def test_open_file_is_seekable(loc: Location) -> None:
    loc.put("f", bytes(range(256)) * 100)
    with loc.open_file("f", buffer_size=4096) as f:
        f.seek(1000)
        assert f.read(4) == bytes([1000 % 256, 1001 % 256, 1002 % 256, 1003 % 256])
        f.seek(-2, os.SEEK_END)
        assert f.read() == bytes([254, 255])


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
        "import sys\nfrom ckptvar.storage.location import open_location\n"
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
        "from ckptvar.storage.location import open_location\n"
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
