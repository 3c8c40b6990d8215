"""Check-free basics of the test suite itself, read with ``ast`` from tests/**.py.

Every test asserts something (an ``assert``, ``pytest.raises``/``warns``/``fail``, an
``assert*`` call, or a helper of its own module that does); no test asserts on the
wall clock unless it is marked ``slow`` (a shared 2-core machine makes any time bound
flaky); no skip is dead (a reason saying something is "not in this checkout yet"),
every skip and xfail says why, and an xfail is strict.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "monotonic", "time", "perf_counter_ns", "monotonic_ns", "time_ns"}
ASSERTING_CALLS = {"raises", "warns", "fail", "deprecated_call"}  # pytest.<name>
DEAD_REASON = re.compile(r"\byet\b|this checkout", re.IGNORECASE)


def _files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fuzz" not in p.parts)


def _trees() -> Iterator[tuple[Path, ast.Module]]:
    for path in _files():
        yield path, ast.parse(path.read_text(), filename=str(path))


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _directly_asserts(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name.startswith("assert") or (
                name in ASSERTING_CALLS and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == "pytest"
            ):
                return True
    return False


def _asserting_functions(tree: ast.Module) -> set[str]:
    """Names of this module's functions that assert, directly or through each other."""
    fns = _functions(tree)
    found = {f.name for f in fns if _directly_asserts(f)}
    changed = True
    while changed:
        changed = False
        for f in fns:
            if f.name not in found and any(
                isinstance(n, ast.Call) and _call_name(n) in found for n in ast.walk(f)
            ):
                found.add(f.name)
                changed = True
    return found


def _is_slow(fn: ast.AST, tree: ast.Module) -> bool:
    marks = [ast.unparse(d) for d in getattr(fn, "decorator_list", [])]
    marks += [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    return any("mark.slow" in m for m in marks)


def _reads_clock(node: ast.AST, clock_names: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _call_name(n) in CLOCKS and "time" in ast.unparse(n.func):
            return True
        if isinstance(n, ast.Name) and n.id in clock_names:
            return True
    return False


def _wall_clock_asserts(tree: ast.Module) -> Iterator[int]:
    for fn in _functions(tree):
        if _is_slow(fn, tree):
            continue
        clock_names: set[str] = set()
        for n in ast.walk(fn):  # names holding a clock reading, or a difference of them
            if isinstance(n, ast.Assign) and _reads_clock(n.value, clock_names):
                clock_names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assert) and _reads_clock(n.test, clock_names):
                yield n.lineno


def _skip_marks(tree: ast.Module) -> Iterator[tuple[int, str, ast.Call]]:
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            text = ast.unparse(n.func)
            if text in {"pytest.skip", "pytest.mark.skip", "pytest.mark.skipif",
                        "pytest.mark.xfail", "pytest.xfail"}:
                yield n.lineno, text, n


def _reason(call: ast.Call, text: str) -> str | None:
    for kw in call.keywords:
        if kw.arg in {"reason", "msg"}:
            return ast.unparse(kw.value)
    positional = 1 if text == "pytest.mark.skipif" else 0
    if len(call.args) > positional:
        return ast.unparse(call.args[positional])
    return None


# --------------------------------------------------------------------------- the rules


def test_every_test_asserts_something() -> None:
    bad = []
    for path, tree in _trees():
        asserting = _asserting_functions(tree)
        bad += [f"{path.name}:{f.lineno} {f.name}" for f in _functions(tree)
                if f.name.startswith("test_") and f.name not in asserting]
    assert not bad, "tests that assert nothing:\n" + "\n".join(bad)


def test_no_wall_clock_assert_outside_slow_tests() -> None:
    bad = [f"{path.name}:{line}" for path, tree in _trees() for line in _wall_clock_asserts(tree)]
    assert not bad, "wall-clock asserts (use a counter, or mark the test slow): " + ", ".join(bad)


def test_no_dead_skip_and_every_skip_says_why() -> None:
    bad = []
    for path, tree in _trees():
        for line, text, call in _skip_marks(tree):
            reason = _reason(call, text)
            where = f"{path.name}:{line} {text}"
            if reason is None:
                bad.append(f"{where}: no reason")
            elif DEAD_REASON.search(reason):
                bad.append(f"{where}: dead reason {reason}")
            if "xfail" in text and not any(
                kw.arg == "strict" and ast.unparse(kw.value) == "True" for kw in call.keywords
            ):
                bad.append(f"{where}: not strict")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- the checkers


def test_the_checkers_catch_what_they_are_for() -> None:
    tree = ast.parse(
        "import time, pytest\n"
        "def helper(x):\n    assert x\n"
        "def test_ok():\n    helper(1)\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_nothing():\n    print(1)\n"
        "def test_clock():\n    t0 = time.perf_counter()\n    el = time.perf_counter() - t0\n"
        "    assert el < 2.0\n"
        "@pytest.mark.slow\ndef test_slow_clock():\n    t0 = time.monotonic()\n"
        "    assert time.monotonic() - t0 < 2.0\n"
        "@pytest.mark.skipif(True, reason='the zarr backend is not in this checkout yet')\n"
        "def test_dead():\n    assert 1\n"
        "@pytest.mark.xfail(reason='bug')\ndef test_lax():\n    assert 1\n"
    )
    asserting = _asserting_functions(tree)
    assert {"helper", "test_ok", "test_raises", "test_clock"} <= asserting
    assert "test_nothing" not in asserting
    assert list(_wall_clock_asserts(tree)) == [14]
    marks = {text: _reason(call, text) for _, text, call in _skip_marks(tree)}
    assert DEAD_REASON.search(marks["pytest.mark.skipif"] or "")
    assert marks["pytest.mark.xfail"] == "'bug'"
