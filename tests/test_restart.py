"""Restart after anything: the committed steps are the record, the state file a cache.

The state-file cases (deleted, stale by one step, damaged, disagreeing with the
directory, a step saved again) run in one process and in three (``mpiexec``), by
the same script (tests/mpi/restart_cases.py): the restarted job lists, restores and
prunes exactly what the directory holds, and saves the next step.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, read_results, run_mpi

import ckptvar as cv
from ckptvar.distributed import MPI_ENV_VARS

CASES = Path(__file__).parent / "mpi" / "restart_cases.py"
STATE_CASES = ["deleted", "stale", "damaged", "disagree", "again"]


def _run(n: int, root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    if n > 1:
        reason = _mpi_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        proc, got, _ = run_mpi(n, str(CASES), str(root), *STATE_CASES, timeout=120)
    else:
        with tempfile.TemporaryDirectory(prefix="ckptvar-restart-") as result_dir:
            env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
            env["RESULT_DIR"] = result_dir
            proc = subprocess.run([sys.executable, str(CASES), str(root), *STATE_CASES],
                                  capture_output=True, text=True, timeout=120, env=env,
                                  check=False)
            got = read_results(Path(result_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return got


@pytest.mark.parametrize("n", [1, 3])
def test_the_state_file_is_only_a_cache(n: int, tmp_path: Path) -> None:
    got = _run(n, tmp_path)
    for case in STATE_CASES:
        assert sorted(got.get(case, {})) == list(range(n)), (case, got.get(case))
        for rank, r in got[case].items():
            where = (case, rank)
            assert r["ok"], (where, r)
            assert r["listed"] == ["ckpt-2.h5", "ckpt-3.h5"], (where, r)
            assert r["latest"] == r["dir_latest"] == r["restored"] == "ckpt-3.h5", (where, r)
            assert r["values"] == r["values_max"] == 3.0, (where, r)  # the newest, bit-exact
            assert r["next"] == "ckpt-4.h5", (where, r)
            assert r["after"] == ["ckpt-3.h5", "ckpt-4.h5"], (where, r)  # pruned by the rule
            assert r["on_disk"] == ["ckpt-3.h5", "ckpt-4.h5"], (where, r)
        if case == "damaged":
            # said once, by the process that found it damaged (and rebuilt it)
            assert any("could not be read" in w for r in got[case].values() for w in r["warned"])
    for r in got["again"].values():  # every process: the same clear error
        assert r["error"] == "CheckpointExistsError", r
        assert "ckpt-3.h5" in r["message"] and "committed already" in r["message"], r


def _model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full(4, value), name="v")
    return cv.Checkpoint(v=v), v


def test_a_step_committed_when_the_state_write_failed_is_listed_and_pruned(
    tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename happened, the state write raised: the step is the manager's all the same."""
    from ckptvar.checkpoint import _state

    ckpt, v = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    mgr.save()
    real = _state.write_state

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_state, "write_state", broken)
    monkeypatch.setattr("ckptvar.checkpoint._manager.write_state", broken)
    v.assign(np.full(4, 2.0))
    with pytest.raises(OSError, match="No space"):
        mgr.save()
    monkeypatch.setattr("ckptvar.checkpoint._manager.write_state", real)
    monkeypatch.setattr(_state, "write_state", real)
    assert (tmp_path / "ckpt-2.h5").exists()
    assert [Path(p).name for p in mgr.checkpoints] == ["ckpt-1.h5", "ckpt-2.h5"]
    assert cv.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2.h5")
    ckpt2, v2 = _model(0.0)
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2)
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-2.h5")
    np.testing.assert_array_equal(v2.numpy(), np.full(4, 2.0))
    for value in (3.0, 4.0):
        v2.assign(np.full(4, value))
        again.save()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-3.h5", "ckpt-4.h5"]
    doc = json.loads((tmp_path / "checkpoint_state.json").read_text())
    assert [e["path"] for e in doc["sections"]["ckpt"]["checkpoints"]] == [
        "ckpt-3.h5", "ckpt-4.h5"]


def test_saving_a_committed_step_again_is_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt, v = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path)
    first = mgr.save()
    before = Path(first).read_bytes()
    v.assign(np.full(4, 9.0))
    with pytest.raises(cv.errors.CheckpointExistsError, match="committed already"):
        mgr.save(checkpoint_number=1)
    assert Path(first).read_bytes() == before
    assert int(ckpt.save_counter.numpy()) == 1  # the failed save did not count
    assert mgr.save() == str(tmp_path / "ckpt-2.h5")


def test_a_save_counter_behind_the_directory_continues_past_it(
    tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture
) -> None:
    """A job that did not restore: its next save is a new step, never an overwrite."""
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=3)
    for _ in range(3):
        mgr.save()
    kept = {p: Path(p).read_bytes() for p in mgr.checkpoints}
    ckpt2, _ = _model(7.0)  # a fresh job that forgot restore_or_initialize()
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=3)
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = again.save()
    assert path == str(tmp_path / "ckpt-4.h5")
    assert "Step 1 is committed already" in caplog.text and "as step 4" in caplog.text
    assert int(ckpt2.save_counter.numpy()) == 4
    assert int(cv.load(path)["save_counter"]) == 4
    for p, raw in kept.items():  # ckpt-1 pruned by the rule, the others untouched
        assert not Path(p).exists() or Path(p).read_bytes() == raw
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-2.h5", "ckpt-3.h5", "ckpt-4.h5"]


def test_a_save_counter_below_the_kept_steps_continues_past_them(
    tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 1-4 pruned, 5-6 kept: a job that did not restore saves step 7, not a step 1
    that the manager would list below the others and prune at once (it did: the save
    returned the path of a file it had just deleted)."""
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    for _ in range(6):
        mgr.save()
    ckpt2, _ = _model(7.0)
    again = cv.CheckpointManager(ckpt2, tmp_path, max_to_keep=2)
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = again.save()
    assert path == str(tmp_path / "ckpt-7.h5") and Path(path).exists()
    assert "Step 1 is older than the newest committed step" in caplog.text
    assert again.latest_checkpoint == path
    assert np.array_equal(cv.load(path)["v"], np.full(4, 7.0))
    assert [Path(p).name for p in again.checkpoints] == ["ckpt-6.h5", "ckpt-7.h5"]


def test_a_save_counter_at_a_local_tier_step_names_the_local_tier(
    tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 is only in the local tier: the log said it was committed in the persistent
    directory, which never held it; it names the local tier's directory now."""
    dirs = {"directory": tmp_path / "persistent", "local_directory": tmp_path / "local",
            "persistent_every": 2, "max_to_keep": 3, "local_max_to_keep": 3}
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, **dirs)
    for _ in range(2):
        mgr.save()
    mgr.wait_until_finished()
    assert not (tmp_path / "persistent" / "ckpt-1.h5").exists()
    ckpt2, _ = _model(7.0)
    again = cv.CheckpointManager(ckpt2, **dirs)
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = again.save()
    again.wait_until_finished()
    assert path == str(tmp_path / "local" / "ckpt-3.h5")
    assert f"Step 1 is committed already in {tmp_path / 'local'};" in caplog.text, caplog.text


def test_a_save_counter_at_a_held_incremental_step_continues_past_it(
    tmp_path: Path, fresh_graph: cv.Graph, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 is pruned from the list but kept on disk (step 2 refers to its frozen
    value): a job that did not restore must not write step 1 again."""
    frozen = cv.Variable(np.arange(300_000, dtype=np.float32), name="frozen")
    head = cv.Variable(np.zeros(3, np.float32), name="head")
    mgr = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), tmp_path,
                               max_to_keep=1, incremental=True)
    mgr.save()
    head.assign_add(np.ones(3, np.float32))
    mgr.save()
    assert (tmp_path / "ckpt-1.h5").exists()  # held for step 2
    held = (tmp_path / "ckpt-1.h5").read_bytes()
    again = cv.CheckpointManager(cv.Checkpoint(frozen=frozen, head=head), tmp_path,
                                 max_to_keep=1, incremental=True)
    with caplog.at_level("WARNING", logger="ckptvar"):
        path = again.save()
    assert path == str(tmp_path / "ckpt-3.h5")
    assert "Step 1 is committed already" in caplog.text
    assert (tmp_path / "ckpt-1.h5").read_bytes() == held
    assert np.array_equal(cv.load(path)["frozen"], frozen.numpy())


# --------------------------------------------------------------------------- leftovers

HEX = "0123456789abcdef" * 2


def _dead_pid() -> int:
    """The id of a process of this host that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    return int(proc.stdout)


def _ckpt_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)


def _leave_leftovers(d: Path, tmpdir: Path) -> dict[str, int]:
    """What dead saves leave in ``d`` and in ``tmpdir`` (names -> bytes)."""
    left = {
        f".ckpt-3.h5.{HEX}.partial": 1000,               # a file checkpoint's temporary
        f".checkpoint_state.json.{HEX}.partial": 10,      # the state file's
        f".ckpt-3.h5.partial-{HEX}": 20,                  # a local location's, old naming
    }
    for name, n in left.items():
        (d / name).write_bytes(b"x" * n)
    tree = d / f".ckpt-4.zarr.{HEX}.partial"               # a directory checkpoint's
    (tree / "v").mkdir(parents=True)
    (tree / "v" / "c0").write_bytes(b"y" * 300)
    left[tree.name] = 300
    stage = tmpdir / f"ckptvar-upload-{cv.locations.this_host()}-{_dead_pid()}-abc_1"
    stage.mkdir()
    (stage / "ckpt-3.h5").write_bytes(b"z" * 5000)
    left[stage.name] = 5000
    alive = tmpdir / f"ckptvar-upload-{cv.locations.this_host()}-{os.getpid()}-live"
    alive.mkdir()  # this process's own: never touched
    return left


def test_ckpt_gc_removes_what_dead_saves_left_and_says_how_much(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    d, tmpdir = tmp_path / "run", tmp_path / "tmp"
    d.mkdir(), tmpdir.mkdir()
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, d)
    kept = Path(mgr.save())
    left = _leave_leftovers(d, tmpdir)
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=os.pathsep.join(sys.path))
    dry = _ckpt_cli("gc", str(d), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    for name, n in left.items():
        assert f"{name}  {n} bytes" in dry.stdout, (name, dry.stdout)
    total = sum(left.values())
    assert f"would remove {len(left)} leftovers, {total} bytes" in dry.stdout
    assert all((d / n).exists() or (tmpdir / n).exists() for n in left)  # nothing removed
    done = _ckpt_cli("gc", str(d), env=env)
    assert done.returncode == 0, done.stderr
    assert f"removed {len(left)} leftovers, {total} bytes" in done.stdout
    assert not any((d / n).exists() or (tmpdir / n).exists() for n in left)
    assert sorted(p.name for p in tmpdir.iterdir()) == [
        f"ckptvar-upload-{cv.locations.this_host()}-{os.getpid()}-live"]
    assert [p.name for p in d.iterdir() if not p.name.startswith(".")] == [
        "checkpoint_state.json", kept.name]
    cv.load(kept)
    again = _ckpt_cli("gc", str(d), env=env)
    assert "removed 0 leftovers, 0 bytes" in again.stdout


def test_the_managers_next_save_removes_dead_leftovers(
    tmp_path: Path, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, tmpdir = tmp_path / "run", tmp_path / "tmp"
    d.mkdir(), tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, d)
    mgr.save()
    left = _leave_leftovers(d, tmpdir)
    stage = next(n for n in left if n.startswith("ckptvar-upload-"))
    mgr.save()  # the temporaries now; TMPDIR is looked at again only after 30 s
    assert [n for n in left if (d / n).exists()] == []
    assert (tmpdir / stage).exists()
    from ckptvar.checkpoint import _manager  # noqa: PLC0415 - the interval, shortened
    monkeypatch.setattr(_manager, "_STAGING_EVERY_S", 0.0)
    mgr.save()
    assert [n for n in left if (d / n).exists() or (tmpdir / n).exists()] == []


def test_a_save_in_flight_keeps_its_temporary_from_gc(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    """While a manager saves into the directory, gc leaves checkpoint temporaries alone."""
    from ckptvar.checkpoint._reclaim import open_saving_lock

    d = tmp_path
    cv.CheckpointManager(_model(1.0)[0], d).save()
    tmp = d / f".ckpt-2.h5.{HEX}.partial"
    tmp.write_bytes(b"being written")
    fd = open_saving_lock(d)  # what a save in flight holds
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert [x for x in cv.checkpoint.gc(d) if x.path.startswith(str(d))] == []
        assert tmp.exists()
    finally:
        os.close(fd)
    assert [Path(x.path).name for x in cv.checkpoint.gc(d) if x.path.startswith(str(d))] == [
        tmp.name]
    assert not tmp.exists()


def test_gc_leaves_the_state_file_being_written_by_a_manager(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    """A manager in flight writes its state file under the state lock: gc removed that
    temporary (it took every state temporary for dead while a save held the saving
    lock), and the manager's state write failed at its rename."""
    from ckptvar.checkpoint._reclaim import open_saving_lock
    from ckptvar.checkpoint._state import LOCK_FILE

    d = tmp_path
    cv.CheckpointManager(_model(1.0)[0], d).save()
    tmp = d / f".checkpoint_state.json.{HEX}.partial"
    tmp.write_bytes(b"{}")
    saving = open_saving_lock(d)
    state = os.open(d / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(saving, fcntl.LOCK_SH)  # a save in flight ...
        fcntl.flock(state, fcntl.LOCK_EX)  # ... writing its state
        assert [x for x in cv.checkpoint.gc(d) if x.path.startswith(str(d))] == []
        assert tmp.exists()
        os.close(state)  # the state written (a dead one's temporary is left now)
        state = -1
        assert [Path(x.path).name for x in cv.checkpoint.gc(d)
                if x.path.startswith(str(d))] == [tmp.name]
    finally:
        os.close(saving)
        if state >= 0:
            os.close(state)


_WRITER = """
import sys
from pathlib import Path
from ckptvar.storage.atomic import publish, temporary_sibling
final = Path(sys.argv[1])
with temporary_sibling(final) as tmp:
    tmp.write_bytes(b"being written")
    print(tmp.name, flush=True)
    sys.stdin.readline()  # the save goes on when told
    publish(tmp, final)
"""


def test_ckpt_gc_leaves_the_temporary_of_any_save_in_flight(tmp_path: Path) -> None:
    """Not only a manager's: a ``Checkpoint.save``/``cv.save`` in another process too."""
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    final = tmp_path / "model-1.h5"
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(final)], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as writer:
        assert writer.stdin is not None and writer.stdout is not None
        tmp = tmp_path / writer.stdout.readline().strip()
        assert tmp.exists()
        done = _ckpt_cli("gc", str(tmp_path), env=env)
        assert done.returncode == 0, done.stderr
        assert "removed 0 leftovers" in done.stdout, done.stdout
        assert tmp.exists()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(timeout=60) == 0
    assert final.read_bytes() == b"being written"
    # a writer killed in the middle leaves a temporary that gc removes
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(final)], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as writer:
        assert writer.stdout is not None
        tmp = tmp_path / writer.stdout.readline().strip()
        writer.kill()
        writer.wait(timeout=60)
    assert tmp.exists()
    done = _ckpt_cli("gc", str(tmp_path), env=env)
    assert f"removed  temporary  {tmp}" in done.stdout, done.stdout
    assert not tmp.exists() and final.exists()


def test_local_location_temporaries_are_the_ones_cleanup_knows(tmp_path: Path) -> None:
    from ckptvar.locations import LocalLocation, is_partial

    loc = LocalLocation(tmp_path)
    with loc.open_writer("a/b.bin") as w:
        w.write(b"x" * 10)
        names = [p.name for p in (tmp_path / "a").iterdir()]
        assert len(names) == 1 and is_partial(names[0]) and names[0].endswith(".partial")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]
    assert is_partial(f".b.bin.partial-{HEX}")  # what older versions named them
