"""``ckpt`` (a real subprocess) on s3:// URLs with --storage-option: inspect, verify, ls,
diff, and convert both ways between local files and the local S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import ckptvar as cv

from ._s3 import S3Bucket


def _ckpt(s3: S3Bucket, *args: str) -> subprocess.CompletedProcess[str]:
    opts = [
        "--storage-option", f"endpoint={s3.endpoint}",
        "--storage-option", "access_key_id=testing",
        "--storage-option", "secret_access_key=testing",
        "--storage-option", "region=us-east-1",
        "--storage-option", "allow_http=true",
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "ckptvar", *args, *opts],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_ckpt_on_urls(s3: S3Bucket, tmp_path: Path) -> None:
    opts = s3.storage_options
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((300, 200)).astype(np.float32), "b": np.arange(5.0)}
    run = f"{s3.url}/run"
    for step in (1, 2):
        cv.save(f"{run}/ckpt-{step}.h5", arrays, storage_options=opts)

    res = _ckpt(s3, "inspect", f"{run}/ckpt-2.h5", "--json")
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert "s3://" in json.dumps(shown) and '"w"' in res.stdout and "300" in res.stdout

    res = _ckpt(s3, "verify", f"{run}/ckpt-1.h5")
    assert res.returncode == 0, res.stdout + res.stderr

    res = _ckpt(s3, "ls", run, "--json")
    assert res.returncode == 0, res.stderr
    listing = json.loads(res.stdout)
    assert [r["path"] for r in listing["checkpoints"]] == [f"{run}/ckpt-1.h5", f"{run}/ckpt-2.h5"]
    assert listing["latest"] == f"{run}/ckpt-2.h5"

    # local -> URL -> local, values unchanged; diff compares a local file with a URL.
    local = cv.save(tmp_path / "src.h5", arrays)
    res = _ckpt(s3, "convert", str(local), f"{s3.url}/conv/model.zarr")
    assert res.returncode == 0, res.stderr
    res = _ckpt(s3, "convert", f"{s3.url}/conv/model.zarr", str(tmp_path / "back.h5"))
    assert res.returncode == 0, res.stderr
    back = cv.load(tmp_path / "back.h5")
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
    res = _ckpt(s3, "diff", str(local), f"{s3.url}/conv/model.zarr")
    assert res.returncode == 0, res.stdout + res.stderr

    res = _ckpt(s3, "inspect", f"{run}/ckpt-7.h5")  # never committed
    assert res.returncode == 2 and "no commit marker" in res.stderr, res.stderr
