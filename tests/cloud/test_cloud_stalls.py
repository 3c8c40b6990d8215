"""A server that stops answering (moto behind a proxy that holds a request, or passes a
response's headers and the start of its body and then goes silent): every call kind (the
parts of a multipart upload and its completion, the index and the marker, a server-side
copy, a listing, a head, a delete, a ranged read) ends within the configured timeouts with
a ckptvar error naming the operation and the URL, never a hang, and nothing is committed;
``ckpt`` (a real subprocess, guarded by a subprocess timeout) exits 2 with that error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

from ._s3 import FaultProxy, S3Bucket

#: Client settings of a stalled server's tests: a short timeout, one try per request.
QUICK = {"timeout": "1s", "connect_timeout": "1s", "max_retries": 0, "retry_timeout": 2}
#: The subprocess timeout of a ``ckpt`` run: the test's guard against a hang.
GUARD = 60


def _ckpt(s3: S3Bucket, proxy: FaultProxy, *args: str) -> subprocess.CompletedProcess[str]:
    opts = {"endpoint": proxy.endpoint, "access_key_id": "testing",
            "secret_access_key": "testing", "region": "us-east-1", "allow_http": "true",
            **QUICK}
    so = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]
    return subprocess.run([sys.executable, "-m", "ckptvar", *args, *so], capture_output=True,
                          text=True, timeout=GUARD, check=False)


@pytest.mark.slow
def test_ckpt_verify_of_a_stalled_read_is_an_error_not_damage(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """A read whose body stalls said ``DAMAGED w: cannot be read`` and ``FAILED: 1 of 1
    values damaged`` (exit 1), calling an intact checkpoint damaged; now ``ckpt verify``
    ends with the storage error (exit 2)."""
    url = cv.save(f"{s3.url}/run/ckpt-1.h5", {"w": np.arange(1 << 18, dtype=np.float64)},
                  storage_options=s3.storage_options)
    proxy.stall_responses(rb"^GET \S+\.data ", 64 * 1024)
    res = _ckpt(s3, proxy, "verify", url)
    assert proxy.stalls, "the read never stalled"
    assert res.returncode == 2, res.stdout + res.stderr
    assert "DAMAGED" not in res.stdout, res.stdout
    assert res.stderr.startswith("ckpt: error: GET range ") and url in res.stderr, res.stderr


def test_a_ranged_read_whose_body_stalls_says_it_timed_out(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """A partial read (a ranged GET) whose response sends its headers and the start of its
    body, then nothing: it said only that the response 'was cut off 3 times', as if the
    server had closed it; now the error says each try timed out, and after which setting."""
    w = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
    url = cv.save(f"{s3.url}/run/ckpt-1.h5", {"w": w}, storage_options=s3.storage_options)
    reader = cv.open(url, storage_options={**s3.storage_options, "endpoint": proxy.endpoint,
                                           "timeout": "0.3s", "max_retries": 0})
    proxy.stall_responses(rb"^GET \S+\.data ", 64 * 1024)
    with reader, pytest.raises(cv.CkptError) as err:
        reader["w"][1000:200_000]
    assert proxy.stalls
    text = str(err.value)
    assert text.startswith(f"GET range {s3.url}/run/ckpt-1.h5.") and ".data" in text, text
    assert "timed out" in text and "timeout" in text and "0.3s" in text, text


def _quick(s3: S3Bucket, proxy: FaultProxy) -> dict[str, object]:
    # 1 s: the calls before the stalled one must not time out on a loaded machine (at
    # 0.3 s one did, under a load of 15 on 2 cores, and the stalled call was never made)
    return {**s3.storage_options, "endpoint": proxy.endpoint, "timeout": "1s",
            "connect_timeout": "1s", "max_retries": 0, "retry_timeout": 2}


#: Each kind of object-store call, held by the proxy: (request pattern, operation named).
#: (A part uploads in the background: its failure is met when the upload completes.)
SAVE_CALLS = {
    "multipart create": (rb"^POST \S+\?uploads", "upload"),
    "multipart part": (rb"^PUT \S+partNumber=", "complete upload"),
    "multipart complete": (rb"^POST \S+uploadId=", "complete upload"),
    "index put": (rb"^PUT \S+\.index ", "PUT"),
    "commit marker": (rb"^PUT \S+\.commit ", "PUT"),
}


@pytest.mark.parametrize("call", list(SAVE_CALLS))
def test_a_save_whose_call_stalls_raises_and_commits_nothing(
    s3: S3Bucket, proxy: FaultProxy, call: str
) -> None:
    pattern, op = SAVE_CALLS[call]
    first = cv.save(f"{s3.url}/run/ckpt-1.h5", {"w": np.zeros(3)},
                    storage_options=s3.storage_options)
    proxy.stall_requests(pattern)
    # 9 MiB: more than one part of 8 MiB, so the upload is multipart
    with pytest.raises(cv.CkptError) as err:
        cv.save(f"{s3.url}/run/ckpt-2.h5", {"w": np.ones(9 << 17)},
                storage_options=_quick(s3, proxy))
    assert proxy.stalls, "nothing stalled"
    proxy.heal()
    assert str(err.value).startswith(f"{op} {s3.url}/run/ckpt-2.h5."), err.value
    assert cv.latest_checkpoint(f"{s3.url}/run", storage_options=s3.storage_options) == first


def test_an_incremental_steps_server_side_copy_that_stalls_raises(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    frozen = cv.Variable(np.arange(1 << 16, dtype=np.float32), name="frozen")
    head = cv.Variable(np.zeros(4, np.float32), name="head")
    mgr = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), f"{s3.url}/run",
                               max_to_keep=2, format="zarr", incremental=True,
                               pack_threshold=0, storage_options=_quick(s3, proxy))
    first = mgr.save()
    head.assign_add(1.0)
    proxy.stall_requests(rb"(?i)^x-amz-copy-source:")  # the copy's header
    with pytest.raises(cv.CkptError) as err:
        mgr.save()
    assert proxy.stalls, "nothing stalled"
    proxy.heal()
    assert str(err.value).startswith(f"COPY {s3.url}/run/ckpt-1.zarr/frozen/"), err.value
    assert cv.latest_checkpoint(f"{s3.url}/run", storage_options=s3.storage_options) == first


@pytest.mark.parametrize("call", ["list", "head", "delete"])
def test_a_listing_head_or_delete_that_stalls_raises_naming_it(
    s3: S3Bucket, proxy: FaultProxy, call: str
) -> None:
    run = s3.location("run", **_quick(s3, proxy))
    run.put("ckpt-1.h5.abc.data", b"x")
    pattern = {"list": rb"^GET /\S+\?\S*list-type", "head": rb"^HEAD ",
               "delete": rb"^DELETE |^POST \S+\?delete"}[call]
    proxy.stall_requests(pattern)
    with pytest.raises(cv.CkptError) as err:
        if call == "list":
            cv.checkpoint.gc(f"{s3.url}/run", storage_options=_quick(s3, proxy))
        elif call == "head":
            run.stat("ckpt-1.h5.abc.data")
        else:
            run.delete(["ckpt-1.h5.abc.data"])
    assert proxy.stalls, "nothing stalled"
    op = {"list": "LIST", "head": "HEAD", "delete": "DELETE"}[call]
    assert str(err.value).startswith(f"{op} {s3.url}/run"), err.value


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc", "convert-from",
                                     "convert-to"])
def test_ckpt_against_a_stalled_server_ends_with_an_error(
    s3: S3Bucket, proxy: FaultProxy, command: str, tmp_path: Path
) -> None:
    url = cv.save(f"{s3.url}/run/ckpt-1.h5", {"w": np.arange(6.0)},
                  storage_options=s3.storage_options)
    local = cv.save(tmp_path / "src.h5", {"w": np.arange(6.0)})
    args = {"ls": ["ls", f"{s3.url}/run"], "inspect": ["inspect", url],
            "verify": ["verify", url], "gc": ["gc", f"{s3.url}/run"],
            "convert-from": ["convert", url, str(tmp_path / "out.h5")],
            "convert-to": ["convert", str(local), f"{s3.url}/conv/model.zarr"]}[command]
    proxy.stall_requests(rb"^(GET|HEAD|PUT|POST|DELETE) ")  # every request, held
    res = _ckpt(s3, proxy, *args)  # (GUARD: a hang fails the test)
    assert proxy.stalls, "nothing stalled"
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("ckpt: error: ") and f"{s3.url}/" in res.stderr, res.stderr
    assert "failed after retries" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out.h5").exists()


def test_a_compressed_zarr_value_whose_read_stalls_is_a_storage_error_not_damage(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """A value stored as a Zarr array of its own (a compressed step), read through
    zarr-python: a read the server never answered said 'value 'w' cannot be decoded
    (GenericError: ...)', a CorruptCheckpointError calling an intact checkpoint damaged;
    now the read (and a verify) raises the storage error naming the GET and the object."""
    w = np.arange(1 << 14, dtype=np.float64)
    url = cv.save(f"{s3.url}/run/ckpt-1.zarr", {"w": w}, compression="zstd",
                  storage_options=s3.storage_options)
    reader = cv.open(url, storage_options=_quick(s3, proxy))
    with reader:
        proxy.stall_requests(rb"^GET \S+/w/c")
        for read in (lambda: reader["w"][...], reader.verify_all):
            with pytest.raises(cv.CkptError) as err:
                read()
            assert not isinstance(err.value, cv.CorruptCheckpointError), err.value
            assert isinstance(err.value, OSError), err.value
            assert str(err.value).startswith(f"GET {url}/w/c"), err.value
        assert proxy.stalls, "nothing stalled"
        proxy.heal()
        np.testing.assert_array_equal(reader["w"][...], w)


def test_a_compressed_zarr_value_whose_chunk_is_garbage_is_damage(s3: S3Bucket) -> None:
    url = cv.save(f"{s3.url}/run/ckpt-1.zarr", {"w": np.arange(1 << 14, dtype=np.float64)},
                  compression="zstd", storage_options=s3.storage_options)
    run = s3.location("run")
    for obj in run.list("ckpt-1.zarr/w"):
        if not obj.key.endswith("zarr.json"):
            run.put(obj.key, b"not zstd")
    with cv.open(url, storage_options=s3.storage_options) as reader:
        assert [k for k, _ in reader.verify_all()] == ["w"]
        with pytest.raises(cv.CorruptCheckpointError, match="'w' cannot be decoded"):
            reader["w"][...]


def test_a_compressed_zarr_value_whose_chunks_are_gone_says_so(s3: S3Bucket) -> None:
    """Its chunk objects deleted: the read said only that the value fails its checksum
    (zarr-python fills a missing chunk); now it says the chunk objects are lost."""
    url = cv.save(f"{s3.url}/run/ckpt-1.zarr", {"w": np.arange(1 << 14, dtype=np.float64)},
                  compression="zstd", storage_options=s3.storage_options)
    run = s3.location("run")
    run.delete([o.key for o in run.list("ckpt-1.zarr/w") if not o.key.endswith("zarr.json")])
    with cv.open(url, storage_options=s3.storage_options) as reader, pytest.raises(
            cv.CorruptCheckpointError, match="'w' has lost its chunk objects under 'w'"):
        reader["w"][...]
