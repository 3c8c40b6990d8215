"""The import graph of the package obeys the layers of docs/ARCHITECTURE.md.

Checked statically over every ``ckptvar/**.py``, with the imports inside functions
and those under ``if TYPE_CHECKING:`` (``ast`` sees them all): no import cycles, the core (device, graph, initializers,
variables, trackable, module) never imports storage, storage never imports the core,
and no module takes another package's ``_private`` module or another module's
``_private`` name, and no module reaches ``obj._name`` into another module's class.
Every module says in its first docstring line what it owns. The implicit import of a module's parent packages is not counted:
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
    """Type-checking-only imports count: a circle drawn only for the type checker is still
    a circle in the design (the modules cannot be read, or moved, one without the other)."""
    cycles = _cycles(_graph(runtime_only=False))
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_rule_sees_type_checking_only_imports() -> None:
    type_only = [i for m in MODULES for i in imports_of(m) if i.type_only]
    assert type_only, "no TYPE_CHECKING import found: the walk misses them"
    full = _graph(runtime_only=False)
    assert all(i.target in full[i.source] for i in type_only if i.target != i.source)
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n")
    imp = tree.body[1].body[0]  # type: ignore[attr-defined]
    assert id(imp) in _type_checking_nodes(tree)


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


# --------------------------------------------------------------------------- storage's three ideas

#: Where other tools' files are read and written, and where bytes live.
FOREIGN_FORMATS = ["ckptvar.formats"]
LOCATIONS = ["ckptvar.locations"]
#: ckptvar's own format: the record, the containers, the multi-process layout.
OWN_FORMAT = [f"ckptvar.storage.{m}" for m in (
    "_record", "_record_index", "_record_checks", "_plain", "_h5", "_zarr", "_zarr_files",
    "_zarr_remote", "_container", "_sharded", "_sharded_zarr", "_sharded_remote",
    "_step_files", "_box_index", "_remote")]


def test_storage_keeps_its_three_ideas_apart() -> None:
    """Foreign formats and locations never import the own format; the own format never
    imports the foreign formats (direct imports, type-checking ones included)."""
    assert all(m in MODULES for m in OWN_FORMAT + FOREIGN_FORMATS + LOCATIONS)
    graph = _graph(runtime_only=False)
    bad = []
    for mod in MODULES:
        if _in(mod, FOREIGN_FORMATS + LOCATIONS):
            bad += [f"{mod} -> {t}" for t in graph[mod] if _in(t, OWN_FORMAT)]
        if _in(mod, OWN_FORMAT):
            bad += [f"{mod} -> {t}" for t in graph[mod] if _in(t, FOREIGN_FORMATS)]
    assert not bad, "\n".join(sorted(bad))


# --------------------------------------------------------------------------- private reaches

#: Private names of other libraries taken on purpose, each for a reason no public API meets.
FOREIGN_PRIVATE = {
    # runs before the interpreter joins threads and shuts the pools (atexit is too late
    # to finish a background save)
    "threading._register_atexit",
    # the pure-Python unpickler: the only one whose globals can be restricted per load
    "pickle._Unpickler",
    # torch.distributed's store of the default process group (no public accessor)
    "dist.distributed_c10d._get_default_store",
    # the ckpt command ending at once on Ctrl-C (a documented os function: exit without
    # waiting for a thread pool's worker CPython never tells to stop)
    "os._exit",
}


def _own_names(tree: ast.AST) -> set[str]:
    """The names a module defines: functions, classes, assigned names and attributes,
    keyword arguments (``set_defaults(_x=...)``) and string constants (``__slots__``)."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.keyword) and n.arg:
            names.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            names.add(n.value)
    return names


def private_reaches(source: str, where: str = "<string>") -> list[str]:
    """``obj._name`` accesses in ``source`` that reach into another module's class.

    An access is this module's own when ``obj`` is ``self`` or ``cls``, or when
    ``_name`` is defined in this module (its own classes, or a class it defines the
    name for); any other ``_name`` belongs to another module. Dunder names are public.
    """
    tree = ast.parse(source)
    own = _own_names(tree)
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__")):
            continue
        if isinstance(n.value, ast.Name) and n.value.id in {"self", "cls"}:
            continue
        text = ast.unparse(n)
        if n.attr in own or text in FOREIGN_PRIVATE:
            continue
        out.append(f"{where}:{n.lineno} {text}")
    return out


def test_the_reach_finder_sees_a_reach_and_only_reaches() -> None:
    code = (
        "class A:\n    def _mine(self): return self._x\n"
        "def f(a, b):\n    a._mine(); b._theirs; b.__len__; return b.public\n"
    )
    assert private_reaches(code) == ["<string>:4 b._theirs"]


def test_no_module_reaches_into_another_modules_private_attributes() -> None:
    reaches = [r for mod, path in sorted(MODULES.items())
               for r in private_reaches(path.read_text(), mod)]
    assert not reaches, "\n".join(reaches)


# --------------------------------------------------------------------------- each module's idea


def test_every_module_says_in_its_first_line_what_it_owns() -> None:
    """A module owns one idea and says which in its docstring's first line (a whole line:
    a sentence ending in ``.`` or ``:``, followed by a blank line or nothing)."""
    bad = []
    for mod, path in sorted(MODULES.items()):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = doc.splitlines() or [""]
        if (len(lines[0]) < 20 or not lines[0].endswith((".", ":"))
                or (len(lines) > 1 and lines[1].strip())):
            bad.append(f"{mod}: {lines[0]!r}")
    assert not bad, "\n".join(bad)


def test_the_storage_rules_see_nested_packages() -> None:
    nested = {m for m in MODULES if m.startswith(("ckptvar.formats.",
                                                 "ckptvar.storage._container.",
                                                 "ckptvar.locations."))}
    assert {"ckptvar.formats._keras", "ckptvar.storage._container.reader"} <= nested
    assert "ckptvar.storage.registry" in MODULES
