"""Preemption with real signals: ``save_on_signal`` saves the current state as a committed
step at the next step boundary, then re-delivers the signal (the process ends by it).

One process (a subprocess training loop gets SIGTERM; synchronous and background
saves), three under a plain ``mpiexec`` (SIGTERM to one rank, and to all), and in
this process a Python handler that runs after the save. The job is
tests/mpi/preempt_job.py; a restarted job (same code, fresh process) restores the step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, find_mpiexec

import ckptvar as cv
from ckptvar.distributed import MPI_ENV_VARS

JOB = Path(__file__).parent / "mpi" / "preempt_job.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _wait_for_steps(out: Path, ranks: int, at_least: int, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if all(int((out / f"step{r}").read_text() or 0) >= at_least for r in range(ranks)):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the job did not reach step {at_least} in 60 s")


def _read_step(path: Path) -> int:
    """The step a job wrote to ``path`` (it rewrites the file: retry past an empty read)."""
    deadline = time.monotonic() + 10
    while True:
        text = path.read_text()
        if text or time.monotonic() > deadline:
            return int(text)
        time.sleep(0.01)


def _restart(out: Path, mode: str = "report") -> dict[str, Any]:
    """The same job in a fresh process: what it restores."""
    subprocess.run([sys.executable, str(JOB), str(out), mode], env=_env(), timeout=60,
                   check=True)
    restored: dict[str, Any] = json.loads((out / "restored0.json").read_text())
    return restored


def _assert_restored_current_state(out: Path, restored: dict[str, Any], seen: int) -> None:
    step = restored["step"]
    assert step >= seen  # the state when the signal came, not an older save
    assert restored["path"] == os.fspath(out / "run" / f"ckpt-{step}.h5")
    assert restored["w"] == [[float(step)] * 3] * 4  # consistent: no half-applied step
    assert not [p.name for p in (out / "run").iterdir() if "partial" in p.name]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_saves_the_current_state_then_ends_the_process_by_sigterm(
    tmp_path: Path, mode: str
) -> None:
    proc = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), mode], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_steps(tmp_path, 1, 20, proc)
    seen = _read_step(tmp_path / "step0")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, output  # re-delivered: ended as it would be
    last = _read_step(tmp_path / "step0")
    restored = _restart(tmp_path)
    _assert_restored_current_state(tmp_path, restored, seen)
    assert restored["step"] == last + 1  # the boundary right after the last finished step


def test_sigterm_with_tiers_persists_the_preemption_save_before_the_process_ends(
    tmp_path: Path,
) -> None:
    # persistent_every=1000: only the preemption save is due a persistent copy, and the
    # process is killed by the re-delivered SIGTERM only once that copy is committed
    proc = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "tiered"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_steps(tmp_path, 1, 20, proc)
    seen = _read_step(tmp_path / "step0")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, output
    last = _read_step(tmp_path / "step0")
    persistent = sorted(p.name for p in (tmp_path / "run").iterdir()
                        if not p.name.startswith("."))
    assert persistent == ["checkpoint_state.json", f"ckpt-{last + 1}.h5"], persistent
    shutil.rmtree(tmp_path / "local")  # the preempted machine's disk is gone
    restored = _restart(tmp_path, "tiered-report")
    _assert_restored_current_state(tmp_path, restored, seen)
    assert restored["step"] == last + 1


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
@pytest.mark.parametrize("to", ["one", "all"])
def test_sigterm_under_mpiexec_makes_one_collective_save(tmp_path: Path, to: str) -> None:
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    proc = subprocess.Popen([mpiexec, "-n", "3", sys.executable, str(JOB), str(tmp_path), "sync"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for_steps(tmp_path, 3, 10, proc)
    seen = max(_read_step(tmp_path / f"step{r}") for r in range(3))
    for r in [1] if to == "one" else [0, 1, 2]:
        os.kill(int((tmp_path / f"pid{r}").read_text()), signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job did not end after SIGTERM")
    assert proc.returncode != 0
    text = output.decode(errors="replace")
    assert "Terminated" in text or "signal 15" in text or "EXIT CODE: 15" in text, text
    restored = _restart(tmp_path)  # one process restores the 3-process step
    _assert_restored_current_state(tmp_path, restored, seen)
    steps = [_read_step(tmp_path / f"step{r}") for r in range(3)]
    assert restored["step"] == max(steps) + 1  # every rank saved the same step


def _preempt_tiered(tmp_path: Path, mode: str, processes: int, victim: int) -> tuple[int, int]:
    """SIGTERM to rank ``victim`` of a tiered job of ``processes`` ranks: the job ends,
    the persistent directory holds exactly the preemption save. Returns ``(step, the
    newest step a rank had reached before the signal)``."""
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    proc = subprocess.Popen([mpiexec, "-n", str(processes), sys.executable, str(JOB),
                             str(tmp_path), mode], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    _wait_for_steps(tmp_path, processes, 10, proc)
    seen = max(_read_step(tmp_path / f"step{r}") for r in range(processes))
    os.kill(int((tmp_path / f"pid{victim}").read_text()), signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job did not end after SIGTERM")
    assert proc.returncode != 0, output
    step = max(_read_step(tmp_path / f"step{r}") for r in range(processes)) + 1
    persistent = sorted(p.name for p in (tmp_path / "run").iterdir()
                        if not p.name.startswith("."))
    assert persistent == ["checkpoint_state.json", f"ckpt-{step}.h5"], output
    return step, seen


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
def test_sigterm_to_one_rank_of_a_tiered_job_persists_the_collective_save(
    tmp_path: Path,
) -> None:
    step, seen = _preempt_tiered(tmp_path, "tiered", 3, victim=1)
    shutil.rmtree(tmp_path / "local")  # the preempted machines' disks are gone
    restored = _restart(tmp_path, "tiered-report")
    _assert_restored_current_state(tmp_path, restored, seen)
    assert restored["step"] == step


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
def test_sigterm_to_one_rank_of_a_job_with_per_node_tiers_persists_the_save(
    tmp_path: Path,
) -> None:
    """4 processes as 2 nodes, each its own local directory: SIGTERM to rank 2; every
    process copies its part of the preemption save before the signal comes back."""
    step, seen = _preempt_tiered(tmp_path, "tiered-nodes", 4, victim=2)
    for node in ("node0", "node1"):  # each node holds its own part of the step
        assert (tmp_path / "local" / node / f"ckpt-{step}.h5").is_dir()
    shutil.rmtree(tmp_path / "local")  # the preempted machines' disks are gone
    restored = _restart(tmp_path, "tiered-report")
    _assert_restored_current_state(tmp_path, restored, seen)
    assert restored["step"] == step


def test_a_python_handler_runs_after_the_save(tmp_path: Path) -> None:
    calls: list[tuple[int, list[str]]] = []
    w = cv.Variable(np.zeros(3), name="w")
    ckpt = cv.Checkpoint(w=w)
    mgr = cv.CheckpointManager(ckpt, tmp_path)

    def handler(signum: int, _frame: object) -> None:
        calls.append((signum, [os.path.basename(p) for p in mgr.checkpoints]))

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        mgr.save_on_signal(signal.SIGUSR1)
        assert not mgr.reached_preemption(1)  # no signal yet: nothing happens
        w.assign(np.full(3, 5.0))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert calls == [] and mgr.checkpoints == []  # the handler only noted it
        assert mgr.reached_preemption(5)  # saved, then the signal went to `handler`
        assert calls == [(signal.SIGUSR1, ["ckpt-5.h5"])]
        assert signal.getsignal(signal.SIGUSR1) is handler  # put back
        assert not mgr.reached_preemption(6)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    again = cv.Checkpoint(w=cv.Variable(np.zeros(3), name="w"))
    again.restore(mgr.latest_checkpoint)
    assert again.w.numpy().tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("tiers", [False, True])
def test_a_preemption_save_at_the_step_saved_last_saves_the_current_state(
        tmp_path: Path, tiers: bool) -> None:
    """A forced save skips the step counter's step saved already; a preemption save does
    not: the state may have changed since, and the process is about to end."""
    calls: list[int] = []
    w = cv.Variable(np.zeros(3), name="w")
    step = cv.Variable(4, dtype="int64", name="step")
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), tmp_path / "p", step_counter=step,
                               checkpoint_interval=10,
                               local_directory=tmp_path / "l" if tiers else None)
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: calls.append(signum))
    try:
        mgr.save_on_signal(signal.SIGUSR1)
        first = mgr.save()
        assert first is not None and mgr.save(check_interval=False) is None
        w.assign(np.full(3, 2.0))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert mgr.reached_preemption()  # step 4 still, saved again with the new state
        assert calls == [signal.SIGUSR1]
        mgr.wait_until_finished()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(mgr.checkpoints) == 2 and mgr.latest_checkpoint != first
    assert cv.load(mgr.latest_checkpoint)["w"].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(("async_save", "tiers"), [(False, False), (True, False), (False, True),
                                                  (True, True)])
def test_a_signal_during_the_save_of_a_step_then_its_boundary_ends_the_job(
    tmp_path: Path, async_save: bool, tiers: bool
) -> None:
    """``save(N)`` then ``reached_preemption(N)`` (the loop of "call it after each step"),
    with the signal arriving during that save: step N is the state, committed (with
    tiers, persisted too, whatever ``persistent_every`` says); the signal is
    re-delivered, never ``CheckpointExistsError``."""
    calls: list[list[str]] = []
    w = cv.Variable(np.zeros(3), name="w")
    more: dict[str, Any] = ({"local_directory": tmp_path / "local", "persistent_every": 10}
                            if tiers else {})
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), tmp_path / "persist",
                               async_save=async_save, **more)
    previous = signal.signal(signal.SIGUSR1, lambda *_: calls.append(
        [os.path.basename(p) for p in mgr.checkpoints]))
    try:
        mgr.save_on_signal(signal.SIGUSR1)
        w.assign(np.full(3, 2.0))
        mgr.save(checkpoint_number=2)
        os.kill(os.getpid(), signal.SIGUSR1)  # as if during that save: only noted
        assert mgr.reached_preemption(2)
        assert calls == [["ckpt-2.h5"]]
        assert signal.getsignal(signal.SIGUSR1) is not None
        w.assign(np.full(3, 3.0))
        os.kill(os.getpid(), signal.SIGUSR1)  # the user's own handler now: no save
        assert not mgr.reached_preemption(3)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-2.h5"]
    assert cv.load(mgr.latest_checkpoint)["w"].tolist() == [2.0, 2.0, 2.0]
    assert cv.load(tmp_path / "persist" / "ckpt-2.h5")["w"].tolist() == [2.0, 2.0, 2.0]
