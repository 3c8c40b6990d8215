"""The root record decoder refuses every hostile or damaged input; key escaping is safe."""

from __future__ import annotations

import os
import resource
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError, UnsupportedFormatError
from ckptvar.storage._record import Entry, Extent, Record, decode, encode
from ckptvar.storage.paths import container_paths, escape_key, is_valid_container_path


def good() -> dict:
    return {
        "format": "ckptvar", "format_version": [1, 0], "library": "ckptvar 0.1.0",
        "container": "h5", "packed": ["_ckptvar/packed", 1000, 128],
        "keys": ["w", "v"], "dtypes": ["float32", "int8"], "shapes": [[2, 2], [3]],
        "checksums": [5, 6], "layouts": ["packed", "packed"], "paths": [None, None],
        "offsets": [0, 64], "attrs": {"name": ["w", "v"]}, "sparse_attrs": {"v": {"x": 1}},
        "metadata": {},
    }


def dec(doc: object) -> Record:
    return decode(msgpack.packb(doc, use_bin_type=True), "x.h5", container="h5")


def test_good_record_decodes() -> None:
    rec = dec(good())
    assert rec.values["w"] == Entry("float32", (2, 2), 5, {"name": "w"}, Extent.packed(0, 16))
    assert rec.values["v"] == Entry("int8", (3,), 6, {"name": "v", "x": 1}, Extent.packed(64, 3))
    assert list(rec.values) == ["w", "v"]


def test_encode_decode_round_trip_keeps_attrs_and_locations() -> None:
    values = {
        "a": Entry("float32", (2,), 1, {"name": "a", "trainable": True}, Extent.packed(0, 8)),
        "b": Entry("bfloat16", (), 2, {"name": "b", "extra": [1, {"k": None}]},
                   Extent.packed(64, 2)),
        "c": Entry("int64", (0, 4), 3, {}, Extent.array("c", 4096, 0)),
    }
    rec = Record(container="h5", values=values, metadata={"m": 1},
                 packed=("_ckptvar/packed", 512, 128))
    back = decode(encode(rec), "x.h5", container="h5")
    assert back.values == values and back.metadata == {"m": 1}


def _set(col: str, i: int, v: object):  # type: ignore[no-untyped-def]
    return lambda d: d[col].__setitem__(i, v)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(format="other"), "format"),
        (_set("dtypes", 0, "object"), "dtype"),
        (_set("dtypes", 0, "<f4"), "dtype"),
        (_set("dtypes", 0, 3), "dtype"),
        (_set("shapes", 0, [-1, 2]), "dimension"),
        (_set("shapes", 0, [2, 2.0]), "dimension"),
        (_set("shapes", 0, [True, 2]), "dimension"),
        (_set("shapes", 0, "22"), "shape"),
        (_set("shapes", 0, [1] * 65), "shape"),
        (_set("shapes", 0, [2**40, 2**40]), "too large"),
        (_set("shapes", 0, [2, 9]), "overlaps"),
        (_set("shapes", 1, [100]), "outside"),
        (_set("checksums", 0, 2**40), "checksum"),
        (_set("checksums", 0, "x"), "checksum"),
        (_set("offsets", 0, 120), "outside"),
        (_set("offsets", 1, 8), "overlaps"),
        (_set("offsets", 1, -8), "offset"),
        (_set("keys", 1, "w"), "twice"),
        (_set("keys", 1, 7), "non-string"),
        (lambda d: d["checksums"].pop(), "items"),
        (lambda d: d.update(paths={}), "paths"),
        (_set("paths", 0, "w"), "container path"),
        (lambda d: (_set("layouts", 0, "array")(d), _set("paths", 0, "../../etc/passwd")(d)),
         "unsafe"),
        (lambda d: (_set("layouts", 0, "array")(d), _set("paths", 0, "/abs")(d)), "unsafe"),
        (lambda d: (_set("layouts", 0, "array")(d), _set("paths", 0, "a/./b")(d)), "unsafe"),
        (lambda d: (_set("layouts", 0, "array")(d), _set("paths", 0, "a\\b")(d)), "unsafe"),
        (lambda d: (_set("layouts", 0, "array")(d), _set("paths", 0, None)(d)), "unsafe"),
        (_set("layouts", 0, "file"), "location"),
        (_set("layouts", 0, "zarr"), "location"),  # compressed Zarr arrays only in Zarr
        (lambda d: d["attrs"].update(name=["w"]), "attribute column"),
        (lambda d: d["attrs"].update(name=["w", {1: 2}]), "map key"),
        (lambda d: d["sparse_attrs"].update(zz={"a": 1}), "not a stored key"),
        (lambda d: d["sparse_attrs"].update(v={"name": "again"}), "repeats"),
        (lambda d: d["sparse_attrs"].update(v=[1]), "not a map"),
        (lambda d: d.update(metadata=[1]), "metadata"),
        (lambda d: d.update(container="zarr"), "container"),
        (lambda d: d.update(keys={}), "keys"),
        (lambda d: d.update(format_version="1.0"), "format_version"),
    ],
)
def test_schema_violations_are_corrupt(mutate, match: str) -> None:
    doc = good()
    mutate(doc)
    with pytest.raises(CorruptCheckpointError, match=match):
        dec(doc)


def test_newer_major_version_is_refused_clearly() -> None:
    doc = good()
    doc["format_version"] = [2, 0]
    with pytest.raises(UnsupportedFormatError, match="newer"):
        dec(doc)
    doc["format_version"] = [1, 7]  # a newer minor version still reads
    assert dec(doc).format_version == (1, 7)


def test_a_record_newer_than_its_header_names_the_file(tmp_path: Path) -> None:
    """The user block says 1.2 and its record 2.0: the error names the file, as the
    user block's own newer version does."""
    doc = good()
    doc["format_version"] = [2, 0]
    with pytest.raises(UnsupportedFormatError, match=r"'x\.h5'.* 2\.0, newer"):
        decode(msgpack.packb(doc), "x.h5", container="h5")
    # an indexed record (1,024 values or more), decoded lazily
    p = cv.save(tmp_path / "many.h5", {f"v{i}": np.full(2, i, np.int16) for i in range(1100)})

    def newer(doc: dict) -> None:
        assert "index" in doc
        doc["format_version"] = [2, 0]

    _rewrite_root_record(p, newer)
    with pytest.raises(UnsupportedFormatError, match=r"many\.h5.* 2\.0, newer"):
        cv.open(p)


@pytest.mark.parametrize(
    "data",
    [
        b"\x82\xa1a\x01\xa1a\x02",  # duplicate map keys
        msgpack.packb(msgpack.ExtType(3, b"xx")),  # ext type
        msgpack.packb({"t": msgpack.Timestamp(1, 0)}),  # the built-in timestamp ext
        b"\x91" * 5000 + b"\xc0",  # deep nesting
        b"\xdd\xff\xff\xff\xff",  # an array declaring 2^32 items in 5 bytes
        b"\xdb\xff\xff\xff\xff",  # a string declaring 4 GiB
        b"\xa2\xff\xfe",  # invalid UTF-8
        b"\x81\x01\x02",  # non-string map key
        b"",
        msgpack.packb(good()) + b"\x00",  # trailing bytes
    ],
)
def test_hostile_msgpack_is_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="x.h5"):
        decode(data, "x.h5", container="h5")


def test_deep_metadata_is_refused() -> None:
    doc = good()
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    doc["metadata"] = {"d": deep}
    with pytest.raises(CorruptCheckpointError, match="deeper"):
        dec(doc)


def test_huge_declared_array_in_a_tiny_file_is_refused_without_allocating(tmp_path: Path) -> None:
    """A ~1 KB .h5 whose record declares 2^40 float64 elements: clear error, memory flat."""
    from ckptvar.storage._h5 import make_userblock

    p = tmp_path / "evil.h5"
    doc = good()
    doc.update(packed=None, keys=["w"], dtypes=["float64"], shapes=[[2**20, 2**20]],
               checksums=[0], layouts=["array"], paths=["w"], offsets=[4096], attrs={},
               sparse_attrs={})
    rec = msgpack.packb(doc)
    p.write_bytes(make_userblock(512, rec) + rec + bytes(100))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        cv.load(p)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_overlapping_regions_are_refused(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "a.h5", {"a": np.ones(100000), "b": np.ones(100000)})
    def overlap(doc: dict) -> None:
        a, b = doc["keys"].index("a"), doc["keys"].index("b")
        doc["offsets"][b] = doc["offsets"][a] + 8

    _rewrite_root_record(p, overlap)
    with pytest.raises(CorruptCheckpointError, match="overlaps"):
        cv.open(p)


def test_damaged_userblock_is_caught(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "a.h5", {"a": np.ones(3)})
    with open(p, "r+b") as f:
        f.seek(20)
        f.write(struct.pack("<Q", 10**12))
    with pytest.raises(CorruptCheckpointError, match="user block"):
        cv.open(p)


# -- key escaping


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=8, unique=True))
def test_escaping_is_safe_and_unique(keys: list[str]) -> None:
    keys = [k for k in keys if "\ud800" > k or all(not 0xD800 <= ord(c) <= 0xDFFF for c in k)]
    paths = container_paths(keys)
    assert len({p.lower() for p in paths}) == len(paths)
    for p in paths:
        assert is_valid_container_path(p)
        assert not p.startswith("_ckptvar")
        for seg in p.split("/"):
            assert seg not in ("", ".", "..", "zarr.json") and not seg.startswith("__")
            assert len(seg.encode()) <= 255


def test_escape_examples() -> None:
    assert escape_key("model/dense/kernel") == "model/dense/kernel"
    assert escape_key("a/../b") == "a/%2E./b"
    assert escape_key("_ckptvar/x") == "%5Fckptvar/x"
    assert escape_key("w:0") == "w%3A0"
    assert escape_key("é") == "%C3%A9"
    assert container_paths(["a", "a/b"]) == ["a%t1", "a/b"]
    long = escape_key("x" * 300)
    assert len(long) == 180 + 2 + 16 and "%h" in long


def _rewrite_root_record(path: str, edit: Callable[[dict], None]) -> None:
    """Append the HDF5 file's root record as ``edit`` changes it, and point its user
    block at the new copy."""
    from ckptvar.storage._h5 import make_userblock, read_userblock

    fd = os.open(path, os.O_RDWR)
    try:
        _, _, off, n, _ = read_userblock(fd, path)
        doc = msgpack.unpackb(os.pread(fd, n, off))
        edit(doc)
        rec = msgpack.packb(doc)
        end = os.fstat(fd).st_size
        os.pwrite(fd, rec, end)
        os.pwrite(fd, make_userblock(end, rec), 0)
    finally:
        os.close(fd)
