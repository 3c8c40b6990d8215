"""The conversion entry points in scripts/, run as real processes on the real fixtures.

Each script converts its format (fixtures made by TensorFlow, PyTorch, Keras,
safetensors and NumPy; see fixtures/manifest.json) to a ckptvar checkpoint whose
values must equal what ``cv.load`` reads from the source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
FIXTURES = ROOT / "fixtures"

# script -> (source fixture, its manifest entry, the output suffix)
CASES = {
    "convert_tf_checkpoint.py": ("tf2_object/ckpt-1", "tf2_object/ckpt-1", ".h5"),
    "convert_torch.py": ("torch/state_dict.pt", "torch/state_dict.pt", ".zarr"),
    "convert_safetensors.py": (
        "safetensors/model.safetensors",
        "safetensors/model.safetensors",
        ".h5",
    ),
    "convert_keras.py": ("keras/tiny.weights.h5", "keras/tiny.weights.h5", ".npz"),
    "convert_npz.py": ("npz/plain.npz", "npz/plain.npz", ".safetensors"),
}


def run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands concurrently (interpreter start-up dominates), in order of results."""
    env = dict(os.environ, PYTHONWARNINGS="error")
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for c in commands
    ]
    out = []
    for c, p in zip(commands, procs, strict=True):
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def script(name: str, *args: str | Path) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *map(str, args)]


def manifest_tensors(entry: str) -> dict[str, dict[str, object]]:
    files = json.loads((FIXTURES / "manifest.json").read_text())["files"]
    for name, rec in files.items():
        if name == entry or name.startswith(entry + "."):  # a TF prefix is listed by a file
            return rec["tensors"]
    raise AssertionError(f"{entry} is not in fixtures/manifest.json")


def test_every_script_converts_its_fixture(tmp_path: Path) -> None:
    outputs = {name: tmp_path / f"out-{name[:-3]}{suffix}" for name, (*_, suffix) in CASES.items()}
    procs = run_all(
        [script(name, FIXTURES / src, outputs[name]) for name, (src, _, _) in CASES.items()]
    )
    for (name, (src, entry, _)), proc in zip(CASES.items(), procs, strict=True):
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stderr == ""
        assert proc.stdout.startswith("Wrote ") and str(outputs[name]) in proc.stdout
        expected = cv.load(FIXTURES / src)
        got = cv.load(outputs[name])
        assert list(got) == list(expected), name
        tensors = manifest_tensors(entry)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, (name, key)
            np.testing.assert_array_equal(got[key], value)
            if key in tensors:  # the producing library's own record of the tensor
                assert tensors[key]["shape"] == list(value.shape), (name, key)


def test_scripts_help_dtype_and_errors(tmp_path: Path) -> None:
    half = tmp_path / "half.h5"
    torch_src = FIXTURES / "torch" / "state_dict.pt"
    commands = [script(name, "--help") for name in CASES]
    commands += [
        script("convert_torch.py", torch_src, half, "--dtype", "bfloat16"),
        script("convert_torch.py", FIXTURES / "npz" / "plain.npz", tmp_path / "x.h5"),
        script("convert_npz.py", tmp_path / "missing.npz", tmp_path / "y.h5"),
    ]
    *helps, cast, wrong, missing = run_all(commands)
    for name, proc in zip(CASES, helps, strict=True):
        assert proc.returncode == 0, (name, proc.stderr)
        assert proc.stdout.startswith(f"usage: {name} [-h]")
        assert "--dtype" in proc.stdout and f"python scripts/{name}" in proc.stdout

    assert cast.returncode == 0, cast.stderr
    source = cv.load(torch_src)
    with cv.open(half) as reader:
        for key, value in source.items():
            dtype = reader.info(key).dtype
            if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
                assert dtype.name == "bfloat16", key
            else:
                assert dtype == value.dtype, key  # integers, bools, complex are kept

    for proc in (wrong, missing):
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert "npz checkpoint, not a PyTorch file" in wrong.stderr
    assert "missing.npz" in missing.stderr
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "y.h5").exists()


@pytest.mark.parametrize("name", [*sorted(CASES), "_convert.py"])
def test_scripts_use_only_the_public_api(name: str) -> None:
    text = (SCRIPTS / name).read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert all(
        line
        in (
            "from __future__ import annotations",
            "import argparse",
            "import sys",
            "import numpy as np",
            "import ckptvar as cv",
            "from _convert import run",  # the scripts' shared front (itself checked here)
            "from ckptvar.cli import main as ckpt",  # the same conversion as `ckpt convert`
        )
        for line in imports
    ), imports
