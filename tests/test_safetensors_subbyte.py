"""safetensors' sub-byte dtypes (F4, F6_E2M3, F6_E3M2): packed as the safetensors library packs them."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckptvar as cv

SUBBYTE = {
    "F4": (np.dtype(ml_dtypes.float4_e2m1fn), 4),
    "F6_E2M3": (np.dtype(ml_dtypes.float6_e2m3fn), 6),
    "F6_E3M2": (np.dtype(ml_dtypes.float6_e3m2fn), 6),
}


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _every_code(dtype: np.dtype, bits: int) -> np.ndarray:
    """Every bit pattern of the type, twice, as a (rows, 8) array."""
    codes = np.tile(np.arange(1 << bits, dtype=np.uint8), 2)
    return codes.view(dtype).reshape(-1, 8)


@pytest.mark.parametrize("name", sorted(SUBBYTE))
def test_every_code_round_trips_packed(tmp_path: Path, name: str) -> None:
    dtype, bits = SUBBYTE[name]
    value = _every_code(dtype, bits)
    path = tmp_path / "m.safetensors"
    cv.save(path, {"w": value, "s": np.zeros((0, 4), dtype)})
    header = _header(path)[0]
    assert header["w"]["dtype"] == name
    assert header["w"]["shape"] == list(value.shape)  # the logical shape, as safetensors keeps it
    assert header["w"]["data_offsets"][1] - header["w"]["data_offsets"][0] == value.size * bits // 8
    with cv.open(path) as reader:
        back = reader["w"].read()
        assert back.dtype == dtype and back.shape == value.shape
        assert np.array_equal(back.view(np.uint8), value.view(np.uint8))
        assert np.array_equal(reader["w"][1:3, 2].view(np.uint8), value[1:3, 2].view(np.uint8))
        out = np.empty(value.shape, dtype)
        reader["w"].read(out=out)
        assert np.array_equal(out.view(np.uint8), value.view(np.uint8))
        assert reader["s"].read().shape == (0, 4)


def test_bit_order_is_the_little_endian_stream(tmp_path: Path) -> None:
    """F4: first value in the low nibble (torch float4_e2m1fn_x2); F6: four values in three bytes."""
    path = tmp_path / "o.safetensors"
    f4 = np.array([1, 2, 3, 4], np.uint8).view(ml_dtypes.float4_e2m1fn)
    f6 = np.array([1, 2, 3, 4], np.uint8).view(ml_dtypes.float6_e2m3fn)
    cv.save(path, {"a": f4, "b": f6})
    header, data = _header(path)
    a0, a1 = header["a"]["data_offsets"]
    b0, b1 = header["b"]["data_offsets"]
    assert data[a0:a1] == bytes([0x21, 0x43])
    word = 1 | 2 << 6 | 3 << 12 | 4 << 18
    assert data[b0:b1] == word.to_bytes(3, "little")


def test_the_safetensors_library_reads_our_f4_and_we_read_its(tmp_path: Path) -> None:
    codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
    ours = tmp_path / "ours.safetensors"
    cv.save(ours, {"w": codes.view(ml_dtypes.float4_e2m1fn)})
    with safe_open(str(ours), "pt") as f:
        t = f.get_tensor("w")
    assert t.dtype == torch.float4_e2m1fn_x2 and tuple(t.shape) == (2, 4)
    packed = t.view(torch.uint8).numpy()
    assert np.array_equal(packed & 0x0F, codes[:, 0::2]) and np.array_equal(packed >> 4, codes[:, 1::2])

    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.from_numpy(packed.copy()).view(torch.float4_e2m1fn_x2)}, str(theirs))
    with cv.open(theirs) as reader:
        assert reader["w"].dtype == ml_dtypes.float4_e2m1fn
        assert np.array_equal(reader["w"].read().view(np.uint8), codes)


def test_the_safetensors_library_accepts_our_f6_header(tmp_path: Path) -> None:
    """The library validates F6 sizes (no framework of it returns F6 values yet)."""
    path = tmp_path / "f6.safetensors"
    cv.save(path, {"y": np.zeros((3, 4), ml_dtypes.float6_e3m2fn)})
    with safe_open(str(path), "np") as f:
        assert list(f.keys()) == ["y"]
        assert f.get_slice("y").get_shape() == [3, 4]
        assert f.get_slice("y").get_dtype() == "F6_E3M2"


def test_a_count_that_does_not_end_at_a_byte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    with pytest.raises(cv.UnsupportedFormatError, match="multiple of 4"):
        cv.save(path, {"y": np.zeros(6, ml_dtypes.float6_e2m3fn)})
    with pytest.raises(cv.UnsupportedFormatError, match="multiple of 2"):
        cv.save(path, {"y": np.zeros(3, ml_dtypes.float4_e2m1fn)})
    assert not path.exists()
    head = json.dumps({"y": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"\0\0")
    with pytest.raises(cv.CorruptCheckpointError, match="byte boundary"):
        cv.open(path)


def test_ckpt_convert_writes_float4_to_safetensors_and_back(tmp_path: Path) -> None:
    value = _every_code(np.dtype(ml_dtypes.float4_e2m1fn), 4)
    src = tmp_path / "m.h5"
    cv.save(src, {"w": value})
    mid, back = tmp_path / "m.safetensors", tmp_path / "back.h5"
    for a, b in ((src, mid), (mid, back)):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvar", "convert", str(a), str(b)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _header(mid)[0]["w"]["dtype"] == "F4"
    loaded = cv.load(back)["w"]
    assert loaded.dtype == ml_dtypes.float4_e2m1fn
    assert np.array_equal(loaded.view(np.uint8), value.view(np.uint8))
