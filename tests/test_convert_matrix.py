"""Conversions between formats, as a matrix: every dtype, every kind of name, every pair.

Each source is written by the library that owns its format where it is installed
(``torch.save``, ``safetensors.numpy.save_file``, ``np.savez``), else by ``cv.save``;
the fixtures in ``fixtures/`` stand for TensorFlow, Keras, Orbax and DCP. Each output
is read back by ckptvar and, where installed, by the owning library. A value must come
back bit-exact, under its name; a dtype or a name the destination cannot hold must be
refused, naming the value, before anything is written.

The default suite converts every source to one writable format (each format taken by
a few) and ckptvar's HDF5 to every one; the rest of the source-by-destination product
is ``slow``. Every conversion carries every dtype, layout and kind of name its source
can hold.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar._dtypes import SUPPORTED_DTYPES
from ckptvar.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"

#: writable format -> the name of an output in that format
OUTPUTS = {
    "h5": "out.h5",
    "zarr": "out.zarr",
    "safetensors": "out.safetensors",
    "hf-safetensors": "out_hf",
    "npz": "out.npz",
}

#: dtypes each writable format refuses (every other supported dtype must round-trip)
REFUSED: dict[str, set[str]] = {
    "h5": set(),
    "zarr": set(),
    "npz": set(),
    "safetensors": {"complex128", "float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz",
                    "int1", "int2", "int4", "uint1", "uint2", "uint4", "complex32",
                    "bcomplex32"},
}
REFUSED["hf-safetensors"] = REFUSED["safetensors"]


def bits(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """A value's dtype name, shape and C-order little-endian bytes: equal means bit-exact."""
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes()


def convert(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``ckpt convert ARGS`` in this process: (status, stdout, stderr)."""
    code = main(["convert", "-q", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _torch() -> Any:
    return pytest.importorskip("torch", reason="the test extra installs the CPU torch wheel")


def test_torch_float8_fnuz_and_e8m0_tensors_read_bit_exact(tmp_path: Path) -> None:
    torch = _torch()
    names = ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    sd = {n: torch.linspace(0.25, 4, 6).reshape(2, 3).to(getattr(torch, n)) for n in names}
    sd["plain"] = torch.ones(2)
    torch.save(sd, tmp_path / "f8.pt")
    loaded = cv.load(tmp_path / "f8.pt")
    for n in names:
        want = sd[n].view(torch.uint8).numpy().view(getattr(ml_dtypes, n))
        assert bits(loaded[n]) == bits(want), n


def test_torch_complex32_tensors_read_bit_exact(tmp_path: Path) -> None:
    torch = _torch()
    pytest.importorskip("ml_dtypes", minversion="0.5")  # ml_dtypes.complex32
    with pytest.warns(UserWarning, match="ComplexHalf"):  # torch: "support is experimental"
        half = torch.tensor([1 + 2j, -0.5 + 3j, 0j], dtype=torch.complex64).to(torch.chalf)
    torch.save({"z": half, "w": torch.ones(2)}, tmp_path / "c32.pt")
    z = cv.load(tmp_path / "c32.pt")["z"]
    assert z.dtype == np.dtype(ml_dtypes.complex32)
    assert bits(z) == bits(half.view(torch.float16).numpy().view(np.uint8).view(z.dtype))


def test_torch_paths_that_join_to_one_key_keep_the_file_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = _torch()
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, "c": torch.ones(1)},
               tmp_path / "two.pt")
    with cv.open(tmp_path / "two.pt") as reader:
        assert sorted(reader) == ["a.b", "c"]
        assert bits(reader.read("a.b")) == bits(np.ones(2, np.float32))
        assert reader.skipped == {"a.b ('a', 'b')": "its path ('a', 'b') joins with '.' to "
                                  "the key 'a.b' of another tensor, which is read under it"}
    code, _, err = convert(capsys, tmp_path / "two.pt", tmp_path / "out.h5")
    assert code == 2 and "('a', 'b')" in err and "--skip-unreadable" in err, err


def test_a_torch_tensor_of_a_dtype_ckptvar_cannot_hold_leaves_the_rest_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = _torch()
    packed = torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.bits8)
    torch.save({"packed": packed, "w": torch.ones(2)}, tmp_path / "b8.pt")
    with cv.open(tmp_path / "b8.pt") as reader:
        assert list(reader) == ["w"]
        assert reader.skipped == {"packed": "a torch.bits8 tensor, a dtype ckptvar "
                                  "cannot hold"}
    code, _, err = convert(capsys, tmp_path / "b8.pt", tmp_path / "out.h5")
    assert code == 2 and "'packed': a torch.bits8 tensor" in err, err
    code, out, err = convert(capsys, tmp_path / "b8.pt", tmp_path / "out.h5", "--skip-unreadable")
    assert code == 0 and "Left out 1 unreadable value" in out, err


def test_an_npz_key_too_long_for_a_zip_member_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    longest = "k" * (0xFFFF - len(".npy"))
    cv.save(tmp_path / "ok.npz", {longest: np.arange(3)})
    with np.load(tmp_path / "ok.npz") as data:
        assert list(data) == [longest]
    too_long = longest + "k"
    with pytest.raises(ValueError, match="more than a zip archive holds"):
        cv.save(tmp_path / "bad.npz", {too_long: np.arange(3)})
    cv.save(tmp_path / "src.h5", {too_long: np.arange(3)})
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.npz")
    assert code == 2 and err.startswith("ckpt: error: Invalid npz key")
    assert len(err) < 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "ok.npz", "src.h5"][1:]


def test_an_empty_key_converts_where_the_output_holds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cv.save(tmp_path / "src.h5", {"": np.arange(3.0), "w": np.ones(2)})
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.zarr")
    assert code == 0, err
    assert bits(cv.load(tmp_path / "out.zarr")[""]) == bits(np.arange(3.0))
    # safetensors has no empty name: the writer says so, and --rename gives it one
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors")
    assert code == 2 and "Invalid safetensors key ''" in err, err
    assert not (tmp_path / "out.safetensors").exists()
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors",
                           "--rename", "^$=empty")
    assert code == 0, err
    assert sorted(cv.load(tmp_path / "out.safetensors")) == ["empty", "w"]
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "x.h5", "--rename", "^w$=")
    assert code == 2 and "--rename maps 'w' to an empty key" in err, err


def test_dcp_float8_tensors_read_bit_exact(tmp_path: Path) -> None:
    torch = _torch()
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    names = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e8m0fnu"]
    state = {n: torch.linspace(0.25, 4, 6).reshape(2, 3).to(getattr(torch, n)) for n in names}
    state["t"] = torch.arange(6.0).reshape(2, 3).t()
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    loaded = cv.load(tmp_path / "dcp")
    for n in names:
        want = state[n].view(torch.uint8).numpy().view(getattr(ml_dtypes, n))
        assert bits(loaded[n]) == bits(want), n
    assert bits(loaded["t"]) == bits(state["t"].contiguous().numpy())


def test_orbax_paths_that_join_to_one_key_are_never_silently_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Orbax keeps {"a/b": [1, 1], "a": {"b": [2, 2]}} apart (a/b/ and a.b/); both join to a/b
    step = FIXTURES / "orbax" / "names_step"
    with cv.open(step) as reader:
        assert bits(reader.read("a/b")) == bits(np.full(2, 2, np.float32))
        (other, why), = reader.skipped.items()
        assert "('a/b',)" in other and "joins with '/' to the key 'a/b'" in why
    code, _, err = convert(capsys, step, tmp_path / "out.h5")
    assert code == 2 and "('a/b',)" in err and "--skip-unreadable" in err, err
    assert not (tmp_path / "out.h5").exists()
    code, out, err = convert(capsys, step, tmp_path / "out.h5", "--skip-unreadable")
    assert code == 0 and "Left out 1 unreadable value" in out, (out, err)


def test_legacy_keras_weights_named_alike_in_two_layers_are_never_silently_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "legacy.h5"
    with h5py.File(path, "w") as f:  # tf.keras 2's save_weights layout; two sub-models'
        f.attrs["layer_names"] = np.array([b"encoder", b"decoder"])  # layers share names
        for i, layer in enumerate(("encoder", "decoder")):
            g = f.create_group(layer)
            g.attrs["weight_names"] = np.array([b"dense/kernel:0"])
            g["dense/kernel:0"] = np.full((2, 2), i, np.float32)
    with cv.open(path) as reader:
        assert list(reader) == ["dense/kernel:0"]
        assert bits(reader.read("dense/kernel:0")) == bits(np.zeros((2, 2), np.float32))
        assert reader.skipped == {"dense/kernel:0 (decoder)": "a second weight named "
                                  "'dense/kernel:0' of layer 'decoder': the first is read under "
                                  "the name"}
    code, _, err = convert(capsys, path, tmp_path / "out.safetensors")
    assert code == 2 and "(decoder)" in err and "--skip-unreadable" in err, err


# --------------------------------------------------------------------------- the matrix

_SUB_BYTE = {"int1", "int2", "int4", "uint1", "uint2", "uint4",
             "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}


def dtype_values() -> dict[str, np.ndarray]:
    """A (2, 3) value of every dtype a checkpoint may hold, from random bits (NaN
    payloads, negative zeros and subnormals included: they must come back as bits)."""
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    for name, dtype in sorted(SUPPORTED_DTYPES.items()):
        if name in _SUB_BYTE:  # only the low bits are the value's
            # eight of them: a format that packs them (safetensors F4, F6) ends on a byte
            small = [0, 1, 0, 1, 1, 0, 1, 1] if name.startswith(("int", "uint")) else [
                0, 0.5, 1, 1.5, -2, 3, -0.5, 1]
            out[f"dtype/{name}"] = np.array(small).astype(dtype).reshape(2, 4)
            continue
        if dtype == np.bool_:
            value = rng.integers(0, 2, size=6).astype(bool)
        else:
            value = rng.integers(0, 256, size=6 * dtype.itemsize, dtype=np.uint8).view(dtype)
        out[f"dtype/{name}"] = value.reshape(2, 3)
    return out


def layout_values() -> dict[str, np.ndarray]:
    """0-d, empty, non-contiguous, Fortran-order and big-endian values."""
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    return {
        "layout/zero_d": np.array(2.5, np.float64),
        "layout/empty": np.zeros((0, 3), np.float32),
        "layout/empty_int": np.zeros((2, 0), np.int64),
        "layout/strided": base[::2, 1::3],
        "layout/fortran": np.asfortranarray(base.astype(np.int16)),
        "layout/big_endian": np.arange(6, dtype=">f8").reshape(2, 3),
        "layout/big_endian_int": np.arange(4, dtype=">u4"),
        "layout/big_endian_complex": (np.arange(3) + 1j).astype(">c8"),
    }


#: Names other formats escape, collide on or refuse (the escaping of ckptvar's own
#: containers, zip member names, safetensors' JSON header, TF object keys).
NAMES = ("nested/a/b/c", "dots.in.name", "with space", "\u00fcn\u00ef\u00e7\u00f8d\u00e9",
         "0leading_digit", "tensor:0", "L" * 300, "_leading_underscore", ".leading_dot",
         "percent%41", "Case", "case", "zarr.json", "a%2Fb")


def name_values() -> dict[str, np.ndarray]:
    return {f"name/{n}": np.full(2, i, np.float32) for i, n in enumerate(NAMES)}


def all_values() -> dict[str, np.ndarray]:
    return {**dtype_values(), **layout_values(), **name_values()}


def refused_by(fmt: str, values: dict[str, np.ndarray]) -> set[str]:
    return {k for k, v in values.items() if v.dtype.newbyteorder("=").name in REFUSED[fmt]}


METADATA = {"step": 7, "run": "matrix", "nested": {"lr": [0.1, 0.01]}}


def _own(fmt: str) -> Callable[[Path, dict[str, np.ndarray]], Path]:
    def write(tmp: Path, values: dict[str, np.ndarray]) -> Path:
        path = tmp / f"src_{fmt}{'' if fmt == 'hf-safetensors' else '.' + fmt}"
        keep = {k: v for k, v in values.items() if k not in refused_by(fmt, values)}
        cv.save(path, keep, format=fmt, metadata=METADATA)
        return path
    return write


def _torch_source(tmp: Path, values: dict[str, np.ndarray]) -> Path:
    torch = _torch()
    sd = {}
    with warnings.catch_warnings():  # torch: "ComplexHalf support is experimental"
        warnings.simplefilter("ignore", UserWarning)
        sd = _torch_tensors(torch, values)
    path = tmp / "src.pt"
    torch.save(sd, path)
    return path


def _torch_tensors(torch: Any, values: dict[str, np.ndarray]) -> dict[str, Any]:
    sd = {}
    for k, v in values.items():
        name = v.dtype.newbyteorder("=").name
        dt = getattr(torch, name, None) if name != "bool" else torch.bool
        if not isinstance(dt, torch.dtype) or name in _SUB_BYTE or name == "float8_e4m3":
            continue  # torch has no such dtype (or holds it packed)
        raw = np.ascontiguousarray(v.astype(v.dtype.newbyteorder("=")))
        if _plain(raw.dtype):
            sd[k] = torch.from_numpy(raw.copy())
        else:  # ml_dtypes: through the bits
            flat = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
            sd[k] = flat.view(dt).reshape(raw.shape)
    sd["layout/strided_view"] = torch.arange(24.0).reshape(4, 6)[::2, 1::3]  # a view, saved as one
    sd["layout/transposed"] = torch.arange(6.0).reshape(2, 3).t()
    return sd


def _safetensors_source(tmp: Path, values: dict[str, np.ndarray]) -> Path:
    st = pytest.importorskip("safetensors.numpy")
    keep = {k: np.ascontiguousarray(v.astype(v.dtype.newbyteorder("=")))
            for k, v in values.items()
            if v.dtype.newbyteorder("=").name in ("bool", "uint8", "int8", "int16", "uint16",
                                                   "int32", "uint32", "int64", "uint64",
                                                   "float16", "float32", "float64", "bfloat16",
                                                   "complex64")}
    path = tmp / "lib.safetensors"
    st.save_file(keep, str(path), metadata={"format": "pt", "note": "by safetensors"})
    return path


def _numpy_source(tmp: Path, values: dict[str, np.ndarray]) -> Path:
    keep = {k: v for k, v in values.items() if _plain(v.dtype)}  # what .npy spells
    path = tmp / "numpy.npz"
    np.savez(path, **keep)  # type: ignore[arg-type]
    return path


def _fixture(rel: str) -> Callable[[Path, dict[str, np.ndarray]], Path]:
    def source(tmp: Path, values: dict[str, np.ndarray]) -> Path:
        return FIXTURES / rel
    return source


SOURCES: dict[str, Callable[[Path, dict[str, np.ndarray]], Path]] = {
    "h5": _own("h5"),
    "zarr": _own("zarr"),
    "safetensors": _own("safetensors"),
    "hf-safetensors": _own("hf-safetensors"),
    "npz": _own("npz"),
    "torch": _torch_source,
    "safetensors-lib": _safetensors_source,
    "numpy-npz": _numpy_source,
    "tf2-object": _fixture("tf2_object/ckpt-1"),
    "tf2-names": _fixture("tf2_names/ckpt-1"),
    "tf-dtypes": _fixture("tf2_names/dtypes"),
    "tf1-partitioned": _fixture("tf1_saver/model.ckpt"),
    "keras": _fixture("keras/tiny.keras"),
    "keras-legacy": _fixture("keras/tiny_legacy.h5"),
    "orbax-ocdbt": _fixture("orbax/ocdbt_run/5"),
    "orbax-names": _fixture("orbax/names_step"),
    "dcp": _fixture("dcp/two_ranks"),
    "hf-model": _fixture("hf_sharded"),
}

#: The default suite: every source to one destination (each destination taken by a few),
#: and ckptvar's HDF5 to every destination; the rest of the product is ``slow``.
_DESTS = list(OUTPUTS)
FAST = {(src, _DESTS[i % len(_DESTS)]) for i, src in enumerate(SOURCES)}
FAST |= {("h5", dst) for dst in _DESTS}
PAIRS = [pytest.param(src, dst, id=f"{src}->{dst}",
                      marks=() if (src, dst) in FAST else pytest.mark.slow)
         for src in SOURCES for dst in _DESTS]


def _check_pair(tmp: Path, capsys: pytest.CaptureFixture[str], src_kind: str, dst_fmt: str,
                values: dict[str, np.ndarray]) -> None:
    src = SOURCES[src_kind](tmp, values)
    with cv.open(src) as reader:
        want = {k: reader.read(k) for k in reader}
        src_meta = reader.metadata()
        unreadable = dict(reader.skipped)
    dst = tmp / OUTPUTS[dst_fmt]
    refused = refused_by(dst_fmt, want)
    extra = ["--skip-unreadable"] if unreadable else []
    if refused:  # refused before anything is written, naming the values
        code, _, err = convert(capsys, src, dst, "--format", dst_fmt, *extra)
        assert code == 2 and f"cannot store the dtype of {len(refused)} value" in err, err
        assert all(repr(k)[:60] in err for k in sorted(refused)[:10]), err
        assert not dst.exists()
        extra += [a for k in sorted(refused) for a in ("--exclude", k)]
    code, out, err = convert(capsys, src, dst, "--format", dst_fmt, *extra)
    assert code == 0, err
    if unreadable:
        assert f"Left out {len(unreadable)} unreadable value" in out, out
    got = cv.load(dst)
    expected = {k: v for k, v in want.items() if k not in refused}
    assert sorted(got) == sorted(expected)  # every name kept, none added
    for key, value in expected.items():
        assert bits(got[key]) == bits(value), key
    with cv.open(dst) as written:
        meta = written.metadata()
    for key, value in src_meta.items():  # metadata kept (tuples become lists)
        assert json.loads(json.dumps(meta.get(key))) == json.loads(json.dumps(value)), key
    _read_with_owner(dst_fmt, dst, expected)


_PLAIN = {np.dtype(n) for n in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                  "uint32", "uint64", "float16", "float32", "float64",
                                  "complex64", "complex128")}


def _plain(dtype: np.dtype) -> bool:
    """A dtype NumPy itself spells (other tools hand ml_dtypes values back as their bits)."""
    return dtype.newbyteorder("=") in _PLAIN


def _read_with_owner(fmt: str, dst: Path, expected: dict[str, np.ndarray]) -> None:
    """The output read by the library that owns its format, where installed."""
    if fmt == "npz":
        with np.load(dst) as data:
            for key, value in expected.items():
                if _plain(value.dtype):
                    assert bits(data[key]) == bits(value), key
    elif fmt in ("safetensors", "hf-safetensors"):
        st = pytest.importorskip("safetensors")
        files = [dst] if fmt == "safetensors" else sorted(dst.glob("*.safetensors"))
        found: set[str] = set()
        for file in files:
            with st.safe_open(str(file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found.add(key)
                    value = expected[key]
                    if _plain(value.dtype):
                        assert bits(f.get_tensor(key)) == bits(value), key
        assert found == set(expected)


@pytest.mark.parametrize(("src_kind", "dst_fmt"), PAIRS)
def test_convert_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str], src_kind: str,
                        dst_fmt: str) -> None:
    _check_pair(tmp_path, capsys, src_kind, dst_fmt, all_values())


def test_sub_byte_values_a_packed_format_cannot_end_on_a_byte_are_named_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f6, f4 = ml_dtypes.float6_e2m3fn, ml_dtypes.float4_e2m1fn
    cv.save(tmp_path / "src.h5", {"six": np.zeros(6, f6), "eight": np.zeros(8, f6),
                                  "three": np.zeros(3, f4), "wide": np.ones(3)})
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors")
    assert code == 2, err
    assert ("safetensors cannot store 2 values at their element count: 'six' (float6_e2m3fn, "
            "6 elements); 'three' (float4_e2m1fn, 3 elements)") in err
    assert not (tmp_path / "out.safetensors").exists()
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors",
                           "--exclude", "six", "--exclude", "three")
    assert code == 0, err
    assert sorted(cv.load(tmp_path / "out.safetensors")) == ["eight", "wide"]


def test_a_conversion_never_replaces_its_own_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "hf"
    cv.save(model, {"w": np.arange(3.0), "v": np.ones(2)}, format="hf-safetensors",
            max_shard_size=30)
    shard = sorted(model.glob("model-*.safetensors"))[0]
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    # one shard into its own model folder, --force: the folder (and the other shard) would go
    code, _, err = convert(capsys, shard, model, "--format", "hf-safetensors", "--force")
    assert code == 2 and "lies inside" in err and "delete its own source" in err, err
    # a model folder onto one of its own files
    code, _, err = convert(capsys, model, model / "model.safetensors.index.json",
                           "--format", "safetensors", "--force")
    assert code == 2 and "is part of the source" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    single = tmp_path / "one"
    cv.save(single, {"w": np.arange(3.0)}, format="hf-safetensors")
    code, _, err = convert(capsys, single, single / "model.safetensors", "--force",
                           "--dtype", "float16")
    assert code == 2 and "is part of the source" in err, err
    assert cv.load(single)["w"].dtype == np.float64
    # a new file inside a source folder replaces nothing: allowed
    code, _, err = convert(capsys, model, model / "copy.h5")
    assert code == 0, err


def test_metadata_the_output_cannot_store_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = _torch()
    torch.save({"w": torch.ones(2), "seed": -(2**64), "epoch": 3}, tmp_path / "m.pt")
    for out in ("out.h5", "out.zarr"):
        code, _, err = convert(capsys, tmp_path / "m.pt", tmp_path / out)
        assert code == 2, err
        assert err.startswith(f"ckpt: error: Cannot store metadata in {str(tmp_path / out)!r}")
        assert "-18446744073709551616 at 'seed'" in err and "--no-metadata" in err, err
        assert "ckpt-probe" not in err
        code, _, err = convert(capsys, tmp_path / "m.pt", tmp_path / out, "--no-metadata")
        assert code == 0, err
    for out in ("out.safetensors", "out.npz"):  # JSON holds any integer
        code, _, err = convert(capsys, tmp_path / "m.pt", tmp_path / out)
        assert code == 0, err
        assert cv.open(tmp_path / out).metadata()["seed"] == -(2**64)


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_a_destination_name_up_to_255_bytes_is_written(tmp_path: Path, fmt: str) -> None:
    # the temporary beside DST adds 42 bytes to its name: it is cut, never DST's own
    name = "\u00e9" * 100 + "x" * (255 - 200 - len(".out")) + ".out"
    assert len(name.encode()) == 255
    values = {"w": np.arange(3.0)}
    written = cv.save(tmp_path / name, values, format=fmt)
    assert written.name == name
    assert bits(cv.load(written)["w"]) == bits(values["w"])
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_a_streamed_conversion_to_a_long_name_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cv.save(tmp_path / "src.h5", {"w": np.arange(40_000.0)})
    dst = tmp_path / ("x" * 245 + ".h5")
    code, _, err = convert(capsys, tmp_path / "src.h5", dst, "--window", "64K")
    assert code == 0, err
    assert bits(cv.load(dst)["w"]) == bits(np.arange(40_000.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dst.name, "src.h5"])


def test_a_folder_that_cannot_be_made_is_said_once_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cv.save(tmp_path / "src.h5", {"w": np.arange(3.0)})
    dst = tmp_path / "made" / ("d" * 300) / "out.h5"  # a folder name over 255 bytes
    code, _, err = convert(capsys, tmp_path / "src.h5", dst)
    assert code == 2, err
    assert err.startswith(f"ckpt: error: cannot create the folder {str(dst.parent)!r}")
    assert err.rstrip().endswith("File name too long") and "[Errno" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.h5"]  # 'made' taken back


def test_a_name_the_output_reserves_is_refused_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cv.save(tmp_path / "src.h5", {"__metadata__": np.ones(2), "__ckptvar__": np.ones(2)})
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors",
                           "--exclude", "__ckptvar__")
    assert code == 2 and "'__metadata__': __metadata__ names the header's metadata" in err, err
    assert "--rename" in err
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.npz",
                           "--exclude", "__metadata__")
    assert code == 2 and "'__ckptvar__': __ckptvar__ names ckptvar's own member" in err, err
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.npz",
                           "--rename", "^__ckptvar__$=ckptvar")
    assert code == 0, err
    assert sorted(cv.load(tmp_path / "out.npz")) == ["__metadata__", "ckptvar"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "src.h5"]


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_an_existing_destination_is_kept_without_force_and_replaced_whole_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    cv.save(tmp_path / "src.h5", {"w": np.arange(3.0)})
    dst = tmp_path / OUTPUTS[fmt]
    cv.save(dst, {"old": np.ones(2), "other": np.zeros(1)}, format=fmt)

    def snapshot() -> dict[str, bytes]:
        files = [dst] if dst.is_file() else sorted(p for p in dst.rglob("*") if p.is_file())
        return {str(p): p.read_bytes() for p in files}

    before = snapshot()
    code, _, err = convert(capsys, tmp_path / "src.h5", dst, "--format", fmt)
    assert code == 2 and "pass --force to replace it" in err, err
    assert snapshot() == before
    code, _, err = convert(capsys, tmp_path / "src.h5", dst, "--format", fmt, "--force")
    assert code == 0, err
    assert sorted(cv.load(dst)) == ["w"]  # replaced whole: nothing of the old one is left
    # a link to the source is the source: never replaced, even with --force
    link = tmp_path / f"link{dst.suffix}"
    link.symlink_to(tmp_path / "src.h5")
    code, _, err = convert(capsys, tmp_path / "src.h5", link, "--format", fmt, "--force")
    assert code == 2 and "same path" in err, err
    assert sorted(cv.load(tmp_path / "src.h5")) == ["w"]


def test_the_exclude_options_an_error_suggests_leave_out_exactly_those_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    z = np.arange(2, dtype=np.complex128)
    cv.save(tmp_path / "src.h5", {"layers[0]/z": z, "layers0/z": z, "w*": z, "ok": np.ones(1)})
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors")
    assert code == 2, err
    suggested = shlex.split(err.split("leave them out with ")[1])
    code, _, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.safetensors", *suggested)
    assert code == 0, err
    assert sorted(cv.load(tmp_path / "out.safetensors")) == ["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_an_interrupted_conversion_leaves_nothing_half_written(tmp_path: Path, fmt: str) -> None:
    """Ctrl-C while the output is being written: DST is whole or absent, nothing else, and
    the command ends (a worker thread a pool was starting made it wait forever, now and
    then: three tries each)."""
    values = {f"w{i}": np.full(2_000_000, i, np.float32) for i in range(16)}
    cv.save(tmp_path / "src.h5", values)
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        dst = out / OUTPUTS[fmt]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptvar", "convert", str(tmp_path / "src.h5"), str(dst),
             "--format", fmt, "--window", "16M"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 60
        while not any(out.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # the scratch file or the temporary: writing has begun
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"try {attempt}: ckpt convert did not end after Ctrl-C") from None
        if proc.returncode == 0:  # it finished first: the output is whole
            assert sorted(cv.load(dst)) == sorted(values)
        else:
            assert proc.returncode == 130 and err.endswith("ckpt: error: interrupted\n"), err
            assert list(out.iterdir()) == []


def test_a_file_of_a_multi_file_source_is_never_replaced_by_its_conversion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "hf"
    cv.save(model, {"w": np.arange(3.0), "v": np.ones(2)}, format="hf-safetensors",
            max_shard_size=30)
    index = model / "model.safetensors.index.json"
    shard = sorted(model.glob("model-*.safetensors"))[-1]
    before = shard.read_bytes()
    code, _, err = convert(capsys, index, shard, "--force")  # SRC named by its index
    assert code == 2 and "is part of the source" in err, err
    assert shard.read_bytes() == before
    tf = tmp_path / "tf"
    tf.mkdir()
    for name in ("ckpt-1.index", "ckpt-1.data-00000-of-00001"):
        shutil.copy(FIXTURES / "tf2_object" / name, tf / name)
    data = tf / "ckpt-1.data-00000-of-00001"
    before = data.read_bytes()
    for src in ("ckpt-1", "ckpt-1.index"):
        code, _, err = convert(capsys, tf / src, data, "--format", "npz", "--force")
        assert code == 2 and "is part of the source" in err, err
    assert data.read_bytes() == before
    code, _, err = convert(capsys, tf / "ckpt-1", tf / "ckpt-1.h5")  # a new sibling: fine
    assert code == 0, err
