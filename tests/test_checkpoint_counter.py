"""The save counter and the directory's latest checkpoint, as TensorFlow keeps them.

``Checkpoint.write`` on a fresh checkpoint neither creates nor stores
``save_counter``; ``Checkpoint.save`` and ``Saver.save`` record the new file where
``cv.latest_checkpoint`` finds it, in the state file a ``CheckpointManager`` uses.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

import ckptvar as cv


def _stored(path: str) -> list[str]:
    return [k for k, _, _ in cv.list_variables(path)]


def test_write_on_a_fresh_checkpoint_stores_no_counter(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    w = cv.Variable([1.0, 2.0], name="w")
    ckpt = cv.Checkpoint(w=w)
    path = ckpt.write(tmp_path / f"final.{fmt}")
    assert _stored(path) == ["w"]
    assert "save_counter" not in ckpt._trackable_children()  # not created by write()

    # read back: neither created nor expected, so the status is complete
    other = cv.Checkpoint(w=cv.Variable([0.0, 0.0], name="w"))
    other.restore(path).assert_consumed()
    np.testing.assert_array_equal(other.w.numpy(), [1.0, 2.0])
    assert "save_counter" not in other._trackable_children()

    # once the property was read (or save() ran) the counter is part of every file
    assert int(ckpt.save_counter.numpy()) == 0
    assert sorted(_stored(ckpt.write(tmp_path / f"again.{fmt}"))) == ["save_counter", "w"]
    saved = cv.Checkpoint(w=cv.Variable([0.0, 0.0], name="w"))
    saved.save(tmp_path / "ckpt", format=fmt)
    assert sorted(_stored(saved.write(tmp_path / f"after.{fmt}"))) == ["save_counter", "w"]


def test_an_existing_counter_is_not_required_from_a_file_without_one(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    path = cv.Checkpoint(w=cv.Variable(1.0, name="w")).write(tmp_path / "w.h5")
    ckpt = cv.Checkpoint(w=cv.Variable(0.0, name="w"))
    ckpt.save_counter.assign(5)
    ckpt.restore(path).assert_consumed()
    assert int(ckpt.save_counter.numpy()) == 5  # untouched: the file holds none


def test_checkpoint_save_is_found_by_latest_checkpoint(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    d = tmp_path / "d"
    ckpt = cv.Checkpoint(w=cv.Variable([1.0], name="w"))
    assert cv.latest_checkpoint(d) is None
    p1 = ckpt.save(d / "ckpt", format=fmt)
    assert cv.latest_checkpoint(d) == p1
    p2 = ckpt.save(d / "ckpt", format=fmt, blocking=False).wait()
    assert cv.latest_checkpoint(d) == p2
    ckpt.write(d / f"other.{fmt}")  # write() records nothing
    assert cv.latest_checkpoint(d) == p2
    state = json.loads((d / "checkpoint_state.json").read_text())
    assert state["latest"] == Path(p2).name and state["sections"] == {}


def test_saver_save_is_found_by_latest_checkpoint(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    v = cv.Variable([1.0, 2.0], name="v")
    saver = cv.Saver([v])
    p1 = saver.save(tmp_path / "model", global_step=1)
    assert cv.latest_checkpoint(tmp_path) == p1
    p2 = saver.save(tmp_path / "model")
    assert cv.latest_checkpoint(tmp_path) == p2 and p2.endswith("model.h5")


def test_checkpoint_save_and_a_manager_share_the_state_file(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    ckpt = cv.Checkpoint(w=cv.Variable([1.0], name="w"))
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    m1 = mgr.save()
    own = ckpt.save(tmp_path / "manual")
    assert cv.latest_checkpoint(tmp_path) == own
    m2 = mgr.save()
    assert cv.latest_checkpoint(tmp_path) == m2 == mgr.latest_checkpoint
    assert not Path(m1).exists() and Path(own).exists()  # the manager prunes only its own
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    assert again.checkpoints == [m2]
