"""``python jax_launch.py N CASE [CASE...]``: N real processes running coordinator cases
on jax.distributed (a coordination service on 127.0.0.1).

Each rank is a fresh ``python coordinator_cases.py`` process (jax must not be
initialised before a fork). The launcher waits at most ``LAUNCH_TIMEOUT`` seconds,
kills what is left and exits with the worst status.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CASES = Path(__file__).parent / "coordinator_cases.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    n, cases = int(sys.argv[1]), sys.argv[2:]
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            ENGINE="jax",
            JAX_COORDINATOR=address,
            RANK=str(rank),
            WORLD_SIZE=str(n),
            JAX_PLATFORMS="cpu",
        )
        procs.append(subprocess.Popen([sys.executable, str(CASES), *cases], env=env))
    deadline = time.monotonic() + float(os.environ.get("LAUNCH_TIMEOUT", "90"))
    codes = []
    for rank, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(124)
            print(f"LAUNCH rank {rank} did not finish in time", flush=True)
    print("LAUNCH exit codes " + " ".join(str(c) for c in codes), flush=True)
    return max((128 - c if c < 0 else c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
