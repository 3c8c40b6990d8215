"""Every ```python block in docs/*.md runs: blocks of one file in order, in one namespace,
in a temporary working directory, so the documentation stays true."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

import ckptvar as cv

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of each ```python block in a markdown text."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def test_python_blocks_are_found() -> None:
    text = "intro\n```python\nx = 1\n```\n```text\nnot code\n```\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = 2\n")]


DOC_FILES = sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("doc", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_examples_run(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # the examples' temporary directories (theirs and their subprocesses') go there too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cv.reset_default_graph()
    namespace: dict[str, object] = {"__name__": f"docs_{doc.stem}"}
    try:
        for line, code in python_blocks(doc.read_text(encoding="utf-8")):
            try:
                exec(compile(code, f"{doc.name}:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{doc.name}, the python block at line {line} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
    finally:
        cv.wait_for_pending_saves()
        cv.reset_default_graph()
        assert Path(os.getcwd()) == tmp_path
