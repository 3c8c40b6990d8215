"""The variables package's layout: light to import, no cycles, one home per rule."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ckptvar

PKG = Path(ckptvar.__file__).parent
HEAVY = ("h5py", "zarr", "msgpack", "cupy")
LAYERS = ("ckptvar.storage", "ckptvar.checkpoint", "ckptvar.io")

# Imports the core modules with the package root's __init__ left out (it re-exports the
# checkpoint layer, which loads the storage libraries), then uses them.
CORE_ONLY = """
import importlib.util, sys, types
spec = importlib.util.find_spec("ckptvar")
root = types.ModuleType("ckptvar")
root.__path__ = list(spec.submodule_search_locations)
sys.modules["ckptvar"] = root
import ckptvar.variables as V, ckptvar.module, ckptvar.graph, ckptvar.trackable
import ckptvar.initializers, ckptvar.device
with V.variable_scope("emb", partitioner=V.fixed_size_partitioner(2)):
    table = V.get_variable("table", shape=(4, 3))
assert V.Variable([1.0]).numpy().tolist() == [1.0] and len(table) == 2
print(sorted(m for m in HEAVY + LAYERS if m in sys.modules))
"""


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_core_loads_no_storage_library_and_no_storage_layer() -> None:
    assert _run(f"HEAVY, LAYERS = {HEAVY!r}, {LAYERS!r}\n" + CORE_ONLY) == "[]"


def test_a_bare_import_of_the_variables_package_loads_neither_zarr_nor_cupy() -> None:
    code = f"import sys, ckptvar.variables\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = ast.literal_eval(_run(code))
    # h5py and msgpack come from the package root's checkpoint re-exports (storage and
    # checkpoint import them at module level); zarr and cupy are always lazy.
    assert "zarr" not in loaded and "cupy" not in loaded, loaded


def _module_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) for each import in ``path``."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    if package[-1] == "__init__":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.append((mod, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


CORE_FILES = sorted(
    [*(PKG / "variables").glob("*.py")]
    + [PKG / f"{m}.py" for m in ("graph", "module", "trackable", "initializers", "device",
                                 "_dtypes", "_naming")]
)


def test_graph_does_not_import_variables() -> None:
    mods = {m for m, _ in _module_imports(PKG / "graph.py")}
    assert not any(m.startswith("ckptvar.variables") for m in mods), mods


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_no_private_name_imported_from_another_package(path: Path) -> None:
    here = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    for mod, names in _module_imports(path):
        if not mod.startswith("ckptvar"):
            continue
        source_pkg = mod if (PKG.parent / mod.replace(".", "/") / "__init__.py").exists() \
            else mod.rpartition(".")[0]
        private = [n for n in names if n.startswith("_")
                   and not (PKG.parent / mod.replace(".", "/") / f"{n}.py").exists()]
        assert source_pkg == here or not private, f"{path.name} imports {private} from {mod}"


def test_the_same_kind_rule_has_one_home() -> None:
    offenders = [p.name for p in CORE_FILES
                 if p.name != "_dtypes.py" and ("_KIND_RANK" in p.read_text()
                                                or "can_cast(" in p.read_text())]
    assert offenders == []


@pytest.mark.parametrize(
    "module",
    ["ckptvar.variables", "ckptvar.variables._variable", "ckptvar.variables._array",
     "ckptvar.variables._hooks", "ckptvar.variables._lifecycle", "ckptvar.variables._shapes", "ckptvar.variables._slices",
     "ckptvar.variables.tf1", "ckptvar.variables.partitioned", "ckptvar._dtypes",
     "ckptvar._naming"],
)
def test_module_doctests(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
