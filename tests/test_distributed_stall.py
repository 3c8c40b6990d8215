"""A rank that stops inside a vote of a multi-process save (real ``mpiexec``; gloo for a
resumed one; cases in tests/mpi/stall_cases.py): the other ranks raise
``DistributedTimeoutError`` naming the stage within the coordinator's timeout, and no step
is left half-made: before the commit the previous step stays the latest; at the last vote,
the step is already whole (rank 0 committed it) and the error on rank 0 says so. A
stopped rank that then goes on raises the same error (the others' notice that they gave
up), so every rank agrees and the next save commits."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

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
        for rank in (0, 2):
            assert f"{second} was committed" in results[rank]["notes"], results[rank]
    else:
        assert results[0]["latest"] == first and results[0]["loaded"] == 1.0, results[0]
        assert not (run / "ckpt-2.h5").exists()
        leftovers = [p.name for p in run.iterdir() if "ckpt-2" in p.name]
        assert leftovers == [], leftovers



def _resumed(got: dict[str, dict[int, dict[str, Any]]], stage: str, late: int, run: Path,
             out: str, call: str = "vote") -> None:
    """What every rank of a resumed stall reported: the same error, nothing half-made,
    and the next save committed on all of them."""
    results, retry = got.get(stage, {}), got.get(f"{stage}-retry", {})
    assert sorted(results) == [0, 1, 2] and sorted(retry) == [0, 1, 2], out
    assert results[late]["stalled"] == f"save:ckpt-2.h5:{stage}"
    first, second = str(run / "ckpt-1.h5"), str(run / "ckpt-2.h5")
    for rank in (0, 1, 2):
        r = results[rank]
        assert r["error"] == "DistributedTimeoutError", (rank, r)
        what = ("allgather(tag='vote:save" if call == "vote" else f"{call}(tag='save")
        assert f"{what}:ckpt-2.h5:{stage}')" in r["message"] and r["ranks"] == [late], r
        assert r["second"] is None, r
        if rank == late:
            assert "gave up on it" in r["message"], r
        if stage == "commit":  # committed before the last vote: whole on every rank
            assert r["latest"] == second and r["loaded"] == 2.0, (rank, r)
        else:  # never committed: the late rank did not commit it either
            assert r["latest"] == first and r["loaded"] == 1.0, (rank, r)
    if stage == "commit":  # every rank's error says the step is committed and whole
        for rank in (0, 1, 2):
            assert f"{second} was committed" in results[rank]["notes"], (rank, results[rank])
    # every rank ran the same collectives: the next save commits on all of them
    third = str(run / "ckpt-3.h5") if stage == "commit" else second
    for rank in (0, 1, 2):
        r = retry[rank]
        assert r["error"] is None and r["again"] == third, (rank, r)
        assert r["latest"] == third, (rank, r)
    steps = sorted(p.name for p in run.iterdir() if "ckpt-" in p.name)  # no temporary left
    assert steps == ["ckpt-1.h5", "ckpt-2.h5"] + (["ckpt-3.h5"] if stage == "commit" else [])


# (``after``: it goes on at once, while the others' notices may still be on their way, or
# a second later, when they have long arrived; rank 0 late in the prepare broadcast, the
# one collective it only sends in, removes the step it made ready)
@pytest.mark.parametrize(("stage", "late", "after", "call"), [
    ("write", 1, 1, "vote"), ("commit", 1, 0, "vote"), ("write", 0, 0, "vote"),
    ("commit", 0, 1, "vote"), ("prepare", 0, 0, "broadcast")])
def test_a_rank_stopped_past_the_timeout_that_goes_on_fails_as_the_others_did(
    stage: str, late: int, after: int, call: str, tmp_path: Path
) -> None:
    """The stopped rank continues once the others gave up: it finds every other part of
    the vote sent, yet raises the same DistributedTimeoutError as they did (their notice
    says they gave up), commits nothing the others reported failed (rank 0 late in the
    write vote used to commit the step), and every rank's next save commits."""
    run = tmp_path / "run"
    proc, got, _ = run_mpi(3, str(CASES), stage, str(run), timeout=120,
                           env={"STALL_TIMEOUT": str(TIMEOUT), "STALL_RESUME": "1",
                                "STALL_RANK": str(late), "STALL_AFTER": str(after),
                                "STALL_CALL": call})
    _resumed(got, stage, late, run, proc.stdout + proc.stderr, call)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize(("stage", "late"), [("write", 1), ("commit", 0)])
def test_on_torch_a_rank_stopped_past_the_timeout_that_goes_on_fails_as_the_others_did(
    stage: str, late: int, tmp_path: Path
) -> None:
    """The same on torch.distributed (gloo): the notice is a key of the c10d store."""
    from test_distributed_torch import launch

    run = tmp_path / "run"
    proc, got = launch(3, stage, str(run), env={
        "CASES_MODULE": "stall_cases", "STALL_TIMEOUT": str(TIMEOUT), "STALL_RESUME": "1",
        "STALL_RANK": str(late)})
    _resumed(got, stage, late, run, proc.stdout[-3000:] + proc.stderr[-3000:])
