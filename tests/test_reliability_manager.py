"""CheckpointManager under restarts, retention changes, crashes and a second manager.

A hypothesis ``RuleBasedStateMachine`` drives one directory through saves, restarts
(a new manager object on the same directory, restoring first, as a restarted job
does), changes of ``max_to_keep`` and crashes in the middle of a save (a forked
child saving, killed with SIGKILL after a drawn delay). After every step:

- every listed checkpoint loads, verified, with exactly the values saved for it;
- the newest successful save is always listed, as ``latest_checkpoint``;
- after a save, no more than ``max_to_keep`` are listed (lowering it trims fully);
- nothing under a final name is half-written or half-deleted;
- a fresh manager on the directory lists the same checkpoints.

Plain tests cover two managers sharing one directory, cleanup of a manager's own
crash leftovers (and nobody else's, nor a save still in flight), and
``restore_or_initialize`` skipping damaged checkpoints and saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ckptvar as cv
from ckptvar.storage import rawio as _rawio
from ckptvar.storage.atomic import is_partial

FINAL = re.compile(r"^ckpt-(\d+)\.(h5|zarr)$")


def values(tag: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(tag)
    return {
        "w": rng.standard_normal(17000).astype(np.float32),  # own array (> pack threshold)
        "b": rng.standard_normal(5),
        "n": np.array(tag, np.int64),
    }


class Model:
    def __init__(self) -> None:
        self.vars = {k: cv.Variable(v, name=k) for k, v in values(0).items()}
        self.ckpt = cv.Checkpoint(**self.vars)

    def set(self, tag: int) -> None:
        for k, v in values(tag).items():
            self.vars[k].assign(v)

    def tag(self) -> int:
        return int(self.vars["n"].numpy())


def loads_as(path: str | Path, tag: int) -> bool:
    got = cv.load(path)
    return all(got[k].tobytes() == v.tobytes() for k, v in values(tag).items())


def _reset_threads_in_child() -> None:
    # A forked child has none of the parent's threads: let it start its own checksum thread.
    _rawio._executor = None


os.register_at_fork(after_in_child=_reset_threads_in_child)


def crash_during_save(model: Model, mgr: cv.CheckpointManager, tag: int, delay: float) -> None:
    """Fork a child that saves ``tag`` through ``mgr``; SIGKILL it after ``delay`` seconds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # child
        try:
            model.set(tag)
            mgr.save()
        finally:
            os._exit(0)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


#: A RAM-backed directory when there is one: these tests are about logic, not fsync speed.
_FAST_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class ManagerMachine(RuleBasedStateMachine):
    fmt = "h5"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ckptvar-sm-", dir=_FAST_DIR))
        self.tags: dict[str, int] = {}  # path -> tag it must load as
        self.next_tag = 1
        self.max_to_keep: int | None = 3
        self.saved_since_change = False
        self.newest: str | None = None
        self.stale = False  # a crash happened: the current manager object is no more
        self.model = Model()
        self.mgr = self._manager()

    def _manager(self) -> cv.CheckpointManager:
        return cv.CheckpointManager(self.model.ckpt, self.dir, max_to_keep=self.max_to_keep,
                                    format=self.fmt)

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules
    @precondition(lambda self: not self.stale)
    @rule()
    def save(self) -> None:
        tag = self.next_tag
        self.next_tag += 1
        self.model.set(tag)
        path = self.mgr.save()
        assert path is not None
        self.tags[path] = tag
        self.newest = path
        self.saved_since_change = True
        assert self.mgr.latest_checkpoint == path, "the newest save is not the latest"
        assert path in self.mgr.checkpoints

    @rule(keep=st.sampled_from([1, 2, 3, 5, None]))
    def restart(self, keep: int | None) -> None:
        """The job restarts: new objects, maybe another max_to_keep, restore first."""
        if keep != self.max_to_keep:
            self.saved_since_change = False
        self.max_to_keep = keep
        self.model = Model()
        self.mgr = self._manager()
        self.stale = False
        got = self.mgr.restore_or_initialize()
        assert self.mgr.skipped == [], self.mgr.skipped
        assert got == self.mgr.latest_checkpoint
        if got is not None:
            assert self.model.tag() == self.tags[got], "restored values are not the latest's"
            if self.newest is not None:
                # the newest successful save survives restarts (a crash-saved one may be newer)
                assert _number(got) >= _number(self.newest)
        self.newest = got

    @precondition(lambda self: not self.stale)
    @rule(delay=st.floats(0.0, 0.04))
    def crash_mid_save(self, delay: float) -> None:
        tag = self.next_tag
        self.next_tag += 1
        number = int(self.model.ckpt.save_counter.numpy()) + 1
        path = str(self.dir / f"ckpt-{number}.{self.fmt}")
        before = self.tags.get(path)
        crash_during_save(self.model, self.mgr, tag, delay)
        if os.path.exists(path):  # complete with the new values, or untouched
            if loads_as(path, tag):
                self.tags[path] = tag
            else:
                assert before is not None and loads_as(path, before), f"{path} damaged by a crash"
        self.stale = True

    # -- invariants
    @invariant()
    def listed_checkpoints_load(self) -> None:
        mgr = self._manager() if self.stale else self.mgr
        listed = mgr.checkpoints
        for p in listed:
            assert loads_as(p, self.tags[p]), f"{p} is listed but does not load as saved"
        if self.saved_since_change and self.max_to_keep is not None and not self.stale:
            assert len(listed) <= self.max_to_keep, (listed, self.max_to_keep)
        if listed:
            assert mgr.latest_checkpoint == listed[-1]
            assert cv.latest_checkpoint(self.dir) == listed[-1]
        if self.newest is not None and not self.stale:
            assert listed and listed[-1] == self.newest

    @invariant()
    def nothing_partial_under_a_final_name(self) -> None:
        if not self.stale:  # a pruned step's temporary is freed in the background
            self.mgr.wait_until_finished()
        for e in os.listdir(self.dir):
            if FINAL.match(e):
                p = str(self.dir / e)
                assert loads_as(p, self.tags[p]), f"{e} is under a final name but incomplete"
            elif not self.stale:
                assert not is_partial(e), f"temporary {e} left behind without a crash"

    @invariant()
    def a_fresh_manager_agrees(self) -> None:
        if self.stale:
            return
        other = cv.CheckpointManager(Model().ckpt, self.dir, max_to_keep=self.max_to_keep,
                                     format=self.fmt)
        assert other.checkpoints == self.mgr.checkpoints


def _number(path: str) -> int:
    m = FINAL.match(Path(path).name)
    assert m is not None
    return int(m.group(1))


_SETTINGS = settings(max_examples=10, stateful_step_count=10, deadline=None, database=None,
                     derandomize=True, suppress_health_check=list(HealthCheck))


class H5Machine(ManagerMachine):
    fmt = "h5"


class ZarrMachine(ManagerMachine):
    fmt = "zarr"


TestManagerStateMachineH5 = H5Machine.TestCase
TestManagerStateMachineH5.settings = _SETTINGS
TestManagerStateMachineZarr = ZarrMachine.TestCase
TestManagerStateMachineZarr.settings = _SETTINGS


# --------------------------------------------------------------------------- two managers


def test_two_managers_on_one_directory_keep_their_own(fresh_graph: cv.Graph, fmt: str,
                                                      tmp_path: Path) -> None:
    """Managers with different names share a directory; neither touches the other's files."""
    ma, mb = Model(), Model()
    a = cv.CheckpointManager(ma.ckpt, tmp_path, max_to_keep=1, checkpoint_name="a", format=fmt)
    b = cv.CheckpointManager(mb.ckpt, tmp_path, max_to_keep=3, checkpoint_name="b", format=fmt)
    tags: dict[str, int] = {}
    for i in range(1, 7):
        ma.set(100 + i)
        tags[a.save()] = 100 + i
        mb.set(200 + i)
        tags[b.save()] = 200 + i
        if i == 3:  # both restart
            ma, mb = Model(), Model()
            a = cv.CheckpointManager(ma.ckpt, tmp_path, max_to_keep=1, checkpoint_name="a",
                                     format=fmt)
            b = cv.CheckpointManager(mb.ckpt, tmp_path, max_to_keep=3, checkpoint_name="b",
                                     format=fmt)
            a.restore_or_initialize()
            b.restore_or_initialize()
    assert [Path(p).name for p in a.checkpoints] == [f"a-6.{fmt}"]
    assert [Path(p).name for p in b.checkpoints] == [f"b-{i}.{fmt}" for i in (4, 5, 6)]
    for p in a.checkpoints + b.checkpoints:
        assert loads_as(p, tags[p])


def test_opening_a_manager_never_deletes_a_save_in_flight(fresh_graph: cv.Graph, fmt: str,
                                                          tmp_path: Path) -> None:
    """A second manager (an evaluator, a restarted job) opened mid-save leaves it alone."""
    m = Model()
    big = cv.Variable(np.random.default_rng(0).standard_normal(12 << 20).astype(np.float32))
    m.ckpt.big = big
    writer = cv.CheckpointManager(m.ckpt, tmp_path, max_to_keep=2, format=fmt)
    m.set(5)
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["path"] = writer.save()
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20  # a hang guard, not a timing
    while not any(is_partial(e) for e in os.listdir(tmp_path)):
        if not t.is_alive() or time.monotonic() > deadline:
            pytest.fail("no temporary ever appeared")
        time.sleep(0.0005)
    cv.CheckpointManager(Model().ckpt, tmp_path, max_to_keep=2, format=fmt)  # opened mid-save
    t.join()
    assert "error" not in result, result.get("error")
    assert writer.latest_checkpoint == result["path"]
    got = cv.load(str(result["path"]))
    assert got["big"].tobytes() == big.numpy().tobytes()


def test_manager_cleans_only_its_own_crash_leftovers(fresh_graph: cv.Graph, fmt: str,
                                                     tmp_path: Path) -> None:
    hexa = "0123456789abcdef" * 2
    mine = [f".ckpt-9.{fmt}.{hexa}.partial", f".checkpoint_state.json.{hexa}.partial"]
    others = [f".other-3.{fmt}.{hexa}.partial", ".ckpt-9.partial", "ckpt-notes.txt",
              f".ckptx-1.{fmt}.{hexa}.partial"]
    for name in mine + others:
        if name.endswith(".zarr." + hexa + ".partial"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "zarr.json").write_text("{}")
        else:
            (tmp_path / name).write_bytes(b"x")
    cv.CheckpointManager(Model().ckpt, tmp_path, format=fmt)
    left = set(os.listdir(tmp_path))
    assert not left & set(mine), left
    assert set(others) <= left, left


def test_restore_or_initialize_skips_damaged_and_says_why(fresh_graph: cv.Graph, fmt: str,
                                                          tmp_path: Path) -> None:
    m = Model()
    mgr = cv.CheckpointManager(m.ckpt, tmp_path, max_to_keep=5, format=fmt)
    paths = []
    for tag in (1, 2, 3):
        m.set(tag)
        paths.append(mgr.save())
    # damage the newest (a flipped bit in 'w') and remove the middle one by hand
    pattern = values(3)["w"].tobytes()
    files = [Path(paths[2])] if fmt == "h5" else sorted(Path(paths[2]).rglob("*"))
    for f in files:
        if f.is_file():
            data = bytearray(f.read_bytes())
            i = data.find(pattern)
            if i != -1:
                data[i + 100] ^= 0x01
                f.write_bytes(bytes(data))
                break
    else:
        raise AssertionError("value bytes not found")
    shutil.rmtree(paths[1]) if fmt == "zarr" else os.unlink(paths[1])
    m2 = Model()
    mgr2 = cv.CheckpointManager(m2.ckpt, tmp_path, max_to_keep=5, format=fmt)
    got = mgr2.restore_or_initialize()
    assert got == paths[0]
    assert m2.tag() == 1
    skipped = dict(mgr2.skipped)
    assert paths[2] in skipped and "'w'" in skipped[paths[2]], mgr2.skipped


def test_two_processes_saving_into_one_directory_lose_no_update(fmt: str, tmp_path: Path) -> None:
    """Managers in two processes update the shared state file under its lock: none is lost."""
    base = Path(_FAST_DIR) if _FAST_DIR else tmp_path
    directory = Path(tempfile.mkdtemp(prefix="ckptvar-2p-", dir=base))
    try:
        pids = []
        for name in ("left", "right"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    m = Model()
                    mgr = cv.CheckpointManager(m.ckpt, directory, max_to_keep=4,
                                               checkpoint_name=name, format=fmt)
                    for i in range(1, 16):
                        m.set(i)
                        mgr.save()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        for name in ("left", "right"):
            mgr = cv.CheckpointManager(Model().ckpt, directory, max_to_keep=4,
                                       checkpoint_name=name, format=fmt)
            assert [Path(p).name for p in mgr.checkpoints] == [
                f"{name}-{i}.{fmt}" for i in range(12, 16)]
            for p in mgr.checkpoints:
                assert loads_as(p, _number_of(p))
        finals = sorted(e for e in os.listdir(directory) if not e.startswith("."))
        assert len(finals) == 9, finals  # 4 + 4 checkpoints and the state file
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _number_of(path: str) -> int:
    return int(Path(path).name.split("-")[1].split(".")[0])


@pytest.mark.parametrize("damage", ["header", "record"])
def test_restore_or_initialize_skips_a_checkpoint_that_no_longer_reads(
    fresh_graph: cv.Graph, fmt: str, tmp_path: Path, damage: str
) -> None:
    """Damage to the newest checkpoint's own header (magic, root zarr.json) or record."""
    m = Model()
    mgr = cv.CheckpointManager(m.ckpt, tmp_path, max_to_keep=5, format=fmt)
    paths = []
    for tag in (1, 2):
        m.set(tag)
        paths.append(mgr.save())
    newest = Path(paths[-1])
    if fmt == "zarr":
        target = newest / "zarr.json" if damage == "header" else next(
            (newest / "_ckptvar" / "record").glob("c*"))
        os.truncate(target, target.stat().st_size // 2)
    else:
        data = bytearray(newest.read_bytes())
        data[0 if damage == "header" else len(data) - 5] ^= 0x01  # magic / record at the end
        newest.write_bytes(bytes(data))
    m2 = Model()
    mgr2 = cv.CheckpointManager(m2.ckpt, tmp_path, max_to_keep=5, format=fmt)
    assert mgr2.restore_or_initialize() == paths[0]
    assert m2.tag() == 1
    assert [p for p, _ in mgr2.skipped] == [paths[1]]


def test_a_step_number_the_manager_could_not_list_is_refused(tmp_path: Path) -> None:
    """A negative, fractional or int64-overflowing ``checkpoint_number`` is refused
    before anything is written: ``-1`` made ``ckpt--1.h5``, which no manager lists,
    restores or prunes; ``7.5`` saved as step 7; ``2**70`` wrapped the save counter."""
    ckpt = cv.Checkpoint(v=cv.Variable(np.zeros(3)))
    mgr = cv.CheckpointManager(ckpt, tmp_path)
    for bad in (-1, np.int64(-5), 7.5, np.float32(2.5), 2**63, 2**70):
        with pytest.raises(ValueError, match="checkpoint_number"):
            mgr.save(checkpoint_number=bad)
        with pytest.raises(ValueError, match="checkpoint_number"):
            mgr.save(checkpoint_number=bad, check_interval=False)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".h5"] == []
    assert int(ckpt.save_counter.numpy()) == 0
    for good, name in ((np.int64(3), "ckpt-3.h5"), (4.0, "ckpt-4.h5"), (np.uint8(5), "ckpt-5.h5"),
                       (cv.Variable(6, dtype="int64"), "ckpt-6.h5")):
        assert os.path.basename(mgr.save(checkpoint_number=good) or "") == name
    assert os.path.basename(mgr.save() or "") == "ckpt-7.h5"


@pytest.mark.parametrize("hours", [-1.0, float("nan")])
def test_keep_checkpoint_every_n_hours_that_keeps_no_period_is_refused(
    tmp_path: Path, hours: float
) -> None:
    """A negative number or NaN (which preserved none) is refused, before anything is
    written."""
    ckpt = cv.Checkpoint(v=cv.Variable(np.zeros(3)))
    with pytest.raises(ValueError, match="keep_checkpoint_every_n_hours"):
        cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=1,
                             keep_checkpoint_every_n_hours=hours)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_after_the_directory_was_removed_makes_it_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    """A run's directory removed under a running job (a scratch purge, a hand clean-up):
    every later save (and ``checkpoints``, ``restore_or_initialize``) failed with a bare
    FileNotFoundError and the job checkpointed no more."""
    v = cv.Variable(np.zeros(3))
    run = tmp_path / "scratch" / "run"
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), run, max_to_keep=2, async_save=async_save)
    mgr.save()
    mgr.wait_until_finished()
    shutil.rmtree(tmp_path / "scratch")
    assert mgr.checkpoints == [] and mgr.latest_checkpoint is None  # nothing on disk
    assert mgr.restore_or_initialize() is None
    v.assign(np.full(3, 2.0))
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = mgr.save()
    mgr.wait_until_finished()
    assert os.path.basename(path or "") == "ckpt-2.h5"
    assert mgr.checkpoints == [str(run / "ckpt-2.h5")]
    assert cv.load(run / "ckpt-2.h5")["v"].tolist() == [2.0, 2.0, 2.0]
    assert any("was removed" in r.getMessage() for r in caplog.records), caplog.text


def test_keep_checkpoint_every_n_hours_of_0_is_off(tmp_path: Path) -> None:
    """``0`` is TensorFlow configurations' "off" (its manager tests the value's truth):
    it preserved every pruned step for good, unlisted, so ``max_to_keep`` deleted
    nothing and the disk filled. Now nothing is preserved, as with ``None``."""
    ckpt = cv.Checkpoint(v=cv.Variable(np.zeros(3)))
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=0)
    for _ in range(3):
        mgr.save()
    mgr.wait_until_finished()
    assert mgr.keep_checkpoint_every_n_hours is None
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-3.h5"]


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := FINAL.match(p.name)))


@pytest.mark.parametrize("lost", ["deleted", "damaged"])
def test_steps_kept_by_the_hours_rule_survive_a_lost_state_file(tmp_path: Path,
                                                               lost: str) -> None:
    """Only the state file said which steps ``keep_checkpoint_every_n_hours`` kept: once
    it was deleted or damaged, a new manager listed them again and its next save pruned
    them. Now the rule is applied again to the steps' times: they stay kept, unlisted."""
    ckpt = cv.Checkpoint(v=cv.Variable(np.zeros(3)))
    first = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1,
                                 keep_checkpoint_every_n_hours=1e-9)
    for _ in range(3):
        time.sleep(0.02)  # file times: a clock tick (a few ms) apart
        first.save()
    first.wait_until_finished()
    assert _steps_on_disk(tmp_path) == [1, 2, 3]
    if lost == "deleted":
        (tmp_path / "checkpoint_state.json").unlink()
    else:
        (tmp_path / "checkpoint_state.json").write_text("{not json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if lost == "damaged" else "error")
        again = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1,
                                     keep_checkpoint_every_n_hours=1e-9)
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-3.h5"]  # 1, 2: kept, unlisted
    for _ in range(2):
        time.sleep(0.02)  # file times: a clock tick (a few ms) apart
        again.save()
    again.wait_until_finished()
    assert _steps_on_disk(tmp_path) == [1, 2, 3, 4, 5]
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-5.h5"]


def test_a_rebuilt_manager_keeps_by_the_hours_rule_what_the_first_kept(tmp_path: Path) -> None:
    """After the state file is lost, the hours rule is applied to the steps in save order
    with their files' times, from the oldest step found (kept): the steps it keeps are
    those a manager that never lost its state keeps, and the others are pruned."""
    ckpt = cv.Checkpoint(v=cv.Variable(np.zeros(3)))
    first = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    for _ in range(5):
        first.save()
    first.wait_until_finished()
    start = time.time() - 10 * 3600
    for number, hours in zip(range(1, 6), (0.0, 0.5, 1.1, 1.5, 2.3), strict=True):
        os.utime(tmp_path / f"ckpt-{number}.h5", (start + hours * 3600,) * 2)
    (tmp_path / "checkpoint_state.json").unlink()
    again = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1)
    # 1 (the oldest found) and 3 (1.1 h after it) are kept: no longer listed
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-2.h5", "ckpt-4.h5", "ckpt-5.h5"]
    again.save()
    again.wait_until_finished()
    assert _steps_on_disk(tmp_path) == [1, 3, 5, 6]  # 5: 1.2 h after 3; 2 and 4 pruned
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-6.h5"]
