"""The import graph of the package obeys the layers of STYLE.md.

Checked statically over every ``ckptvar/**.py``, with the imports inside functions
(``ast`` sees them all): no import cycles, the core (device, graph, initializers,
variables, trackable, module) never imports storage, storage never imports the core,
and no module takes another package's ``_private`` module or another module's
``_private`` name. The implicit import of a module's parent packages is not counted:
``ckptvar/__init__`` imports every layer, so it would join everything into one cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import ckptvar

PKG = Path(ckptvar.__file__).parent
CORE = ["device", "graph", "variables", "initializers", "trackable", "module"]
LEAF = ["_dtypes", "errors"]  # shared by every layer


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (a module or a package)
    name: str | None  # the name taken from it by ``from target import name``, if not a module
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _package_of(mod: str) -> str:
    return mod if _is_package(mod) else mod.rpartition(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                ids.update(id(n) for n in ast.walk(stmt))
    return ids


@cache
def imports_of(mod: str) -> tuple[Import, ...]:
    tree = ast.parse(MODULES[mod].read_text())
    type_only = _type_checking_nodes(tree)
    here = _package_of(mod).split(".")
    found: list[Import] = []
    for node in ast.walk(tree):
        tc = id(node) in type_only
        if isinstance(node, ast.Import):
            found += [Import(mod, a.name, None, node.lineno, tc) for a in node.names
                      if a.name.startswith("ckptvar")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ckptvar"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    found.append(Import(mod, sub, None, node.lineno, tc))
                else:
                    found.append(Import(mod, target, a.name, node.lineno, tc))
    return tuple(i for i in found if i.target in MODULES)


def _graph(*, runtime_only: bool) -> dict[str, set[str]]:
    return {m: {i.target for i in imports_of(m) if i.target not in {"ckptvar", m}
                and not (runtime_only and i.type_only)} for m in MODULES}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that each reach all the others."""
    reach = {v: _reachable(graph, v) for v in graph}
    out: list[list[str]] = []
    done: set[str] = set()
    for v in sorted(graph):
        group = sorted(w for w in reach[v] if v in reach[w])
        if v not in done and len(group) > 1:
            out.append(group)
            done.update(group)
    return out


def _reach(roots: list[str]) -> dict[str, list[str]]:
    """Every module reachable from ``roots``, with one import chain leading to it."""
    graph = _graph(runtime_only=False)
    how = {r: [r] for r in roots}
    todo = list(roots)
    while todo:
        m = todo.pop()
        for t in sorted(graph[m]):
            if t not in how:
                how[t] = [*how[m], t]
                todo.append(t)
    return how


def _in(mod: str, packages: list[str]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _private_crossings() -> Iterator[str]:
    for mod in sorted(MODULES):
        pkg = _package_of(mod).split(".")
        for imp in imports_of(mod):
            parts = imp.target.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = parts[:i]  # the package the private module belongs to
                    if pkg[: len(owner)] != owner:  # not this package or one above it
                        yield f"{mod}:{imp.line} imports {'.'.join(parts[: i + 1])}"
                    break
            if imp.name and imp.name.startswith("_") and not imp.name.startswith("__"):
                yield f"{mod}:{imp.line} takes {imp.target}.{imp.name}"


# --------------------------------------------------------------------------- the checker itself


def test_the_graph_sees_every_module_and_imports_inside_functions() -> None:
    assert {"ckptvar.errors", "ckptvar.storage", "ckptvar.cli"} <= set(MODULES)
    assert all(p.suffix == ".py" for p in MODULES.values())
    graph = _graph(runtime_only=False)
    assert graph["ckptvar"], "the package __init__ imports its layers"
    # an import inside a function body counts (ast.walk sees every node)
    inner = [i for m in MODULES for i in imports_of(m)
             if i.line > 0 and not MODULES[m].read_text().splitlines()[i.line - 1].startswith(
                 ("from", "import"))]
    assert inner, "no indented (function-level or guarded) import found: the walk misses them"


def test_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# --------------------------------------------------------------------------- the rules


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph(runtime_only=True))
    assert not cycles, f"import cycles: {cycles}"


def test_core_never_imports_storage() -> None:
    how = _reach([f"ckptvar.{m}" for m in CORE if f"ckptvar.{m}" in MODULES])
    bad = {m: chain for m, chain in how.items()
           if _in(m, ["ckptvar.storage", "ckptvar.checkpoint", "ckptvar.io", "ckptvar.cli"])}
    assert not bad, f"core reaches storage: {sorted(bad.values())}"


def test_core_never_imports_h5py_or_zarr() -> None:
    core = [m for m in _reach([f"ckptvar.{c}" for c in CORE if f"ckptvar.{c}" in MODULES])]
    bad = []
    for mod in core:
        for node in ast.walk(ast.parse(MODULES[mod].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and
                     not node.level else [])
            bad += [f"{mod}:{node.lineno} {n}" for n in names
                    if n.split(".")[0] in {"h5py", "zarr"}]
    assert not bad, bad


def test_storage_never_imports_core() -> None:
    storage = [m for m in MODULES if _in(m, ["ckptvar.storage"])]
    assert len(storage) > 3
    how = _reach(storage)
    bad = {m: chain for m, chain in how.items()
           if _in(m, [f"ckptvar.{c}" for c in CORE]) or _in(m, ["ckptvar.checkpoint"])}
    assert not bad, f"storage reaches the core: {sorted(bad.values())}"


def test_no_module_takes_another_packages_private_name() -> None:
    crossings = list(dict.fromkeys(_private_crossings()))
    assert not crossings, "\n".join(crossings)


def test_the_storage_rules_see_nested_packages() -> None:
    nested = {m for m in MODULES if m.startswith(("ckptvar.storage.formats.",
                                                 "ckptvar.storage._container.",
                                                 "ckptvar.storage.location."))}
    assert {"ckptvar.storage.formats._keras", "ckptvar.storage._container.reader"} <= nested
    assert "ckptvar.storage.registry" in MODULES
