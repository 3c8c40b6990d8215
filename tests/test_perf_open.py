"""Opening a checkpoint of many values through the record's key index (format 1.1):
one value is found and decoded alone, old (1.0) records still read, and an index that
disagrees with the record's columns is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import crc32c
import msgpack
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage._record import FORMAT_VERSION, RowValues
from ckptvar.storage._record_index import INDEX_FROM

N = INDEX_FROM + 500


def _values(n: int = N) -> dict[str, np.ndarray]:
    return {f"layer_{i // 100}/v{i % 100}": np.full(3 + i % 5, i, np.float32) for i in range(n)}


def _zarr_record(p: Path) -> dict:
    return msgpack.unpackb((p / "_ckptvar/record/c.0").read_bytes())


def _rewrite_zarr_record(p: Path, doc: dict) -> None:
    """Replace a Zarr checkpoint's record (and its length and checksum in zarr.json)."""
    data = msgpack.packb(doc, use_bin_type=True)
    (p / "_ckptvar/record/c.0").write_bytes(data)
    meta = json.loads((p / "zarr.json").read_text())
    meta["attributes"]["ckptvar"].update(
        format_version=doc["format_version"], record_nbytes=len(data),
        record_crc32c=crc32c.crc32c(data))
    (p / "zarr.json").write_text(json.dumps(meta))


def _h5_record(p: Path) -> dict:
    _, _, _, off, n, _ = struct.unpack("<12sHHQQI", p.read_bytes()[:36])
    return msgpack.unpackb(p.read_bytes()[off : off + n])


def _rewrite_h5_record(p: Path, doc: dict) -> None:
    """Replace an HDF5 checkpoint's record in place (no longer than it was) and point the
    user block at it, with valid checksums: a record that is damaged yet well signed."""
    data = msgpack.packb(doc, use_bin_type=True)
    raw = bytearray(p.read_bytes())
    magic, major, minor, off, n, _ = struct.unpack("<12sHHQQI", raw[:36])
    assert len(data) <= n
    raw[off : off + len(data)] = data
    head = struct.pack("<12sHHQQI", magic, major, minor, off, len(data), crc32c.crc32c(data))
    raw[:40] = head + struct.pack("<I", crc32c.crc32c(head))
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_one_value_of_many_is_read_without_decoding_the_others(tmp_path: Path, fmt: str) -> None:
    vals = _values()
    p = cv.save(tmp_path / f"m.{fmt}", vals, attrs={"layer_3/v7": {"trainable": False}})
    with cv.open(p) as r:
        assert r.format_version == FORMAT_VERSION
        np.testing.assert_array_equal(r["layer_12/v34"].read(), vals["layer_12/v34"])
        assert r.info("layer_3/v7").attrs == {"name": "layer_3/v7", "trainable": False}
        assert "layer_0/v0" in r and "nope" not in r and len(r) == N
        assert not r._values.decoded_all
        assert list(r.keys()) == list(vals)  # listing decodes it all, in file order
        # and values are looked up in the full decode from now on, not by the key index
        assert isinstance(r._values, RowValues)
        with pytest.raises(KeyError, match="layer_0/nope"):
            r["layer_0/nope"].read()
        np.testing.assert_array_equal(r["layer_0/v1"].read(), vals["layer_0/v1"])
    got = cv.load(p)
    assert list(got) == list(vals)
    for k in ("layer_0/v0", f"layer_{(N - 1) // 100}/v{(N - 1) % 100}"):
        np.testing.assert_array_equal(got[k], vals[k])


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_every_key_is_found_through_the_index(tmp_path: Path, fmt: str) -> None:
    vals = {f"k{i:05d}\u00e9" if i % 3 else f"a/{i}": np.arange(i % 4, dtype=np.int16)
            for i in range(INDEX_FROM)}
    p = cv.save(tmp_path / f"m.{fmt}", vals)
    with cv.open(p) as r:
        for k, v in vals.items():
            np.testing.assert_array_equal(r[k].read(), v)


def test_a_row_that_contradicts_its_size_is_refused_when_read(tmp_path: Path) -> None:
    z = cv.save(tmp_path / "bad.h5", _values(), pack_threshold=64 << 10)  # packed
    doc = _h5_record(z)
    nbytes = np.frombuffer(doc["index"]["nbytes"], "<u8").copy()
    nbytes[5] += 4  # packed values sit 64 bytes apart: still inside, still no overlap
    doc["index"]["nbytes"] = nbytes.tobytes()
    _rewrite_h5_record(z, doc)
    with cv.open(z) as r:
        key = sorted(r._values._full or [], key=str) or None
        assert key is None  # nothing decoded yet
        with pytest.raises(cv.CorruptCheckpointError, match="bytes, its dtype and shape"):
            r[sorted(_values())[5]].read()


def test_small_records_carry_no_index(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "s.zarr", _values(INDEX_FROM - 1))
    assert "index" not in _zarr_record(p)
    assert "index" in _zarr_record(cv.save(tmp_path / "b.zarr", _values(INDEX_FROM)))


def test_a_format_1_0_record_of_many_values_still_reads(tmp_path: Path) -> None:
    vals = _values()
    p = cv.save(tmp_path / "old.zarr", vals)
    doc = _zarr_record(p)
    del doc["index"]
    doc["format_version"] = [1, 0]
    _rewrite_zarr_record(p, doc)
    with cv.open(p) as r:
        assert r.format_version == (1, 0)
        np.testing.assert_array_equal(r["layer_5/v5"].read(), vals["layer_5/v5"])
    assert list(cv.load(p)) == list(vals)


def test_an_index_that_disagrees_with_the_columns_is_refused(tmp_path: Path) -> None:
    z = cv.save(tmp_path / "bad.h5", _values())
    doc = _h5_record(z)
    ends = np.frombuffer(doc["index"]["key_ends"], "<u8")
    doc["index"]["key_ends"] = ends[:-1].tobytes()  # one value fewer
    for name, dt in (("offsets", "<u8"), ("nbytes", "<u8"), ("checksums", "<u4"),
                     ("layouts", "u1"), ("row_ends", "<u8")):
        doc["index"][name] = np.frombuffer(doc["index"][name], dt)[:-1].tobytes()
    doc["index"]["keys"] = doc["index"]["keys"][: int(ends[-2])]
    doc["index"]["rows"] = doc["index"]["rows"][
        : int(np.frombuffer(doc["index"]["row_ends"], "<u8")[-1])]
    _rewrite_h5_record(z, doc)
    with cv.open(z) as r:  # one value: through the index
        assert r["layer_0/v0"].read().tolist() == [0.0] * 3
    with pytest.raises(cv.CorruptCheckpointError, match="key index does not agree"):
        cv.load(z)


def test_a_damaged_index_row_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    z = cv.save(tmp_path / "bad.h5", _values())
    doc = _h5_record(z)
    ends = np.frombuffer(doc["index"]["row_ends"], "<u8").copy()
    ends[3] = ends[4]  # an empty row
    doc["index"]["row_ends"] = ends.tobytes()
    _rewrite_h5_record(z, doc)
    with pytest.raises(cv.CorruptCheckpointError, match="does not cut its blob"):
        cv.open(z)


def test_opening_a_zarr_checkpoint_decodes_one_row(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Zarr, like HDF5, finds one value through the key index: no full decode, one row
    decoded; the check that no two values share a container path waits for the first
    operation that needs every value (counted, not timed)."""
    from ckptvar.storage import _record, _record_index

    vals = _values()
    vals.update({f"big/{i}": np.full(20_000, i, np.float32) for i in range(3)})  # own arrays
    p = cv.save(tmp_path / "m.zarr", vals)
    counts = {"full": 0, "rows": 0}
    full, row = _record._decode, _record_index.KeyIndex.row

    def counting_full(*args: object) -> object:
        counts["full"] += 1
        return full(*args)  # type: ignore[arg-type]

    def counting_row(self: _record_index.KeyIndex, i: int) -> object:
        counts["rows"] += 1
        return row(self, i)

    monkeypatch.setattr(_record, "_decode", counting_full)
    monkeypatch.setattr(_record_index.KeyIndex, "row", counting_row)
    with cv.open(p) as r:
        np.testing.assert_array_equal(r["big/1"].read(), vals["big/1"])
        assert counts == {"full": 0, "rows": 1}
        assert len(r.keys()) == len(vals)
        assert counts == {"full": 1, "rows": 1}


def test_zarr_values_sharing_a_path_are_refused_when_all_are_needed(tmp_path: Path) -> None:
    vals = _values()
    vals.update({"big/a": np.ones(20_000, np.float32), "big/b": np.zeros(20_000, np.float32)})
    p = cv.save(tmp_path / "m.zarr", vals)
    doc = _zarr_record(p)
    i, j = doc["keys"].index("big/a"), doc["keys"].index("big/b")
    doc["paths"][j] = doc["paths"][i]  # the columns say b is stored where a is
    _rewrite_zarr_record(p, doc)
    with cv.open(p) as r:  # one value through the index (its own checksum still holds)
        np.testing.assert_array_equal(r["big/a"].read(), vals["big/a"])
    with pytest.raises(cv.CorruptCheckpointError, match="two values claim the container path"):
        cv.load(p)
    del doc["index"]  # without an index (format 1.0) the columns are checked at open
    doc["format_version"] = [1, 0]
    _rewrite_zarr_record(p, doc)
    with pytest.raises(cv.CorruptCheckpointError, match="two values claim the container path"):
        cv.open(p)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_reading_every_value_switches_to_one_full_decode(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore asks for every key one by one: after 1/64 of them (at least 256), the
    record is decoded once, whole, instead of row by row (counted, not timed)."""
    from ckptvar.storage import _record_index

    vals = _values(20_000)
    p = cv.save(tmp_path / f"m.{fmt}", vals)
    rows = [0]
    row = _record_index.KeyIndex.row

    def counting_row(self: _record_index.KeyIndex, i: int) -> object:
        rows[0] += 1
        return row(self, i)

    monkeypatch.setattr(_record_index.KeyIndex, "row", counting_row)
    outs = [(k, np.empty_like(v)) for k, v in vals.items()]
    with cv.open(p) as r:
        r.read_into_many(outs)
        assert r._values.decoded_all
    assert rows[0] == 20_000 // 64
    assert all(np.array_equal(o, vals[k]) for k, o in outs)
