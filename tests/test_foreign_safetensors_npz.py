"""safetensors and npz: strict header validation, lazy reads, and the interop writers."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError, UnsupportedFormatError
from ckptvar.formats import NpzBackend, SafetensorsBackend

BF16 = np.dtype(ml_dtypes.bfloat16)


def _st(path: Path, header: Any, data: bytes = b"", *, raw: bytes | None = None) -> Path:
    head = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


# --------------------------------------------------------------------------- safetensors


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I8", "shape": [2, 2], "data_offsets": [8, 12]}}


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, "integer"),
        ({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, b"\0" * 8,
         "too many"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "outside"),
        ({"a": {"dtype": "OBJ", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, b"\0" * 8,
         "exactly"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "overlap"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "cover 4"),
        ({"__metadata__": {"k": 1}}, b"", "strings"),
        ([1, 2], b"", "start with"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, True]}}, b"\0" * 4, "begin, end"),
    ],
)
def test_bad_safetensors_headers_are_refused(
    tmp_path: Path, header: Any, data: bytes, match: str
) -> None:
    path = _st(tmp_path / "x.safetensors", header, data)
    with pytest.raises(CorruptCheckpointError, match=match):
        cv.open(path)


def test_bad_header_lengths_and_encodings(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="declares"):
        cv.open(p)
    p.write_bytes(b"\x01\x00")
    with pytest.raises(CorruptCheckpointError, match="too short"):
        cv.open(p)
    _st(p, None, raw=b'{"a": 1, "a": 2}')
    with pytest.raises(CorruptCheckpointError, match=r"x\.safetensors.*'a' twice"):
        cv.open(p)  # the message names the file
    _st(p, None, raw=b"{\xff}")
    with pytest.raises(CorruptCheckpointError, match="UTF-8"):
        cv.open(p)
    _st(p, None, raw=b"{" * 100_000)
    with pytest.raises(CorruptCheckpointError, match="JSON"):
        cv.open(p)


def test_safetensors_round_trip_every_dtype(tmp_path: Path) -> None:
    values = {
        "f32": np.arange(6, dtype="f4").reshape(2, 3),
        "bf16": np.array([1.5, -2.0], dtype=BF16),
        "f16": np.array([0.5], dtype="f2"),
        "f64": np.array(3.25),
        "i64": np.array([2**40, -1]),
        "u8": np.arange(3, dtype="u1"),
        "bool": np.array([True, False]),
        "c64": np.array([1 + 2j], dtype="c8"),
        "f8": np.array([1.0, 2.0], dtype=ml_dtypes.float8_e4m3fn),
        "empty": np.zeros((0, 4), "f4"),
        "strided": np.arange(12, dtype="f4").reshape(3, 4)[:, ::2],
        "big_endian": np.arange(3, dtype=">i4"),
    }
    path = cv.save(tmp_path / "all.safetensors", values, metadata={"step": 3, "raw": b"\x00\x01"},
                   attrs={"f32": {"trainable": False}})
    with cv.open(path) as reader:
        assert reader.format == "safetensors"
        assert list(reader.keys()) == list(values)
        for key, value in values.items():
            got = reader[key].read()
            assert got.dtype == value.dtype.newbyteorder("="), key
            np.testing.assert_array_equal(got, value)
        assert reader.metadata() == {"format": "pt", "step": 3, "raw": b"\x00\x01"}  # format: pt added
        assert reader.info("f32").attrs == {"name": "f32", "trainable": False}
    head = path.read_bytes()
    (n,) = struct.unpack("<Q", head[:8])
    assert (8 + n) % 8 == 0  # data aligned like the reference writer
    header = json.loads(head[8 : 8 + n])
    assert header["bf16"]["dtype"] == "BF16" and header["f8"]["dtype"] == "F8_E4M3"


def test_safetensors_writer_refuses_what_the_format_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedFormatError, match="complex128"):
        cv.save(tmp_path / "c.safetensors", {"c": np.zeros(2, "c16")})
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary left


def test_safetensors_writer_is_atomic(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "m.safetensors", {"a": np.ones(3, "f4")})
    before = path.read_bytes()
    writer = SafetensorsBackend.open_writer(path)
    writer.add("a", np.zeros(3, "f4"))
    writer.add("b", np.zeros(3, "f4"))
    writer.abort()
    with pytest.raises(ValueError, match="already added"):
        w2 = SafetensorsBackend.open_writer(path)
        w2.add("a", np.zeros(1))
        w2.add("a", np.zeros(1))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_lazy_slice_reads_only_the_rows_it_needs(tmp_path: Path) -> None:
    value = np.arange(1000 * 64, dtype="f4").reshape(1000, 64)
    path = cv.save(tmp_path / "big.safetensors", {"w": value})
    with cv.open(path) as reader:
        # Cut the file after row 10 while it is open: rows 0..9 are still readable,
        # so a slice of them cannot have touched anything beyond.
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        os.truncate(path, 8 + n + 10 * 64 * 4)
        np.testing.assert_array_equal(reader["w"][2:10, 5], value[2:10, 5])
        np.testing.assert_array_equal(reader["w"][9], value[9])
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            reader["w"].read()


# --------------------------------------------------------------------------- npz


def test_npz_round_trip_and_numpy_can_read_our_files(tmp_path: Path) -> None:
    values = {
        "model/dense/kernel": np.arange(6, dtype="f4").reshape(2, 3),
        "bf16": np.array([1.5, -2.0, 3.0], dtype=BF16),
        "scalar": np.array(7, dtype="i8"),
        "empty": np.zeros((0,), "f8"),
    }
    path = cv.save(tmp_path / "a.npz", values, metadata={"step": 2})
    with cv.open(path) as reader:
        assert reader.format == "npz"
        for key, value in values.items():
            got = reader[key].read()
            assert got.dtype == value.dtype
            np.testing.assert_array_equal(got, value)
        assert reader.metadata() == {"step": 2}
        np.testing.assert_array_equal(reader["model/dense/kernel"][1, 1:], [4, 5])
    with np.load(path, allow_pickle=False) as data:  # plain NumPy reads it, no pickle needed
        np.testing.assert_array_equal(data["model/dense/kernel"], values["model/dense/kernel"])
        bits = data["bf16"]
        assert bits.dtype == np.dtype("<u2")
        np.testing.assert_array_equal(bits.view(BF16), values["bf16"])


def test_npz_big_endian_values_are_plain_numbers_for_numpy(tmp_path: Path) -> None:
    # stored little-endian by value: NumPy reads the same floats, not their bits as uints
    values = {"f": np.arange(4, dtype=">f4"), "i": np.array(-3, dtype=">i8"),
              "c": np.array([1 + 2j], dtype=">c16")}
    path = cv.save(tmp_path / "b.npz", values)
    with np.load(path, allow_pickle=False) as data:
        for key, value in values.items():
            assert data[key].dtype == value.dtype.newbyteorder("<"), key
            np.testing.assert_array_equal(data[key], value)
    with zipfile.ZipFile(path) as zf:
        assert zf.namelist() == ["f.npy", "i.npy", "c.npy"]  # no dtype record needed
    assert {k: v.dtype for k, v in cv.load(path).items()} == {
        "f": np.dtype("<f4"), "i": np.dtype("<i8"), "c": np.dtype("<c16")}


def test_npz_metadata_bytes_come_back_as_bytes(tmp_path: Path) -> None:
    # bytes are kept in the JSON member as base64; the reader decodes them, as the
    # safetensors reader does, instead of giving the {"__bytes__": ...} wrapper
    meta = {"blob": b"\x00\xff", "nested": [{"raw": b"ab"}], "step": 3}
    path = cv.save(tmp_path / "m.npz", {"w": np.ones(2)}, metadata=meta)
    with cv.open(path) as reader:
        assert reader.metadata() == meta
    tree = {"w": np.ones(2), "b": b"\x01"}
    assert cv.load(cv.save(tmp_path / "t.npz", tree), like=tree)["b"] == b"\x01"


@pytest.mark.parametrize("key", ["../x", "/abs", "a\\b", "C:x", "a/../../b"])
def test_an_npz_key_the_reader_would_refuse_is_refused_when_written(
        tmp_path: Path, key: str) -> None:
    # a member name pointing outside the archive: refused by name before anything is
    # written, never a file that reads back as "points outside the archive"
    path = tmp_path / "k.npz"
    with pytest.raises(ValueError, match=r"Invalid npz key.*outside"):
        cv.save(path, {"ok": np.ones(2), key: np.zeros(2)})
    assert not path.exists() and not list(tmp_path.iterdir())


def test_npz_object_and_structured_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self) -> Any:
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    # not numbers: each such member is listed in skipped (with why) and never read; the
    # numeric members beside it still read (the whole file used to be refused)
    np.savez(tmp_path / "obj.npz", ok=np.zeros(2), bad=np.array([Evil()], dtype=object))
    with cv.open(tmp_path / "obj.npz") as reader:
        assert list(reader) == ["ok"] and "'|O' refused" in reader.skipped["bad"]
        assert reader.read("ok").tolist() == [0.0, 0.0]
        with pytest.raises(cv.UnsupportedFormatError, match="refused"):
            reader["bad"]
    assert not marker.exists()
    np.savez(tmp_path / "rec.npz", r=np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]))
    with cv.open(tmp_path / "rec.npz") as reader:
        assert list(reader) == [] and "structured" in reader.skipped["r"]
    np.savez(tmp_path / "s.npz", s=np.array(["abc"]), w=np.ones(3))
    with cv.open(tmp_path / "s.npz") as reader:
        assert list(reader) == ["w"] and "'<U3' refused" in reader.skipped["s"]
    with zipfile.ZipFile(tmp_path / "p.npz", "w") as zf:  # a bare pickle as a member
        zf.writestr("x.npy", pickle.dumps([1, 2]))
    with pytest.raises(CorruptCheckpointError, match="magic"):
        cv.open(tmp_path / "p.npz")


def test_npz_sizes_are_checked_before_allocation(tmp_path: Path) -> None:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as zf:
        zf.writestr("x.npy", raw + b"\0" * 16)
    with pytest.raises(CorruptCheckpointError, match="needs 4398046511104"):
        cv.open(tmp_path / "huge.npz")
    # A deflated member whose declared size is impossible for its compressed size.
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", raw + b"\0" * 16)
    data = bytearray((tmp_path / "bomb.npz").read_bytes())
    for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        pos = data.find(sig)
        struct.pack_into("<I", data, pos + off, 0xFFFFFFF0)
    (tmp_path / "bomb.npz").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="zip bomb"):
        cv.open(tmp_path / "bomb.npz")


def test_npz_header_variants(tmp_path: Path) -> None:
    bad = {
        "nodict": "[1, 2]",
        "call": "__import__('os').system('true')",
        "keys": "{'descr': '<f4', 'shape': (1,)}",
        "fortran": "{'descr': '<f4', 'fortran_order': 1, 'shape': (1,)}",
        "shape": "{'descr': '<f4', 'fortran_order': False, 'shape': [1]}",
    }
    for name, text in bad.items():
        raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode()
        with zipfile.ZipFile(tmp_path / f"{name}.npz", "w") as zf:
            zf.writestr("x.npy", raw + b"\0" * 4)
        with pytest.raises(CorruptCheckpointError):
            NpzBackend.open_reader(tmp_path / f"{name}.npz")


def test_npz_compressed_members_read_lazily_and_detect_damage(tmp_path: Path) -> None:
    value = np.arange(5000, dtype="f8").reshape(100, 50)
    np.savez_compressed(tmp_path / "c.npz", w=value)
    with cv.open(tmp_path / "c.npz") as reader:
        np.testing.assert_array_equal(reader["w"][10:12], value[10:12])
    data = bytearray((tmp_path / "c.npz").read_bytes())
    data[200] ^= 0xFF
    (tmp_path / "c.npz").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError), cv.open(tmp_path / "c.npz") as reader:
        reader["w"].read()


@pytest.mark.parametrize("name", ["plain.npz", "compressed.npz"])
def test_npz_values_are_checked_against_the_zip_crc(tmp_path: Path, name: str) -> None:
    src = Path(__file__).resolve().parent.parent / "fixtures" / "npz" / name
    path = tmp_path / name
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo("weights.npy")
    assert cv.open(src).info("weights").checksum == info.CRC
    if name == "plain.npz":
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        data[info.header_offset + 30 + name_len + extra_len + 128 + 7] ^= 0x04  # a value bit
        path.write_bytes(bytes(data))
        with cv.open(path) as reader:
            assert reader["weights"][4].shape == (3,)  # slices are not checked
            with pytest.raises(CorruptCheckpointError, match="CRC-32"):
                reader["weights"].read()
            reader["weights"].read(verify=False)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_failed_write_leaves_the_previous_file_and_no_temporary(
    tmp_path: Path, suffix: str
) -> None:
    import subprocess
    import sys

    path = tmp_path / f"w{suffix}"
    cv.save(path, {"old": np.arange(4, dtype="f4")})
    before = path.read_bytes()
    code = (
        "import resource, signal, sys, numpy as np, ckptvar as cv\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    cv.save({str(path)!r}, {{'new': np.zeros(100_000, 'f4')}})\n"
        "except OSError as exc:\n"
        "    print('failed', exc.errno)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("failed 27"), out.stdout + out.stderr  # EFBIG
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    np.testing.assert_array_equal(cv.load(path)["old"], np.arange(4, dtype="f4"))


def test_npz_members_that_are_not_npy_are_listed_never_dropped(tmp_path: Path) -> None:
    """A member without ``.npy`` (NumPy's np.load returns it, as bytes or an array) used to be
    ignored without a word; beside ``a.npy`` a member ``a`` made ``reader['a']`` differ
    from ``np.load(...)['a']``."""
    def npy(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    p = tmp_path / "extra.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("w.npy", npy(np.ones(2)))
        zf.writestr("README.txt", b"hello")
        zf.writestr("bias", npy(np.zeros(2)))
    with cv.open(p) as reader:
        assert list(reader) == ["w"]
        assert set(reader.skipped) == {"README.txt", "bias"}
        assert "not a .npy" in reader.skipped["bias"]
    both = tmp_path / "both.npz"
    with zipfile.ZipFile(both, "w") as zf:
        zf.writestr("a.npy", npy(np.ones(2)))
        zf.writestr("a", npy(np.zeros(2)))
    with pytest.raises(CorruptCheckpointError, match=r"both\.npz.*'a'.*'a\.npy'"):
        cv.open(both)


@pytest.mark.parametrize("name", ["x.safetensors", "x.npz", "hf"])
def test_a_key_that_is_not_utf8_is_refused_by_name(tmp_path: Path, name: str) -> None:
    """A key holding a lone surrogate (how a TF checkpoint's non-UTF-8 key bytes are read)
    was written to safetensors as a JSON escape the safetensors library refuses, making
    the whole file unreadable there (npz: a bare UnicodeEncodeError)."""
    fmt = "hf-safetensors" if name == "hf" else None
    with pytest.raises(ValueError, match=r"'x\\udcff'.*UTF-8") as info:
        cv.save(tmp_path / name, {"x\udcff": np.ones(2), "ok": np.zeros(1)}, format=fmt)
    assert not isinstance(info.value, UnicodeError)
    assert not (tmp_path / name).exists()


def test_metadata_strings_that_are_not_utf8_keep_the_file_readable_by_safetensors(
    tmp_path: Path,
) -> None:
    """Such a string went into ``__metadata__`` as a JSON escape the safetensors library
    refuses, so the whole file was unreadable there; it is now kept in ckptvar's own JSON
    entry, read back as it was."""
    load_file = pytest.importorskip("safetensors.numpy").load_file
    path = tmp_path / "m.safetensors"
    cv.save(path, {"w": np.ones(2)}, metadata={"format": "pt", "note": "x\udcff", "k\udcff": "v"})
    assert load_file(str(path))["w"].tolist() == [1.0, 1.0]
    with cv.open(path) as reader:
        meta = reader.metadata()
    assert meta["note"] == "x\udcff" and meta["k\udcff"] == "v" and meta["format"] == "pt"
