"""Tiers on per-node local disks (API.md section 14): 4 processes under ``mpiexec`` as 2
simulated nodes, each node's local directory seen only by its own 2 processes."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv

CASES = Path(__file__).parent / "mpi" / "node_tiers_cases.py"

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None,
                                reason=_mpi_skip_reason() or "")


def node_case(tmp: Path, name: str, env: dict[str, str] | None = None,
              ok: bool = True) -> dict[int, dict[str, Any]]:
    """Run one case under ``mpiexec -n 4`` (hard timeout) and return each rank's report."""
    proc, got, _ = run_mpi(4, str(CASES), str(tmp), name, timeout=120, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(got.get(name, {})) == [0, 1, 2, 3], (got, proc.stderr)
    return got.get(name, {})


def check_save_lose_restore(tmp: Path, persistent: str, fmt: str,
                            env: dict[str, str] | None = None) -> None:
    """Save 5 steps (every 2nd persisted); restore the local step 5; with node 1's step 5
    gone, the newest step complete on every node (local 4); save step 14; with node 1's
    whole directory gone (a new machine), every process restores step 14 from the
    persistent tier. Every restore bit-exact, the same step on every process."""
    for rank, r in node_case(tmp, "save", env).items():
        assert r["local"] == [f"ckpt-4.{fmt}", f"ckpt-5.{fmt}"], r
        node = rank // 2  # a node holds its processes' files and its own index only
        mine = [f"rank-{q:05d}.{fmt}" for q in (2 * node, 2 * node + 1)]
        assert set(mine) <= set(r["parts"]), r
        assert not any(f"rank-{q:05d}" in p for p in r["parts"]
                       for q in range(4) if q // 2 != node), r
        assert r["listed"][-2:] == [f"node{node}/ckpt-4.{fmt}", f"node{node}/ckpt-5.{fmt}"], r

    def local(rank: int, step: int) -> str:
        return str(tmp / "nodes" / f"node{rank // 2}" / f"ckpt-{step}.{fmt}")

    for rank, r in node_case(tmp, "restore", env).items():  # the same machines: step 5
        assert r["restored"] == local(rank, 5) and r["exact"] and r["counter"] == 5, r
    shutil.rmtree(tmp / "nodes" / "node1" / f"ckpt-5.{fmt}")  # step 5: on node 0 only
    for rank, r in node_case(tmp, "next", env).items():
        assert r["saved"] == local(rank, 14), r
    shutil.rmtree(tmp / "nodes" / "node1")  # a new machine for node 1
    for r in node_case(tmp, "restore", env).values():  # everyone: the persistent step 14
        assert r["restored"] == f"{persistent}/ckpt-14.{fmt}", r
        assert r["exact"] and r["counter"] == 5, r  # step 14 was the 5th save


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_restore_takes_the_newest_step_complete_on_every_node(tmp_path: Path) -> None:
    node_case(tmp_path, "save")
    # a job restarted on 2 processes (one node): the local steps hold only node 0's
    # part, so they fail to load on rank 1 and are skipped on both, for the persistent step
    proc, got, _ = run_mpi(2, str(CASES), str(tmp_path), "restore", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in got["restore"].values():
        assert r["restored"] == str(tmp_path / "persistent" / "ckpt-4.h5") and r["exact"], r
    shutil.rmtree(tmp_path / "nodes" / "node1" / "ckpt-5.h5")  # node 1 lost step 5 only
    for rank, r in node_case(tmp_path, "restore").items():
        assert r["restored"] == str(tmp_path / "nodes" / f"node{rank // 2}" / "ckpt-4.h5"), r
        assert r["exact"] and r["counter"] == 4, r


@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_per_node_local_tiers_save_persist_and_restore_after_losing_a_node(
    tmp_path: Path, fmt: str
) -> None:
    check_save_lose_restore(tmp_path, str(tmp_path / "persistent"), fmt, {"FORMAT": fmt})
    steps = sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*"))
    assert steps == [f"ckpt-{n}.{fmt}" for n in (14, 2, 4)]
    for name in steps:  # each persistent copy is one whole step, every process's file
        step = int(name.split("-")[1].split(".")[0])
        loaded = cv.load(tmp_path / "persistent" / name)
        assert np.array_equal(loaded["b"], np.full(7, step * 10.0))
        rows = np.arange(4096, dtype=np.float64)[:, None]
        assert np.array_equal(loaded["w"], step + rows / 4096 + np.zeros((1, 64)))


def test_a_process_killed_mid_persist_commits_nothing_and_keeps_the_local_steps(
    tmp_path: Path,
) -> None:
    node_case(tmp_path, "kill", ok=False)  # rank 2 SIGKILLs itself while copying step 2
    kill = tmp_path / "kill"
    assert not list((kill / "persistent").glob("ckpt-*")), "nothing committed persistently"
    assert list((kill / "persistent").glob(".ckpt-2.*")), "the copy had begun"
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (kill / "nodes" / node).glob("ckpt-*")) == [
            "ckpt-1.h5", "ckpt-2.h5"]
    for rank, r in node_case(kill, "restore").items():  # the local step 2, bit-exact
        assert r["restored"] == str(kill / "nodes" / f"node{rank // 2}" / "ckpt-2.h5"), r
        assert r["exact"], r
    node_case(kill, "next")  # the restarted job goes on: step 12, persisted
    assert not list((kill / "persistent").glob(".ckpt-*")), "the dead copy is reclaimed"
    assert sorted(p.name for p in (kill / "persistent").glob("ckpt-*")) == ["ckpt-12.h5"]


def test_a_local_step_stays_on_every_node_until_its_persistent_copy_is_committed(
    tmp_path: Path,
) -> None:
    hold = tmp_path / "hold"
    (hold / "persistent").mkdir(parents=True)
    got: dict[str, Any] = {}
    job = threading.Thread(target=lambda: got.update(
        run=run_mpi(4, str(CASES), str(tmp_path), "hold", timeout=120)))
    job.start()

    def wait_for(pattern: str) -> None:
        deadline = time.monotonic() + 60
        while len(list(hold.glob(pattern))) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)

    wait_for("ready-*")  # the managers are made (they read the persistent state)
    fd = os.open(hold / "persistent" / ".checkpoint_state.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # rank 0 cannot record a copy: none is committed
        (hold / "locked").touch()
        wait_for("saved-*")
    finally:
        os.close(fd)
    job.join(timeout=120)
    proc, results, _ = got["run"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in results["held"].values():  # step 2 is due a copy: it and the newer ones stay
        assert r["local"] == ["ckpt-2.h5", "ckpt-3.h5", "ckpt-4.h5", "ckpt-5.h5"], r
    for r in results["hold"].values():  # copies committed: local_max_to_keep=1
        assert r["local"] == ["ckpt-5.h5"] and r["persistent"] == ["ckpt-2.h5", "ckpt-4.h5"], r


@pytest.mark.parametrize("env", [None, pytest.param({"ASYNC": "1"}, marks=pytest.mark.slow)])
def test_a_signal_during_the_save_of_a_step_then_its_boundary_ends_the_job(
    tmp_path: Path, env: dict[str, str] | None
) -> None:
    """``save(N)`` then ``reached_preemption(N)`` with the signal arriving during that save,
    on per-node tiers: step N, committed on every node, is the preemption save; it is
    persisted (though not due a copy) and the signal re-delivered on every process. It
    raised CheckpointExistsError on every process."""
    for r in node_case(tmp_path, "preempt", env).values():
        assert r["error"] is None and r["reached"] is True and r["calls"] == 1, r
        assert r["local"] == ["ckpt-2.h5", "ckpt-3.h5"], r
        assert r["persistent"] == ["ckpt-2.h5", "ckpt-3.h5"], r


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_per_node_local_tiers_with_background_saves(tmp_path: Path) -> None:
    """``async_save=True``: the local saves run in the background too; same outcome."""
    check_save_lose_restore(tmp_path, str(tmp_path / "persistent"), "h5", {"ASYNC": "1"})


def test_a_background_save_into_a_local_tier_returns_before_the_step_is_written(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    """One process: ``save()`` returns after the snapshot; the local step is written and
    persisted in the background, ``wait_until_finished()`` waits for both."""
    v = cv.Variable(np.zeros(32 << 20), name="big")  # 256 MB: writing takes a while
    ckpt = cv.Checkpoint(v=v)
    mgr = cv.CheckpointManager(ckpt, tmp_path / "persistent", local_directory=tmp_path / "l",
                               persistent_every=1, async_save=True)
    v.assign(np.full(v.shape, 1.0))
    path = mgr.save()
    assert path == str(tmp_path / "l" / "ckpt-1.h5")
    assert not (tmp_path / "l" / "ckpt-1.h5").exists(), "written in the background"
    v.assign(np.full(v.shape, 2.0))  # after the snapshot: not in step 1
    mgr.wait_until_finished()
    for tier in ("l", "persistent"):
        assert cv.load(tmp_path / tier / "ckpt-1.h5")["v"].max() == 1.0
