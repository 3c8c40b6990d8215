"""A manager never waits forever on a lock that a stopped (or hung) process holds."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
import ckptvar.locations._lockwait as lockwait

_HOLD = """
import fcntl, os, signal, sys
if sys.argv[2] == "dir":
    fd = os.open(sys.argv[1], os.O_RDONLY)
else:
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextlib.contextmanager
def _stopped_holder(path: Path, kind: str = "file") -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), kind],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _manager(directory: Path) -> cv.CheckpointManager:
    return cv.CheckpointManager(cv.Checkpoint(v=cv.Variable(np.arange(3.0))), directory,
                                max_to_keep=2)


@pytest.fixture
def short_wait(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(lockwait, "LOCK_TIMEOUT", 0.5)
    return 0.5


def test_a_stopped_holder_of_the_state_lock_times_out_a_new_manager(
        tmp_path: Path, short_wait: float, fresh_graph: cv.Graph) -> None:
    first = _manager(tmp_path)
    committed = first.save()
    with _stopped_holder(tmp_path / ".checkpoint_state.lock") as holder:
        with pytest.raises(cv.CkptError) as info:  # after short_wait, not forever
            _manager(tmp_path)
        assert isinstance(info.value, TimeoutError)
        message = str(info.value)
        assert ".checkpoint_state.lock" in message and str(tmp_path) in message
        assert f"process {holder.pid}" in message
        with pytest.raises(TimeoutError):  # a save's record of its step, too
            first.save()
    # nothing was half-changed: the committed step is still the latest and loads
    again = _manager(tmp_path)
    assert cv.latest_checkpoint(tmp_path) is not None
    assert committed in again.checkpoints
    np.testing.assert_array_equal(cv.load(committed)["v"], np.arange(3.0))


def test_a_stopped_clean_up_does_not_block_a_save_forever(
        tmp_path: Path, short_wait: float, fresh_graph: cv.Graph) -> None:
    manager = _manager(tmp_path)
    manager.save()
    with _stopped_holder(tmp_path / ".checkpoint_saving.lock") as holder:
        with pytest.raises(TimeoutError, match=r"\.checkpoint_saving\.lock") as info:
            manager.save()
        assert f"process {holder.pid}" in str(info.value)
    assert len(manager.checkpoints) == 1 and os.path.exists(manager.checkpoints[0])
    manager.save()
    assert len(manager.checkpoints) == 2


def test_a_stopped_clean_up_of_the_directory_does_not_block_a_save_forever(
        tmp_path: Path, short_wait: float, fresh_graph: cv.Graph) -> None:
    with _stopped_holder(tmp_path, "dir") as holder:
        with pytest.raises(TimeoutError, match=str(tmp_path)) as info:
            cv.save(tmp_path / "one", {"v": np.arange(3.0)})
        assert f"process {holder.pid}" in str(info.value)
    assert not list(tmp_path.iterdir())


def test_lock_timeout_is_the_managers_to_choose(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """The wait for a held lock was a constant 300 s, the same for every manager (a job
    that would rather fail fast, or wait out a long clean-up, could not say). Now
    ``lock_timeout=`` sets it, and its error names the directory, the holder and the
    time waited."""
    import socket

    first = _manager(tmp_path)
    first.save()
    with _stopped_holder(tmp_path / ".checkpoint_state.lock") as holder:
        with pytest.raises(cv.CkptError) as info:
            cv.CheckpointManager(cv.Checkpoint(v=cv.Variable(np.arange(3.0))), tmp_path,
                                 lock_timeout=0.3)
        assert isinstance(info.value, TimeoutError)
        message = str(info.value)
        assert str(tmp_path) in message and ".checkpoint_state.lock" in message
        assert f"process {holder.pid} on host {socket.gethostname()}" in message
        assert "0.3 s" in message and "lock_timeout" in message
    for bad in (0, -1.0, float("nan"), "soon"):
        with pytest.raises((ValueError, TypeError), match="lock_timeout"):
            cv.CheckpointManager(first.checkpoint, tmp_path, lock_timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_does_not_use_up_its_step_number(
        tmp_path: Path, fresh_graph: cv.Graph, async_save: bool) -> None:
    """A background save that failed (here: the directory locked by a stopped clean-up)
    used up its number: the next save was step 3, leaving a gap at 2, where a failed
    blocking save left the counter as it was. Now neither does (docs/reliability.md: a
    failed save leaves the save counter unchanged), the error says which step was not
    saved, and nothing lists it."""
    v = cv.Variable(np.arange(3.0))
    manager = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=3,
                                   async_save=async_save, lock_timeout=0.3)
    manager.save()
    manager.wait_until_finished()
    v.assign(np.full(3, 2.0))
    with _stopped_holder(tmp_path, "dir"), pytest.raises(TimeoutError) as info:
        manager.save()  # a background save returns its path first: its error comes next
        manager.wait_until_finished()
    assert any("Step 2" in note and "not saved" in note
               for note in getattr(info.value, "__notes__", [])), info.value
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1.h5"]
    assert os.path.basename(cv.latest_checkpoint(tmp_path) or "") == "ckpt-1.h5"
    assert int(manager.checkpoint.save_counter.numpy()) == 1
    path = manager.save()
    manager.wait_until_finished()
    assert os.path.basename(path or "") == "ckpt-2.h5"
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1.h5", "ckpt-2.h5"]
    assert cv.load(path)["save_counter"] == 2
    np.testing.assert_array_equal(cv.load(path)["v"], np.full(3, 2.0))


def test_a_held_directory_lock_is_named_as_the_directory(
        tmp_path: Path, short_wait: float, fresh_graph: cv.Graph) -> None:
    """The directory's own lock (a save's temporary, a clean-up) was named as a lock
    file "in" the directory's parent; it is the directory's."""
    with _stopped_holder(tmp_path, "dir"), pytest.raises(TimeoutError) as info:
        cv.save(tmp_path / "one", {"v": np.arange(3.0)})
    assert f"The lock on the directory {str(tmp_path)!r} was not free" in str(info.value)
