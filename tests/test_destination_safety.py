"""A save never deletes what ckptvar did not write (a directory of the user's, a file in the way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv


def _user_dir(path: Path) -> dict[str, bytes]:
    """Fill ``path`` with a user's files; return what must still be there afterwards."""
    (path / "sub").mkdir(parents=True)
    files = {"notes.txt": b"my notes", "sub/data.bin": b"\x00\x01\x02"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def _assert_intact(path: Path, files: dict[str, bytes]) -> None:
    assert path.is_dir()
    for name, data in files.items():
        assert (path / name).read_bytes() == data
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".partial")]
    assert leftovers == []


def _refused(fn, path: Path) -> None:
    with pytest.raises(IsADirectoryError) as info:
        fn()
    assert isinstance(info.value, cv.CkptError)
    assert str(path) in str(info.value)


def test_save_without_suffix_onto_a_directory_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    files = _user_dir(runs)
    _refused(lambda: cv.save(runs, {"w": np.ones(3)}), runs)
    _assert_intact(runs, files)


@pytest.mark.parametrize("name", ["model.h5", "ckpt-1.h5"])
def test_checkpoint_write_onto_a_directory_is_refused(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    files = _user_dir(target)
    ckpt = cv.Checkpoint(w=cv.Variable(np.ones(3), name="w"))
    _refused(lambda: ckpt.write(target), target)
    _assert_intact(target, files)


def test_checkpoint_save_onto_a_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt-1.h5"
    files = _user_dir(target)
    ckpt = cv.Checkpoint(w=cv.Variable(np.ones(3), name="w"))
    _refused(lambda: ckpt.save(tmp_path / "ckpt"), target)
    _assert_intact(target, files)


def test_saver_save_onto_a_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model-1.h5"
    files = _user_dir(target)
    w = cv.Variable(np.ones(3), name="w")  # kept alive: collections hold variables weakly
    saver = cv.Saver([w])
    _refused(lambda: saver.save(tmp_path / "model", global_step=1), target)
    _assert_intact(target, files)


def test_zarr_save_onto_a_plain_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model.zarr"
    files = _user_dir(target)
    _refused(lambda: cv.save(target, {"w": np.ones(3)}), target)
    _assert_intact(target, files)


def test_zarr_save_onto_a_foreign_zarr_group_is_refused(tmp_path: Path) -> None:
    import zarr

    target = tmp_path / "data.zarr"
    zarr.open_group(str(target), mode="w").create_array("x", shape=(2,), dtype="f4")
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    _refused(lambda: cv.save(target, {"w": np.ones(3)}), target)
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before


def test_zarr_checkpoint_may_replace_a_zarr_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "model.zarr"
    cv.save(target, {"w": np.ones(3)})
    cv.save(target, {"w": np.full(3, 2.0)})
    np.testing.assert_array_equal(cv.load(target)["w"], np.full(3, 2.0))


def test_zarr_save_onto_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "model.zarr"
    target.write_bytes(b"not a checkpoint")
    with pytest.raises(FileExistsError) as info:
        cv.save(target, {"w": np.ones(3)})
    assert isinstance(info.value, cv.CkptError)
    assert target.read_bytes() == b"not a checkpoint"


def test_file_checkpoint_replaces_a_file(tmp_path: Path) -> None:
    target = tmp_path / "model.h5"
    cv.save(target, {"w": np.ones(3)})
    cv.save(target, {"w": np.zeros(3)})
    np.testing.assert_array_equal(cv.load(target)["w"], np.zeros(3))


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_convert_onto_a_directory_is_refused(tmp_path: Path, suffix: str) -> None:
    src = tmp_path / "src.h5"
    cv.save(src, {"w": np.ones(3, dtype=np.float32)})
    target = tmp_path / f"out{suffix}"
    files = _user_dir(target)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptvar.cli", "convert", str(src), str(target)],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )
    assert proc.returncode == 2, proc.stderr
    assert "directory" in proc.stderr and "Traceback" not in proc.stderr
    _assert_intact(target, files)


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_manager_never_writes_over_or_prunes_a_users_file(tmp_path: Path, fmt: str) -> None:
    """A user's own ``ckpt-1.<suffix>`` (not a checkpoint) is refused, never pruned."""
    suffix = ".h5" if fmt == "h5" else ".zarr"
    users = tmp_path / f"ckpt-1{suffix}"
    users.write_bytes(b"my own notes, not a checkpoint")
    v = cv.Variable(np.arange(3.0), name="v")
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=1, format=fmt)
    with pytest.raises(cv.errors.DestinationExistsError) as info:
        mgr.save()
    assert str(users) in str(info.value)
    assert "not a ckptvar checkpoint" in str(info.value)
    assert users.read_bytes() == b"my own notes, not a checkpoint"
    assert mgr.latest_checkpoint is None
    # Later steps save and prune their own files; the user's file stays.
    for n in (2, 3, 4):
        v.assign(np.full(3, float(n)))
        mgr.save(checkpoint_number=n)
    assert users.read_bytes() == b"my own notes, not a checkpoint"
    assert [Path(p).name for p in mgr.checkpoints] == [f"ckpt-4{suffix}"]
    assert not (tmp_path / f"ckpt-2{suffix}").exists()


def test_manager_does_not_prune_a_listed_file_replaced_by_a_users(tmp_path: Path) -> None:
    """A listed step that a user replaced with a file of their own is left, not deleted."""
    v = cv.Variable(np.arange(3.0), name="v")
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=1)
    first = Path(mgr.save())
    first.write_bytes(b"the user's file now")
    mgr.save()
    assert first.read_bytes() == b"the user's file now"
    assert [Path(p).name for p in mgr.checkpoints] == ["ckpt-2.h5"]
