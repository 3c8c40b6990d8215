"""A server that stops answering (moto behind a proxy that holds a request, or passes a
response's headers and the start of its body and then goes silent): every call ends within
the configured timeouts with a ckptvar error naming the operation and the URL, never a hang,
and ``ckpt`` (a real subprocess) exits nonzero with that error."""

from __future__ import annotations

import subprocess
import sys

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
