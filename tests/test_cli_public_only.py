"""The ``ckpt`` command stands on the public API alone, and ``--no-metadata`` means none."""

from __future__ import annotations

import ast
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

import ckptvar as cv

CLI = Path(cv.__file__).parent / "cli"


def test_the_cli_imports_only_import_ckptvar_as_cv() -> None:
    reached = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                public = node.module == "ckptvar" and all(a.name in cv.__all__ for a in node.names)
                own = node.module == "ckptvar.cli"  # __main__.py: ``from ckptvar.cli import main``
                if node.module.split(".")[0] == "ckptvar" and not (public or own):
                    reached.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.ImportFrom) and node.level > 1:
                reached.append(f"{path.name}: from {'.' * node.level}{node.module}")
            elif isinstance(node, ast.Import):
                reached += [f"{path.name}: import {a.name}" for a in node.names
                            if a.name.startswith("ckptvar") and a.name != "ckptvar"]
    assert not reached, reached
    assert not (CLI / "_library.py").exists()


def _header_metadata(path: Path) -> dict[str, str] | None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    meta: dict[str, str] | None = json.loads(data[8 : 8 + n]).get("__metadata__")
    return meta


def test_no_metadata_to_safetensors_writes_none_of_ckptvars_keys(tmp_path: Path) -> None:
    v = cv.Variable(np.arange(3, dtype=np.float32), name="w", trainable=False)
    src = cv.Checkpoint(v=v).save(str(tmp_path / "c"))
    with_meta, without = tmp_path / "with.safetensors", tmp_path / "without.safetensors"
    for dst, extra in ((with_meta, []), (without, ["--no-metadata"])):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptvar", "convert", src, str(dst), *extra],
            capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
        )
        assert proc.returncode == 0, proc.stderr
    kept = _header_metadata(with_meta) or {}
    assert "ckptvar.attrs" in kept and '"trainable": false' in kept["ckptvar.attrs"]
    assert _header_metadata(without) is None  # not even the per-value attributes
    with cv.open(without) as reader:
        assert reader.read("v").tolist() == [0.0, 1.0, 2.0]
        assert reader.metadata() == {}
