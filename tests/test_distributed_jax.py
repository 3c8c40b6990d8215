"""The jax.distributed coordinator on real processes (a coordination service on 127.0.0.1).

tests/mpi/jax_launch.py starts N fresh ``python coordinator_cases.py`` processes that
call ``jax.distributed.initialize``; they run the same cases as the MPI tests. A
killed rank is not run here: the survivors do raise ``DistributedTimeoutError``
naming it (checked by hand), but jax's own shutdown at exit then waits for the dead
task (see docs/distributed.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ckptvar.distributed import MPI_ENV_VARS

LAUNCH = Path(__file__).parent / "mpi" / "jax_launch.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None,
    reason="jax is not installed (pip install 'ckptvar[test]' installs it)",
)


def test_jax_coordinator_collectives_vote_timeout_and_planning() -> None:
    n, timeout = 3, 2.0
    cases = ["collectives", "vote_raises", "mismatch", "plan", "slow"]
    with tempfile.TemporaryDirectory(prefix="ckptvar-jax-") as result_dir:
        env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
        env.update(RESULT_DIR=result_dir, LAUNCH_TIMEOUT="90", CASE_TIMEOUT=str(timeout))
        try:
            proc = subprocess.run(
                [sys.executable, str(LAUNCH), str(n), *cases],
                capture_output=True,
                text=True,
                timeout=150,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the jax launch hung:\n{exc.stdout}\n{exc.stderr}")
        got: dict[str, dict[int, dict[str, Any]]] = {}
        for path in Path(result_dir).glob("rank*.jsonl"):
            for line in path.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                got.setdefault(r["case"], {})[r["rank"]] = r
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for case in cases:
        assert sorted(got.get(case, {})) == list(range(n)), (case, proc.stdout, proc.stderr)
    for r in got["collectives"].values():
        assert r["engine"] == "JaxCoordinator"  # from_env picked the initialised client
        assert r["gathered"] == [{"rank": i, "sq": i * i} for i in range(n)]
        assert r["from_root"] == f"hello from {n - 1}"
        assert r["bg"] == [[i + 100 * k for i in range(n)] for k in range(5)]
    for rank, r in got["vote_raises"].items():  # rank 1 raises its own error, the others name it
        text = r["message"] if rank != 1 else r["notes"][0]
        assert r["error"] == ("OSError" if rank == 1 else "DistributedError")
        assert "rank 1: OSError: disk full while writing shard 1" in text
    for r in got["mismatch"].values():
        assert "running different collective steps" in r["message"]
    for r in got["plan"].values():
        assert r["same"] and r["second_tags"] == ["plan:digests"]
    for rank in (0, 1):
        r = got["slow"][rank]
        assert r["is_timeout"] and r["ranks"] == [2]
        assert "nothing arrived from rank 2" in r["message"]
        assert timeout <= r["elapsed"] < timeout + 2.0
    late = got["slow"][2]  # it found every part sent, and the others' notice: it fails too
    assert late["is_timeout"] and late["ranks"] == [2] and "gave up on it" in late["message"]
    for r in got["slow"].values():
        assert r["vote"]["error"] == "DistributedError" and r["vote"]["ranks"] == [0, 1, 2]


_STOPPED_SERVICE = r"""
import os, signal, sys, time
import jax
rank, address = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(address, num_processes=2, process_id=rank,
                           heartbeat_timeout_seconds=600)
from ckptvar import distributed as dist
from ckptvar.errors import DistributedTimeoutError
coord = dist.from_env(timeout=1.0)
from ckptvar.distributed._jax import jax_client
try:
    coord.barrier(tag="start", timeout=60)
    if rank == 0:  # hosts the coordination service: stopped once process 1 is past the
        # barrier (stopped earlier, the service may not have answered its last read)
        jax_client().blocking_key_value_get("past the start", 60_000)
        time.sleep(0.2)  # the service answers process 1's write too
        os.kill(os.getpid(), signal.SIGSTOP)
    jax_client().key_value_set("past the start", "1")
    time.sleep(0.5)
    for call in ("allgather", "barrier"):
        start = time.monotonic()
        try:
            getattr(coord, call)(*(() if call == "barrier" else (1,)), tag="step 3",
                                 timeout=1.0)
        except DistributedTimeoutError as exc:
            print(f"{call} {time.monotonic() - start:.2f} {exc}", flush=True)
        except BaseException as exc:
            print(f"{call} raised {exc!r}", flush=True)
finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # jax's own shutdown would wait for the stopped service
"""


@pytest.mark.slow
def test_a_stopped_coordination_service_host_times_out_each_collective() -> None:
    """Process 0 (it hosts jax's coordination service) is stopped (SIGSTOP): a collective
    of process 1 raises DistributedTimeoutError at its timeout instead of hanging in a
    key-value call that never returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env["JAX_PLATFORMS"] = "cpu"
    argv = [sys.executable, "-c", _STOPPED_SERVICE]
    host = subprocess.Popen([*argv, "0", address], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc = subprocess.run([*argv, "1", address], capture_output=True, text=True,
                              timeout=120, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a collective hung on a stopped service:\n{exc.stdout!r}")
    finally:
        host.kill()
        host.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["allgather", "barrier"], proc.stdout
    for line in lines:
        call, seconds, message = line.split(" ", 2)
        assert float(seconds) < 5, line
        assert f"{call}(tag='step 3')" in message, line
        assert "the jax coordination service did not answer" in message, line
