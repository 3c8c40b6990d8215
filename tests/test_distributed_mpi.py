"""The MPI coordinator on real processes: ``mpiexec -n N python -m mpi4py`` (mpich from pip).

The ``-m mpi4py`` form makes a rank that raises abort the whole job instead of
leaving the others waiting; every run also has a subprocess timeout, so no test
can hang. The cases themselves are in tests/mpi/coordinator_cases.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ckptvar.distributed import MPI_ENV_VARS

CASES = Path(__file__).parent / "mpi" / "coordinator_cases.py"


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (pip's mpich puts it there), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _mpi_skip_reason() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'ckptvar[test]' installs mpi4py and mpich)"
    if find_mpiexec() is None:
        return "no mpiexec found (pip install mpich)"
    return None


pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")


def read_results(result_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """The JSON lines each rank wrote to ``result_dir``, by case, then by rank."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(result_dir.glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            out.setdefault(r["case"], {})[r["rank"]] = r
    return out


def run_mpi(
    n: int, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[int, dict[str, Any]]], float]:
    """Run ``mpiexec -n n python -m mpi4py <args>`` with a hard timeout.

    Returns the process, the results the ranks wrote (``$RESULT_DIR``) and the seconds it took.
    """
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    with tempfile.TemporaryDirectory(prefix="ckptvar-mpi-") as result_dir:
        full_env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
        full_env.update(env or {}, RESULT_DIR=result_dir)
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", *args]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}")
        return proc, read_results(Path(result_dir)), time.monotonic() - t0


def ok_results(n: int, *cases: str, **kw: Any) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got, _ = run_mpi(n, str(CASES), *cases, **kw)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for case in cases:
        assert sorted(got.get(case, {})) == list(range(n)), (case, proc.stdout, proc.stderr)
    return got


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_vote_and_planning_on_n_ranks(n: int) -> None:
    got = ok_results(n, "collectives", "vote_raises", "mismatch", "plan")
    for rank, r in got["collectives"].items():
        assert r["engine"] == "MPICoordinator"  # from_env picked MPI under mpiexec
        assert r["size"] == n
        assert r["gathered"] == [{"rank": i, "sq": i * i} for i in range(n)]
        assert r["from_root"] == f"hello from {n - 1}"
        assert r["fg"] == [[-i - k for i in range(n)] for k in range(5)]
        assert r["bg"] == [[i + 100 * k for i in range(n)] for k in range(5)]
    for rank, r in got["vote_raises"].items():  # rank 1 failed: it raises its own error
        if rank == 1:  # as one process would, with a note naming the failing ranks
            assert r["error"] == "OSError" and r["message"] == "disk full while writing shard 1"
            assert "(rank 1): rank 1: OSError: disk full while writing shard 1" in r["notes"][0]
        else:  # the others raise DistributedError naming it
            assert r["error"] == "DistributedError" and r["ranks"] == [1]
            assert "(rank 1): rank 1: OSError: disk full while writing shard 1" in r["message"]
    for rank, r in got["mismatch"].items():  # different tags: caught, not mixed up
        assert r["error"] == "DistributedError"
        assert "running different collective steps" in r["message"]
    rows = [3, 0, 5, 2][:n]
    writes = {rank: r["writes"] for rank, r in got["plan"].items()}
    for rank in range(n):
        shard = [["w", [sum(rows[:rank]), 0], [rows[rank], 4]]] if rows[rank] else []
        assert [w for w in writes[rank] if w[0] == "w"] == shard
    assert sum(w[0] == "bias" for ws in writes.values() for w in ws) == 1  # one writer
    for r in got["plan"].values():
        assert r["same"] and r["first_tags"] == ["plan:digests", "plan:layouts"]
        assert r["second_tags"] == ["plan:digests"]  # the cached plan skipped the layout gather
        assert r["bad"]["error"] == "ShardLayoutError"
        assert "'bias'" in r["bad"]["message"] and "rank 0;" in r["bad"]["message"]


def test_a_slow_rank_times_the_others_out_and_the_vote_fails_everywhere() -> None:
    timeout = 2.0
    got = ok_results(3, "slow", env={"CASE_TIMEOUT": str(timeout)})["slow"]
    for rank in (0, 1):
        r = got[rank]
        assert r["is_timeout"] and r["ranks"] == [2]
        assert "barrier(tag='after write') timed out after 2 s" in r["message"]
        assert "nothing arrived from rank 2" in r["message"]
        assert timeout <= r["elapsed"] < timeout + 2.0  # polling adds ms; margin for load
    # the late rank finds every part sent, and the others' notice that they gave up: it
    # fails the barrier as they did
    late = got[2]
    assert late["is_timeout"] and late["ranks"] == [2], late
    assert "barrier(tag='after write') timed out on rank" in late["message"], late
    assert "gave up on it" in late["message"], late
    for r in got.values():  # and the vote fails everywhere
        assert r["vote"]["error"] == "DistributedError" and r["vote"]["ranks"] == [0, 1, 2]


def test_a_rank_killed_with_sigkill_hangs_no_one() -> None:
    proc, got, seconds = run_mpi(3, str(CASES), "killed", timeout=60, env={"CASE_TIMEOUT": "3"})
    assert proc.returncode != 0
    # mpich's mpiexec ends the survivors itself as soon as one rank dies; a survivor
    # that is still running when its barrier times out must name the dead rank.
    assert seconds < 30
    for r in got.get("killed", {}).values():
        assert r["rank"] != 1 and r["is_timeout"] and r["ranks"] == [1]
