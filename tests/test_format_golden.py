"""Format stability: the root record of a tiny fixed checkpoint, pinned field by field."""

from __future__ import annotations

import struct
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest
import zarr

import ckptvar as cv

VALUES = {
    "model/w": np.arange(20000, dtype="<f4").reshape(100, 200),
    "b": np.array([1, 2, 3], np.int8),
    "s": np.array(2.5),
}
ATTRS = {"model/w": {"trainable": True}}


#: The block size the writer uses (64 KiB; 256 KiB before 2026-11-27, when "model/w",
#: 80,000 bytes, was one block and carried none).
BLOCK = 64 << 10


def _block_crcs(a: np.ndarray, size: int) -> bytes:
    import crc32c

    data = a.tobytes()
    return np.array([crc32c.crc32c(data[i : i + size]) for i in range(0, len(data), size)],
                    "<u4").tobytes()


def expected(container: str, w_offset: object, packed_offset: object) -> dict:
    return {
        "format": "ckptvar",
        "format_version": [1, 2],
        "library": "ckptvar 0.1.0",
        "container": container,
        "packed": ["_ckptvar/packed", packed_offset, 128],
        "keys": ["model/w", "b", "s"],
        "dtypes": ["float32", "int8", "float64"],
        "shapes": [[100, 200], [3], []],
        "checksums": [1412696452, 287330943, 4016038162],
        "layouts": ["array", "packed", "packed"],
        "paths": ["model/w", None, None],
        "offsets": [w_offset, 0, 64],
        "block_size": BLOCK,
        "block_checksums": [_block_crcs(VALUES["model/w"], BLOCK), None, None],
        "attrs": {"name": ["model/w", "b", "s"]},
        "sparse_attrs": {"model/w": {"trainable": True}},
        "metadata": {"step": 1},
    }


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_root_record_is_pinned(tmp_path: Path, fmt: str) -> None:
    # the packed layout, pinned (a checkpoint this small packs nothing by default)
    p = cv.save(tmp_path / f"g.{fmt}", VALUES, metadata={"step": 1}, attrs=ATTRS,
                pack_threshold=64 << 10)
    if fmt == "h5":
        with h5py.File(p, "r") as f:
            data = f["_ckptvar/manifest"][()].tobytes()
            w_off = f["model/w"].id.get_offset()
            packed_off = f["_ckptvar/packed"].id.get_offset()
        record = msgpack.unpackb(data)
        assert record == expected("h5", w_off, packed_off)
        assert list(record) == ["format", "format_version", "library", "container", "packed",
                                "keys", "dtypes", "shapes", "checksums", "layouts", "paths",
                                "offsets", "block_size", "block_checksums", "attrs",
                                "sparse_attrs", "metadata"]
    else:
        root = zarr.open_group(p, mode="r")
        data = root["_ckptvar/record"][...].tobytes()
        assert msgpack.unpackb(data) == expected("zarr", 0, 0)
        attrs = dict(root.attrs)
        assert attrs.pop("description").startswith("A ckptvar checkpoint")
        assert attrs == {"format": "ckptvar", "format_version": "1.2",
                         "manifest": "_ckptvar/record",
                         "ckptvar": {"format_version": [1, 2],
                                     "record": "_ckptvar/record",
                                     "record_nbytes": 366,
                                     "record_crc32c": 1423380596}}
    assert msgpack.unpackb(data)["keys"] == list(VALUES)  # file order = add order


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_block_checksums_follow_the_spec(tmp_path: Path, fmt: str) -> None:
    """Format 1.2: a value of more than one block carries the CRC-32C of each block
    (``block_size`` bytes, 64 KiB as written now) of its bytes; the value's checksum is
    still one CRC-32C over all of them."""
    import crc32c

    big = np.arange(100_000, dtype="<f4")  # 400,000 bytes: seven blocks
    p = cv.save(tmp_path / f"b.{fmt}", {"big": big, "small": np.ones(3, np.int8)})
    if fmt == "h5":
        with h5py.File(p, "r") as f:
            record = msgpack.unpackb(f["_ckptvar/manifest"][()].tobytes())
    else:
        record = msgpack.unpackb((p / "_ckptvar/record/c.0").read_bytes())
    assert list(record)[:15] == ["format", "format_version", "library", "container", "packed",
                                 "keys", "dtypes", "shapes", "checksums", "layouts", "paths",
                                 "offsets", "block_size", "block_checksums", "attrs"]
    data, size = big.tobytes(), record["block_size"]
    assert size == BLOCK
    want = np.array([crc32c.crc32c(data[i : i + size]) for i in range(0, len(data), size)], "<u4")
    assert len(want) == 7 and record["block_checksums"] == [want.tobytes(), None]
    header = crc32c.crc32c(b"big\x00float32\x00100000\x00")
    assert record["checksums"][0] == crc32c.crc32c(data, header)


def test_h5_dataset_attributes_are_pinned(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "g.h5", VALUES, attrs=ATTRS)
    with h5py.File(p, "r") as f:
        attrs = dict(f["model/w"].attrs)
    assert {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in attrs.items()} == {
        "name": "model/w", "trainable": True, "key": "model/w", "dtype": "float32",
        "shape": [100, 200], "checksum": 1412696452,
    }


# -- checkpoints written by earlier versions of the format, kept as files ---------------

GOLDEN = Path(__file__).parent / "golden"


def golden_values() -> dict[str, np.ndarray]:
    """What ``tests/golden/format-1.1.{h5,zarr}`` hold (written by the format-1.1 writer
    with ``metadata={"step": 7}`` and ``attrs={"emb": {"trainable": False}}``)."""
    import ml_dtypes

    vals = {
        "emb": (np.arange(384 * 1024, dtype=np.float32) % 1000 * 0.5).reshape(384, 1024),
        "model/kernel": np.arange(64 * 64, dtype="<f4").reshape(64, 64) / 7,
        "model/bf": np.arange(8).astype(ml_dtypes.bfloat16),
    }
    for i in range(1100):
        vals[f"small/v{i:04d}"] = np.arange(i % 7, dtype=np.int16) + i
    return vals


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_format_1_1_files_still_read_bit_exact(fmt: str) -> None:
    path = GOLDEN / f"format-1.1.{fmt}"
    want = golden_values()
    got = cv.load(path)
    assert list(got) == list(want)
    assert all(_same(got[k], v) for k, v in want.items())
    with cv.open(path) as r:
        assert r.format_version == (1, 1)
        assert r.metadata() == {"step": 7}
        assert r.info("emb").attrs["trainable"] is False
        assert _same(r["small/v0500"].read(), want["small/v0500"])
        assert _same(r["emb"][100:300], want["emb"][100:300])  # a slice, verified whole
        assert _same(r["emb"][5, 7:9], want["emb"][5, 7:9])
        assert r.verify_all() == []


def test_root_attributes_say_the_version_the_record_is_written_as(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    # HDF5: an incremental step holding an unchanged value of the step before (1.3)
    ckpt = cv.Checkpoint(w=cv.Variable(np.arange(100_000, dtype=np.float32), name="w"),
                         b=cv.Variable(np.zeros(20_000, np.float32), name="b"))
    manager = cv.CheckpointManager(ckpt, tmp_path / "h", incremental=True)
    manager.save()
    ckpt.b.assign_add(1)
    second = manager.save()
    with h5py.File(second, "r") as f:
        record = msgpack.unpackb(f["_ckptvar/manifest"][()].tobytes())
        assert record["format_version"] == [1, 3]
        assert f.attrs["format_version"] == "1.3"
    head = Path(second).read_bytes()[:16]
    assert struct.unpack("<HH", head[12:16]) == (1, 3)  # the user block's major, minor
    with cv.open(second) as reader:
        assert reader.format_version == (1, 3)
    # Zarr: a value of more than 4 MiB stored in pieces by an incremental step (1.4)
    table = cv.Checkpoint(t=cv.Variable(np.zeros((20_000, 64), np.float32), name="t"))
    step = cv.CheckpointManager(table, tmp_path / "z", format="zarr", incremental=True).save()
    root = zarr.open_group(step, mode="r")
    assert msgpack.unpackb(root["_ckptvar/record"][...].tobytes())["format_version"] == [1, 4]
    assert root.attrs["format_version"] == "1.4"
    assert root.attrs["ckptvar"]["format_version"] == [1, 4]
