"""Incremental managers at their edges: values with no bytes, numbers given by hand, the
CLI on steps that refer to others; each step checked bit-exact by every reader."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_value_with_no_bytes_is_read_from_a_step_that_shares_it(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """An empty embedding table (no rows yet) unchanged since the last step: the next
    step refers to it like any value, and every reader reads that step."""
    empty = cv.Variable(np.zeros((0, 4), np.float32), name="empty")
    w = cv.Variable(np.ones(3, np.float32), name="w")
    manager = cv.CheckpointManager(cv.Checkpoint(empty=empty, w=w), tmp_path, format=fmt,
                                   incremental=True)
    manager.save()
    w.assign_add(1.0)
    step = manager.save()
    got = cv.load(step)
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == np.float32
    assert np.array_equal(got["w"], w.numpy())
    with cv.open(step) as reader:
        assert reader["empty"][:].shape == (0, 4)
    empty.assign(np.ones((0, 4), np.float32))
    w.assign(np.zeros(3, np.float32))
    cv.Checkpoint(empty=empty, w=w).restore(step)
    assert np.array_equal(w.numpy(), np.full(3, 2, np.float32))
    verified = _ckpt("verify", str(step))
    assert verified.returncode == 0, verified.stderr
    if fmt == "h5":
        with h5py.File(step, "r") as f:  # plain h5py too
            assert f["empty"].shape == (0, 4)


def test_pruned_steps_held_only_by_other_pruned_steps_do_not_pile_up(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """max_to_keep=1, a table trained at new rows every step (written whole each time its
    16 patches are used up) and a value changed every 10 steps: each pruned step that a
    kept step reads from is held whole, with what it refers to, and such chains reached
    back through the whole run (800 step files, 45x the state, after 3,000 steps). The
    steps kept only for other pruned steps stay a few: every step file left loads."""
    table = cv.Variable(np.zeros((4096, 64), np.float32), name="table")  # 1 MiB
    other = cv.Variable(np.arange(300_000, dtype=np.float32), name="other")
    manager = cv.CheckpointManager(cv.Checkpoint(table=table, other=other), tmp_path,
                                   max_to_keep=1, incremental=True)
    counts = []
    for step in range(1, 126):
        table.scatter_update((np.arange(10) + 10 * step) % 4096,
                             np.full((10, 64), step, np.float32))
        if step % 10 == 0:
            other.assign_add(np.ones(300_000, np.float32))
        manager.save()
        counts.append(len(list(tmp_path.glob("ckpt-*.h5"))))
    assert max(counts[-50:]) <= 36, counts[::5]  # 16 patches, their base, a holder: ~20
    for path in tmp_path.glob("ckpt-*.h5"):
        got = cv.load(path)
        assert got["table"].shape == (4096, 64)
    last = cv.load(manager.latest_checkpoint)
    assert np.array_equal(last["table"], table.numpy())
    assert np.array_equal(last["other"], other.numpy())


def test_a_holder_deleted_by_hand_is_not_referred_to(
        tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture) -> None:
    """The step file that holds a frozen value's bytes is deleted by hand behind a running
    HDF5 manager: the next step must not link to it (it would not read); it writes every
    value, says so, and loads; the steps after it share again."""
    frozen = cv.Variable(np.arange(50_000, dtype=np.float32), name="frozen")
    w = cv.Variable(np.zeros(3, np.float32), name="w")
    manager = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, w=w), tmp_path,
                                   max_to_keep=5, incremental=True)
    first = Path(manager.save())
    w.assign_add(1.0)
    manager.save()  # refers to the first step's frozen bytes
    first.unlink()
    w.assign_add(1.0)
    with caplog.at_level("WARNING", logger="ckptvar"):
        step = manager.save()
    assert "no longer exist" in caplog.text and first.name in caplog.text, caplog.text
    got = cv.load(step)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["w"], w.numpy())
    w.assign_add(1.0)
    after = manager.save()
    with cv.open(after) as reader:
        assert "frozen" in reader.shared()
    assert np.array_equal(cv.load(after)["frozen"], frozen.numpy())


def test_a_value_changed_by_ufunc_at_is_written_again(tmp_path: Path) -> None:
    """np.add.at(v, ...) changed the value without a write the variable knew of, so the next
    incremental step referred to the old bytes: the checkpoint held [0, 0, 0, 0] while the
    variable held [0, 5, 0, 0]."""
    v = cv.Variable(np.zeros(4, np.float32), name="v")
    manager = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, incremental=True)
    manager.save()
    np.add.at(v, [1], 5.0)
    step = manager.save()
    manager.wait_until_finished()
    assert cv.load(step)["v"].tolist() == [0.0, 5.0, 0.0, 0.0]


def test_a_zarr_value_linked_only_outside_the_steps_is_not_listed_as_shared(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """With ``max_to_keep=1`` the only other name of an unchanged Zarr value's chunk file
    is the pruned step set aside for the next save (a temporary), and a backup made with
    ``cp -al`` holds more: no other step shares it, so ``shared()`` and ``ckpt inspect``
    do not list it (they listed it, with no step)."""
    frozen = cv.Variable(np.random.default_rng(0).random(300_000, dtype=np.float32),
                         name="frozen")
    head = cv.Variable(np.zeros(3, np.float32), name="head")
    manager = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), tmp_path / "run",
                                   format="zarr", max_to_keep=1, incremental=True)
    for _ in range(3):
        head.assign_add(1.0)
        step = manager.save()
    manager.wait_until_finished()
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".zarr")] == [
        Path(step).name]
    subprocess.run(["cp", "-al", str(tmp_path / "run"), str(tmp_path / "backup")], check=True)
    with cv.open(step) as reader:
        assert reader.shared() == {}
    done = _ckpt("inspect", step)
    assert done.returncode == 0, done.stderr
    assert "shared with other steps" not in done.stdout
    head.assign_add(1.0)  # a step beside it shares the value: listed, with that step
    again = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), tmp_path / "run",
                                 format="zarr", max_to_keep=2, incremental=True)
    later = again.save()
    with cv.open(later) as reader:
        assert reader.shared() == {"frozen": [Path(step).name]}


def _zarr_run(directory: Path, *, async_save: bool = False
              ) -> tuple[cv.Variable, cv.Variable, cv.CheckpointManager]:
    rng = np.random.default_rng(3)
    frozen = cv.Variable(rng.random(300_000, dtype=np.float32), name="frozen")
    table = cv.Variable(rng.random((8192, 64), dtype=np.float32), name="table")  # 2 MiB
    manager = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, table=table), directory,
                                   format="zarr", max_to_keep=2, incremental=True,
                                   async_save=async_save)
    for i in range(3):  # the table a row delta, the frozen value linked step to step
        table.scatter_update([i], np.full((1, 64), i, np.float32))
        manager.save()
    manager.wait_until_finished()
    return frozen, table, manager


@pytest.mark.parametrize("lost", ["frozen/c.0", "frozen", "table/base/c.0.0",
                                  "table/patch-0/c.0"])
def test_a_file_deleted_from_the_latest_zarr_step_is_not_built_on(
        tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture,
        lost: str) -> None:
    """A file of the latest Zarr step deleted by hand (an interrupted ``rm -r``, a value's
    directory removed to make room) behind a running manager: the next save neither
    fails on it at every step (a bare FileNotFoundError) nor commits a step that lacks it
    (a row delta's base or patch, linked from what was left): it writes every value, says
    so, and loads; the saves after it build on it again."""
    frozen, table, manager = _zarr_run(tmp_path)
    latest = Path(manager.latest_checkpoint)
    gone = latest / lost
    if gone.is_dir():
        shutil.rmtree(gone)
    else:
        gone.unlink()
    table.scatter_update([100], np.ones((1, 64), np.float32))
    with caplog.at_level("WARNING", logger="ckptvar"):
        step = manager.save()
    assert latest.name in caplog.text and "written whole" in caplog.text, caplog.text
    got = cv.load(step)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["table"], table.numpy())
    table.scatter_update([101], np.ones((1, 64), np.float32))
    after = manager.save()
    with cv.open(after) as reader:
        assert reader.deltas()["table"]["patches"] == 1 and "frozen" in reader.shared()
    got = cv.load(after)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["table"], table.numpy())


def test_a_background_save_on_a_zarr_step_that_lost_a_file_fails_clearly(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """The same with ``async_save``: the background save fails with a
    CorruptCheckpointError naming the step it built on and the file, committing nothing;
    the save after it writes every value."""
    frozen, table, manager = _zarr_run(tmp_path, async_save=True)
    latest = Path(manager.latest_checkpoint)
    (latest / "frozen" / "c.0").unlink()
    table.scatter_update([100], np.ones((1, 64), np.float32))
    manager.save()
    with pytest.raises(cv.CorruptCheckpointError, match=latest.name) as info:
        manager.wait_until_finished()
    assert "frozen/c.0" in str(info.value)
    assert manager.latest_checkpoint == str(latest)
    step = manager.save()
    manager.wait_until_finished()
    got = cv.load(step)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["table"], table.numpy())
