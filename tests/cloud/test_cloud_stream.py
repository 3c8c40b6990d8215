"""cv.load from an object store: one long GET per object, streamed into the arrays and
verified as the bytes arrive; request planning; early stop; order; damage."""

from __future__ import annotations

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import read_commit
from ckptvar.storage._container import bulk

from ._s3 import FaultProxy, S3Bucket

MiB = 1024 * 1024


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    out = {f"big/{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(6)}
    out.update({f"small/{i}": rng.standard_normal(100 + i) for i in range(20)})
    out["empty"] = np.zeros((0, 3), np.float32)
    out["scalar"] = np.array(5, np.int64)
    return out


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_load_streams_every_value_verified(s3: S3Bucket, ext: str) -> None:
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.{ext}", arrays, storage_options=s3.storage_options)
    got = cv.load(url, storage_options=s3.storage_options)
    assert sorted(got) == sorted(arrays)
    for key, value in arrays.items():
        np.testing.assert_array_equal(got[key], value)
        assert got[key].dtype == value.dtype and got[key].shape == value.shape


def test_hdf5_load_is_one_get_of_the_data(s3: S3Bucket, proxy: FaultProxy) -> None:
    """12 MiB of values and the packed small ones: one GET streams them all (the open reads
    only the marker and the index object), and little more than the data crosses the socket."""
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.h5", arrays, storage_options=s3.storage_options)
    size = s3.location("run").size(read_commit(s3.location("run"), "ckpt-1.h5").data)  # type: ignore[union-attr]
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    with cv.open(url, storage_options=opts) as reader:
        stats = reader._fd.location.stats  # type: ignore[attr-defined]
        stats.reset()
        proxy.reset_counts()
        got = dict(reader.read_many(list(reader.keys())))
        assert stats.get_requests == 1
        assert size - 64 * 1024 <= stats.bytes_read <= size
        assert proxy.bytes_down <= size + 64 * 1024
    np.testing.assert_array_equal(got["big/5"], arrays["big/5"])


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_keys_in_any_order_with_a_small_window(
    s3: S3Bucket, ext: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for in reverse order with a window smaller than one value: no deadlock, each
    value right (the streams run past the window while the consumer waits)."""
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.{ext}", arrays, storage_options=s3.storage_options)
    monkeypatch.setattr(bulk, "_WINDOW", 1 * MiB)
    with cv.open(url, storage_options=s3.storage_options) as reader:
        keys = sorted(arrays, reverse=True)
        for key, value in reader.read_many(keys):
            np.testing.assert_array_equal(value, arrays[key])


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_stopping_early_ends_the_streams(
    s3: S3Bucket, ext: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.{ext}", arrays, storage_options=s3.storage_options)
    monkeypatch.setattr(bulk, "_WINDOW", 2 * MiB)
    with cv.open(url, storage_options=s3.storage_options) as reader:
        it = reader.read_many(list(reader.keys()))
        key, value = next(it)
        np.testing.assert_array_equal(value, arrays[key])
        it.close()  # returns once every stream has stopped (no thread left writing)
        np.testing.assert_array_equal(reader["big/2"].read(), arrays["big/2"])


def test_a_truncated_zarr_chunk_names_the_value(s3: S3Bucket) -> None:
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.zarr", arrays, storage_options=s3.storage_options)
    loc = s3.location("run")
    key = next(o.key for o in loc.list("ckpt-1.zarr/big/3") if "/c" in o.key)
    loc.put(key, loc.read(key)[: 1 * MiB])
    with pytest.raises(cv.CorruptCheckpointError, match=r"'big/3' is truncated.*ckpt-1\.zarr/big/3"):
        cv.load(url, storage_options=s3.storage_options)


def test_read_part_size_splits_a_stream_into_parallel_requests(s3: S3Bucket) -> None:
    arrays = _arrays()
    url = cv.save(f"{s3.url}/run/ckpt-1.h5", arrays, storage_options=s3.storage_options)
    opts = {**s3.storage_options, "read_part_size": 4 * MiB}
    with cv.open(url, storage_options=opts) as reader:
        stats = reader._fd.location.stats  # type: ignore[attr-defined]
        stats.reset()
        got = dict(reader.read_many(list(reader.keys())))
        assert 3 <= stats.get_requests <= 5  # 12 MiB of data in requests of about 4 MiB
    for key, value in arrays.items():
        np.testing.assert_array_equal(got[key], value)


@pytest.mark.parametrize("part_size", [0, 64 << 10])
def test_a_slice_streams_its_edge_blocks_with_it_and_finds_damage_there(
    s3: S3Bucket, part_size: int
) -> None:
    """A sliced read from an object store fetches the run and the parts of its first and
    last checksum block outside it in one request (ranges cut into parallel requests by
    ``read_part_size`` too), hashed as they arrive: damage just outside the slice, in its
    edge block, is found; an undamaged slice reads back."""
    value = np.arange(1000 * 1024, dtype=np.float32).reshape(1000, 1024)  # 4 KiB rows
    url = cv.save(f"{s3.url}/run/ckpt-1.zarr", {"w": value}, storage_options=s3.storage_options)
    opts = {**s3.storage_options, "read_part_size": part_size}
    with cv.open(url, storage_options=opts) as reader:
        np.testing.assert_array_equal(reader["w"][70:530], value[70:530])  # not on blocks
        size = reader._record.block_size  # 64 KiB: 16 rows a block
    first = 70 * 4096 // size  # the block of row 70, from row 64 on (blocks of 8+ rows)
    assert first * size <= 65 * 4096
    loc = s3.location("run")
    key = next(o.key for o in loc.list("ckpt-1.zarr/w") if "/c" in o.key)
    data = bytearray(loc.read(key))
    data[65 * 4096 + 8] ^= 0xFF  # row 65: in the first block, outside rows 70..530
    loc.put(key, bytes(data))
    with cv.open(url, storage_options=opts) as reader, pytest.raises(
            cv.CorruptCheckpointError, match=rf"'w' fails the checksum of its block {first} "):
        reader["w"][70:530]
