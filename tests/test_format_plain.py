"""docs/FORMAT.md is enough: plain h5py / zarr + NumPy + msgpack read every value.

These tests never import ckptvar's readers; they only use ckptvar to write.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import h5py
import ml_dtypes
import msgpack
import numpy as np
import pytest
import zarr

import ckptvar as cv

VALUES = {
    "model/dense/kernel": np.arange(40000, dtype=np.float32).reshape(200, 200),
    "model/dense/bias": np.arange(5, dtype=np.float64),
    "model/emb": np.linspace(0, 1, 50000).astype(ml_dtypes.bfloat16).reshape(500, 100),
    "tiny/bf": np.ones(3, ml_dtypes.bfloat16),
    "odd/../name:0": np.arange(30000, dtype=np.int16),
    "flag": np.array(True),
    "c": np.array([1 + 2j], np.complex64),
    "empty": np.zeros((0, 3), np.float32),
}


def as_stored(dtype: str, raw: np.ndarray) -> np.ndarray:
    """FORMAT.md: dtypes NumPy lacks are stored as unsigned bits; view them back."""
    if dtype == "bfloat16":
        return raw.view(ml_dtypes.bfloat16)
    return raw


def check(got: dict[str, np.ndarray]) -> None:
    assert set(got) == set(VALUES)
    for k, v in VALUES.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v)


def test_plain_h5py_reads_every_value(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.h5", VALUES)
    got = {}
    with h5py.File(p, "r") as f:
        assert f.userblock_size == 512
        record = msgpack.unpackb(f["_ckptvar/manifest"][()].tobytes())
        assert record["format"] == "ckptvar" and record["format_version"][0] == 1
        packed = f[record["packed"][0]][()] if record["packed"] else None  # null: none packed
        for key, dtype, shape, layout, path, offset, name in zip(
            record["keys"], record["dtypes"], record["shapes"], record["layouts"],
            record["paths"], record["offsets"], record["attrs"]["name"], strict=True,
        ):
            assert name == key
            if layout == "array":
                ds = f[path]
                assert ds.attrs["key"] == key and ds.attrs["dtype"] == dtype
                raw = ds[()]
            else:
                assert layout == "packed" and path is None
                dt = np.dtype(dtype if dtype != "bfloat16" else "<u2")
                nbytes = dt.itemsize * int(np.prod(shape))
                raw = packed[offset : offset + nbytes].view(dt).reshape(shape)
            got[key] = as_stored(dtype, raw)
    check(got)


def test_h5_userblock_layout(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.h5", VALUES)
    head = p.read_bytes()[:512]
    magic, major, minor, off, n, _crc = struct.unpack("<12sHHQQI", head[:36])
    assert magic == b"\x89CKPTVAR\r\n\x1a\n" and (major, minor) == (1, 2)
    assert head[40:] == bytes(472)
    with h5py.File(p, "r") as f:
        ds = f["_ckptvar/manifest"]
        assert ds.id.get_offset() == off and ds.shape == (n,)
        assert f["model/dense/kernel"].id.get_offset() % 1 == 0
        assert f["model/dense/kernel"].chunks is None  # contiguous
        assert f["model/dense/kernel"].compression is None


def test_plain_zarr_reads_every_value(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.zarr", VALUES)
    root = zarr.open_group(p, mode="r")
    info = root.attrs["ckptvar"]
    raw_record = root[info["record"]][...]
    assert raw_record.nbytes == info["record_nbytes"]
    record = msgpack.unpackb(raw_record.tobytes())
    packed = root[record["packed"][0]][...] if record["packed"] else None
    got = {}
    for i, key in enumerate(record["keys"]):
        dtype, shape = record["dtypes"][i], record["shapes"][i]
        if record["layouts"][i] == "array":
            arr = root[record["paths"][i]]
            assert arr.attrs["key"] == key and arr.attrs["checksum"] == record["checksums"][i]
            raw = arr[...]
        else:
            dt = np.dtype(dtype if dtype != "bfloat16" else "<u2")
            offset, nbytes = record["offsets"][i], dt.itemsize * int(np.prod(shape))
            raw = packed[offset : offset + nbytes].view(dt).reshape(shape)
        got[key] = as_stored(dtype, raw)
    check(got)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_checksums_follow_the_documented_recipe(tmp_path: Path, fmt: str) -> None:
    import crc32c

    p = cv.save(tmp_path / f"c.{fmt}", VALUES)
    if fmt == "h5":
        with h5py.File(p, "r") as f:
            record = msgpack.unpackb(f["_ckptvar/manifest"][()].tobytes())
    else:
        root = zarr.open_group(p, mode="r")
        record = msgpack.unpackb(root["_ckptvar/record"][...].tobytes())
    for key, dtype, shape, checksum in zip(record["keys"], record["dtypes"], record["shapes"],
                                           record["checksums"], strict=True):
        head = f"{key}\0{dtype}\0{','.join(map(str, shape))}\0".encode()
        v = VALUES[key]
        assert crc32c.crc32c(v.tobytes(), crc32c.crc32c(head)) == checksum, key


def test_zarr_json_documents_are_plain_v3(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.zarr", VALUES)
    meta = json.loads((p / "model/dense/kernel/zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["node_type"] == "array"
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [200, 200]
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    assert (p / "model/dense/kernel/c.0.0").stat().st_size == 40000 * 4
    emb = json.loads((p / "model/emb/zarr.json").read_text())
    assert emb["data_type"] == "uint16" and emb["attributes"]["dtype"] == "bfloat16"
