"""safetensors output keeps string metadata (``format``) where Hugging Face tools look for it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import ckptvar as cv
from ckptvar.formats import SafetensorsBackend

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _header_metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]).get("__metadata__", {})


def _convert(src: Path, dst: Path, *extra: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvar", "convert", str(src), str(dst), *extra],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_converting_an_hf_file_keeps_format_at_the_top_level(tmp_path: Path) -> None:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}
    src = tmp_path / "hf.safetensors"
    safetensors.numpy.save_file(arrays, str(src), metadata={"format": "pt"})
    dst = tmp_path / "out.safetensors"
    _convert(src, dst)
    assert _header_metadata(dst) == {"format": "pt"}
    loaded = safetensors.numpy.load_file(str(dst))
    assert sorted(loaded) == sorted(arrays)
    for key, value in arrays.items():
        np.testing.assert_array_equal(loaded[key], value)
    with cv.open(dst) as reader:
        assert reader.metadata() == {"format": "pt"}


def test_a_converted_torch_file_loads_with_safetensors(tmp_path: Path) -> None:
    src = FIXTURES / "torch" / "state_dict.pt"
    dst = tmp_path / "model.safetensors"
    _convert(src, dst, "--filter", "[02].*")
    want = {k: v for k, v in cv.load(src).items() if k.startswith(("0.", "2."))}
    loaded = safetensors.numpy.load_file(str(dst))
    assert sorted(loaded) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_string_metadata_stays_at_the_top_and_the_rest_under_ckptvar(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    meta = {"format": "pt", "step": 3, "blob": b"\x00\x01", "note": "kept"}
    cv.save(path, {"w": np.zeros(2, np.float32)}, metadata=meta, attrs={"w": {"trainable": False}})
    top = _header_metadata(path)
    assert top["format"] == "pt" and top["note"] == "kept"
    assert set(top) == {"format", "note", "ckptvar.attrs", "ckptvar.metadata"}
    with cv.open(path) as reader:
        assert reader.metadata() == meta
        assert reader.info("w").attrs["trainable"] is False


def test_without_ckptvar_metadata_only_string_pairs_are_written(tmp_path: Path) -> None:
    path = tmp_path / "bare.safetensors"
    writer = SafetensorsBackend.open_writer(path, ckptvar_metadata=False)
    writer.add("w", np.ones(2, np.float32), {"name": "w", "trainable": False})
    writer.set_metadata({"format": "pt", "step": 3})
    writer.commit()
    assert _header_metadata(path) == {"format": "pt"}
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(path))["w"], np.ones(2))


def test_files_written_before_keep_their_metadata(tmp_path: Path) -> None:
    path = tmp_path / "old.safetensors"
    header = {"__metadata__": {"ckptvar.metadata": json.dumps({"step": 5, "format": "pt"})},
              "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + np.float32(2).tobytes())
    with cv.open(path) as reader:
        assert reader.metadata() == {"step": 5, "format": "pt"}


@pytest.mark.parametrize("bad", ["[1, 2]", "not json"])
def test_damaged_ckptvar_metadata_is_an_error(bad: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    header = {"__metadata__": {"ckptvar.metadata": bad},
              "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + np.float32(2).tobytes())
    with pytest.raises(cv.CorruptCheckpointError, match="ckptvar"):
        cv.open(path)


def test_cv_save_writes_format_pt_with_any_metadata_unless_given(tmp_path: Path) -> None:
    """As ``ckpt convert`` does: transformers refuses a header whose metadata has no format."""
    w = {"w": np.ones(3, np.float32)}
    cases = {
        "plain": ({}, None),  # no metadata at all: no __metadata__, which loaders accept
        "meta": ({"metadata": {"step": 7}}, "pt"),
        "strings": ({"metadata": {"source": "x"}, "ckptvar_metadata": False}, "pt"),
        "attrs": ({"attrs": {"w": {"trainable": False}}}, "pt"),
        "given": ({"metadata": {"format": "flax", "step": 7}}, "flax"),
    }
    for name, (options, fmt) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        cv.save(path, w, **options)
        header = _header_metadata(path)
        assert header.get("format") == fmt, (name, header)
        with safetensors.safe_open(str(path), "np") as f:
            assert f.metadata() == (header or None), name
    with cv.open(tmp_path / "meta.safetensors") as reader:
        assert reader.metadata() == {"format": "pt", "step": 7}
