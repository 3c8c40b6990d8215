"""A safetensors file converted from a torch or Hugging Face file loads in torch and keeps ``format``."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="the test extra installs the CPU torch wheel")
st_torch = pytest.importorskip("safetensors.torch")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta: dict[str, str] = json.loads(raw[8 : 8 + n]).get("__metadata__", {})
    return meta


def _convert(src: Path, dst: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvar", "convert", str(src), str(dst)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_a_torch_file_becomes_a_pt_safetensors_file(tmp_path: Path) -> None:
    state = {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "fc.bias": torch.ones(2, dtype=torch.bfloat16)}
    src = tmp_path / "model.pt"
    torch.save(state, src)
    dst = tmp_path / "model.safetensors"
    proc = _convert(src, dst)
    assert _metadata(dst).get("format") == "pt"
    assert "format" in proc.stdout  # the added entry is said, never silent
    loaded = st_torch.load_file(str(dst))
    assert sorted(loaded) == sorted(state)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key], value)


def test_an_hf_safetensors_file_keeps_its_format_through_h5(tmp_path: Path) -> None:
    src = tmp_path / "hf.safetensors"
    st_torch.save_file({"w": torch.ones(2, 2)}, str(src), metadata={"format": "pt"})
    mid, dst = tmp_path / "mid.h5", tmp_path / "back.safetensors"
    _convert(src, mid)
    _convert(mid, dst)
    assert _metadata(dst).get("format") == "pt"
    np.testing.assert_array_equal(st_torch.load_file(str(dst))["w"].numpy(), np.ones((2, 2)))
    with cv.open(dst) as reader:
        assert reader.metadata().get("format") == "pt"
