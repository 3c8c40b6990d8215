"""Threads: saves, restores and waits of one checkpoint or manager from several threads.

Each interleaving is forced, not hoped for: a trackable whose state a save (or a
restore) asks for holds that call until the test lets it go, while a second thread
tries its own save; so each test fails every time without the lock it checks. A
stress test then runs several threads of saves of one checkpoint into real HDF5 and
Zarr files and compares every file, bit for bit, with what its thread saved.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.storage import paused_gc


class Gate(cv.Trackable):
    """A trackable with a Python state (``n``) that can hold the next save that asks for
    its state (``hold_save``), or the next restore that gives it one (``hold_restore``),
    until :attr:`go` is set."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.hold_save = self.hold_restore = False
        self.inside = threading.Event()
        self.go = threading.Event()

    def _hold(self) -> None:
        self.inside.set()
        assert self.go.wait(10)

    def python_state(self) -> Any:
        if self.hold_save:
            self.hold_save = False
            self._hold()
        return {"n": self.n}

    def restore_python_state(self, state: Any) -> None:
        if self.hold_restore:
            self.hold_restore = False
            self._hold()
        self.n = state["n"]


def _interleave(first: Callable[[], object], second: Callable[[], object], gate: Gate,
                turn: float = 0.3) -> None:
    """Run ``first`` on a thread until ``gate`` holds it, then ``second`` on another for
    up to ``turn`` seconds (without a lock it is done by then; with one it waits), then
    let ``first`` go. Both end; the first error of either is raised."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(exc)

    a = threading.Thread(target=run, args=(first,))
    a.start()
    assert gate.inside.wait(10)
    b = threading.Thread(target=run, args=(second,))
    b.start()
    b.join(turn)
    gate.go.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    if errors:
        raise errors[0]


def _on_threads(work: Callable[[int], None], n: int, timeout: float = 60) -> None:
    """``work(t)`` on ``n`` threads at once (``t`` in ``range(n)``), each started after a
    barrier; all end within ``timeout`` seconds; the first error of any is raised."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            barrier.wait(10)
            work(t)
        except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout)
    assert not any(w.is_alive() for w in workers)
    if errors:
        raise errors[0]


def _number(path: str) -> int:
    return int(Path(path).name.rpartition("-")[2].partition(".")[0])


def test_two_threads_saving_one_checkpoint_store_each_its_own_counter(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    gate = Gate()
    ckpt = cv.Checkpoint(v=cv.Variable(np.arange(1000.0)), gate=gate)
    paths: list[str] = []
    gate.hold_save = True  # the first save holds after its counter went up
    _interleave(lambda: paths.append(ckpt.save(tmp_path / "a", format=fmt)),
                lambda: paths.append(ckpt.save(tmp_path / "b", format=fmt,
                                               blocking=False).wait()),
                gate)
    assert sorted(map(_number, paths)) == [1, 2]
    for path in paths:  # each file holds the counter of its own name
        assert int(cv.load(path)["save_counter"]) == _number(path)
    assert int(ckpt.save_counter.numpy()) == 2


@pytest.mark.parametrize("async_save", [False, True])
def test_two_threads_saving_through_one_manager_get_two_steps(
        tmp_path: Path, async_save: bool, fresh_graph: cv.Graph) -> None:
    v = cv.Variable(np.arange(1000.0))
    ckpt = cv.Checkpoint(v=v)
    gate = Gate()
    held = [True]

    def step() -> int:  # asked once the step number is chosen: holds the first save there
        if held[0]:
            held[0] = False
            gate._hold()
        return int(ckpt.save_counter.numpy()) + 1

    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, step_counter=step,
                               async_save=async_save)
    paths: list[str | None] = []
    _interleave(lambda: paths.append(mgr.save()), lambda: paths.append(mgr.save()), gate)
    mgr.wait_until_finished()
    assert sorted(map(_number, map(str, paths))) == [1, 2]
    assert [Path(p).name for p in mgr.checkpoints] == ["ckpt-1.h5", "ckpt-2.h5"]
    for path in mgr.checkpoints:
        assert int(cv.load(path)["save_counter"]) == _number(path)


def test_a_save_beside_a_restore_of_the_same_checkpoint_holds_one_state_or_the_other(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    gate = Gate(n=1)
    v = cv.Variable(np.ones(1000))
    ckpt = cv.Checkpoint(v=v, gate=gate)
    stored = ckpt.write(tmp_path / f"one.{fmt}")
    v.assign(np.zeros(1000))
    gate.n = 0
    gate.hold_restore = True  # the restore holds with the values in, the state not yet
    out = tmp_path / f"during.{fmt}"
    _interleave(lambda: ckpt.restore(stored).assert_consumed(),
                lambda: ckpt.write(out, blocking=False).wait(), gate)
    back = Gate()
    fresh = cv.Checkpoint(v=cv.Variable(np.full(1000, 7.0)), gate=back)
    fresh.restore(out).assert_consumed()
    # the save came after the restore: its values and its state, never a mix
    assert back.n == 1
    np.testing.assert_array_equal(fresh.v.numpy(), np.ones(1000))


def test_a_pause_of_the_collector_beginning_as_another_threads_ends_leaves_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert gc.isenabled()
    real = gc.isenabled
    second_asked, first_out = threading.Event(), threading.Event()

    def isenabled() -> bool:  # the second thread's look, held until the first pause ended
        was = real()
        if threading.current_thread().name == "second":
            second_asked.set()
            first_out.wait(0.5)
        return was

    monkeypatch.setattr(gc, "isenabled", isenabled)
    first_in = threading.Event()

    def first() -> None:
        with paused_gc():
            first_in.set()
            second_asked.wait(0.5)  # (with the lock: the second never looks meanwhile)
        first_out.set()

    def second() -> None:
        assert first_in.wait(10)
        with paused_gc():
            pass

    threads = [threading.Thread(target=first), threading.Thread(target=second, name="second")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert real()  # on again once both pauses ended
    finally:
        gc.enable()


def test_a_checkpoint_copied_or_pickled_has_a_lock_of_its_own(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(v=cv.Variable(np.arange(4.0)))
    for other in (copy.copy(ckpt), copy.deepcopy(ckpt), pickle.loads(pickle.dumps(ckpt))):
        path = other.write(tmp_path / f"{id(other)}.h5")
        np.testing.assert_array_equal(cv.load(path)["v"], np.arange(4.0))


def test_threads_saving_one_checkpoint_write_each_file_whole(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """N threads x M saves of one checkpoint, each thread writing its own variable
    before each save (``save`` and ``write``, blocking and in the background): every
    file holds, bit for bit, the value its thread saved, and its own counter."""
    threads, saves = 4, 6

    def value(t: int, m: int) -> np.ndarray:
        rng = np.random.default_rng(1000 * t + m)
        return rng.standard_normal((64, 256)).astype(np.float32)

    own = [cv.Variable(value(t, 0)) for t in range(threads)]
    ckpt = cv.Checkpoint(own=own)
    done: list[tuple[str, int, int]] = []

    def work(t: int) -> None:
        for m in range(saves):
            own[t].assign(value(t, m))
            blocking = (t + m) % 3 == 0
            if t % 2:
                got = ckpt.save(tmp_path / f"t{t}", format=fmt, blocking=blocking)
                path = got if blocking else got.path
            else:
                path = os.fspath(tmp_path / f"t{t}-w{m}.{fmt}")
                ckpt.write(path, blocking=blocking)
            done.append((path, t, m))

    _on_threads(work, threads)
    ckpt.wait()
    assert len(done) == threads * saves
    counters = []
    for path, t, m in done:
        # another thread's variable may be written while this save reads it (a blocking
        # save reads the variables in place): only this thread's own value is checked
        keys = [f"own/{t}", "save_counter"] if t % 2 else [f"own/{t}"]
        got = cv.load(path, keys=keys, verify=False)
        np.testing.assert_array_equal(got[f"own/{t}"], value(t, m), err_msg=path)
        if t % 2:
            counters.append(int(got["save_counter"]))
            assert counters[-1] == _number(path)
    # every save() counted once, each under its own number
    assert sorted(counters) == list(range(1, len(counters) + 1))


def test_threads_saving_through_one_manager_write_each_step_whole(
        tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """N threads x M saves through one manager (in the background): N x M steps, each
    under its own number, each holding bit for bit the value its thread saved."""
    threads, saves = 3, 4

    def value(t: int, m: int) -> np.ndarray:
        return np.random.default_rng(1000 * t + m).standard_normal(4096).astype(np.float32)

    own = [cv.Variable(value(t, 0)) for t in range(threads)]
    mgr = cv.CheckpointManager(cv.Checkpoint(own=own), tmp_path, max_to_keep=None,
                               async_save=True)
    done: list[tuple[str, int, int]] = []

    def work(t: int) -> None:
        for m in range(saves):
            own[t].assign(value(t, m))
            path = mgr.save()
            assert path is not None
            done.append((path, t, m))

    _on_threads(work, threads)
    mgr.wait_until_finished()
    assert sorted(_number(p) for p, _, _ in done) == list(range(1, threads * saves + 1))
    assert len(mgr.checkpoints) == threads * saves
    for path, t, m in done:
        got = cv.load(path, keys=[f"own/{t}", "save_counter"], verify=False)
        np.testing.assert_array_equal(got[f"own/{t}"], value(t, m), err_msg=path)
        assert int(got["save_counter"]) == _number(path)
