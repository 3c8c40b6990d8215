"""A manager frees its pruned steps' bytes in the background.

Before ``save()`` returns, a pruned step is no longer under its final name (renamed to a
temporary: never half-deleted); its bytes are freed on the manager's own thread, which
the next save, ``wait_until_finished()`` and the interpreter's exit wait for (bounded). A
failed deletion is logged and fails nothing; a process killed with one pending leaves only
temporaries, which the next manager and ``ckpt gc`` remove.

The deletion is held up (or made to fail) by replacing the function it frees a temporary
with (``checkpoint._deletes.remove_path``): an injected fault, the files stay real.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint import _deletes
from ckptvar.storage import is_partial


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if is_partial(p.name))


def _finals(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith("ckpt-") and not is_partial(p.name))


def _held_up(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background deletions wait for the returned event before freeing anything."""
    release = threading.Event()
    real = _deletes.remove_path

    def slow(path: Path) -> None:
        assert release.wait(30), "the test never released the deletion"
        real(path)

    monkeypatch.setattr(_deletes, "remove_path", slow)
    return release


@pytest.mark.parametrize(("fmt", "incremental"),
                         [("h5", False), ("zarr", False), ("zarr", True)])
def test_save_returns_with_the_pruned_step_renamed_and_its_bytes_freed_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, incremental: bool) -> None:
    with cv.Graph().as_default():
        frozen = cv.Variable(np.arange(20_000, dtype=np.float32), name="frozen")
        head = cv.Variable(np.zeros(1000, np.float32), name="head")
        ckpt = cv.Checkpoint(frozen=frozen, head=head)
        mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, format=fmt,
                                   incremental=incremental)
        first = mgr.save()
        release = _held_up(monkeypatch)
        head.assign_add(np.ones(1000, np.float32))
        second = mgr.save()  # prunes step 1: its freeing waits for ``release``
        assert second is not None and first is not None
        assert _finals(tmp_path) == [Path(second).name]  # gone from its final name at once
        assert mgr.checkpoints == [second]
        pending = _temporaries(tmp_path)
        assert len(pending) == 1 and pending[0].startswith(f".{Path(first).name}.")
        # a manager opened meanwhile agrees: step 1 is not a checkpoint any more
        assert cv.CheckpointManager(cv.Checkpoint(), tmp_path, format=fmt,
                                    max_to_keep=None).checkpoints == [second]
        release.set()
        mgr.wait_until_finished()
        left = _temporaries(tmp_path)
        if incremental and fmt == "zarr":  # set aside for the next save, holding no bytes
            assert len(left) <= 1
            for f in (tmp_path / n for n in left):
                assert not [p for p in f.rglob("*") if p.is_file() and p.stat().st_nlink < 2
                            and p.name != "zarr.json"]
        else:
            assert left == []
        head.assign_add(np.ones(1000, np.float32))
        third = mgr.save()
        mgr.wait_until_finished()
        assert _finals(tmp_path) == [Path(str(third)).name]
        got = cv.load(str(third))
        np.testing.assert_array_equal(got["head"], head.numpy())
        np.testing.assert_array_equal(got["frozen"], frozen.numpy())


def test_wait_until_finished_waits_at_most_its_timeout_for_a_deletion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with cv.Graph().as_default():
        v = cv.Variable(np.zeros(1000, np.float32), name="v")
        mgr = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=1)
        mgr.save()
        release = _held_up(monkeypatch)
        mgr.save()
        with caplog.at_level(logging.WARNING, logger="ckptvar"):
            mgr.wait_until_finished(timeout=0.3)  # returns, never raises for a deletion
        assert "Still freeing pruned steps" in caplog.text
        assert len(_temporaries(tmp_path)) == 1
        release.set()
        mgr.wait_until_finished()
        assert _temporaries(tmp_path) == []


def test_a_failed_background_deletion_is_logged_and_the_next_save_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(path: Path) -> None:
        raise OSError(5, "Input/output error (injected)", os.fspath(path))

    with cv.Graph().as_default():
        v = cv.Variable(np.zeros(1000, np.float32), name="v")
        mgr = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=1)
        mgr.save()
        monkeypatch.setattr(_deletes, "remove_path", broken)
        with caplog.at_level(logging.ERROR, logger="ckptvar"):
            mgr.save()
            mgr.wait_until_finished()
        assert "Could not free the pruned step" in caplog.text
        assert "injected" in caplog.text
        left = _temporaries(tmp_path)
        assert len(left) == 1 and left[0].startswith(".ckpt-1.h5.")
        monkeypatch.undo()
        v.assign(np.ones(1000, np.float32))
        path = mgr.save()  # the failure failed nothing; its temporary is reclaimed
        mgr.wait_until_finished()
        assert _temporaries(tmp_path) == []
        assert _finals(tmp_path) == ["ckpt-3.h5"]
        np.testing.assert_array_equal(cv.load(str(path))["v"], np.ones(1000, np.float32))



def test_a_save_interrupted_as_its_deletion_starts_leaves_the_manager_working(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a KeyboardInterrupt) that lands as a save starts freeing its pruned step,
    before that thread started: the user's next saves and ``wait_until_finished()``
    work (every one raised RuntimeError 'cannot join thread before it is started'), and
    the pruned step's temporary is reclaimed."""
    start = threading.Thread.start

    def interrupted(thread: threading.Thread) -> None:
        if thread.name == "ckptvar-delete":
            raise KeyboardInterrupt
        start(thread)

    with cv.Graph().as_default():
        v = cv.Variable(np.zeros(1000, np.float32), name="v")
        mgr = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path, max_to_keep=1)
        mgr.save()
        monkeypatch.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.save()  # committed, then interrupted in its prune
        monkeypatch.undo()
        mgr.wait_until_finished()
        v.assign(np.ones(1000, np.float32))
        path = mgr.save()
        mgr.wait_until_finished()
        assert _temporaries(tmp_path) == []
        assert _finals(tmp_path) == ["ckpt-3.h5"]
        np.testing.assert_array_equal(cv.load(str(path))["v"], np.ones(1000, np.float32))

_KILLED = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    import ckptvar as cv
    from ckptvar.checkpoint import _deletes

    fmt, incremental = sys.argv[2], sys.argv[3] == "1"
    never = threading.Event()
    frozen = cv.Variable(np.arange(50_000, dtype=np.float32), name="frozen")
    head = cv.Variable(np.zeros(100, np.float32), name="head")
    mgr = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), sys.argv[1],
                               max_to_keep=2, format=fmt, incremental=incremental)
    for step in range(1, 5):
        if step == 4:  # its prune's deletion never ends
            _deletes.remove_path = lambda path: never.wait()
        head.assign_add(np.ones(100, np.float32))
        mgr.save()
    print("saved", flush=True)
    never.wait()
    """
)


@pytest.mark.parametrize(("fmt", "incremental"), [
    ("h5", False), ("zarr", False), pytest.param("zarr", True, marks=pytest.mark.slow)])
def test_a_process_killed_with_a_pending_deletion_leaves_only_temporaries(
        tmp_path: Path, fmt: str, incremental: bool) -> None:
    directory = tmp_path / "run"
    with subprocess.Popen([sys.executable, "-c", _KILLED, str(directory), fmt,
                           str(int(incremental))],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            assert line.strip() == "saved", proc.stderr.read()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
    kept = [f"ckpt-3.{fmt}", f"ckpt-4.{fmt}"]
    assert _finals(directory) == kept  # every pruned step left its final name
    assert _temporaries(directory)  # what the deletions never freed
    listed = subprocess.run([sys.executable, "-m", "ckptvar", "gc", "--dry-run",
                             str(directory)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert listed.returncode == 0, listed.stderr
    for name in _temporaries(directory):
        assert name in listed.stdout
    removed = subprocess.run([sys.executable, "-m", "ckptvar", "gc", str(directory)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert removed.returncode == 0, removed.stderr
    assert _temporaries(directory) == []
    assert _finals(directory) == kept
    for name in kept:  # every kept step whole: no byte it refers to was freed
        got = cv.load(str(directory / name))
        assert got["head"][0] == float(name.split("-")[1].split(".")[0])
        np.testing.assert_array_equal(got["frozen"], np.arange(50_000, dtype=np.float32))


_EXITS = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import ckptvar as cv
    from ckptvar.checkpoint import _deletes

    real = _deletes.remove_path
    def slow(path):
        time.sleep(0.5)
        real(path)
    _deletes.remove_path = slow
    fmt, background = sys.argv[2], sys.argv[3] == "1"
    v = cv.Variable(np.zeros(1000, np.float32), name="v")
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), sys.argv[1], max_to_keep=1, format=fmt,
                               async_save=background)
    mgr.save()
    mgr.save()  # ends the script (with async_save, before the save committed)
    print(len([p for p in __import__("os").listdir(sys.argv[1]) if p.endswith(".partial")]))
    """
)


@pytest.mark.parametrize(("fmt", "async_save"), [
    ("h5", False), pytest.param("zarr", False, marks=pytest.mark.slow),
    pytest.param("zarr", True, marks=pytest.mark.slow)])
def test_the_interpreter_exit_waits_for_a_pending_deletion(
        tmp_path: Path, fmt: str, async_save: bool) -> None:
    directory = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", _EXITS, str(directory), fmt,
                          str(int(async_save))], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert "Could not free" not in res.stderr, res.stderr
    if not async_save:
        assert res.stdout.strip() == "1"  # pending when the script ended
    assert _temporaries(directory) == []  # freed before the process ended
    assert _finals(directory) == [f"ckpt-2.{fmt}"]


_ENDS_WITH_WORK_PENDING = textwrap.dedent(
    """
    import gc, sys, threading, time
    import numpy as np
    import ckptvar as cv
    from ckptvar.checkpoint import _manager

    # the last prune's deletion starts its work once the main thread ended (as a slow
    # disk makes it do): while the interpreter shuts its thread pools down
    real, last = _manager.cut_down, [False]
    def late(path):
        while last[0] and threading.main_thread().is_alive():
            time.sleep(0.005)
        return real(path)
    _manager.cut_down = late
    ending = sys.argv[2]
    vs = {f"v{j}": cv.Variable(np.zeros(64, np.float32), name=f"v{j}") for j in range(4)}
    mgr = cv.CheckpointManager(cv.Checkpoint(**vs), sys.argv[1], max_to_keep=1,
                               format="zarr", async_save=True, incremental=True)
    for step in range(3):
        if step == 2:
            mgr.wait_until_finished()
            last[0] = True
        vs["v0"].assign(np.full(64, step, np.float32))
        mgr.save()  # the last one still in flight when the script ends
    if ending == "dropped":
        del mgr
        gc.collect()
    """
)


@pytest.mark.parametrize("ending", ["ends", "dropped"])
def test_a_script_ending_with_a_save_and_a_deletion_pending_exits_cleanly(
        tmp_path: Path, ending: str) -> None:
    directory = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", _ENDS_WITH_WORK_PENDING, str(directory),
                          ending], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert _finals(directory) == ["ckpt-3.zarr"]  # the save in flight at exit committed
    v0 = cv.Variable(np.zeros(64, np.float32), name="v0")
    mgr = cv.CheckpointManager(cv.Checkpoint(v0=v0), str(directory), max_to_keep=1,
                               format="zarr")
    assert mgr.checkpoints == [str(directory / "ckpt-3.zarr")]
    assert _temporaries(directory) == []  # what the pruned steps left is gone
    mgr.restore_or_initialize()
    np.testing.assert_array_equal(v0.numpy(), np.full(64, 2, np.float32))
