"""Restart after anything: the committed steps are the record, the state file a cache.

The state-file cases (deleted, stale by one step, damaged, disagreeing with the
directory, a step saved again) run in one process and in three (``mpiexec``), by
the same script (tests/mpi/restart_cases.py): the restarted job lists, restores and
prunes exactly what the directory holds, and saves the next step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.distributed import MPI_ENV_VARS

from test_distributed_mpi import _mpi_skip_reason, read_results, run_mpi

CASES = Path(__file__).parent / "mpi" / "restart_cases.py"
STATE_CASES = ["deleted", "stale", "damaged", "disagree", "again"]


def _run(n: int, root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    if n > 1:
        reason = _mpi_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        proc, got, _ = run_mpi(n, str(CASES), str(root), *STATE_CASES, timeout=120)
    else:
        with tempfile.TemporaryDirectory(prefix="ckptvar-restart-") as result_dir:
            env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
            env["RESULT_DIR"] = result_dir
            proc = subprocess.run([sys.executable, str(CASES), str(root), *STATE_CASES],
                                  capture_output=True, text=True, timeout=120, env=env,
                                  check=False)
            got = read_results(Path(result_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return got


@pytest.mark.parametrize("n", [1, 3])
def test_the_state_file_is_only_a_cache(n: int, tmp_path: Path) -> None:
    got = _run(n, tmp_path)
    for case in STATE_CASES:
        assert sorted(got.get(case, {})) == list(range(n)), (case, got.get(case))
        for rank, r in got[case].items():
            where = (case, rank)
            assert r["ok"], (where, r)
            assert r["listed"] == ["ckpt-2.h5", "ckpt-3.h5"], (where, r)
            assert r["latest"] == r["dir_latest"] == r["restored"] == "ckpt-3.h5", (where, r)
            assert r["values"] == r["values_max"] == 3.0, (where, r)  # the newest, bit-exact
            assert r["next"] == "ckpt-4.h5", (where, r)
            assert r["after"] == ["ckpt-3.h5", "ckpt-4.h5"], (where, r)  # pruned by the rule
            assert r["on_disk"] == ["ckpt-3.h5", "ckpt-4.h5"], (where, r)
        if case == "damaged":
            # said once, by the process that found it damaged (and rebuilt it)
            assert any("could not be read" in w for r in got[case].values() for w in r["warned"])
    for r in got["again"].values():  # every process: the same clear error
        assert r["error"] == "CheckpointExistsError", r
        assert "ckpt-3.h5" in r["message"] and "committed already" in r["message"], r


def _model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full(4, value), name="v")
    return cv.Checkpoint(v=v), v


def test_a_step_committed_when_the_state_write_failed_is_listed_and_pruned(
    tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename happened, the state write raised: the step is the manager's all the same."""
    from ckptvar.checkpoint import _state

    ckpt, v = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    mgr.save()
    real = _state.write_state

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_state, "write_state", broken)
    monkeypatch.setattr("ckptvar.checkpoint._manager.write_state", broken)
    v.assign(np.full(4, 2.0))
    with pytest.raises(OSError, match="No space"):
        mgr.save()
    monkeypatch.setattr("ckptvar.checkpoint._manager.write_state", real)
    monkeypatch.setattr(_state, "write_state", real)
    assert (tmp_path / "ckpt-2.h5").exists()
    assert [Path(p).name for p in mgr.checkpoints] == ["ckpt-1.h5", "ckpt-2.h5"]
    assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    ckpt2, v2 = _model(0.0)
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2)
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-2.h5")
    np.testing.assert_array_equal(v2.numpy(), np.full(4, 2.0))
    for value in (3.0, 4.0):
        v2.assign(np.full(4, value))
        again.save()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-3.h5", "ckpt-4.h5"]
    doc = json.loads((tmp_path / "checkpoint_state.json").read_text())
    assert [e["path"] for e in doc["sections"]["ckpt"]["checkpoints"]] == [
        "ckpt-3.h5", "ckpt-4.h5"]


def test_saving_a_committed_step_again_is_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, v = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path)
    first = mgr.save()
    before = Path(first).read_bytes()
    v.assign(np.full(4, 9.0))
    with pytest.raises(cv.errors.CheckpointExistsError, match="committed already"):
        mgr.save(checkpoint_number=1)
    assert Path(first).read_bytes() == before
    assert int(ckpt.save_counter.numpy()) == 1  # the failed save did not count
    assert mgr.save() == str(tmp_path / "ckpt-2.h5")


def test_a_save_counter_behind_the_directory_continues_past_it(
    tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture
) -> None:
    """A job that did not restore: its next save is a new step, never an overwrite."""
    ckpt, v = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=3)
    for _ in range(3):
        mgr.save()
    kept = {p: Path(p).read_bytes() for p in mgr.checkpoints}
    ckpt2, v2 = _model(7.0)  # a fresh job that forgot restore_or_initialize()
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=3)
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = again.save()
    assert path == str(tmp_path / "ckpt-4.h5")
    assert "Step 1 is committed already" in caplog.text and "as step 4" in caplog.text
    assert int(ckpt2.save_counter.numpy()) == 4
    assert int(cv.load(path)["save_counter"]) == 4
    for p, raw in kept.items():  # ckpt-1 pruned by the rule, the others untouched
        assert not Path(p).exists() or Path(p).read_bytes() == raw
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-2.h5", "ckpt-3.h5", "ckpt-4.h5"]
