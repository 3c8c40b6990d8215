"""Real ckptvar checkpoints on a real local S3 server (moto): HDF5 streamed up and read
back by ranged GETs, Zarr v3 read by plain zarr, lazy-read byte counts, injected faults."""

from __future__ import annotations

from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckptvar.errors import CheckpointExistsError
from ckptvar.locations import (
    ObjectStoreLocation,
    StorageError,
    commit,
    is_committed,
    latest_committed_step,
    list_committed_steps,
    marker_key,
    read_commit,
    upload_step,
)
from ckptvar.storage.checksum import value_checksum

from ._s3 import FaultProxy, S3Bucket

MiB = 1024 * 1024


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((256, 512)).astype(np.float32),
        "dense/bias": rng.standard_normal(512),
        "step": np.array(7, dtype=np.int64),
    }


def test_hdf5_streamed_up_and_read_back_by_ranges(s3: S3Bucket, tmp_path: Path) -> None:
    arrays = _arrays()
    local = cv.save(tmp_path / "ckpt-1.h5", arrays, pack_threshold=0)
    loc = s3.location("run")
    record = upload_step(loc, local, "ckpt-1.h5", part_size=5 * MiB)
    assert record.index_checksum == f"bytes-crc32c:{crc32c.crc32c(Path(local).read_bytes()):08x}"
    assert list_committed_steps(loc) == ["ckpt-1.h5"] and is_committed(loc, "ckpt-1.h5")

    # ckptvar-style read: offsets from the file's metadata, values by one ranged GET each,
    # checked against the checksum stored beside each value.
    with h5py.File(local, "r") as f:
        layout = {
            k: (f[k].id.get_offset(), f[k].dtype, f[k].shape, int(f[k].attrs["checksum"]))
            for k in arrays
        }
    for key, (offset, dtype, shape, checksum) in layout.items():
        out = np.empty(shape, dtype)
        loc.read_into("ckpt-1.h5", offset, memoryview(out).cast("B"))
        assert value_checksum(key, out.dtype.name, shape, out) == checksum
        np.testing.assert_array_equal(out, arrays[key])

    # h5py on the ranged file object: plain HDF5 readers work too.
    with loc.open_file("ckpt-1.h5") as fobj, h5py.File(fobj, "r") as f:
        np.testing.assert_array_equal(f["dense/kernel"][10:20], arrays["dense/kernel"][10:20])


def test_zarr_checkpoint_readable_by_plain_zarr(s3: S3Bucket, tmp_path: Path) -> None:
    from obstore.store import S3Store

    arrays = _arrays(1)
    local = cv.save(tmp_path / "ckpt-2.zarr", arrays, pack_threshold=0)
    loc = s3.location("run")
    upload_step(loc, local, "ckpt-2.zarr")
    assert latest_committed_step(loc) == "ckpt-2.zarr"
    opts = s3.storage_options
    store = S3Store(
        s3.name,
        prefix="run/ckpt-2.zarr",
        endpoint=opts["endpoint"],
        access_key_id="testing",
        secret_access_key="testing",
        region="us-east-1",
        client_options={"allow_http": True},
    )
    group = zarr.open_group(zarr.storage.ObjectStore(store, read_only=True), mode="r")
    for key, value in arrays.items():
        np.testing.assert_array_equal(group[key][...], value)


def test_lazy_16mib_read_of_a_large_object(s3: S3Bucket, proxy: FaultProxy) -> None:
    """16 MiB out of 64 MiB: bytes counted by a real TCP proxy, requests at the layer."""
    big = np.arange(64 * MiB // 8, dtype=np.int64)
    direct = s3.location()
    with direct.open_writer("big.bin", part_size=16 * MiB) as w:
        w.write(memoryview(big).cast("B"))
    via_proxy = s3.location(endpoint=proxy.endpoint)
    assert via_proxy.size("big.bin") == big.nbytes
    proxy.reset_counts()
    via_proxy.stats.reset()
    out = np.empty(16 * MiB // 8, dtype=np.int64)
    via_proxy.read_into("big.bin", 20 * MiB, memoryview(out).cast("B"))
    np.testing.assert_array_equal(out, big[20 * MiB // 8 : 36 * MiB // 8])
    assert via_proxy.stats.get_requests <= 3 and via_proxy.stats.bytes_read == 16 * MiB
    assert 16 * MiB < proxy.bytes_down <= 17 * MiB, proxy.bytes_down


def test_dropped_connection_is_retried(s3: S3Bucket, proxy: FaultProxy, tmp_path: Path) -> None:
    payload = np.random.default_rng(3).bytes(12 * MiB)
    src = tmp_path / "blob"
    src.write_bytes(payload)
    loc = s3.location(endpoint=proxy.endpoint)
    proxy.break_after_upload(7 * MiB, once=True)  # one part's connection dies mid-body
    upload_step(loc, src, "ckpt-1.bin", part_size=5 * MiB)
    assert proxy.drops == 1
    assert s3.location().read("ckpt-1.bin") == payload and is_committed(s3.location(), "ckpt-1.bin")


def test_upload_failure_leaves_no_commit(s3: S3Bucket, proxy: FaultProxy, tmp_path: Path) -> None:
    loc_ok = s3.location("run")
    first = cv.save(tmp_path / "ckpt-1.h5", _arrays(1), pack_threshold=0)
    upload_step(loc_ok, first, "ckpt-1.h5")
    big = {"w": np.random.default_rng(2).standard_normal(3 * MiB)}  # 24 MiB
    second = cv.save(tmp_path / "ckpt-2.h5", big, pack_threshold=0)
    loc = s3.location("run", endpoint=proxy.endpoint, max_retries=2, retry_timeout=5)
    proxy.break_after_upload(9 * MiB)  # the server becomes unreachable mid-upload
    with pytest.raises(cv.CkptError, match=r"ckpt-2\.h5") as info:
        upload_step(loc, second, "ckpt-2.h5", part_size=5 * MiB)
    assert isinstance(info.value, StorageError)
    proxy.heal()
    assert not loc_ok.exists("ckpt-2.h5") and not loc_ok.exists(marker_key("ckpt-2.h5"))
    assert latest_committed_step(loc_ok) == "ckpt-1.h5"
    assert loc_ok.read("ckpt-1.h5") == Path(first).read_bytes()
    record = read_commit(loc_ok, "ckpt-1.h5")
    assert record is not None
    assert record.index_checksum == f"bytes-crc32c:{crc32c.crc32c(Path(first).read_bytes()):08x}"


def test_failed_commit_marker_write_is_clear(s3: S3Bucket, proxy: FaultProxy) -> None:
    """The data is up, then the server becomes unreachable: the commit fails clearly, no step."""
    loc = s3.location(endpoint=proxy.endpoint, max_retries=1, retry_timeout=3)
    loc.put("ckpt-3.h5", b"x" * 1000)
    proxy.break_after_upload(1)
    with pytest.raises(StorageError, match=r"s3://bucket-\d+/ckpt-3\.h5.*failed after retries"):
        commit(loc, "ckpt-3.h5", "crc32c:0")
    proxy.heal()
    assert list_committed_steps(s3.location()) == []


def test_step_already_committed_is_refused_before_upload(s3: S3Bucket, tmp_path: Path) -> None:
    local = cv.save(tmp_path / "a.h5", _arrays(), pack_threshold=0)
    loc = s3.location()
    upload_step(loc, local, "ckpt-1.h5")
    loc.stats.reset()
    with pytest.raises(CheckpointExistsError, match=r"ckpt-1\.h5"):
        upload_step(loc, local, "ckpt-1.h5")
    assert loc.stats.bytes_written == 0
    assert isinstance(loc, ObjectStoreLocation)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_saver_on_urls_keeps_max_to_keep_committed_steps(s3: S3Bucket, suffix: str) -> None:
    opts = s3.storage_options
    v = cv.Variable(np.arange(6.0).reshape(2, 3), name="v")
    saver = cv.Saver(var_list=[v], max_to_keep=2)
    paths = [saver.save(f"{s3.url}/tf1/model{suffix}", global_step=step, storage_options=opts)
             for step in (10, 20, 30)]
    assert paths == [f"{s3.url}/tf1/model-{s}{suffix}" for s in (10, 20, 30)]
    # the oldest is pruned: marker first, then its data; the kept ones are committed
    keys = sorted(o.key for o in s3.location().list("tf1/"))
    assert not [k for k in keys if "model-10" in k], keys
    assert list_committed_steps(s3.location("tf1")) == [f"model-20{suffix}", f"model-30{suffix}"]
    assert cv.latest_checkpoint(f"{s3.url}/tf1", storage_options=opts) == paths[-1]
    v.assign(np.zeros((2, 3)))
    saver.restore(paths[-1], storage_options=opts)
    assert v.numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
