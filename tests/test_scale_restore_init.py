"""Restore-as-initialization on many processes (real ``mpiexec``): deferred restores,
``cv.restore_on_create`` and ``restore_or_initialize`` with a coordinator, and ``cast=``.

Two ranks save (tests/mpi/restore_init_cases.py), three restore into their own row
shards: each rank reads only its own box, and a failure on one rank makes every
rank raise ``DistributedError`` naming it, with no stored value given to any variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")

CASES = str(Path(__file__).parent / "mpi" / "restore_init_cases.py")


def _run(n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got, _ = run_mpi(n, CASES, *args, timeout=120)
    assert "crash" not in got, got["crash"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return got


@pytest.fixture(scope="module")
def restored(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    d = tmp_path_factory.mktemp("restore-init")
    saved = _run(2, "save", str(d))["save"]
    return saved, _run(3, "restore", str(d))


def _each(got: dict[str, Any], case: str) -> list[dict[str, Any]]:
    assert sorted(got[case]) == [0, 1, 2], case
    return [got[case][r] for r in range(3)]


def test_variables_created_after_restore_take_their_own_boxes(restored: Any) -> None:
    saved, got = restored
    for r in _each(got, "deferred"):
        assert r["ok"] and r["counter"] == 1, r
    for r in _each(got, "manager"):
        assert r["ok"] and r["path"] == saved[0]["mgr"], r
    assert all(r["ok"] for r in _each(got, "manager_init"))


def test_restore_on_create_with_a_coordinator(restored: Any) -> None:
    _, got = restored
    for r in _each(got, "on_create"):
        assert r["ok"], r


@pytest.mark.parametrize(("case", "rank"), [
    ("deferred_fail", 1), ("on_create_fail", 1), ("cast_refused", None),
    ("cast_forbidden", 2)])
def test_a_failure_on_one_rank_fails_every_rank_and_changes_nothing(
    restored: Any, case: str, rank: int | None
) -> None:
    _, got = restored
    for r in _each(got, case):
        assert r["ok"], r
        assert all(r["unchanged"]), r
        # the rank that found it raises its own error (as alone), the others name it
        assert r["own"] == (rank is None or r["rank"] == rank), r
        assert r["ranks"] == ([r["rank"]] if rank is None else [rank]), r
        assert (f"rank {rank}" if rank is not None else "cast=True") in r["error"]


def test_cast_in_a_multi_process_restore_is_said_on_every_rank(restored: Any) -> None:
    _, got = restored
    for case in ("cast", "cast_on_create"):
        for r in _each(got, case):
            assert r["ok"], r
            said = [w for w in r["warnings"] if "cast" in w]
            assert len(said) == 1 and "'t' (float16 -> float32)" in said[0], r
