"""A rank that stops inside a vote of a multi-process save (real ``mpiexec``, cases in
tests/mpi/stall_cases.py): the other ranks raise ``DistributedTimeoutError`` naming the
stage within the coordinator's timeout, and no step is left half-made: before the commit
the previous step stays the latest; at the last vote, the step is already whole (rank 0
committed it) and the error on rank 0 says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

CASES = Path(__file__).parent / "mpi" / "stall_cases.py"
TIMEOUT = 3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or ""),
]


@pytest.mark.parametrize("stage", ["prepare", "write", "commit"])
def test_a_rank_stopped_in_a_vote_of_a_save_times_the_others_out(
    stage: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc, got, _ = run_mpi(3, str(CASES), stage, str(run), timeout=90,
                           env={"STALL_TIMEOUT": str(TIMEOUT)})
    results = got.get(stage, {})
    assert sorted(results) == [0, 1, 2], proc.stdout + proc.stderr
    assert results[1]["stalled"] == f"save:ckpt-2.h5:{stage}"
    first, second = str(run / "ckpt-1.h5"), str(run / "ckpt-2.h5")
    for rank in (0, 2):
        r = results[rank]
        assert r["error"] == "DistributedTimeoutError", r
        assert f"vote:save:ckpt-2.h5:{stage}'" in r["message"] and r["ranks"] == [1], r
        assert r["seconds"] < TIMEOUT + 5, r
        # what is on disk, the manager and the latest step agree, and it loads whole
        assert r["manager_latest"] == r["latest"], r
    if stage == "commit":  # committed before the last vote: whole, the latest, and said
        assert results[0]["latest"] == second and results[0]["loaded"] == 2.0, results[0]
        assert f"{second} was committed" in results[0]["notes"], results[0]
    else:
        assert results[0]["latest"] == first and results[0]["loaded"] == 1.0, results[0]
        assert not (run / "ckpt-2.h5").exists()
        leftovers = [p.name for p in run.iterdir() if "ckpt-2" in p.name]
        assert leftovers == [], leftovers
