"""CheckpointManager with a local and a persistent tier (API.md section 14)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv


def _model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full(1000, value), name="v")
    return cv.Checkpoint(v=v), v


def _names(paths: list[str]) -> list[str]:
    return [f"{Path(p).parent.name}/{Path(p).name}" for p in paths]


def _manager(ckpt: cv.Checkpoint, tmp: Path, **kw: object) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, tmp / "persistent", max_to_keep=3,
                                local_directory=tmp / "local", local_max_to_keep=2,
                                **{"persistent_every": 2, **kw})  # type: ignore[arg-type]


def test_every_step_locally_every_second_persisted(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, v = _model(0.0)
    mgr = _manager(ckpt, tmp_path)
    for step in range(1, 8):
        v.assign(np.full(1000, float(step)))
        assert mgr.save() == str(tmp_path / "local" / f"ckpt-{step}.h5")
    mgr.wait_until_finished()
    local = sorted(p.name for p in (tmp_path / "local").glob("ckpt-*"))
    persistent = sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*"))
    assert local == ["ckpt-6.h5", "ckpt-7.h5"]
    assert persistent == ["ckpt-2.h5", "ckpt-4.h5", "ckpt-6.h5"]
    for name in persistent:
        step = int(name.split("-")[1].split(".")[0])
        np.testing.assert_array_equal(cv.load(tmp_path / "persistent" / name)["v"],
                                      np.full(1000, float(step)))
    # every step committed in either tier, the local copy where there is one
    assert _names(mgr.checkpoints) == ["persistent/ckpt-2.h5", "persistent/ckpt-4.h5",
                                       "local/ckpt-6.h5", "local/ckpt-7.h5"]
    assert mgr.latest_checkpoint == str(tmp_path / "local" / "ckpt-7.h5")


def test_restore_takes_the_newest_step_of_either_tier(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, v = _model(0.0)
    mgr = _manager(ckpt, tmp_path)
    for step in range(1, 6):
        v.assign(np.full(1000, float(step)))
        mgr.save()
    mgr.wait_until_finished()
    ckpt2, v2 = _model(-1.0)  # a restart on the same machine: step 5 is local only
    again = _manager(ckpt2, tmp_path)
    assert again.restore_or_initialize() == str(tmp_path / "local" / "ckpt-5.h5")
    np.testing.assert_array_equal(v2.numpy(), np.full(1000, 5.0))
    shutil.rmtree(tmp_path / "local")  # a new machine: the local tier is gone
    ckpt3, v3 = _model(-1.0)
    third = _manager(ckpt3, tmp_path)
    assert third.restore_or_initialize() == str(tmp_path / "persistent" / "ckpt-4.h5")
    np.testing.assert_array_equal(v3.numpy(), np.full(1000, 4.0))
    v3.assign(np.full(1000, 5.5))
    assert third.save() == str(tmp_path / "local" / "ckpt-5.h5")  # goes on from step 4
    third.wait_until_finished()


def test_a_local_step_is_never_pruned_before_its_persistent_copy(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    ckpt, v = _model(0.0)
    mgr = _manager(ckpt, tmp_path)
    v.assign(np.full(1000, 1.0))
    mgr.save()
    # hold the persistent tier's state lock: step 2's copy cannot be recorded yet
    fd = os.open(tmp_path / "persistent" / ".checkpoint_state.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        for step in range(2, 7):
            v.assign(np.full(1000, float(step)))
            mgr.save()
        local = sorted(p.name for p in (tmp_path / "local").glob("ckpt-*"))
        assert "ckpt-2.h5" in local  # due a persistent copy that is not committed
        assert len(local) > 2
    finally:
        os.close(fd)
    mgr.wait_until_finished()
    assert sorted(p.name for p in (tmp_path / "local").glob("ckpt-*")) == ["ckpt-5.h5",
                                                                          "ckpt-6.h5"]
    assert sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*")) == [
        "ckpt-2.h5", "ckpt-4.h5", "ckpt-6.h5"]


def test_tiers_refuse_bad_settings(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _model(0.0)
    with pytest.raises(ValueError, match="persistent_every"):
        _manager(ckpt, tmp_path / "a", persistent_every=0)


def test_a_preemption_save_is_persisted_before_the_signal_comes_back(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    ckpt, v = _model(0.0)
    mgr = _manager(ckpt, tmp_path, persistent_every=10)
    seen: list[list[str]] = []

    def handler(_signum: int, _frame: object) -> None:  # runs after the re-delivery
        seen.append(sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*")))

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        mgr.save_on_signal(signal.SIGUSR1)
        for step in range(1, 3):
            v.assign(np.full(1000, float(step)))
            mgr.save(step)  # local only (persistent_every=10)
        v.assign(np.full(1000, 3.0))
        assert not mgr.reached_preemption(3)  # no signal yet
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.reached_preemption(3)  # step 3: not a multiple of 10, persisted anyway
        assert seen == [["ckpt-3.h5"]]  # committed before the handler ran
    finally:
        signal.signal(signal.SIGUSR1, previous)
    for step in range(4, 7):  # later steps: persistent_every again; step 3 stays until pruned
        mgr.save(step)
    mgr.wait_until_finished()
    assert sorted(p.name for p in (tmp_path / "persistent").glob("ckpt-*")) == ["ckpt-3.h5"]
    assert sorted(p.name for p in (tmp_path / "local").glob("ckpt-*")) == ["ckpt-5.h5",
                                                                          "ckpt-6.h5"]
    shutil.rmtree(tmp_path / "local")
    ckpt2, v2 = _model(-1.0)
    assert _manager(ckpt2, tmp_path).restore_or_initialize() == str(
        tmp_path / "persistent" / "ckpt-3.h5")
    np.testing.assert_array_equal(v2.numpy(), np.full(1000, 3.0))


TIERS_CASES = Path(__file__).parent / "mpi" / "tiers_cases.py"


def _mpi(tmp: Path, *cases: str, env: dict[str, str] | None = None
         ) -> dict[str, dict[int, dict[str, object]]]:
    reason = _mpi_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    proc, got, _ = run_mpi(3, str(TIERS_CASES), str(tmp), *cases, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for case in cases:
        assert sorted(got.get(case, {})) == [0, 1, 2], got
    return got


def test_three_processes_share_a_local_tier_and_rank_0_persists(tmp_path: Path) -> None:
    saved = _mpi(tmp_path, "save", "per-rank", "fail")
    for r in saved["save"].values():
        assert r["local"] == ["ckpt-5.h5"], r
        assert r["persistent"] == ["ckpt-2.h5", "ckpt-4.h5"], r
        assert r["listed"] == ["persistent/ckpt-2.h5", "persistent/ckpt-4.h5",
                               "local/ckpt-5.h5"], r
    for rank, r in saved["per-rank"].items():  # one local directory per rank: each its part
        assert r["local"] == ["ckpt-2.h5"] and r["persistent"] == ["ckpt-2.h5"], r
        assert f"rank-{rank:05d}.h5" in r["parts"], r
        assert not any(f"rank-{q:05d}" in p for p in r["parts"] for q in range(3) if q != rank)
    for r in saved["fail"].values():  # rank 0's copy failed: said on every process
        assert r["error"] == "CkptError" and "ckpt-2.h5' exists already" in r["message"], r
    assert (tmp_path / "fail" / "persistent" / "ckpt-2.h5" / "mine").read_text() == "mine"
    for r in _mpi(tmp_path, "restore")["restore"].values():  # the same machines: step 5
        assert r["restored"] == str(tmp_path / "local" / "ckpt-5.h5"), r
        assert r["values"] == [5.0], r
    shutil.rmtree(tmp_path / "local")  # new machines: every process restores step 4
    for r in _mpi(tmp_path, "restore")["restore"].values():
        assert r["restored"] == str(tmp_path / "persistent" / "ckpt-4.h5"), r
        assert r["values"] == [4.0], r


@pytest.mark.slow
def test_three_processes_share_an_incremental_local_tier(tmp_path: Path) -> None:
    """Incremental local steps of three processes: step 5 shares the frozen value with
    step 4, the persistent copies (of steps written whole) load once the local tier is
    gone; per-node local tiers refuse ``incremental=True`` on every process."""
    env = {"INCREMENTAL": "1"}
    saved = _mpi(tmp_path, "save", "per-rank", env=env)
    for r in saved["save"].values():
        # local_max_to_keep=1: step 4 is no longer listed there, but held for step 5
        assert r["local"] == ["ckpt-4.h5", "ckpt-5.h5"], r
        assert r["persistent"] == ["ckpt-2.h5", "ckpt-4.h5"], r
        assert r["listed"] == ["persistent/ckpt-2.h5", "persistent/ckpt-4.h5",
                               "local/ckpt-5.h5"], r
        assert r["shared"] == {"frozen": ["ckpt-4.h5"]}, r
    for r in saved["per-rank"].values():
        assert r["error"] == "CkptError" and "each node's own disk" in r["message"], r
    shutil.rmtree(tmp_path / "local")  # new machines: every process restores step 4
    for r in _mpi(tmp_path, "restore", env=env)["restore"].values():
        assert r["restored"] == str(tmp_path / "persistent" / "ckpt-4.h5"), r
        assert r["values"] == [4.0], r


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_three_processes_with_background_saves_into_a_shared_local_tier(tmp_path: Path) -> None:
    """``async_save=True``: the collective local saves run in the background; rank 0's
    copy of a step starts once that step is committed; the same steps as blocking."""
    for r in _mpi(tmp_path, "save", env={"ASYNC": "1"})["save"].values():
        assert r["local"] == ["ckpt-5.h5"] and r["persistent"] == ["ckpt-2.h5", "ckpt-4.h5"], r
    for r in _mpi(tmp_path, "restore", env={"ASYNC": "1"})["restore"].values():
        assert r["restored"] == str(tmp_path / "local" / "ckpt-5.h5") and r["values"] == [5.0], r


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_an_incremental_local_tier_persists_standalone_copies(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    """The local tier's steps are incremental, except those due a persistent copy: they
    are written whole, so every persistent step loads after the local tier is gone."""
    frozen = cv.Variable(np.arange(400_000, dtype=np.float32), name="frozen")  # 1.6 MB
    head = cv.Variable(np.zeros(8, np.float32), name="head")
    mgr = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), tmp_path / "persistent",
                               max_to_keep=3, local_directory=tmp_path / "local",
                               local_max_to_keep=2, persistent_every=2, format=fmt,
                               incremental=True)
    sizes = {}
    for step in range(1, 8):
        head.assign(np.full(8, float(step), np.float32))
        path = Path(mgr.save())
        mgr.wait_until_finished()
        sizes[step] = (sum(f.stat().st_size for f in path.rglob("*") if f.stat().st_nlink == 1
                           and f.is_file()) if path.is_dir() else path.stat().st_size)
    # the steps between two persistent copies write the head alone; the due ones whole
    for step in (3, 5, 7):
        assert sizes[step] < frozen.numpy().nbytes // 4, sizes
    for step in (2, 4, 6):
        assert sizes[step] > frozen.numpy().nbytes, sizes
    with cv.open(tmp_path / "local" / f"ckpt-7.{fmt}") as reader:
        assert reader.shared() == {"frozen": [f"ckpt-6.{fmt}"]}
    shutil.rmtree(tmp_path / "local")  # a new machine: only the persistent tier is left
    for step in (4, 6):
        got = cv.load(tmp_path / "persistent" / f"ckpt-{step}.{fmt}")
        np.testing.assert_array_equal(got["frozen"], frozen.numpy())
        np.testing.assert_array_equal(got["head"], np.full(8, float(step), np.float32))
    head2 = cv.Variable(np.zeros(8, np.float32), name="head")
    again = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head2),
                                 tmp_path / "persistent", max_to_keep=3,
                                 local_directory=tmp_path / "local", local_max_to_keep=2,
                                 persistent_every=2, format=fmt, incremental=True)
    again.restore_or_initialize()
    np.testing.assert_array_equal(head2.numpy(), np.full(8, 6.0, np.float32))
