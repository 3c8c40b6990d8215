"""Checkpoints at az:// URLs against a real local Azure Blob emulator (Azurite, in memory):
round trips in both formats through cv.save/load/open, Checkpoint.save and CheckpointManager,
lazy-read request and byte counts, the create-only commit marker and two writers racing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import (
    commit,
    latest_committed_step,
    list_committed_steps,
    marker_key,
    read_commit,
)

from ._emulators import AZURE_ACCOUNT, AZURE_KEY, CloudBucket

MiB = 1024 * 1024


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB: own array
        "dense/bias": rng.standard_normal(512),  # packed
        "step": np.array(7, dtype=np.int64),
    }


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_round_trip_through_the_public_functions(azure: CloudBucket, ext: str) -> None:
    arrays = _arrays()
    opts = azure.storage_options
    url = f"{azure.url}/run/ckpt-1.{ext}"
    assert cv.save(url, arrays, storage_options=opts, metadata={"epoch": 3}) == url
    assert list_committed_steps(azure.location("run")) == [f"ckpt-1.{ext}"]
    assert cv.list_variables(url, storage_options=opts) == [
        (k, v.shape, v.dtype) for k, v in arrays.items()
    ]
    loaded = cv.load(url, storage_options=opts)
    for k, v in arrays.items():
        np.testing.assert_array_equal(loaded[k], v)
    with cv.open(url, storage_options=opts) as reader:
        assert reader.metadata()["epoch"] == 3
        np.testing.assert_array_equal(reader["dense/kernel"][7:9], arrays["dense/kernel"][7:9])
        assert reader.verify_all() == []
    # A second save of the step is refused, and the first one's bytes stay.
    with pytest.raises(cv.CheckpointExistsError, match=r"ckpt-1\." + ext):
        cv.save(url, _arrays(1), storage_options=opts)
    np.testing.assert_array_equal(cv.load(url, storage_options=opts)["step"], arrays["step"])


def test_zarr_on_azure_is_plain_zarr(azure: CloudBucket) -> None:
    zarr = pytest.importorskip("zarr")
    arrays = _arrays(1)
    cv.save(f"{azure.url}/run/ckpt-2.zarr", arrays, storage_options=azure.storage_options)
    store = zarr.storage.ObjectStore(azure.location().zarr_store("run/ckpt-2.zarr"), read_only=True)
    group = zarr.open_group(store=store, mode="r")
    np.testing.assert_array_equal(np.asarray(group["dense/kernel"][...]), arrays["dense/kernel"])


def test_lazy_read_fetches_only_the_slice(azure: CloudBucket) -> None:
    """4 MiB of rows out of a 16 MiB value: requests and payload bytes at the layer."""
    big = np.arange(4 * MiB, dtype=np.float32).reshape(256, 16384)  # 16 MiB, 64 KiB rows
    url = f"{azure.url}/run/ckpt-1.h5"
    cv.save(url, {"w": big, "b": np.ones(4)}, storage_options=azure.storage_options)
    with cv.open(url, storage_options=azure.storage_options) as reader:
        lazy = reader["w"]
        stats = reader._fd.location.stats  # type: ignore[attr-defined]
        stats.reset()
        np.testing.assert_array_equal(lazy[100:164], big[100:164])  # 64 rows = 4 MiB
        assert stats.get_requests <= 3 and stats.bytes_read == 4 * MiB


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_manager_and_checkpoint_on_azure(azure: CloudBucket, fmt: str) -> None:
    opts = azure.storage_options
    v = cv.Variable(np.zeros((64, 32), np.float32), name="v")
    ckpt = cv.Checkpoint(v=v)
    run = f"{azure.url}/run"
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=2, format=fmt, storage_options=opts)
    saved = []
    for i in range(3):
        v.assign(np.full((64, 32), i, np.float32))
        saved.append(manager.save())
    assert saved == [f"{run}/ckpt-{i}.{fmt}" for i in range(1, 4)]
    assert manager.checkpoints == saved[1:]
    assert cv.latest_checkpoint(run, storage_options=opts) == saved[-1]
    loc = azure.location("run")
    assert list_committed_steps(loc) == [f"ckpt-2.{fmt}", f"ckpt-3.{fmt}"]
    assert not any(o.key.startswith("ckpt-1.") for o in loc.list())  # pruned: marker and data
    v.assign(np.zeros((64, 32), np.float32))
    ckpt.restore(saved[-1], storage_options=opts).assert_consumed()
    np.testing.assert_array_equal(v.numpy(), np.full((64, 32), 2.0, np.float32))
    # Checkpoint.save numbers its own steps under another prefix.
    path = ckpt.save(f"{azure.url}/other/ckpt", storage_options=opts)
    assert path.startswith(f"{azure.url}/other/ckpt-") and path.endswith(".h5")
    np.testing.assert_array_equal(cv.load(path, storage_options=opts)["v"], v.numpy())


def test_commit_marker_is_create_only(azure: CloudBucket) -> None:
    loc = azure.location("run")
    loc.put("ckpt-1.h5", b"data")
    commit(loc, "ckpt-1.h5", "crc32c:00000001")
    with pytest.raises(cv.CheckpointExistsError, match=r"ckpt-1\.h5"):
        commit(loc, "ckpt-1.h5", "crc32c:00000002")
    record = read_commit(loc, "ckpt-1.h5")
    assert record is not None and record.index_checksum == "crc32c:00000001"
    assert latest_committed_step(loc) == "ckpt-1.h5"


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_two_writers_race_for_one_step(azure: CloudBucket, ext: str) -> None:
    opts = azure.storage_options
    url = f"{azure.url}/run/ckpt-3.{ext}"
    barrier = threading.Barrier(2, timeout=30)
    results: dict[int, object] = {}

    def writer(i: int) -> None:
        arrays = {"w": np.full((256, 256), i, np.float32), "who": np.array(i)}
        barrier.wait()
        try:
            results[i] = cv.save(url, arrays, storage_options=opts)
        except cv.CheckpointExistsError as exc:
            results[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [i for i, r in results.items() if r == url]
    lost = [r for r in results.values() if isinstance(r, cv.CheckpointExistsError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "ckpt-3" in str(lost[0])
    loaded = cv.load(url, storage_options=opts)
    assert int(loaded["who"]) == won[0]
    np.testing.assert_array_equal(loaded["w"], np.full((256, 256), won[0], np.float32))
    loc = azure.location("run")
    assert loc.exists(marker_key(f"ckpt-3.{ext}"))
    record = read_commit(loc, f"ckpt-3.{ext}")
    assert record is not None
    if ext == "h5":  # the loser removed its own bytes
        kept = [f"ckpt-3.{ext}.commit", record.data, *([record.index] if record.index else [])]
        assert [o.key for o in loc.list()] == sorted(kept)


def test_configured_from_the_environment(
    azure: CloudBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No storage_options: account, key, endpoint and plain HTTP from the AZURE_* variables
    (AZURE_ALLOW_HTTP is read although ckptvar passes client options of its own)."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURE_KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azure.endpoint)
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    url = cv.save(f"{azure.url}/env/ckpt-1.h5", {"w": np.arange(6.0)})
    np.testing.assert_array_equal(cv.load(url)["w"], np.arange(6.0))
    assert cv.latest_checkpoint(f"{azure.url}/env") == url


def test_use_emulator_option(azure: CloudBucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """``use_emulator``: the development account and key, at AZURITE_BLOB_STORAGE_URL."""
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azure.endpoint.rsplit("/", 1)[0])
    opts = {"use_emulator": True, "timeout": "30s", "max_retries": 2, "retry_timeout": 10}
    url = cv.save(f"{azure.url}/emu/ckpt-1.zarr", {"w": np.arange(6.0)}, storage_options=opts)
    np.testing.assert_array_equal(cv.load(url, storage_options=opts)["w"], np.arange(6.0))
