"""Conversions between formats, as a matrix: every dtype, every kind of name, every pair.

Each source is written by the library that owns its format where it is installed
(``torch.save``, ``safetensors.numpy.save_file``, ``np.savez``), else by ``cv.save``;
the fixtures in ``fixtures/`` stand for TensorFlow, Keras, Orbax and DCP. Each output
is read back by ckptvar and, where installed, by the owning library. A value must come
back bit-exact, under its name; a dtype or a name the destination cannot hold must be
refused, naming the value, before anything is written.

The default suite converts one small source per format to every writable format; the
full dtype-by-name-by-pair matrix is ``slow``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
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
    code, out, err = convert(capsys, tmp_path / "src.h5", tmp_path / "out.zarr")
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
