"""How the format readers are laid out: lazy heavy imports, one zip checker, shared helpers."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError

PKG = Path(__file__).resolve().parent.parent / "ckptvar" / "formats"
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_importing_ckptvar_does_not_import_h5py() -> None:
    code = (
        "import sys, ckptvar, ckptvar.formats\n"
        "assert 'h5py' not in sys.modules, 'h5py imported'\n"
        "r = ckptvar.open(sys.argv[1]); r.close()\n"
        "assert 'h5py' in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURES / "keras" / "tiny.weights.h5")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False,
    )
    assert proc.returncode == 0, proc.stderr


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module)
    return found


def test_writers_share_helpers_not_each_other() -> None:
    assert "_safetensors" not in _imports(PKG / "_npz.py")
    assert "_json" in _imports(PKG / "_npz.py") and "_json" in _imports(PKG / "_safetensors.py")
    for reader in ("_torch.py", "_keras.py", "_npz.py"):
        assert "_zip" in _imports(PKG / reader), reader
    assert not any("zipfile" in line for line in (PKG / "_common.py").read_text().splitlines()
                   if line.startswith("import"))


def test_the_formats_register_through_the_registry_module() -> None:
    from ckptvar import formats
    from ckptvar.storage import registry

    assert not (PKG.parent / "foreign" / "__init__.py").exists(), "the old alias package is gone"
    assert registry.backend_for("m.pt") is formats.TorchBackend
    assert cv.storage.backend_for is registry.backend_for


@pytest.mark.parametrize("name", ["../evil", "/abs/evil", "a\\..\\evil"])
@pytest.mark.parametrize("kind", ["torch", "keras"])
def test_torch_and_keras_archives_refuse_members_outside_the_archive(
    kind: str, name: str, tmp_path: Path
) -> None:
    src = FIXTURES / ("torch/state_dict.pt" if kind == "torch" else "keras/tiny.keras")
    path = tmp_path / ("x.pt" if kind == "torch" else "x.keras")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        zout.writestr(zipfile.ZipInfo(name), b"x")
    with pytest.raises(CorruptCheckpointError, match="outside the archive"):
        cv.open(path)
