"""The core never imports storage, and storage never imports the core (STYLE.md).

Checked statically: the package ``__init__`` imports every layer, so the import
graph of the modules themselves is what matters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptvar

PKG = Path(ckptvar.__file__).parent
CORE = ["device", "graph", "variables", "initializers", "trackable", "module", "_dtypes", "errors"]


def _module_file(name: str) -> Path | None:
    rel = name.split(".")[1:]
    for cand in (PKG.joinpath(*rel).with_suffix(".py"), PKG.joinpath(*rel, "__init__.py")):
        if cand.exists():
            return cand
    return None


def _imports(name: str) -> set[str]:
    path = _module_file(name)
    if path is None:
        return set()
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def _closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for imp in _imports(mod):
            if imp.startswith("ckptvar") and _module_file(imp) is not None and imp != "ckptvar":
                todo.append(imp)
            else:
                seen.add(imp)
    return seen


def test_core_never_imports_storage() -> None:
    reached = _closure([f"ckptvar.{m}" for m in CORE if _module_file(f"ckptvar.{m}")])
    bad = {m for m in reached if m.split(".")[0] in {"h5py", "zarr"}}
    bad |= {m for m in reached if m.startswith(("ckptvar.storage", "ckptvar.checkpoint", "ckptvar.io"))}
    assert not bad, f"core reaches storage: {sorted(bad)}"


def test_storage_never_imports_core() -> None:
    storage = [
        f"ckptvar.storage.{p.stem}" for p in (PKG / "storage").glob("*.py") if p.stem != "__init__"
    ]
    storage += [
        f"ckptvar.storage.foreign.{p.stem}" for p in (PKG / "storage" / "foreign").glob("*.py")
    ]
    reached = _closure(storage)
    core = {f"ckptvar.{m}" for m in ["device", "graph", "variables", "trackable", "module"]}
    assert not core & reached, f"storage reaches the core: {sorted(core & reached)}"
