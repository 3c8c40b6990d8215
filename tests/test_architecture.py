"""docs/ARCHITECTURE.md's module map holds against the package: every module listed, none gone."""

from __future__ import annotations

import re
from pathlib import Path

import ckptvar

PKG = Path(ckptvar.__file__).parent
DOC = PKG.parent / "docs" / "ARCHITECTURE.md"


def package_modules() -> set[str]:
    """Every module of the package as a path below it without ``.py`` (``storage/_h5``,
    ``storage/__init__``)."""
    return {str(p.relative_to(PKG).with_suffix("")) for p in PKG.rglob("*.py")}


def _cell_modules(cell: str) -> list[str]:
    """The modules a first-column cell names: ``a/b``, then bare siblings of the first
    (``_c``: ``a/_c``); a name ending in ``/`` is the package itself (``a/__init__``)."""
    names = re.findall(r"`([^`]+)`", cell)
    if not names:
        return []
    first = names[0]
    where = first.rstrip("/") if first.endswith("/") else first.rpartition("/")[0]
    out = []
    for name in names:
        if "/" not in name:
            name = f"{where}/{name}" if where else name
        out.append(f"{name.rstrip('/')}/__init__" if name.endswith("/") else name)
    return out


def mapped_modules(text: str) -> list[str]:
    """The modules the module map's table lists, in order (duplicates kept)."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [m for row in rows for m in _cell_modules(row.split("|")[1])]


def test_the_cell_reader_resolves_siblings_and_packages() -> None:
    assert _cell_modules(" `storage/_record`, `_plain` ") == ["storage/_record", "storage/_plain"]
    assert _cell_modules(" `cli/`, `__main__` ") == ["cli/__init__", "cli/__main__"]
    assert _cell_modules(" `__init__`, `__main__` ") == ["__init__", "__main__"]


def test_the_map_lists_every_module_and_none_that_is_gone() -> None:
    listed = mapped_modules(DOC.read_text())
    actual = package_modules()
    missing = sorted(actual - set(listed))
    gone = sorted(set(listed) - actual)
    assert not missing, f"modules missing from docs/ARCHITECTURE.md's module map: {missing}"
    assert not gone, f"modules in docs/ARCHITECTURE.md's module map that are gone: {gone}"


def test_each_module_is_listed_once() -> None:
    listed = mapped_modules(DOC.read_text())
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"listed more than once: {twice}"


def test_a_drifted_map_is_caught() -> None:
    gone = "storage/_nothing_here"
    text = DOC.read_text().replace("| `storage/checksum` |", f"| `{gone}` |")
    listed = set(mapped_modules(text))
    assert gone in listed and "storage/checksum" not in listed
