"""A small training job for the fail-fast tests: ``ENGINE=mpi|torch|jax python
failfast_cases.py CASE DIR`` (under a plain ``mpiexec``, or started N times with
``RANK``/``WORLD_SIZE``).

Every rank uses the default collective timeout (300 s), so a run that ends in
seconds shows that the failure travelled. Each rank that catches an error writes
one JSON line to ``DIR/rank<N>.jsonl`` (the error's type, message, ranks, and the
seconds from the failure to it), then lets it go uncaught, as a training script does.

- ``raise``: a collective save of step 1; then rank 1 raises in its own code, and the
  others call ``mgr.save()`` for step 2.
- ``exit``: the same, but rank 1 calls ``sys.exit(3)``.
- ``kill``: the same, but rank 1 is killed (``SIGKILL``).
- ``mismatch``: a collective restore where ranks 1 and 2 hold a target whose shape
  differs from the stored one; nothing is caught by the ranks.
- ``mismatch_manager``: the same through ``restore_or_initialize`` (which must not
  skip to an older step or initialise on any rank).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import ckptvar as cv
from ckptvar.distributed import Coordinator, from_env


def report(coord: Coordinator, out: Path, exc: BaseException, t0: float) -> None:
    line = {
        "rank": coord.rank,
        "error": type(exc).__name__,
        "message": str(exc),
        "ranks": list(getattr(exc, "ranks", ())),
        "seconds": time.time() - t0,
    }
    with open(out / f"rank{coord.rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def start_engine() -> None:
    engine = os.environ.get("ENGINE", "mpi")
    if engine == "torch":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=os.environ["INIT_METHOD"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    elif engine == "jax":
        import jax

        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR"],
            num_processes=int(os.environ["WORLD_SIZE"]),
            process_id=int(os.environ["RANK"]),
            # how long jax's own shutdown waits for a dead task (its default: 100 s)
            heartbeat_timeout_seconds=int(os.environ.get("JAX_HEARTBEAT", "100")),
        )
    else:
        from mpi4py import MPI  # noqa: F401 - initialises MPI under a plain mpiexec


def user_hook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
    """The job's own excepthook, set before ckptvar's: it must still run."""
    print(f"USER HOOK {kind.__name__}", flush=True)
    sys.__excepthook__(kind, exc, tb)  # type: ignore[arg-type]


def main(case: str, out: Path) -> None:
    sys.excepthook = user_hook
    start_engine()
    coord = from_env()  # the default timeout: 300 s
    ckpt = cv.Checkpoint(w=cv.Variable(np.arange(12.0).reshape(3, 4), name="w"))
    mgr = cv.CheckpointManager(ckpt, out / "run", coordinator=coord)
    mgr.save()
    if case.startswith("mismatch"):
        mgr.save()  # two steps: a skip to the older one would be wrong too
        shape = (4, 4) if coord.rank in (1, 2) else (3, 4)
        target = cv.Checkpoint(w=cv.Variable(np.zeros(shape), name="w"))
        t0 = time.time()
        try:
            if case == "mismatch":
                target.restore(mgr.latest_checkpoint, coordinator=coord)
            else:
                cv.CheckpointManager(target, out / "run", coordinator=coord,
                                     init_fn=lambda: print("INITIALISED", flush=True)
                                     ).restore_or_initialize()
        except Exception as exc:
            report(coord, out, exc, t0)
            raise
        return
    stamp = out / "failed-at"
    if coord.rank == 1:
        stamp.write_text(str(time.time()))
        if case == "exit":
            sys.exit(3)
        if case == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("loss is NaN at step 2")
    try:
        mgr.save()
    except Exception as exc:
        report(coord, out, exc, float(stamp.read_text()))
        raise


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
