"""Tiers on per-node local disks (API.md section 14): 4 processes under ``mpiexec`` as 2
simulated nodes, each node's local directory seen only by its own 2 processes."""

from __future__ import annotations

import shutil
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
    """Save 5 steps (every 2nd persisted), restore the local step 5, lose node 1's
    directory, restore the persistent step 6 bit-exact on every process."""
    for rank, r in node_case(tmp, "save", env).items():
        assert r["local"] == [f"ckpt-4.{fmt}", f"ckpt-5.{fmt}"], r
        node = rank // 2  # a node holds its processes' files and its own index only
        mine = [f"rank-{q:05d}.{fmt}" for q in (2 * node, 2 * node + 1)]
        assert set(mine) <= set(r["parts"]), r
        assert not any(f"rank-{q:05d}" in p for p in r["parts"]
                       for q in range(4) if q // 2 != node), r
        assert r["listed"][-2:] == [f"node{node}/ckpt-4.{fmt}", f"node{node}/ckpt-5.{fmt}"], r
    restored = node_case(tmp, "restore", env)
    for rank, r in restored.items():  # the same machines: the newest local step
        assert r["restored"] == str(tmp / "nodes" / f"node{rank // 2}" / f"ckpt-5.{fmt}"), r
        assert r["exact"] and r["counter"] == 5, r
    shutil.rmtree(tmp / "nodes" / "node1")  # a new machine for node 1
    for r in node_case(tmp, "restore", env).values():  # everyone: the persistent step 6
        assert r["restored"] == f"{persistent}/ckpt-6.{fmt}", r
        assert r["exact"] and r["counter"] == 6, r


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_per_node_local_tiers_save_persist_and_restore_after_losing_a_node(
    tmp_path: Path, fmt: str
) -> None:
    check_save_lose_restore(tmp_path, str(tmp_path / "persistent"), fmt, {"FORMAT": fmt})
    steps = sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*"))
    assert steps == [f"ckpt-{n}.{fmt}" for n in (2, 4, 6)]
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
    assert not list((kill / "persistent").glob(".ckpt-*")), "the dead copy is reclaimed"


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
    t0 = time.perf_counter()
    path = mgr.save()
    returned = time.perf_counter() - t0
    assert path == str(tmp_path / "l" / "ckpt-1.h5")
    assert not (tmp_path / "l" / "ckpt-1.h5").exists(), "written in the background"
    v.assign(np.full(v.shape, 2.0))  # after the snapshot: not in step 1
    t1 = time.perf_counter()
    mgr.wait_until_finished()
    waited = time.perf_counter() - t1
    for tier in ("l", "persistent"):
        assert cv.load(tmp_path / tier / "ckpt-1.h5")["v"].max() == 1.0
    assert returned < 10 and waited > 0, (returned, waited)
