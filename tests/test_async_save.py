"""Background saves: snapshot consistency, waiting, and errors that surface exactly once."""

from __future__ import annotations

import inspect
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import backend_for


def _read(path: str, key: str) -> np.ndarray:
    with backend_for(path).open_reader(Path(path)) as r:
        return r.read(key)


def test_later_assigns_do_not_leak_into_the_file(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    big = cv.Variable(np.zeros(2_000_000, np.float32), name="big")
    step = cv.Variable(0, dtype="int64", name="step")
    ckpt = cv.Checkpoint(big=big, step=step)
    handles = []
    for i in range(3):
        big.assign(np.full(2_000_000, i, np.float32))
        step.assign(i)
        handles.append(ckpt.save(tmp_path / "ckpt", format=fmt, blocking=False))
        big.assign(np.full(2_000_000, 100 + i, np.float32))  # after the snapshot
        step.assign(100 + i)
    paths = [h.wait() for h in handles]
    for i, path in enumerate(paths):
        assert Path(path).name == f"ckpt-{i + 1}.{fmt}"
        assert int(_read(path, "step")) == i
        stored = _read(path, "big")
        assert stored.min() == stored.max() == i
        assert int(_read(path, "save_counter")) == i + 1


def test_wait_functions(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(v=cv.Variable(np.arange(10.0), name="v"))
    h = ckpt.save(tmp_path / "a", format=fmt, blocking=False)
    ckpt.wait()
    assert h.done() and Path(h.path).exists()
    h2 = ckpt.write(tmp_path / f"b.{fmt}", blocking=False)
    cv.wait_for_pending_saves()
    assert h2.done() and h2.wait() == str(tmp_path / f"b.{fmt}")
    status = cv.Checkpoint(v=cv.Variable(np.zeros(10), name="w")).restore(h2.path)
    status.assert_existing_objects_matched()


def _failing_save(tmp_path: Path, ckpt: cv.Checkpoint) -> object:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    # the directory cannot be created: the background write fails
    return ckpt.save(blocker / "ckpt", blocking=False)


def test_background_error_surfaces_at_next_save_once(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(v=cv.Variable(1.0, name="v"))
    handle = _failing_save(tmp_path, ckpt)
    with pytest.raises(OSError):
        ckpt.save(tmp_path / "ok")  # reports the earlier failure, does not save
    assert not (tmp_path / "ok-2.h5").exists()
    assert handle.wait() is None  # already reported: not raised twice
    ckpt.wait()
    cv.wait_for_pending_saves()
    assert Path(ckpt.save(tmp_path / "ok")).exists()


@pytest.mark.parametrize("where", ["handle", "checkpoint", "global"])
def test_background_error_surfaces_at_wait_once(
    tmp_path: Path, fresh_graph: cv.Graph, where: str
) -> None:
    ckpt = cv.Checkpoint(v=cv.Variable(1.0, name="v"))
    handle = _failing_save(tmp_path, ckpt)
    waits = {
        "handle": handle.wait,  # type: ignore[attr-defined]
        "checkpoint": ckpt.wait,
        "global": cv.wait_for_pending_saves,
    }
    with pytest.raises(OSError):
        waits[where]()
    for wait in waits.values():
        wait()  # exactly once: every later wait is quiet


def test_manager_async_save(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    v = cv.Variable(np.zeros(1000), name="v")
    manager = cv.CheckpointManager(
        cv.Checkpoint(v=v), tmp_path, max_to_keep=2, format=fmt, async_save=True
    )
    for i in range(4):
        v.assign(np.full(1000, i))
        path = manager.save()
        v.assign(np.full(1000, -1))
    assert manager.latest_checkpoint == path  # waits for the background save
    assert [Path(p).name for p in manager.checkpoints] == [f"ckpt-3.{fmt}", f"ckpt-4.{fmt}"]
    assert _read(path, "v").max() == 3
    assert cv.latest_checkpoint(tmp_path) == path


def _run_script(script: str, arg: Path) -> subprocess.CompletedProcess[str]:
    """``python -c script arg`` in a fresh interpreter, which must exit with 0."""
    proc = subprocess.run([sys.executable, "-c", script, str(arg)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_save_in_flight_when_the_interpreter_exits_is_finished(tmp_path: Path) -> None:
    """Exiting without wait(): the save completes (the pools it uses are not shut first)."""
    proc = _run_script(
        "import sys, numpy as np, ckptvar as cv\n"
        "c = cv.Checkpoint(v=cv.Variable(np.arange(4 << 20, dtype='float32'), name='v'))\n"
        "c.save(sys.argv[1], blocking=False)\n",
        tmp_path / "ck",
    )
    assert "failed" not in proc.stderr, proc.stderr
    value = cv.load(tmp_path / "ck-1.h5")["v"]
    assert np.array_equal(value, np.arange(4 << 20, dtype="float32"))
    assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "ck-1.h5")



def test_a_first_background_save_interrupted_as_its_writer_starts_hangs_nothing(
        tmp_path: Path) -> None:
    """Ctrl-C (a KeyboardInterrupt) that lands as the process's first background save
    starts its writer thread: that save raises it and is not written, and the next
    background saves are written and waited for (they were queued for a thread that
    never ran: every ``wait()`` hung for good)."""
    proc = _run_script(
        "import sys, threading, numpy as np, ckptvar as cv\n"
        "c = cv.Checkpoint(v=cv.Variable(np.arange(1000, dtype='float32'), name='v'))\n"
        "start = threading.Thread.start\n"
        "def interrupted(thread):\n"
        "    if thread.name == 'ckptvar-save':\n"
        "        raise KeyboardInterrupt\n"
        "    start(thread)\n"
        "threading.Thread.start = interrupted\n"
        "try:\n"
        "    c.save(sys.argv[1], blocking=False)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "threading.Thread.start = start\n"
        "c.v.assign(np.ones(1000, dtype='float32'))\n"
        "print(c.save(sys.argv[1], blocking=False).wait())\n"
        "c.wait()\n",
        tmp_path / "ck",
    )
    assert proc.stdout.splitlines() == ["interrupted", str(tmp_path / "ck-1.h5")]
    assert np.array_equal(cv.load(tmp_path / "ck-1.h5")["v"], np.ones(1000, np.float32))

def test_a_background_save_asked_for_at_exit_is_written_or_refused_never_lost(
        tmp_path: Path) -> None:
    """A save started by an ``atexit`` handler, after the exit wait for saves in flight
    has run: the writer thread may never run again, so the save is written on the
    caller's thread before ``save()`` returns (or fails there, loudly)."""
    proc = _run_script(
        "import atexit, sys, numpy as np, ckptvar as cv\n"
        "c = cv.Checkpoint(v=cv.Variable(np.arange(1 << 20, dtype='float32'), name='v'))\n"
        "c.save(sys.argv[1], blocking=False).wait()\n"
        "def last():\n"
        "    c.v.assign(np.ones(1 << 20, dtype='float32'))\n"
        "    c.save(sys.argv[1], blocking=False)\n"
        "atexit.register(last)\n",
        tmp_path / "ck",
    )
    assert "Error" not in proc.stderr, proc.stderr
    assert cv.load(tmp_path / "ck-2.h5")["v"].sum() == 1 << 20
    assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "ck-2.h5")


def test_a_finished_background_save_holds_no_snapshot(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The job drops its snapshot itself: the executor's worker keeps a finished job a
    moment after its future is done, and the next save would snapshot meanwhile."""
    from ckptvar.checkpoint import _async

    jobs: list = []  # type: ignore[type-arg]
    real = _async.submit

    def spy(fn, path):  # type: ignore[no-untyped-def]
        jobs.append(fn)
        return real(fn, path)

    monkeypatch.setattr(_async, "submit", spy)
    ckpt = cv.Checkpoint(w=cv.Variable(np.ones(1000), name="w"))
    ckpt.save(tmp_path / "ckpt", blocking=False).wait()
    assert len(jobs) == 1
    held = [c.cell_contents for c in inspect.unwrap(jobs[0]).__closure__ or ()
            if isinstance(c.cell_contents, list)]
    assert held == [[]]  # the snapshot's holder, emptied when the job ended


def test_background_saves_snapshot_into_one_reused_buffer(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each background save copies into the buffer the last one used (no fresh memory to
    fault in), and each file holds the values of its call though they change in place
    as soon as ``save`` returns; a big value is copied on the I/O threads."""
    import ml_dtypes

    from ckptvar.checkpoint import _serialize

    starts: list[int] = []
    real = _serialize.SnapshotBuffer.copy

    def spy(self, sources, **kw):  # type: ignore[no-untyped-def]
        views = real(self, sources, **kw)
        starts.append(min(v.__array_interface__["data"][0] for v in views))
        return views

    monkeypatch.setattr(_serialize.SnapshotBuffer, "copy", spy)
    big = cv.Variable(np.zeros(5 << 20, dtype="float32"), name="big")  # 20 MiB: in pieces
    half = cv.Variable(np.zeros(7, dtype=ml_dtypes.bfloat16), name="half")
    ckpt = cv.Checkpoint(big=big, half=half)
    handles = []
    for _ in range(3):
        handles.append(ckpt.save(tmp_path / "ck", blocking=False))
        big.assign_add(np.ones(5 << 20, dtype="float32"))  # right after the call returns
        half.assign_add(np.ones(7, dtype=ml_dtypes.bfloat16))
        ckpt.wait()
    for i, handle in enumerate(handles):
        got = cv.load(handle.wait())
        assert np.array_equal(got["big"], np.full(5 << 20, i, dtype="float32"))
        assert got["half"].dtype == ml_dtypes.bfloat16 and got["half"].tolist() == [i] * 7
    assert len(starts) == 3 and len(set(starts)) == 1


def test_a_snapshot_buffer_still_viewed_is_never_reused() -> None:
    """A view of the last snapshot still alive (a save in flight, an error's traceback)
    keeps its bytes: the next snapshot gets new memory, which is then kept."""
    from ckptvar.checkpoint._serialize import SnapshotBuffer

    buf = SnapshotBuffer()
    spec = [((1000,), np.dtype("float64"))]
    (held,) = buf.views(spec)
    held[:] = 1.0
    (other,) = buf.views(spec)
    assert not np.shares_memory(held, other)
    other[:] = 2.0
    assert (held == 1.0).all()
    where = other.__array_interface__["data"][0]
    del other
    (again,) = buf.views(spec)  # nothing views the second buffer now: reused
    assert again.__array_interface__["data"][0] == where
    del again
    (bigger,) = buf.views([((4000,), np.dtype("float64"))])  # no longer fits: a new one
    assert bigger.shape == (4000,) and buf.nbytes >= bigger.nbytes


def test_a_snapshot_of_the_same_arrays_copies_into_the_same_views_unless_one_is_held() -> None:
    """The buffer keeps its last copy's views and pieces for a copy of the very same
    arrays, and makes new ones whenever a view (or a view of one) is held elsewhere or
    an array is another: a held snapshot keeps its values."""
    from ckptvar.checkpoint._serialize import SnapshotBuffer

    buf = SnapshotBuffer()
    small, big = np.arange(10.0), np.arange(3 << 18, dtype="float64")  # 6 MiB: 3 pieces
    first = buf.copy([small, big])
    kept = [weakref.ref(a) for a in first]  # (alive only while the buffer keeps them)
    del first
    small[:] = -1.0
    big[::1000] = 7.0
    again = buf.copy([small, big])  # the same views, the new values
    assert all(r() is a for r, a in zip(kept, again, strict=True))
    assert np.array_equal(again[0], small) and np.array_equal(again[1], big)
    held = again[1]  # a save still in flight holds the snapshot
    del again
    big[:] = 3.0
    third = buf.copy([small, big])
    assert not np.shares_memory(third[1], held) and (third[1] == 3.0).all()
    assert held[0] == 7.0 and held[1] == 1.0  # its bytes untouched
    del held
    part = third[0][2:5]  # a view of a view (its base the buffer)
    kept = [weakref.ref(a) for a in third]
    del third
    fourth = buf.copy([small, big])
    assert not any(r() is a for r, a in zip(kept, fourth, strict=True))
    assert not np.shares_memory(fourth[0], part)
    assert (part == -1.0).all()
    del fourth, part
    other = np.arange(10.0) + 100  # another array of the same shape: a new plan
    fifth = buf.copy([other, big])
    assert np.array_equal(fifth[0], other) and np.array_equal(fifth[1], big)


def test_a_save_handle_waits_times_out_and_calls_back_as_a_future_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handle's outcome (one lock, not a ``Future``): ``wait(timeout)`` raises
    ``TimeoutError`` while the save runs; every waiting thread gets the path; callbacks
    added before run on the writer thread, after at once; a callback's error is logged,
    never raised; an error reaches the first ``wait()`` only."""
    import logging

    from ckptvar.checkpoint import _async

    logged: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptvar").addHandler(handler)
    try:
        _handle_outcomes(tmp_path, monkeypatch, _async, logged)
    finally:
        logging.getLogger("ckptvar").removeHandler(handler)


def _handle_outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _async: Any,
                     logged: list[str]) -> None:
    import threading

    release = threading.Event()
    real = _async.submit

    def held(fn, path):  # type: ignore[no-untyped-def]
        def job() -> str:
            assert release.wait(30)
            return fn()  # type: ignore[no-any-return]
        return real(job, path)

    monkeypatch.setattr(_async, "submit", held)
    ckpt = cv.Checkpoint(w=cv.Variable(np.arange(10.0), name="w"))
    handle = ckpt.write(tmp_path / "a.h5", blocking=False)
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    assert not handle.done()
    seen: list[tuple[str, str]] = []
    handle.add_done_callback(lambda h: seen.append(("before", threading.current_thread().name)))
    handle.add_done_callback(lambda h: 1 / 0)  # logged, never raised
    called = threading.Event()  # (callbacks run in turn, after the waiters are let go)
    handle.add_done_callback(lambda h: called.set())
    got: list[str | None] = []
    waiters = [threading.Thread(target=lambda: got.append(handle.wait(30))) for _ in range(3)]
    for t in waiters:
        t.start()
    release.set()
    for t in waiters:
        t.join(30)
    assert got == [str(tmp_path / "a.h5")] * 3 and handle.done()
    assert called.wait(30)
    handle.add_done_callback(lambda h: seen.append(("after", threading.current_thread().name)))
    assert seen == [("before", "ckptvar-save"), ("after", threading.current_thread().name)]
    assert logged == ["A callback of a background save raised"]

    def failing(fn, path):  # type: ignore[no-untyped-def]
        def job() -> str:
            raise OSError("the disk went away")
        return real(job, path)

    monkeypatch.setattr(_async, "submit", failing)
    bad = ckpt.write(tmp_path / "b.h5", blocking=False)
    with pytest.raises(OSError, match="went away"):
        bad.wait(30)
    assert bad.wait(30) is None  # reported once


def test_a_failed_background_save_leaves_the_counter_as_it_was(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """``Checkpoint.save(blocking=False)`` that failed kept its increment of the save
    counter (a blocking one that fails does not): the next save skipped a number. Now
    the failed save gives it back, and its error says which file was not saved."""
    ckpt = cv.Checkpoint(v=cv.Variable(1.0, name="v"))
    handle = _failing_save(tmp_path, ckpt)
    with pytest.raises(OSError) as info:
        handle.wait()  # type: ignore[attr-defined]
    assert any("ckpt-1.h5" in note and "not saved" in note
               for note in getattr(info.value, "__notes__", []))
    assert int(ckpt.save_counter.numpy()) == 0
    assert Path(ckpt.save(tmp_path / "ok")).name == "ok-1.h5"
