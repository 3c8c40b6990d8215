"""cv.CheckpointManager: numbering, retention, intervals, state file, restarts, ownership."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint._manager import STATE_FILE


def _ckpt(value: float = 0.0) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full(3, value), name="v")
    return cv.Checkpoint(v=v), v


def _names(paths: list[str]) -> list[str]:
    return [Path(p).name for p in paths]


def test_save_retention_and_latest(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt, v = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=3, format=fmt)
    assert manager.latest_checkpoint is None and cv.latest_checkpoint(tmp_path / "run") is None
    for i in range(5):
        v.assign(np.full(3, float(i)))
        manager.save()
    assert _names(manager.checkpoints) == [f"ckpt-{i}.{fmt}" for i in (3, 4, 5)]
    assert manager.latest_checkpoint == str(tmp_path / "run" / f"ckpt-5.{fmt}")
    assert cv.latest_checkpoint(tmp_path / "run") == manager.latest_checkpoint
    on_disk = sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith("."))
    assert on_disk == sorted([f"ckpt-{i}.{fmt}" for i in (3, 4, 5)] + [STATE_FILE])
    state = json.loads((tmp_path / "run" / STATE_FILE).read_text())
    entries = state["sections"]["ckpt"]["checkpoints"]
    assert [e["step"] for e in entries] == [3, 4, 5] and all(e["time"] > 0 for e in entries)
    assert manager.save(checkpoint_number=100).endswith(f"ckpt-100.{fmt}")


def test_restart_picks_the_state_back_up(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt, v = _ckpt()
    first = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format=fmt)
    for i in range(3):
        v.assign(np.full(3, float(i)))
        first.save()
    del first, ckpt
    # a "new process": fresh objects, same directory
    with cv.Graph().as_default():
        ckpt2, v2 = _ckpt(-1.0)
        second = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2, format=fmt)
        assert _names(second.checkpoints) == [f"ckpt-2.{fmt}", f"ckpt-3.{fmt}"]
        assert second.restore_or_initialize() == second.latest_checkpoint
        np.testing.assert_array_equal(v2.numpy(), [2, 2, 2])
        assert int(ckpt2.save_counter.numpy()) == 3
        second.save()
        assert _names(second.checkpoints) == [f"ckpt-3.{fmt}", f"ckpt-4.{fmt}"]
        assert not (tmp_path / f"ckpt-2.{fmt}").exists()


def test_a_save_does_not_open_the_step_it_committed(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record of a step lists it without opening it to be told it is a checkpoint
    (the manager wrote it; a pruned step is, before it is deleted); a committed step the
    state file does not know is still opened and listed."""
    from ckptvar.checkpoint import _manager

    opened: list[str] = []
    real = _manager.is_own_checkpoint

    def counting(path: Path) -> bool:
        opened.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(_manager, "is_own_checkpoint", counting)
    ckpt, v = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, format=fmt)
    for i in range(3):
        v.assign(np.full(3, float(i)))
        manager.save()
    assert opened == [f"ckpt-1.{fmt}"]  # pruned: deleted only if it is a checkpoint
    opened.clear()
    (tmp_path / STATE_FILE).unlink()  # lost: the steps on disk are the record
    with cv.Graph().as_default():
        again = cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=2, format=fmt)
        assert _names(again.checkpoints) == [f"ckpt-2.{fmt}", f"ckpt-3.{fmt}"]
    assert sorted(opened) == [f"ckpt-2.{fmt}", f"ckpt-3.{fmt}"]


def test_restore_or_initialize(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    calls = []
    ckpt, v = _ckpt()
    manager = cv.CheckpointManager(
        ckpt, tmp_path, format=fmt, init_fn=lambda: calls.append(1)
    )
    assert manager.restore_or_initialize() is None and calls == [1]
    v.assign([1.0, 1.0, 1.0])
    good = manager.save()
    v.assign([2.0, 2.0, 2.0])
    bad = manager.save()
    # damage the newest (flip a byte of the stored value): it is skipped for the older one
    needle = np.full(3, 2.0).tobytes()
    files = [Path(bad)] if Path(bad).is_file() else sorted(Path(bad).rglob("*"))
    for f in files:
        data = bytearray(f.read_bytes()) if f.is_file() else bytearray()
        at = data.find(needle)
        if at >= 0:
            data[at + 3] ^= 0xFF
            f.write_bytes(bytes(data))
            break
    else:
        pytest.fail("stored value not found")
    v.assign([0.0, 0.0, 0.0])
    assert manager.restore_or_initialize() == good
    assert [p for p, _ in manager.skipped] == [bad]
    np.testing.assert_array_equal(v.numpy(), [1, 1, 1])
    assert calls == [1]


def test_a_forced_save_skips_only_the_step_saved_already(tmp_path: Path,
                                                         fresh_graph: cv.Graph) -> None:
    """check_interval=False saves whatever the interval, but not the step counter's step
    twice (TensorFlow's manager: 'unless a checkpoint has already been saved for the
    current step')."""
    ckpt, _ = _ckpt()
    step = cv.Variable(5, dtype="int64", name="step")
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, step_counter=step,
                                   checkpoint_interval=10)
    assert _names([manager.save()]) == ["ckpt-1.h5"]
    assert manager.save(check_interval=False) is None  # step 5 again: nothing written
    step.assign(7)
    assert _names([manager.save(check_interval=False)]) == ["ckpt-2.h5"]  # inside the interval
    assert manager.save(check_interval=False) is None
    assert _names(manager.checkpoints) == ["ckpt-1.h5", "ckpt-2.h5"]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-1.h5", "ckpt-2.h5"]


def test_a_save_the_interval_skips_logs_nothing_about_its_number(
        tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture) -> None:
    step = cv.Variable(10, dtype="int64", name="step")
    first = cv.CheckpointManager(_ckpt()[0], tmp_path, step_counter=step, checkpoint_interval=5)
    assert first.save() is not None
    step.assign(12)  # a new run that did not restore: its save counter is behind
    again = cv.CheckpointManager(_ckpt()[0], tmp_path, step_counter=step, checkpoint_interval=5)
    with caplog.at_level("WARNING", logger="ckptvar"):
        assert again.save() is None  # 12 < 10 + 5: nothing saved, nothing to say
    assert caplog.records == []
    step.assign(15)
    with caplog.at_level("WARNING", logger="ckptvar"):
        assert _names([again.save()]) == ["ckpt-2.h5"]  # past the committed step 1
    assert "continues past the newest committed step" in caplog.text


@pytest.mark.parametrize(("saved", "opened"), [("zarr", "h5"), ("h5", "zarr")])
def test_a_manager_of_another_format_names_the_steps_it_does_not_list(
        tmp_path: Path, saved: str, opened: str, fresh_graph: cv.Graph) -> None:
    """A run saved as Zarr, restarted by a manager left at the default format (h5),
    listed nothing, so restore_or_initialize started from scratch without a word and the
    run's next save was ckpt-1.h5 beside ckpt-2.zarr. Now the manager says which steps
    of its name it does not list, and how to continue them."""
    v = cv.Variable(np.ones(3), name="v")
    first = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, format=saved)
    first.save()
    first.save()
    again = cv.Variable(np.zeros(3), name="v")
    with pytest.warns(UserWarning, match=rf"ckpt-2\.{saved}.*format='{saved}'"):
        restarted = cv.CheckpointManager(cv.Checkpoint(v=again), tmp_path, format=opened)
    assert restarted.checkpoints == []
    with pytest.warns(UserWarning, match=f"format='{saved}'"):  # each manager says it
        cv.CheckpointManager(cv.Checkpoint(v=again), tmp_path, format=opened)
    import warnings  # noqa: PLC0415
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own format's steps there too: quiet
        cv.CheckpointManager(cv.Checkpoint(v=again), tmp_path, format=saved)
        restarted.save()
        cv.CheckpointManager(cv.Checkpoint(v=again), tmp_path, format=opened)


def test_checkpoint_interval(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _ckpt()
    step = cv.Variable(0, dtype="int64", name="step")
    manager = cv.CheckpointManager(
        ckpt, tmp_path, max_to_keep=None, step_counter=step, checkpoint_interval=10
    )
    saved = []
    for s in range(0, 35, 5):
        step.assign(s)
        saved.append(manager.save() is not None)
    assert saved == [True, False, True, False, True, False, True]
    assert manager.save(check_interval=False) is None  # step 30 is saved already
    assert manager.save(checkpoint_number=31) is None  # 31 < 30 + 10
    assert manager.save(checkpoint_number=40) is not None
    no_counter = cv.CheckpointManager(
        ckpt, tmp_path / "b", checkpoint_interval=5, checkpoint_name="b"
    )
    with pytest.raises(ValueError, match="step_counter"):
        no_counter.save()
    assert no_counter.save(check_interval=False) is not None  # no step needed then


def test_keep_checkpoint_every_n_hours(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(
        ckpt, tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1e-9
    )
    paths = []
    for _ in range(3):
        time.sleep(0.02)  # a step's time is its file's: a clock tick (a few ms) apart
        paths.append(manager.save())
    assert manager.checkpoints == paths[-1:]
    assert all(Path(p).exists() for p in paths)  # preserved: unlisted, never deleted


def test_cleans_its_own_temporaries_only(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    hexid = "0123456789abcdef0123456789abcdef"
    mine = tmp_path / f".ckpt-7.h5.{hexid}.partial"
    mine_dir = tmp_path / f".ckpt-8.zarr.{hexid}.partial"
    state_tmp = tmp_path / f".{STATE_FILE}.{hexid}.partial"
    theirs = tmp_path / f".other-1.h5.{hexid}.partial"
    foreign = tmp_path / "ckpt-99.h5"  # not written by a manager: never touched
    for p in (mine, state_tmp, theirs, foreign):
        p.write_bytes(b"partial")
    mine_dir.mkdir()
    (mine_dir / "zarr.json").write_text("{}")
    manager = cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=1)
    assert not mine.exists() and not mine_dir.exists() and not state_tmp.exists()
    assert theirs.exists() and foreign.exists()
    manager.save()
    manager.save()
    assert foreign.exists() and manager.checkpoints == [str(tmp_path / "ckpt-2.h5")]


def test_two_managers_share_a_directory(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    a = cv.CheckpointManager(_ckpt(1.0)[0], tmp_path, max_to_keep=1, checkpoint_name="a")
    b = cv.CheckpointManager(_ckpt(2.0)[0], tmp_path, max_to_keep=1, checkpoint_name="b")
    for _ in range(3):
        a.save()
        b.save()
    assert a.checkpoints == [str(tmp_path / "a-3.h5")]
    assert b.checkpoints == [str(tmp_path / "b-3.h5")]
    assert Path(a.latest_checkpoint).exists() and Path(b.latest_checkpoint).exists()
    assert cv.latest_checkpoint(tmp_path) == b.latest_checkpoint


def test_a_failed_save_is_never_listed(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path)
    good = manager.save()
    with cv.deferred_init():
        ckpt.broken = cv.Variable(cv.initializers.zeros, shape=(2,), dtype="float32")
    with pytest.raises(cv.UninitializedVariableError):
        manager.save()
    assert manager.checkpoints == [good] and cv.latest_checkpoint(tmp_path) == good
    assert int(ckpt.save_counter.numpy()) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_state.json", "ckpt-1.h5",
    ]


def test_a_listed_file_deleted_by_hand_is_dropped(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    manager = cv.CheckpointManager(_ckpt()[0], tmp_path)
    first, second = manager.save(), manager.save()
    Path(second).unlink()
    again = cv.CheckpointManager(_ckpt()[0], tmp_path)
    assert again.checkpoints == [first]


def test_bad_arguments(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, _ = _ckpt()
    with pytest.raises(ValueError, match="max_to_keep"):
        cv.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(cv.UnsupportedFormatError, match="'npz'"):
        cv.CheckpointManager(ckpt, tmp_path, format="npz")
    with pytest.raises(TypeError, match="Checkpoint"):
        cv.CheckpointManager(object(), tmp_path)  # type: ignore[arg-type]


def test_a_damaged_state_file_is_kept_aside_and_the_list_rebuilt(
    tmp_path: Path, fmt: str
) -> None:
    """The state file is only damaged from outside; the directory stays usable."""
    w = cv.Variable(np.zeros(3, np.float32))
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), tmp_path, max_to_keep=3, format=fmt)
    for step in range(1, 4):
        w.assign(np.full(3, step, np.float32))
        mgr.save()
    state = tmp_path / "checkpoint_state.json"
    state.write_bytes(state.read_bytes()[:20])  # truncated
    with pytest.warns(UserWarning, match="was rebuilt from the files"):
        assert cv.latest_checkpoint(tmp_path) == os.fspath(tmp_path / f"ckpt-3.{fmt}")
    with pytest.warns(UserWarning, match="could not be read"):
        again = cv.CheckpointManager(cv.Checkpoint(w=w), tmp_path, max_to_keep=3, format=fmt)
    assert [Path(p).name for p in again.checkpoints] == [f"ckpt-{i}.{fmt}" for i in (1, 2, 3)]
    damaged = [p for p in os.listdir(tmp_path) if p.startswith("checkpoint_state.json.damaged")]
    assert damaged, "the damaged state file is kept, not deleted"
    w.assign(np.zeros(3, np.float32))
    again.restore_or_initialize()
    assert np.array_equal(w.numpy(), np.full(3, 3, np.float32))
    again.save()  # and the manager carries on, with a healthy state file again
    assert cv.latest_checkpoint(tmp_path) == os.fspath(tmp_path / f"ckpt-4.{fmt}")


@pytest.mark.parametrize("name", ["model.h5", "model.zarr", "Model.H5", "weights.pt"])
def test_a_checkpoint_name_ending_in_a_format_suffix_is_refused(
        tmp_path: Path, fresh_graph: cv.Graph, name: str) -> None:
    """A save takes such a suffix as the format and drops it from the file name
    (``model-1.h5``), so the manager would never list, prune nor restore its own steps."""
    with pytest.raises(ValueError, match="checkpoint_name") as err:
        cv.CheckpointManager(_ckpt()[0], tmp_path, checkpoint_name=name)
    assert repr(name) in str(err.value) and "format=" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing touched


def test_steps_are_kept_in_save_order_after_a_run_went_back(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """Steps 100, 500, then 200 (the run went back to 100 and trained on): as
    TensorFlow's manager, the latest is the last saved and pruning removes the oldest
    saved, never the current run's newest steps before the abandoned 500."""
    ckpt, v = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=3, format=fmt)
    for number in (100, 500, 200):
        v.assign(np.full(3, float(number)))
        manager.save(checkpoint_number=number)
    names = [f"ckpt-{n}.{fmt}" for n in (100, 500, 200)]
    assert _names(manager.checkpoints) == names
    assert manager.latest_checkpoint == cv.latest_checkpoint(tmp_path) == os.fspath(
        tmp_path / names[-1])
    for number in (300, 400):
        v.assign(np.full(3, float(number)))
        manager.save(checkpoint_number=number)
    kept = [f"ckpt-{n}.{fmt}" for n in (200, 300, 400)]
    assert _names(manager.checkpoints) == kept  # 100 and the abandoned 500 pruned first
    manager.wait_until_finished()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == sorted(kept)
    # a fresh manager (a restart) recovers the same order, and restores the last save
    ckpt2, v2 = _ckpt(-1.0)
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=3, format=fmt)
    assert _names(again.checkpoints) == kept
    assert again.restore_or_initialize() == os.fspath(tmp_path / kept[-1])
    np.testing.assert_array_equal(v2.numpy(), [400.0] * 3)


def test_a_fresh_manager_places_an_unrecorded_step_by_its_time(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A crash between a step's rename and the state write: the step the state does not
    know is placed by its file's time, as cv.latest_checkpoint places it (one rule)."""
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=3)
    for number in (100, 500):
        manager.save(checkpoint_number=number)
    before = (tmp_path / STATE_FILE).read_bytes()
    manager.save(checkpoint_number=200)
    (tmp_path / STATE_FILE).write_bytes(before)  # the state write of step 200 never happened
    for age, number in ((30, 100), (20, 500), (10, 200)):
        os.utime(tmp_path / f"ckpt-{number}.h5", (time.time() - age,) * 2)
    again = cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=3)
    assert _names(again.checkpoints) == ["ckpt-100.h5", "ckpt-500.h5", "ckpt-200.h5"]
    assert again.latest_checkpoint == cv.latest_checkpoint(tmp_path)
    # no state file at all: the files' times alone
    (tmp_path / STATE_FILE).unlink()
    assert cv.latest_checkpoint(tmp_path) == os.fspath(tmp_path / "ckpt-200.h5")
    again = cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=3)
    assert _names(again.checkpoints) == ["ckpt-100.h5", "ckpt-500.h5", "ckpt-200.h5"]


def test_a_stale_state_file_is_written_again_when_a_manager_opens(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A state file that lists a step deleted by hand and misses one committed after it
    was written: the manager opening the directory recovered both in memory but left the
    file stale until its next save (its "changed?" check compared the recovered section
    with itself); it writes the recovered state at open."""
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=5)
    manager.save()
    manager.save()
    before = (tmp_path / STATE_FILE).read_bytes()
    manager.save()
    (tmp_path / STATE_FILE).write_bytes(before)  # the state write of step 3 never happened
    (tmp_path / "ckpt-1.h5").unlink()  # and step 1 deleted by hand
    again = cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=5)
    assert _names(again.checkpoints) == ["ckpt-2.h5", "ckpt-3.h5"]
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert [e["path"] for e in state["sections"]["ckpt"]["checkpoints"]] == [
        "ckpt-2.h5", "ckpt-3.h5"]
    assert state["latest"] == "ckpt-3.h5"
    written = (tmp_path / STATE_FILE).stat().st_mtime_ns
    cv.CheckpointManager(_ckpt()[0], tmp_path, max_to_keep=5)  # nothing to recover now
    assert (tmp_path / STATE_FILE).stat().st_mtime_ns == written


def test_a_copied_directory_keeps_its_latest(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """A copy of the directory (cp -r, a download) gives the files new times in any order:
    the steps the state file lists keep its order, so the latest is still the last saved."""
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path / "a", max_to_keep=5)
    for _ in range(5):
        manager.save()
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copyfile)
    for age, number in ((10, 5), (0, 2)):  # step 2 copied last
        os.utime(tmp_path / "b" / f"ckpt-{number}.h5", (time.time() - age,) * 2)
    assert cv.latest_checkpoint(tmp_path / "b") == os.fspath(tmp_path / "b" / "ckpt-5.h5")
    again = cv.CheckpointManager(_ckpt()[0], tmp_path / "b", max_to_keep=5)
    assert again.latest_checkpoint == os.fspath(tmp_path / "b" / "ckpt-5.h5")


def test_hours_rule_preserves_the_oldest_saved_step(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """keep_checkpoint_every_n_hours looks at the step leaving the window: the oldest saved."""
    ckpt, _ = _ckpt()
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1,
                                   keep_checkpoint_every_n_hours=1e-9)
    for number in (100, 500, 200):
        time.sleep(0.02)  # file times: a clock tick (a few ms) apart
        manager.save(checkpoint_number=number)
    assert _names(manager.checkpoints) == ["ckpt-200.h5"]
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert [e["path"] for e in state["sections"]["ckpt"]["preserved"]] == [
        "ckpt-100.h5", "ckpt-500.h5"]
