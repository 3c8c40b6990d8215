"""``python torch_launch.py N CASE [CASE...]``: N real processes running coordinator
cases on torch.distributed (gloo, ``init_method=file://``).

``$CASES_MODULE`` names another module of this folder whose ``main(cases)`` runs on
every rank instead (default ``coordinator_cases``).

torch is imported once, here, and the ranks are forked from this process (so N
ranks cost one torch import). Each rank exits 0 when its cases ran; the launcher
waits at most ``LAUNCH_TIMEOUT`` seconds, kills what is left and exits with the
worst status (a rank killed by signal S counts as 128 + S).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.distributed  # noqa: F401 - imported once, before the fork

sys.path.insert(0, str(Path(__file__).parent))
cases_module = importlib.import_module(os.environ.get("CASES_MODULE", "coordinator_cases"))


def main() -> int:
    n, cases = int(sys.argv[1]), sys.argv[2:]
    with tempfile.TemporaryDirectory(prefix="ckptvar-torch-") as where:
        return _launch(n, cases, Path(where) / "init")


def _launch(n: int, cases: list[str], init: Path) -> int:
    """Fork ``n`` ranks meeting at ``init``; their worst exit code (124: one timed out)."""
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                ENGINE="torch", INIT_METHOD=init.as_uri(), RANK=str(rank), WORLD_SIZE=str(n)
            )
            code = 0
            try:
                cases_module.main(cases)
            except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + float(os.environ.get("LAUNCH_TIMEOUT", "60"))
    status: dict[int, int] = {}
    while len(status) < n and time.monotonic() < deadline:
        for pid in pids:
            if pid in status:
                continue
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(raw)
        time.sleep(0.05)
    for pid in pids:
        if pid not in status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status[pid] = 124
            print(f"LAUNCH rank {pids.index(pid)} did not finish in time", flush=True)
    codes = [status[p] for p in pids]
    print("LAUNCH exit codes " + " ".join(str(c) for c in codes), flush=True)
    return max((128 - c if c < 0 else c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
