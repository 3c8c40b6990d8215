"""The torch.distributed coordinator on real processes (gloo, ``init_method=file://``).

tests/mpi/torch_launch.py imports torch once and forks the ranks; each runs the
same cases as the MPI tests (tests/mpi/coordinator_cases.py). Every launch has a
subprocess timeout, so no test can hang.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ckptvar.distributed import MPI_ENV_VARS

LAUNCH = Path(__file__).parent / "mpi" / "torch_launch.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="PyTorch is not installed (pip install 'ckptvar[test]' installs it)",
)


def read_results(result_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """The JSON lines each rank wrote to ``result_dir``, by case, then by rank."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(result_dir.glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            out.setdefault(r["case"], {})[r["rank"]] = r
    return out


def launch(
    n: int, *cases: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[int, dict[str, Any]]]]:
    """Run ``torch_launch.py n cases...`` with a hard timeout: (process, results by case/rank)."""
    with tempfile.TemporaryDirectory(prefix="ckptvar-torch-") as result_dir:
        full_env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
        full_env.update(env or {}, RESULT_DIR=result_dir, LAUNCH_TIMEOUT="90")
        try:
            proc = subprocess.run(
                [sys.executable, str(LAUNCH), str(n), *cases],
                capture_output=True,
                text=True,
                timeout=150,
                env=full_env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the torch launch hung:\n{exc.stdout}\n{exc.stderr}")
        return proc, read_results(Path(result_dir))


TIMEOUT = 2.0
N = 3


@pytest.fixture(scope="module")
def torch_run() -> tuple[subprocess.CompletedProcess[str], dict[str, dict[int, dict[str, Any]]]]:
    """One launch of 3 ranks running every case; ``killed`` (rank 1 SIGKILLs itself) is last."""
    return launch(
        N,
        "collectives",
        "vote_raises",
        "mismatch",
        "plan",
        "slow",
        "killed",
        env={"CASE_TIMEOUT": str(TIMEOUT)},
    )


def test_torch_coordinator_collectives_vote_timeout_and_planning(torch_run: Any) -> None:
    proc, got = torch_run
    for case in ("collectives", "vote_raises", "mismatch", "plan", "slow"):
        assert sorted(got.get(case, {})) == list(range(N)), (case, proc.stdout, proc.stderr)
    for r in got["collectives"].values():
        assert r["engine"] == "TorchCoordinator"  # from_env picked the initialised group
        assert r["gathered"] == [{"rank": i, "sq": i * i} for i in range(N)]
        assert r["from_root"] == f"hello from {N - 1}"
        assert r["fg"] == [[-i - k for i in range(N)] for k in range(5)]
        assert r["bg"] == [[i + 100 * k for i in range(N)] for k in range(5)]
    for rank, r in got["vote_raises"].items():  # rank 1 raises its own error, the others name it
        text = r["message"] if rank != 1 else r["notes"][0]
        assert r["error"] == ("OSError" if rank == 1 else "DistributedError")
        assert "rank 1: OSError: disk full while writing shard 1" in text
    for r in got["mismatch"].values():
        assert "running different collective steps" in r["message"]
    for r in got["plan"].values():
        assert r["same"] and r["second_tags"] == ["plan:digests"]
        assert r["bad"]["error"] == "ShardLayoutError"
    for rank in (0, 1):
        r = got["slow"][rank]
        assert r["is_timeout"] and r["ranks"] == [2]
        assert "nothing arrived from rank 2" in r["message"]
        assert TIMEOUT <= r["elapsed"] < TIMEOUT + 2.0
    late = got["slow"][2]  # it found every part sent, and the others' notice: it fails too
    assert late["is_timeout"] and late["ranks"] == [2] and "gave up on it" in late["message"]
    for r in got["slow"].values():
        assert r["vote"]["error"] == "DistributedError" and r["vote"]["ranks"] == [0, 1, 2]


def test_torch_rank_killed_with_sigkill_survivors_raise_at_once(torch_run: Any) -> None:
    proc, got = torch_run
    assert "LAUNCH exit codes 0 -9 0" in proc.stdout, proc.stdout + proc.stderr
    assert sorted(got["killed"]) == [0, 2]  # nothing ends the survivors: they see it is gone
    for r in got["killed"].values():
        assert not r["is_timeout"] and r["ranks"] == [1]
        assert "rank 1 was killed (process " in r["message"]
        assert r["elapsed"] < TIMEOUT  # before the collective's timeout


_STOPPED_STORE = r"""
import os, signal, subprocess, sys, time
from datetime import timedelta
import torch.distributed as dist
from ckptvar.distributed import TorchCoordinator
from ckptvar.errors import DistributedTimeoutError

SERVER = '''
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=600),
                      wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGSTOP)
'''
server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(f"server {server.pid}", flush=True)
try:
    port = int(server.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=600))
    coord = TorchCoordinator(store=store, rank=1, size=2, timeout=1.0)
    server.stdin.write("stop\n")
    server.stdin.flush()
    while open(f"/proc/{server.pid}/stat").read().split(")")[-1].split()[0] != "T":
        time.sleep(0.01)
    for call in ("allgather", "barrier"):
        start = time.monotonic()
        try:
            getattr(coord, call)(*(() if call == "barrier" else (1,)), tag="step 3",
                                 timeout=1.0)
        except DistributedTimeoutError as exc:
            print(f"{call} {time.monotonic() - start:.2f} {exc}", flush=True)
    start = time.monotonic()
    coord.post_failure("rank 1 exited")  # at exit: never long on a store that is gone
    print(f"posted {time.monotonic() - start:.2f}", flush=True)
except BaseException:
    server.kill()
    raise
# this process ends with the store's host still stopped (the test then ends it)
"""


@pytest.mark.slow
def test_a_stopped_store_host_times_out_each_collective(tmp_path: Path) -> None:
    """The process that hosts the TCPStore (rank 0) is stopped (SIGSTOP): a collective of
    another rank raises DistributedTimeoutError at its timeout instead of hanging in a
    store call that never returns."""
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    try:
        proc = subprocess.run([sys.executable, "-c", _STOPPED_STORE], capture_output=True,
                              text=True, timeout=120, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        proc = subprocess.CompletedProcess([], -1, out, "")
        pytest.fail(f"a collective hung on a stopped store:\n{exc.stdout!r}\n{exc.stderr!r}")
    finally:
        for line in proc.stdout.splitlines()[:1]:
            if line.startswith("server "):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["allgather", "barrier", "posted"], lines
    for line in lines[:2]:
        call, seconds, message = line.split(" ", 2)
        assert float(seconds) < 5, line
        assert f"{call}(tag='step 3')" in message and "store" in message, line
    assert float(lines[2].split()[1]) < 3, lines


_KILLED_STORE = '''
import subprocess, sys
from datetime import timedelta
import torch.distributed as dist
from ckptvar.distributed import TorchCoordinator
from ckptvar.errors import DistributedError

SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60),
                      wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.readline()
"""
server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
try:
    port = int(server.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    coord = TorchCoordinator(store=store, rank=1, size=2, timeout=5.0)
finally:
    server.kill()
    server.wait()
for call in ("allgather", "barrier", "broadcast"):
    try:
        getattr(coord, call)(*(() if call == "barrier" else (1,)), tag="step 4", timeout=5.0)
    except DistributedError as exc:
        print(f"{call} {type(exc).__name__} {exc}", flush=True)
    except BaseException as exc:
        print(f"{call} RAW {type(exc).__name__} {exc}", flush=True)
'''


@pytest.mark.slow  # a torch import in two processes
def test_a_killed_store_host_is_a_distributed_error_in_each_collective() -> None:
    """The process that hosts the TCPStore (rank 0) was killed (``SIGKILL``) before another
    rank's collective began (a rank killed in an incremental save while the others still
    wrote): the collective raised torch's own ``DistNetworkError: Connection reset by
    peer`` from its first store call; it is a ``DistributedError`` naming the collective
    and the store, as when the store fails while a collective waits."""
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    proc = subprocess.run([sys.executable, "-c", _KILLED_STORE], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["allgather", "DistributedError"], ["barrier", "DistributedError"],
        ["broadcast", "DistributedError"]], lines
    for line in lines:
        call = line.split()[0]
        assert f"{call}(tag='step 4') on rank 1: the c10d store failed: " in line, line
