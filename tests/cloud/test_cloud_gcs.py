"""Checkpoints at gs:// URLs against a real local GCS emulator (fake-gcs-server, in memory).

fake-gcs-server serves the reads obstore's GCS client sends (GET with ranges, HEAD, XML
listing, DELETE) but not its writes: obstore puts objects with the XML API's plain
``PUT /bucket/key`` and XML multipart uploads, which fake-gcs-server answers with
``400 invalid uploadType`` (fsouza/fake-gcs-server#1164). So the steps here are committed
on a local directory with the same protocol and copied into the bucket through the JSON
API's media upload, and every ckptvar read, list and delete then runs over gs:// for real;
a write through gs:// is tested to fail clearly, leaving nothing committed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import (
    LocalLocation,
    StorageError,
    clean_uncommitted,
    latest_committed_step,
    list_committed_steps,
    prune,
    upload_step,
)

from ._emulators import CloudBucket, gcs_upload

MiB = 1024 * 1024


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB: own array
        "dense/bias": rng.standard_normal(512),  # packed
        "step": np.array(7, dtype=np.int64),
    }


def _commit_and_copy(
    gcs: CloudBucket, stage: Path, locals_: dict[str, Path | str], prefix: str = "run"
) -> None:
    """Commit each local checkpoint as a step on the directory ``stage`` (data, then the
    create-only marker), then copy every file of it into the bucket below ``prefix``: what
    a save to gs:// would have left there."""
    for step, local in locals_.items():
        upload_step(LocalLocation(stage), local, step)
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(stage).as_posix()}"
        gcs_upload(gcs.endpoint, gcs.name, key, path.read_bytes())


def _stage_steps(gcs: CloudBucket, tmp_path: Path, steps: dict[str, dict[str, np.ndarray]]) -> None:
    """Save each step's arrays locally, then :func:`_commit_and_copy` them below run/."""
    locals_ = {step: cv.save(tmp_path / "local" / step, a) for step, a in steps.items()}
    _commit_and_copy(gcs, tmp_path / "stage", locals_)


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_committed_checkpoints_read_back_over_gs(
    gcs: CloudBucket, tmp_path: Path, ext: str
) -> None:
    arrays = {1: _arrays(1), 2: _arrays(2)}
    _stage_steps(gcs, tmp_path, {f"ckpt-{i}.{ext}": a for i, a in arrays.items()})
    opts = gcs.storage_options
    run = f"{gcs.url}/run"
    url = f"{run}/ckpt-2.{ext}"
    assert list_committed_steps(gcs.location("run")) == [f"ckpt-1.{ext}", f"ckpt-2.{ext}"]
    assert cv.latest_checkpoint(run, storage_options=opts) == url
    assert cv.list_variables(url, storage_options=opts) == [
        (k, v.shape, v.dtype) for k, v in arrays[2].items()
    ]
    loaded = cv.load(url, storage_options=opts)
    for k, v in arrays[2].items():
        np.testing.assert_array_equal(loaded[k], v)
    np.testing.assert_array_equal(
        cv.load_variable(f"{run}/ckpt-1.{ext}", "dense/bias", storage_options=opts),
        arrays[1]["dense/bias"],
    )
    with cv.open(url, storage_options=opts) as reader:
        np.testing.assert_array_equal(reader["dense/kernel"][7:9], arrays[2]["dense/kernel"][7:9])
        assert reader.verify_all() == []


def test_lazy_read_fetches_only_the_slice(gcs: CloudBucket, tmp_path: Path) -> None:
    """4 MiB of rows out of a 16 MiB value: requests and payload bytes at the layer."""
    big = np.arange(4 * MiB, dtype=np.float32).reshape(256, 16384)  # 16 MiB, 64 KiB rows
    _stage_steps(gcs, tmp_path, {"ckpt-1.h5": {"w": big, "b": np.ones(4)}})
    with cv.open(f"{gcs.url}/run/ckpt-1.h5", storage_options=gcs.storage_options) as reader:
        lazy = reader["w"]
        stats = reader._fd.location.stats  # type: ignore[attr-defined]
        stats.reset()
        np.testing.assert_array_equal(lazy[100:164], big[100:164])  # 64 rows = 4 MiB
        assert stats.get_requests <= 3 and stats.bytes_read == 4 * MiB


def test_zarr_on_gcs_is_plain_zarr(gcs: CloudBucket, tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    arrays = _arrays(3)
    _stage_steps(gcs, tmp_path, {"ckpt-4.zarr": arrays})
    store = zarr.storage.ObjectStore(gcs.location().zarr_store("run/ckpt-4.zarr"), read_only=True)
    group = zarr.open_group(store=store, mode="r")
    np.testing.assert_array_equal(np.asarray(group["dense/kernel"][...]), arrays["dense/kernel"])


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_manager_restores_from_gs_and_cleans_leftovers(
    gcs: CloudBucket, tmp_path: Path, fmt: str
) -> None:
    v = cv.Variable(np.zeros((64, 32), np.float32), name="v")
    ckpt = cv.Checkpoint(v=v)
    written: dict[str, Path | str] = {}
    for i in (1, 2):
        v.assign(np.full((64, 32), i, np.float32))
        written[f"ckpt-{i}.{fmt}"] = ckpt.write(str(tmp_path / "written" / f"ckpt-{i}.{fmt}"))
    _commit_and_copy(gcs, tmp_path / "stage", written)
    # A failed save's leftover below the latest committed step, and a newer one in flight.
    gcs_upload(gcs.endpoint, gcs.name, "run/ckpt-0.h5.x.data", b"partial")
    gcs_upload(gcs.endpoint, gcs.name, "run/ckpt-9.h5.y.data", b"in flight")
    opts = gcs.storage_options
    run = f"{gcs.url}/run"
    fresh = cv.Variable(np.zeros((64, 32), np.float32), name="v")
    manager = cv.CheckpointManager(cv.Checkpoint(v=fresh), run, format=fmt, storage_options=opts)
    assert manager.checkpoints == [f"{run}/ckpt-1.{fmt}", f"{run}/ckpt-2.{fmt}"]
    assert manager.restore_or_initialize() == f"{run}/ckpt-2.{fmt}"
    np.testing.assert_array_equal(fresh.numpy(), np.full((64, 32), 2.0, np.float32))
    keys = [o.key for o in gcs.location("run").list()]
    assert "ckpt-0.h5.x.data" not in keys and "ckpt-9.h5.y.data" in keys


def test_prune_and_uncommitted_steps_over_gs(gcs: CloudBucket, tmp_path: Path) -> None:
    _stage_steps(gcs, tmp_path, {"ckpt-1.h5": _arrays(1), "ckpt-2.h5": _arrays(2)})
    loc = gcs.location("run")
    gcs_upload(gcs.endpoint, gcs.name, "run/ckpt-3.h5", b"data whose marker never came")
    with pytest.raises(cv.CheckpointNotFoundError, match="no commit marker"):
        cv.load(f"{gcs.url}/run/ckpt-3.h5", storage_options=gcs.storage_options)
    prune(loc, "ckpt-2.h5")  # marker first, then the data
    assert list_committed_steps(loc) == ["ckpt-1.h5"] == [latest_committed_step(loc)]
    assert not any(o.key.startswith("ckpt-2.") for o in loc.list())
    # ckpt-3 is newer than the latest committed step: a save in flight, never cleaned.
    assert clean_uncommitted(loc) == [] and loc.exists("ckpt-3.h5")


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_a_write_refused_by_the_emulator_fails_clearly(gcs: CloudBucket, ext: str) -> None:
    """fake-gcs-server rejects obstore's XML API PUT (a 400, not retried): the save raises
    StorageError naming the URL and the server's answer, and no step is committed."""
    url = f"{gcs.url}/run/ckpt-1.{ext}"
    with pytest.raises(StorageError, match=r"gs://.*/run/ckpt-1\." + ext) as err:
        cv.save(url, _arrays(), storage_options=gcs.storage_options)
    assert "400" in str(err.value)
    assert list_committed_steps(gcs.location("run")) == []


def test_configured_from_the_environment(
    gcs: CloudBucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No storage_options: the service-account key and plain HTTP from the GOOGLE_* variables
    (GOOGLE_ALLOW_HTTP is read although ckptvar passes client options of its own)."""
    _stage_steps(gcs, tmp_path, {"ckpt-1.h5": _arrays(5)})
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", gcs.storage_options["service_account_key"])
    monkeypatch.setenv("GOOGLE_ALLOW_HTTP", "true")
    url = f"{gcs.url}/run/ckpt-1.h5"
    assert cv.latest_checkpoint(f"{gcs.url}/run") == url
    np.testing.assert_array_equal(cv.load(url)["dense/bias"], _arrays(5)["dense/bias"])


def test_a_read_from_a_bucket_that_does_not_exist_names_the_bucket(gcs: CloudBucket) -> None:
    """A read's not-found said "no committed checkpoint" of a bucket that is not there;
    now the bucket is named as missing, as a save names it."""
    opts = gcs.storage_options
    url = "gs://no-such-bucket-here/run"
    calls = [lambda: cv.load(f"{url}/ckpt-1.h5", storage_options=opts),
             lambda: cv.open(f"{url}/x", storage_options=opts),
             lambda: cv.latest_checkpoint(url, storage_options=opts)]
    for call in calls:
        with pytest.raises(StorageError) as err:
            call()
        assert "bucket 'no-such-bucket-here' does not exist" in str(err.value), err.value
    # a bucket that is there, without the step: still "no committed checkpoint"
    with pytest.raises(cv.CheckpointNotFoundError, match="No committed checkpoint"):
        cv.load(f"{gcs.url}/run/ckpt-1.h5", storage_options=opts)
