"""Files that plain tools read by name (issue 23, section 2).

A checkpoint of up to 2,048 values shows every value by its key to plain h5py and
zarr-python; larger ones pack their small values; ``pack_threshold`` is accepted by every
save; the root attributes say what the file is; docs/FORMAT.md's plain-h5py and plain-zarr
recipes, extracted from the page, read every kind of checkpoint.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckptvar._dtypes import SUPPORTED_DTYPES, kind_of

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def recipe(name: str) -> Callable[[Any], dict[str, np.ndarray]]:
    """The function ``name`` as FORMAT.md defines it, run from the page's own block."""
    blocks = [b for b in _BLOCK.findall((DOCS / "FORMAT.md").read_text()) if f"def {name}(" in b]
    assert len(blocks) == 1, f"FORMAT.md defines {name} once"
    assert "import ckptvar" not in blocks[0] and "cv." not in blocks[0], "plain tools only"
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], f"FORMAT.md:{name}", "exec"), namespace)
    fn: Callable[[Any], dict[str, np.ndarray]] = namespace[name]
    return fn


def _listed(path: Path) -> set[str]:
    """What plain h5py (visit) or zarr-python (members) lists, as names, minus ckptvar's own."""
    if path.suffix == ".h5":
        names: list[str] = []
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    else:
        root = zarr.open_group(path, mode="r")
        names = [n for n, a in root.members(max_depth=None) if isinstance(a, zarr.Array)]
    return {n for n in names if not n.startswith("_ckptvar/")}


def every_ml_dtype() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, dt in SUPPORTED_DTYPES.items():
        kind = kind_of(dt)
        if kind == "f":
            base = [0.5, 1, 2, 4] if "e8m0" in name else [0.5, 1, -1, 2]
            out[f"dt/{name}"] = np.array(base, np.float32).astype(dt)
        elif kind == "c":
            out[f"dt/{name}"] = np.array([1 + 2j, 0.5], np.complex64).astype(dt)
        elif kind == "b":
            out[f"dt/{name}"] = np.array([True, False])
        else:
            out[f"dt/{name}"] = np.array([0, 1], np.int8).astype(dt)
    return out


TINY = {
    "bert/embeddings/word": np.arange(12, dtype=np.float32).reshape(3, 4),
    "bert/encoder/layer/0/attention/query/kernel": np.ones((4, 4), ml_dtypes.bfloat16),
    "bert/encoder/layer/0/attention/query/bias": np.zeros(4, ml_dtypes.bfloat16),
    "bert/pooler/scale": np.full(3, 0.5, ml_dtypes.float8_e4m3fn),
    "bert/pooler/e5": np.full(3, 2, ml_dtypes.float8_e5m2),
    "bert/packed4": np.array([1, -2, 3], ml_dtypes.int4),
    "step": np.array(7, np.int64),
    "empty": np.zeros((0, 3), np.float32),
}


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_tiny_model_shows_every_value_by_its_key(tmp_path: Path, suffix: str) -> None:
    p = cv.save(tmp_path / f"tiny{suffix}", TINY)
    assert _listed(Path(p)) == set(TINY)
    assert not (Path(p) / "_ckptvar" / "packed").exists() if suffix == ".zarr" else True


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_the_default_packs_only_checkpoints_of_many_values(tmp_path: Path, suffix: str) -> None:
    few = {f"v{i}": np.full(2, i, np.float32) for i in range(2048)}
    many = {f"v{i}": np.full(2, i, np.float32) for i in range(2049)}
    assert len(_listed(Path(cv.save(tmp_path / f"few{suffix}", few)))) == 2048
    assert _listed(Path(cv.save(tmp_path / f"many{suffix}", many))) == set()
    big = {**many, "big": np.ones(70_000, np.uint8)}  # 64 KiB and more: its own array
    assert _listed(Path(cv.save(tmp_path / f"big{suffix}", big))) == {"big"}
    assert np.array_equal(cv.load(tmp_path / f"many{suffix}")["v2048"], many["v2048"])


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_root_attributes_say_what_the_file_is(tmp_path: Path, suffix: str) -> None:
    p = cv.save(tmp_path / f"a{suffix}", TINY)
    if suffix == ".h5":
        with h5py.File(p, "r") as f:
            attrs = dict(f.attrs)
            assert attrs["manifest"] in f
    else:
        root = zarr.open_group(p, mode="r")
        attrs = dict(root.attrs)
        assert attrs["manifest"] in root
    assert attrs["format"] == "ckptvar"
    assert attrs["format_version"] == "1.2"
    assert "ckptvar checkpoint" in attrs["description"]


def _read_everything(reader: Callable[[Any], dict[str, np.ndarray]], p: Any,
                     values: dict[str, np.ndarray]) -> None:
    got = reader(p)
    assert set(got) == set(values)
    for k, v in values.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


CASES: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {
    "bf16-float8-no-packed": (TINY, {}),
    "every-ml-dtype-packed": ({**every_ml_dtype(), **TINY}, {"pack_threshold": 1 << 20}),
    "every-ml-dtype-own": (every_ml_dtype(), {"pack_threshold": 0}),
    "many-packed": ({f"m/{i}": np.full(i % 5, i, ml_dtypes.bfloat16) for i in range(2500)}, {}),
    "only-empty-packed": ({"a": np.zeros(0, np.float32), "b": np.zeros((2, 0), np.int8)},
                          {"pack_threshold": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_format_md_h5py_recipe_reads_every_value(tmp_path: Path, case: str) -> None:
    values, options = CASES[case]
    p = cv.save(tmp_path / "c.h5", values, **options)
    _read_everything(recipe("read_h5"), p, values)


@pytest.mark.parametrize("case", [*CASES, "compressed"])
def test_format_md_zarr_recipe_reads_every_value(tmp_path: Path, case: str) -> None:
    if case == "compressed":
        values, options = TINY, {"compression": "zstd"}
    else:
        values, options = CASES[case]
    p = cv.save(tmp_path / "c.zarr", values, **options)
    _read_everything(recipe("read_zarr"), p, values)


def test_pack_threshold_is_accepted_by_every_save(tmp_path: Path) -> None:
    v = cv.Variable(np.ones(3, np.float32), name="w")
    ckpt = cv.Checkpoint(w=v)
    packed = [
        ckpt.write(tmp_path / "write.h5", pack_threshold=1 << 20),
        ckpt.save(tmp_path / "save", pack_threshold=1 << 20),
        ckpt.save(tmp_path / "async", pack_threshold=1 << 20, blocking=False).wait(),
        cv.Saver([v]).save(str(tmp_path / "saver"), pack_threshold=1 << 20),
        cv.CheckpointManager(ckpt, tmp_path / "m", pack_threshold=1 << 20).save(),
        cv.save(tmp_path / "cv.zarr", {"w": np.ones(3)}, pack_threshold=1 << 20),
    ]
    for p in packed:
        assert _listed(Path(p)) == set(), p
    own = ckpt.write(tmp_path / "own.h5", pack_threshold=0)
    assert "w" in _listed(Path(own))
    with pytest.raises(ValueError, match="pack_threshold must be >= 0"):
        ckpt.write(tmp_path / "bad.h5", pack_threshold=-1)
    with pytest.raises(TypeError, match="pack_threshold is a number of bytes"):
        cv.save(tmp_path / "bad2.h5", {"w": np.ones(2)}, pack_threshold="64K")


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_ckpt_convert_pack_threshold(tmp_path: Path) -> None:
    src = cv.save(tmp_path / "src.h5", TINY)
    out = _ckpt("convert", str(src), str(tmp_path / "packed.zarr"), "--pack-threshold", "1M")
    assert out.returncode == 0, out.stderr
    assert _listed(tmp_path / "packed.zarr") == set()
    out = _ckpt("convert", str(tmp_path / "packed.zarr"), str(tmp_path / "own.h5"),
                "--pack-threshold", "0")
    assert out.returncode == 0, out.stderr
    assert _listed(tmp_path / "own.h5") == set(TINY)
    out = _ckpt("convert", str(src), str(tmp_path / "x.npz"), "--pack-threshold", "0")
    assert out.returncode == 2 and "applies to .h5 and .zarr outputs" in out.stderr


def test_files_of_the_old_rule_still_read() -> None:
    """Golden files written before this rule (small values packed) still load, and the
    recipes read them."""
    golden = Path(__file__).resolve().parent / "golden"
    for name in ("format-1.1.h5", "format-1.1.zarr"):
        p = golden / name
        values = cv.load(p)
        assert values
        reader = recipe("read_h5" if name.endswith(".h5") else "read_zarr")
        _read_everything(reader, p, values)
