"""The house checks of scripts/check, as tests: ruff, mypy and the doctests of every module.

Each runs in a subprocess with the configuration in pyproject.toml, over the whole
package, in the default suite: ruff and mypy find nothing, and every doctest passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ckptvar"


def _run(*args: str, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python -m args`` in ``cwd``; a scratch ``cwd``'s examples make their temporary
    directories inside it too (``TMPDIR``), so a run leaves nothing behind."""
    env = os.environ if cwd == ROOT else {**os.environ, "TMPDIR": str(cwd)}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          check=False, timeout=timeout, cwd=str(cwd), env=env)


def test_doctests_of_every_module_pass(tmp_path: Path) -> None:
    """``pytest --doctest-modules ckptvar`` imports every module and runs every example.

    In a scratch directory: the examples write files (``demo.h5``) where they run.
    """
    proc = _run("pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
                str(ROOT), "--doctest-modules", str(PKG), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, proc.stdout[-2000:]
    assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def test_doctest_collection_covers_every_module(tmp_path: Path) -> None:
    """Collection finds the modules by itself: a module with an example is never left out."""
    proc = _run("pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
                str(ROOT), "--doctest-modules", "--collect-only", str(PKG), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    with_examples = {
        p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py")
        if re.search(r"^\s*>>> ", p.read_text(), re.MULTILINE)
    }
    assert with_examples, "no module of the package has an example"
    collected = set(re.findall(r"(ckptvar/\S+\.py)::", proc.stdout))
    assert with_examples <= collected, sorted(with_examples - collected)


def test_ruff_finds_nothing() -> None:
    proc = _run("ruff", "check", "--output-format", "concise", str(PKG))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    proc = _run("mypy", str(PKG), timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
