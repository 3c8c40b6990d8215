"""What the caller passes in ``storage_options`` wins over the environment, for every key;
and checkpoints of empty values round-trip through an object store (local S3 server)."""

from __future__ import annotations

import numpy as np
import pytest

import ckptvar as cv

from ._s3 import S3Bucket

DEAD = "http://127.0.0.1:9"  # nothing listens there


@pytest.fixture
def hostile_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment pointing every S3 setting somewhere else (a dead port, wrong keys)."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, DEAD)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")


@pytest.mark.usefixtures("hostile_env")
@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_explicit_storage_options_beat_the_environment(s3: S3Bucket, ext: str) -> None:
    opts = {**s3.storage_options, "max_retries": 0, "retry_timeout": 5}
    url = f"{s3.url}/env/x.{ext}"
    assert cv.save(url, {"a": np.arange(3.0)}, storage_options=opts) == url
    assert cv.load(url, storage_options=opts)["a"].tolist() == [0.0, 1.0, 2.0]
    v = cv.Variable(np.ones(2), name="v")
    ckpt = cv.Checkpoint(v=v)
    step = ckpt.save(f"{s3.url}/env/run/ckpt", storage_options=opts, format=ext)
    ckpt.restore(step, storage_options=opts).assert_consumed()
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/env/m", storage_options=opts, format=ext)
    assert manager.save() is not None and manager.latest_checkpoint is not None


@pytest.mark.usefixtures("hostile_env")
def test_without_explicit_options_the_environment_is_used(s3: S3Bucket) -> None:
    """The environment still counts where the caller is silent (here: it is wrong)."""
    with pytest.raises((cv.CkptError, OSError)):
        cv.save(f"{s3.url}/env/y.h5", {"a": np.ones(1)},
                storage_options={"allow_http": True, "max_retries": 0, "retry_timeout": 2})


@pytest.mark.parametrize("pack", [None, 0, 1 << 20])
@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_empty_values_through_an_object_store(s3: S3Bucket, ext: str, pack: int | None) -> None:
    values = {"a": np.zeros((0,), np.float32), "b": np.zeros((2, 0), np.int8)}
    options = {} if pack is None else {"pack_threshold": pack}
    url = f"{s3.url}/empty-{pack}.{ext}"
    cv.save(url, values, storage_options=s3.storage_options, **options)
    got = cv.load(url, storage_options=s3.storage_options)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in values.items()}
