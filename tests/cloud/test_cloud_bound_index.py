"""The commit marker binds the checkpoint's index (its root record's CRC-32C), and readers
check it: an index object damaged or replaced after the commit is refused, naming the keys."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import CommitRecord, marker_key, read_commit

from ._s3 import S3Bucket

RECORD = "_ckptvar/record/c.0"  # the Zarr root record's object, below the step


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 256)).astype(np.float32), "b": rng.standard_normal(8)}


def _save_two(s3: S3Bucket, ext: str) -> tuple[str, str]:
    opts = s3.storage_options
    first = cv.save(f"{s3.url}/run/ckpt-1.{ext}", _arrays(1), storage_options=opts)
    second = cv.save(f"{s3.url}/run/ckpt-2.{ext}", _arrays(2), storage_options=opts)
    return first, second


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_the_marker_binds_the_root_record_checksum(s3: S3Bucket, ext: str) -> None:
    first, _ = _save_two(s3, ext)
    loc = s3.location("run")
    marker = read_commit(loc, f"ckpt-1.{ext}")
    assert marker is not None and marker.index_checksum.startswith("record-crc32c:")
    with cv.open(first, storage_options=s3.storage_options) as reader:  # it matches: opens
        np.testing.assert_array_equal(reader["w"].read(), _arrays(1)["w"])


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_an_index_replaced_after_the_commit_is_refused(s3: S3Bucket, ext: str) -> None:
    """A consistent index of another checkpoint (record and its own checksum) put in place
    of the committed one: only the marker can tell, and the reader checks it."""
    first, _ = _save_two(s3, ext)
    loc = s3.location("run")
    if ext == "h5":  # the index object (user block + record) of another checkpoint
        keys = [(_commit(loc, "ckpt-2.h5").index, _commit(loc, "ckpt-1.h5").index)]
    else:
        keys = [(f"ckpt-2.zarr/{k}", f"ckpt-1.zarr/{k}") for k in ("zarr.json", RECORD)]
    for src, dst in keys:
        loc.put(dst, loc.read(src))
    for call in (
        lambda: cv.open(first, storage_options=s3.storage_options),
        lambda: cv.load(first, storage_options=s3.storage_options),
    ):
        with pytest.raises(cv.CorruptCheckpointError) as err:
            call()
        msg = str(err.value)
        assert loc.join(marker_key(f"ckpt-1.{ext}")) in msg
        assert "index checksum" in msg and keys[0][1].split("/")[0] in msg


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_a_marker_binding_another_index_is_refused(s3: S3Bucket, ext: str) -> None:
    first, _ = _save_two(s3, ext)
    loc = s3.location("run")
    key = marker_key(f"ckpt-1.{ext}")
    doc = json.loads(loc.read(key))
    doc["index_checksum"] = "record-crc32c:00000000"
    loc.put(key, json.dumps(doc).encode())
    with pytest.raises(cv.CorruptCheckpointError, match=r"binds index checksum record-crc32c:0{8}"):
        cv.load(first, storage_options=s3.storage_options)


def _commit(loc: Any, step: str) -> CommitRecord:
    record = read_commit(loc, step)
    assert record is not None
    return record


def test_hdf5_index_object_is_named_by_the_marker_and_opening_reads_no_data(
    s3: S3Bucket,
) -> None:
    first, _ = _save_two(s3, "h5")
    loc = s3.location("run")
    record = _commit(loc, "ckpt-1.h5")
    assert record.index == f"{record.data.removesuffix('.data')}.index"
    index_bytes = len(loc.read(record.index))
    with cv.open(first, storage_options=s3.storage_options) as reader:
        assert sorted(reader.keys()) == ["b", "w"]
        stats = reader._fd.location.stats  # type: ignore[attr-defined]
        # the marker and the index object (and one HEAD): no byte of the data object
        assert stats.get_requests == 2 and stats.bytes_read < index_bytes + 1024
        np.testing.assert_array_equal(reader["w"][3:5], _arrays(1)["w"][3:5])


def test_damaged_hdf5_index_object_names_its_key(s3: S3Bucket) -> None:
    first, _ = _save_two(s3, "h5")
    loc = s3.location("run")
    key = _commit(loc, "ckpt-1.h5").index
    data = bytearray(loc.read(key))
    data[-5] ^= 0xFF  # inside the record
    loc.put(key, bytes(data))
    with pytest.raises(cv.CorruptCheckpointError) as err:
        cv.load(first, storage_options=s3.storage_options)
    assert loc.join(key) in str(err.value) and "damaged" in str(err.value)


def test_data_object_replaced_after_the_commit_fails_the_value_checksums(s3: S3Bucket) -> None:
    first, _ = _save_two(s3, "h5")
    loc = s3.location("run")
    loc.put(_commit(loc, "ckpt-1.h5").data, loc.read(_commit(loc, "ckpt-2.h5").data))
    with pytest.raises(cv.CorruptCheckpointError, match=r"value '(w|b)'.*checksum"):
        cv.load(first, storage_options=s3.storage_options)


def test_a_damaged_zarr_index_object_names_its_key(s3: S3Bucket) -> None:
    first, _ = _save_two(s3, "zarr")
    loc = s3.location("run")
    key = f"ckpt-1.zarr/{RECORD}"
    data = bytearray(loc.read(key))
    data[len(data) // 2] ^= 0xFF
    loc.put(key, bytes(data))
    with pytest.raises(cv.CorruptCheckpointError, match=r"record.*c\.0.*damaged"):
        cv.open(first, storage_options=s3.storage_options)
