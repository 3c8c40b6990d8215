"""Failures travel in seconds: one rank raises or exits in its own code, the others raise
``DistributedError`` naming it, under a plain ``mpiexec python`` (no ``-m mpi4py``),
torch.distributed (gloo) and jax.distributed, with the default 300 s timeout.

The job is tests/mpi/failfast_cases.py; every rank lets its error go uncaught, as a
training script does. Each run has a hard timeout; the bound asserted (60 s for the
whole run, 10 s from the failure to each peer's error) is far below the 300 s a
collective would otherwise wait.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from test_distributed_mpi import _mpi_skip_reason, find_mpiexec

from ckptvar.distributed import MPI_ENV_VARS

CASES = Path(__file__).parent / "mpi" / "failfast_cases.py"
N = 3
RUN_BOUND = 60.0  # the whole run, launch and imports included
FAIL_BOUND = 10.0  # from rank 1's failure to each peer's DistributedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(out: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _start(
    engine: str, case: str, out: str, extra: dict[str, str]
) -> tuple[list[subprocess.Popen[str]], str]:
    """The processes of one run: one ``mpiexec``, or N processes of a torch/jax job."""
    env = {**_env(out), **extra}
    if engine in ("mpi", "mpi4py"):
        mpiexec = find_mpiexec()
        assert mpiexec is not None
        module = ["-m", "mpi4py"] if engine == "mpi4py" else []
        cmd = [mpiexec, "-n", str(N), sys.executable, *module, str(CASES), case, out]
        return [subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)], " ".join(cmd)
    if engine == "torchrun":  # torch's own launcher: a TCPStore in its agent, env:// here
        env.update(ENGINE="torch", INIT_METHOD="env://")
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(N),
               "--master-port", str(_free_port()), str(CASES), case, out]
        return [subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)], " ".join(cmd)
    if engine == "torch":
        env.update(ENGINE="torch", INIT_METHOD=(Path(out) / "torch-init").as_uri())
    else:
        env.update(ENGINE="jax", JAX_COORDINATOR=f"127.0.0.1:{_free_port()}")
    procs = []
    for rank in range(N):
        env_r = dict(env, RANK=str(rank), WORLD_SIZE=str(N))
        procs.append(subprocess.Popen([sys.executable, str(CASES), case, out], env=env_r,
                                      text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    return procs, f"{N} x python {CASES.name} {case} ({engine})"


def run_job(engine: str, case: str, **env: str) -> tuple[dict[int, dict[str, Any]], float, str]:
    """Run ``case`` on N ranks; the ranks' reports, the run's seconds, and its output."""
    with tempfile.TemporaryDirectory(prefix="ckptvar-failfast-") as out:
        t0 = time.monotonic()
        procs, what = _start(engine, case, out, env)
        text = []
        try:
            for p in procs:
                stdout, _ = p.communicate(timeout=max(1.0, t0 + 120 - time.monotonic()))
                text.append(stdout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{what} hung for 120 s")
        seconds = time.monotonic() - t0
        got: dict[int, dict[str, Any]] = {}
        for path in Path(out).glob("rank*.jsonl"):
            for line in path.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                got[r["rank"]] = r
        assert all(p.returncode != 0 for p in procs)  # the job failed, as it should
        return got, seconds, "\n".join(text)


def _engines() -> list[Any]:
    mpi_reason = _mpi_skip_reason()
    return [
        pytest.param("mpi", marks=pytest.mark.skipif(mpi_reason is not None,
                                                     reason=mpi_reason or "")),
        # 15-30 s each (three fresh torch/jax imports on a small machine): the long run
        pytest.param("torch", marks=[pytest.mark.slow, pytest.mark.skipif(
            importlib.util.find_spec("torch") is None, reason="torch is not installed")]),
        pytest.param("jax", marks=[pytest.mark.slow, pytest.mark.skipif(
            importlib.util.find_spec("jax") is None, reason="jax is not installed")]),
    ]


@pytest.mark.parametrize("case", ["raise", "exit"])
@pytest.mark.parametrize("engine", _engines())
def test_a_rank_that_fails_in_its_own_code_fails_the_others_in_seconds(
    engine: str, case: str
) -> None:
    got, seconds, output = run_job(engine, case)
    assert seconds < RUN_BOUND, output
    assert sorted(got) == [0, 2], output  # rank 1 failed in the user's code
    what = "rank 1 raised RuntimeError: loss is NaN at step 2" if case == "raise" else (
        "rank 1 exited")
    for r in got.values():
        assert r["error"] == "DistributedError" and r["ranks"] == [1], r
        assert what in r["message"] and "save:ckpt-2.h5" in r["message"], r
        assert r["seconds"] < FAIL_BOUND, r
    # the job's own sys.excepthook, set before ckptvar's, still ran: on every rank that raised
    assert output.count("USER HOOK") == (3 if case == "raise" else 2), output
    print(f"{engine} {case}: peers raised {max(r['seconds'] for r in got.values()):.2f} s "
          f"after the failure; the run took {seconds:.1f} s")


@pytest.mark.slow  # 25 s: three torch imports
@pytest.mark.skipif(not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun is not installed beside this Python (pip install torch)")
def test_under_torchrun_a_raising_rank_fails_the_others_in_seconds() -> None:
    got, seconds, output = run_job("torchrun", "raise")
    assert seconds < RUN_BOUND, output
    # each other rank raised DistributedError naming rank 1, or torchrun ended it first
    ended = output.count("Signal 15 (SIGTERM) received by PID")
    assert len(got) + ended >= N - 1, output
    for r in got.values():
        assert r["error"] == "DistributedError" and r["ranks"] == [1], r
        assert "rank 1 raised RuntimeError: loss is NaN at step 2" in r["message"], r
        assert r["seconds"] < FAIL_BOUND, r
    print(f"torchrun raise: {len(got)} peers raised, the last "
          f"{max((r['seconds'] for r in got.values()), default=0):.2f} s after the failure; "
          f"the run took {seconds:.1f} s")


@pytest.mark.parametrize("engine", _engines())
def test_a_rank_killed_with_sigkill_ends_the_others_in_seconds(engine: str) -> None:
    # jax's own shutdown at exit waits for the dead task for its heartbeat timeout
    # (100 s by default): the job that wants to end sooner sets it lower
    got, seconds, output = run_job(engine, "kill", JAX_HEARTBEAT="10")
    assert seconds < RUN_BOUND, output
    if engine == "mpi":  # mpiexec (Hydra) ends the job itself
        assert "BAD TERMINATION" in output and "EXIT CODE: 9" in output, output
        print(f"mpi kill: mpiexec ended the job; the run took {seconds:.1f} s")
        return
    assert sorted(got) == [0, 2], output  # the survivors see that it is gone
    for r in got.values():
        assert r["error"] == "DistributedError" and r["ranks"] == [1], r
        assert "rank 1 was killed (process " in r["message"], r
        assert r["seconds"] < FAIL_BOUND, r
    print(f"{engine} kill: peers raised {max(r['seconds'] for r in got.values()):.2f} s "
          f"after the kill; the run took {seconds:.1f} s")


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
def test_under_python_m_mpi4py_a_raising_rank_ends_the_job_in_seconds() -> None:
    _got, seconds, output = run_job("mpi4py", "raise")
    assert seconds < RUN_BOUND, output
    assert "RuntimeError: loss is NaN at step 2" in output


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
@pytest.mark.parametrize("case", ["mismatch", "mismatch_manager"])
def test_a_mismatched_target_raises_checkpoint_mismatch_where_it_is_and_distributed_elsewhere(
    case: str,
) -> None:
    got, seconds, output = run_job("mpi", case)
    assert seconds < RUN_BOUND, output
    assert "INITIALISED" not in output  # restore_or_initialize neither skipped nor initialised
    for r in got.values():
        assert "ckpt-2.h5" in r["message"], r  # the newest step, not an older one
    assert sorted(got) == [0, 1, 2], output
    for rank in (1, 2):  # as one process with such a target would
        assert got[rank]["error"] == "CheckpointMismatchError", got[rank]
        assert "expected shape (4, 4)" in got[rank]["message"]
    assert got[0]["error"] == "DistributedError" and got[0]["ranks"] == [1, 2]
    assert "rank 1: CheckpointMismatchError" in got[0]["message"]


def test_a_peer_is_failed_only_for_collectives_the_ended_process_never_joined() -> None:
    from ckptvar.distributed._failure import peer_failed

    down = {1: (4, "exited")}  # rank 1 took part in collectives up to number 4
    assert peer_failed("barrier", "t", me=0, seq=4, waiting_for=[1], down=down) is None
    assert peer_failed("barrier", "t", me=0, seq=5, waiting_for=[2], down=down) is None
    error = peer_failed("barrier", "t", me=0, seq=5, waiting_for=[1, 2], down=down)
    assert error is not None and error.ranks == (1,) and error.failures == {1: "exited"}
    assert str(error) == ("barrier(tag='t') on rank 0 cannot complete: rank 1 exited "
                          "(it ended without taking part in this collective)")

