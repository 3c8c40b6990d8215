"""Keras 3 raw-dtype weights, ``.keras`` archives, hollow HDF5 datasets, and what readers skip."""

from __future__ import annotations

import json
import tracemalloc
import zipfile
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError
from ckptvar.formats import HDF5Backend, KerasBackend
from ckptvar.storage import backend_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["files"]
BF16 = np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- item 3: dtypes


def test_keras3_bfloat16_weights_are_read_with_their_dtype() -> None:
    want = MANIFEST["keras/tiny.weights.h5"]["tensors"]
    bf16 = sorted(k for k, v in want.items() if v["dtype"] == "bfloat16")
    assert len(bf16) >= 2 and {v["dtype"] for v in want.values()} >= {"float32", "float16"}
    with cv.open(FIXTURES / "keras" / "tiny.weights.h5") as reader:
        assert reader.skipped == {}
        for key in bf16:
            assert reader.info(key).dtype == BF16
            whole = reader[key].read()
            assert whole.dtype == BF16
            np.testing.assert_array_equal(reader[key][1:], whole[1:])
    values = cv.load(FIXTURES / "keras" / "tiny.weights.h5")
    assert all(values[k].dtype == BF16 for k in bf16)


@pytest.mark.parametrize("stored", ["opaque", "uint16"])
def test_a_dtype_attribute_on_raw_16_bit_data_is_honoured(stored: str, tmp_path: Path) -> None:
    value = np.array([1.5, -2.25, 3.0], BF16)
    path = tmp_path / "w.weights.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("layers/dense/vars")
        bits = value.view(np.uint16)
        data = bits.view(np.dtype("V2")) if stored == "opaque" else bits
        g.create_dataset("0", data=data).attrs["dtype"] = "bfloat16"
        g.create_dataset("1", data=bits).attrs["dtype"] = "float8_e4m3fn"  # width differs
    with cv.open(path) as reader:
        np.testing.assert_array_equal(reader["layers/dense/vars/0"].read(), value)
        assert reader["layers/dense/vars/1"].dtype == np.dtype("uint16")  # not reinterpreted


# --------------------------------------------------------------------------- item 3: .keras


def test_a_keras_archive_reads_like_its_weights_file() -> None:
    archive = FIXTURES / "keras" / "tiny.keras"
    assert backend_for(archive) is KerasBackend
    with cv.open(archive) as reader, cv.open(FIXTURES / "keras" / "tiny.weights.h5") as weights:
        assert reader.format == "keras"
        assert sorted(reader) == sorted(weights)
        for key in weights:
            a, b = reader[key].read(), weights[key].read()
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        meta = reader.metadata()
        assert meta["config"]["class_name"] == "Functional"
        assert meta["metadata"]["keras_version"].startswith("3.")
    assert set(cv.load(archive)) == set(MANIFEST["keras/tiny.keras"]["tensors"])


def _rezip(src: Path, dst: Path, *, rename: dict[str, str] | None = None,
           deflate: bool = False, extra: dict[str, bytes] | None = None,
           drop: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            name = (rename or {}).get(info.filename, info.filename)
            method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            zout.writestr(zipfile.ZipInfo(name), zin.read(info), compress_type=method)
        for name, data in (extra or {}).items():
            zout.writestr(name, data)
    return dst


def test_a_deflated_keras_archive_reads_the_same(tmp_path: Path) -> None:
    src = FIXTURES / "keras" / "tiny.keras"
    path = _rezip(src, tmp_path / "deflated.keras", deflate=True)
    with cv.open(path) as a, cv.open(src) as b:
        for key in b:
            assert a[key].read().tobytes() == b[key].read().tobytes()


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("traversal", "outside the archive"),
        ("absolute", "outside the archive"),
        ("no_weights", "no 'model.weights.h5'"),
        ("npz_weights", "does not read"),
        ("bad_json", "config.json"),
    ],
)
def test_a_keras_archive_is_checked_strictly(case: str, match: str, tmp_path: Path) -> None:
    src = FIXTURES / "keras" / "tiny.keras"
    path = tmp_path / "bad.keras"
    if case == "traversal":
        _rezip(src, path, extra={"../../evil.json": b"{}"})
    elif case == "absolute":
        _rezip(src, path, extra={"/etc/evil": b"{}"})
    elif case == "no_weights":
        _rezip(src, path, drop=("model.weights.h5",))
    elif case == "npz_weights":
        _rezip(src, path, rename={"model.weights.h5": "model.weights.npz"})
    else:
        _rezip(src, path, drop=("config.json",), extra={"config.json": b"{not json"})
    with pytest.raises(CorruptCheckpointError, match=match):
        cv.open(path)


def test_a_keras_archive_bomb_is_refused_before_inflating(tmp_path: Path) -> None:
    path = _rezip(FIXTURES / "keras" / "tiny.keras", tmp_path / "bomb.keras",
                  drop=("config.json",))
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(zipfile.ZipInfo("config.json"), b" " * (80 << 20),
                    compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(CorruptCheckpointError, match="limit|zip bomb"):
        cv.open(path)


# --------------------------------------------------------------------------- item 21: hollow


def _hollow(tmp: Path, n: int, *, chunked: bool = True, write_first: bool = False) -> Path:
    path = tmp / "hollow.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("big/x", shape=(n,), dtype="f8",
                             chunks=(1024,) if chunked else None)
        if write_first:
            d[:1024] = 1.0
        f["small"] = np.arange(3.0)
    return path


@pytest.mark.parametrize(
    ("n", "chunked", "write_first"),
    [(2**31, True, False), (2**40, True, False), (2**31, False, False), (2**31, True, True)],
    ids=["2^31-chunked", "2^40-chunked", "2^31-contiguous", "one-chunk-written"],
)
def test_a_hollow_dataset_is_refused_before_allocating(
    n: int, chunked: bool, write_first: bool, tmp_path: Path
) -> None:
    path = _hollow(tmp_path, n, chunked=chunked, write_first=write_first)
    assert path.stat().st_size < 64 * 1024
    tracemalloc.start()
    try:
        with cv.open(path) as reader:
            assert reader.info("big/x").shape == (n,)  # still listed
            np.testing.assert_array_equal(reader["small"].read(), np.arange(3.0))
            for read in (lambda: reader["big/x"].read(), lambda: reader["big/x"][...],
                         lambda: reader["big/x"][:10]):
                with pytest.raises(CorruptCheckpointError, match="'big/x'.*fill value"):
                    read()
        with pytest.raises(CorruptCheckpointError, match="big/x"):
            cv.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_unwritten_data_is_read_as_fill_values_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "partial.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(4096,), dtype="f4", chunks=(1024,), fillvalue=7.0)
        d[:1024] = 1.0
    with HDF5Backend.open_reader(path, read_unwritten=True) as reader:
        value = reader["x"].read()
    assert (value[:1024] == 1).all() and (value[1024:] == 7).all()


def test_written_and_compressed_datasets_are_not_hollow(tmp_path: Path) -> None:
    path = tmp_path / "zeros.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("z", data=np.zeros(1 << 20), chunks=(1 << 16,), compression="gzip")
        f.create_dataset("empty", shape=(0, 3), dtype="f4")
    with cv.open(path) as reader:
        assert not reader["z"].read().any()
        assert reader["empty"].read().shape == (0, 3)


# --------------------------------------------------------------------------- item 2: skipped


def test_every_reader_says_what_it_skipped_and_why(tmp_path: Path) -> None:
    for name in sorted(MANIFEST):
        with cv.open(FIXTURES / name) as reader:
            assert isinstance(reader.skipped, dict), name
            assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in reader.skipped, name
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f["numbers"] = np.arange(3)
        f["text"] = "hello"
        f["rows"] = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
        f["names"] = np.array([b"a", b"bc"])
    with cv.open(path) as reader:
        assert list(reader) == ["numbers"]
        assert set(reader.skipped) == {"text", "rows", "names"}
        assert all("not a plain numeric type" in why for why in reader.skipped.values())
        with pytest.raises(cv.UnsupportedFormatError, match="rows"):
            reader["rows"]
    with cv.open(FIXTURES / "tf2_object" / "ckpt-1") as reader:
        assert "_CHECKPOINTABLE_OBJECT_GRAPH" in reader.bookkeeping


def test_torch_leaves_that_are_neither_tensors_nor_plain_values_are_listed(tmp_path: Path) -> None:
    # {'w': tensor, 'blob': b'xy', 'dt': torch.float32, 'n': 3}, as a hand-written pickle.
    pkl = (
        b"\x80\x02}(X\x01\x00\x00\x00w"
        b"ctorch._utils\n_rebuild_tensor_v2\n("
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
        b"K\x02tQK\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR"
        b"X\x04\x00\x00\x00blobC\x02xy"
        b"X\x02\x00\x00\x00dtctorch\nfloat32\n"
        b"X\x01\x00\x00\x00nK\x03u."
    )
    path = tmp_path / "mixed.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", np.array([1, 2], "<f4").tobytes())
    with cv.open(path) as reader:
        assert list(reader) == ["w"]
        assert reader.metadata() == {"n": 3}
        assert set(reader.skipped) == {"blob", "dt"}
        assert "torch.float32" in reader.skipped["dt"] and "bytes" in reader.skipped["blob"]


def test_inspect_shows_the_keras_layer_names_in_the_table_and_the_tree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ckptvar.cli import main

    path = FIXTURES / "keras" / "tiny.weights.h5"
    with cv.open(path) as reader:
        layers = {k: reader.info(k).attrs.get("layer") for k in reader}
    assert layers["layers/dense/vars/0"] == "hidden" and layers["layers/dense/vars/0"] not in (
        ["layers", "dense", "vars", "0"])
    assert main(["inspect", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("KEY"))
    assert header.split()[:2] == ["KEY", "LAYER"]
    row = next(line for line in table if line.startswith("layers/dense/vars/0 "))
    assert row.split()[1] == "hidden"
    assert next(line for line in table if line.startswith("optimizer/vars/0 ")).split()[1] == "adam"
    assert main(["inspect", str(path), "--tree"]) == 0
    tree = capsys.readouterr().out
    assert "layer 'hidden'" in tree and "layer 'norm'" in tree
    # A legacy file's keys already hold the layer name: no column repeats it.
    assert main(["inspect", str(FIXTURES / "keras" / "tiny_legacy.h5")]) == 0
    assert "LAYER" not in capsys.readouterr().out
