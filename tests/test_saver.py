"""cv.Saver: name-based checkpoints (TF1 style) on both formats."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import backend_for


def _keys(path: str) -> list[str]:
    with backend_for(path).open_reader(Path(path)) as r:
        return list(r.keys())


def test_default_var_list_is_the_global_variables(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    with cv.variable_scope("net"):
        w = cv.get_variable("w", shape=(2, 3))
    b = cv.Variable(np.arange(3, dtype=np.float32), name="b")
    local = cv.Variable(1.0, name="local", collections=[cv.GraphKeys.LOCAL_VARIABLES])
    saver = cv.Saver()
    path = saver.save(tmp_path / "model", global_step=7, format=fmt)
    assert path == str(tmp_path / f"model-7.{fmt}")
    assert sorted(_keys(path)) == ["b", "net/w"]
    expected_w = w.numpy()
    w.assign(np.zeros((2, 3)))
    b.assign([9, 9, 9])
    local.assign(5.0)
    saver.restore(path)
    np.testing.assert_array_equal(w.numpy(), expected_w)
    np.testing.assert_array_equal(b.numpy(), [0, 1, 2])
    assert float(local.numpy()) == 5.0


def test_list_and_dict_var_lists(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    a = cv.Variable([1.0, 2.0], name="a")
    step = cv.Variable(3, dtype="int64", name="step")
    p1 = cv.Saver([a]).save(tmp_path / f"list.{fmt}", global_step=step)
    assert Path(p1).name == f"list-3.{fmt}" and _keys(p1) == ["a"]
    p2 = cv.Saver({"renamed/a": a}).save(tmp_path / "dict", format=fmt)
    assert Path(p2).name == f"dict.{fmt}" and _keys(p2) == ["renamed/a"]
    other = cv.Variable([0.0, 0.0], name="other")
    cv.Saver({"renamed/a": other}).restore(p2)
    np.testing.assert_array_equal(other.numpy(), [1, 2])
    with cv.Graph().as_default():
        same_name = cv.Variable(1.0, name="a")  # another graph: the name is free there
    with pytest.raises(ValueError, match="Two different variables.*'a'"):
        cv.Saver([a, same_name])
    with pytest.raises(TypeError, match="not a Variable"):
        cv.Saver({"x": 3})  # type: ignore[dict-item]


def test_missing_key_or_mismatch_changes_nothing(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    a = cv.Variable([1.0, 2.0], name="a")
    path = cv.Saver([a]).save(tmp_path / "s", format=fmt)
    a2 = cv.Variable([5.0, 5.0], name="a2")
    b2 = cv.Variable([7.0], name="b2")
    with pytest.raises(KeyError, match="'b'"):
        cv.Saver({"a": a2, "b": b2}).restore(path)
    np.testing.assert_array_equal(a2.numpy(), [5, 5])
    wrong = cv.Variable([1, 2, 3], name="wrong")
    with pytest.raises(cv.CheckpointMismatchError, match=r"'a'.*expected shape \(3,\)"):
        cv.Saver({"a": wrong}).restore(path)
    np.testing.assert_array_equal(wrong.numpy(), [1, 2, 3])


def test_max_to_keep(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    v = cv.Variable(0, name="v")
    saver = cv.Saver([v], max_to_keep=2)
    mine = [saver.save(tmp_path / "m", global_step=i, format=fmt) for i in range(4)]
    assert saver.last_checkpoints == mine[2:]
    assert [Path(p).exists() for p in mine] == [False, False, True, True]
    keep_all = cv.Saver([v], max_to_keep=None)
    for i in range(3):
        keep_all.save(tmp_path / "all", global_step=i, format=fmt)
    assert len(keep_all.last_checkpoints) == 3


def test_recover_last_checkpoints_after_a_restart(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """TensorFlow's Saver.recover_last_checkpoints: a new saver takes the files an earlier
    run wrote as its own, so that max_to_keep prunes them too (it had no such method, and
    a restarted run's old files were never pruned)."""
    v = cv.Variable(0, name="v")
    first = [cv.Saver([v]).save(tmp_path / "m", global_step=i) for i in range(3)]
    again = cv.Saver([v], max_to_keep=2)
    again.recover_last_checkpoints([*first, str(tmp_path / "m-9.h5")])  # m-9: gone
    assert again.last_checkpoints == first
    newer = again.save(tmp_path / "m", global_step=3)
    assert again.last_checkpoints == [first[2], newer]
    assert sorted(p.name for p in tmp_path.glob("m-*.h5")) == ["m-2.h5", "m-3.h5"]


def test_nothing_to_save(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    with pytest.raises(ValueError, match="no variables"):
        cv.Saver().save(tmp_path / "empty")


def test_keep_checkpoint_every_n_hours_keeps_one_per_period(tmp_path: Path) -> None:
    """A TF1 ``Saver(keep_checkpoint_every_n_hours=...)`` raised TypeError."""
    with cv.Graph().as_default():
        w = cv.Variable([1.0, 2.0], name="w")
        saver = cv.Saver([w], max_to_keep=1, keep_checkpoint_every_n_hours=1.0 / 3600)  # one second
        saver.save(tmp_path / "m", global_step=0)  # saved before the first period ends
        saver.save(tmp_path / "m", global_step=1)  # step 0 goes
        time.sleep(1.1)
        saver.save(tmp_path / "m", global_step=2)  # step 1 (saved early) goes
        saver.save(tmp_path / "m", global_step=3)  # step 2 is past the period: kept for good
        saver.save(tmp_path / "m", global_step=4)  # step 3 is inside the next period: goes
        assert sorted(p.name for p in tmp_path.glob("m-*.h5")) == ["m-2.h5", "m-4.h5"]
        assert saver.last_checkpoints == [str(tmp_path / "m-4.h5")]
        with pytest.raises(ValueError, match="keep_checkpoint_every_n_hours"):
            cv.Saver(keep_checkpoint_every_n_hours=0)


def test_latest_checkpoint_is_the_last_save_after_going_back_to_an_earlier_step(
    tmp_path: Path,
) -> None:
    """Train to 500, go back to 100 and save 200: latest_checkpoint returned step 500 (a
    higher number than the recorded latest), so a restart restored the abandoned run."""
    with cv.Graph().as_default():
        w = cv.Variable([0.0], name="w")
        saver = cv.Saver([w], max_to_keep=None)
        for step in (100, 500, 200):
            w.assign([float(step)])
            saver.save(tmp_path / "m", global_step=step)
            time.sleep(0.05)  # distinct modification times on any file system clock
        assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "m-200.h5")
        w.assign([0.0])
        saver.restore(cv.latest_checkpoint(tmp_path))
        assert w.numpy().tolist() == [200.0]
        # a higher step written after the recorded one (a crash before the state write)
        # is still found, as before
        os.utime(tmp_path / "m-500.h5")
        assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "m-500.h5")


def test_restore_of_no_checkpoint_says_so(tmp_path: Path) -> None:
    """``saver.restore(cv.latest_checkpoint(empty_dir))`` raised a bare TypeError from os.fspath."""
    with cv.Graph().as_default():
        w = cv.Variable([1.0], name="w")
        with pytest.raises(cv.CheckpointNotFoundError, match="path None"):
            cv.Saver([w]).restore(cv.latest_checkpoint(tmp_path))
        assert w.numpy().tolist() == [1.0]
