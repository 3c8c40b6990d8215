"""A process killed (``SIGKILL``) in an incremental save or in its pruning, on real
torch.distributed (gloo) processes.

Run through torch_launch.py with ``CASES_MODULE=incremental_kill_cases``:
``torch_launch.py 3 WHEN WHERE FORMAT``; ``WHERE`` a directory or an ``s3://`` URL
(``$S3_OPTIONS``). The model and the values of each step are
tests/mpi/incremental_resize_cases.py's. An incremental manager (``max_to_keep=2``,
``whole_every=3``) saves steps 1-3; then, in the save of step 4 (``prune``: 5):

- ``write``: process 1 is killed once its file of step 4 is written (on an object store:
  uploaded), before the vote;
- ``prune``: process 0 is killed while it prunes after committing step 5 (on an object
  store: the oldest step's commit marker deleted, its objects not yet).

Each surviving process reports what it raised (type, message, seconds since the kill)
and, on rank 0 when it survives, which steps are committed.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from incremental_resize_cases import apply, committed, model

import ckptvar as cv


def killed_in(when: str) -> int:
    """The step whose save a process is killed in: 4, or 5 for ``prune`` (steps 1 and 4
    are whole, ``whole_every=3``: step 5 is the first whose prune deletes a step; until
    then every older step is held, its row patches read by the kept ones)."""
    return 5 if when == "prune" else 4


def _kill_after(target: Any, name: str, stamp: Path) -> None:
    """Make ``target.name`` run, then kill this process (``SIGKILL``)."""
    real = getattr(target, name)

    def then_die(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        stamp.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(target, name, then_die)


def _kill_before(target: Any, name: str, stamp: Path) -> None:
    """Make ``target.name`` kill this process (``SIGKILL``) as it is called."""

    def die(*args: Any, **kw: Any) -> Any:
        stamp.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(target, name, die)


def _kill_in_prune(stamp: Path) -> None:
    """Make this process's next prune delete the step's commit marker, then die."""
    from ckptvar.checkpoint import _manager
    from ckptvar.locations import marker_key

    def prune(location: Any, step: str) -> None:
        location.delete(marker_key(step))
        stamp.write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    _manager.prune = prune  # type: ignore[attr-defined]


def _arm(when: str, rank: int, local: bool, stamp: Path) -> None:
    """Make this process die where ``when`` says, if it is the one to."""
    from ckptvar.checkpoint import _collective_targets as targets
    from ckptvar.storage import _sharded_remote

    if when == "write0" and rank == 0:  # the process that hosts the c10d store
        _kill_before(targets, "_write_file", stamp)
    elif when == "write" and rank == 1 and local:
        _kill_after(targets, "_write_file", stamp)
    elif when == "write" and rank == 1:
        _kill_after(_sharded_remote.RemoteStep, "upload", stamp)
    elif when == "prune" and rank == 0:
        _kill_in_prune(stamp)


def main(cases: list[str]) -> None:
    import torch.distributed as dist

    when, where, fmt = cases
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=60),
    )
    coord = cv.distributed.from_env(timeout=20)
    opts = json.loads(os.environ["S3_OPTIONS"]) if where.startswith("s3://") else None
    result = Path(os.environ["RESULT_DIR"])
    stamp = result / "killed-at"
    ckpt, made = model(rank, size)
    mgr = cv.CheckpointManager(ckpt, where, max_to_keep=2, format=fmt, coordinator=coord,
                               incremental=cv.IncrementalOptions(whole_every=3),
                               storage_options=opts)
    last = killed_in(when)
    for step in range(1, last):
        apply(made, step, rank, size)
        mgr.save(checkpoint_number=step)
    coord.barrier(tag="saved", timeout=20)
    _arm(when, rank, opts is None, stamp)
    apply(made, last, rank, size)
    fields: dict[str, Any] = {"rank": rank, "case": when}
    try:
        fields["saved"] = mgr.save(checkpoint_number=last)
    except Exception as exc:  # noqa: BLE001 - reported
        fields["error"] = type(exc).__name__
        fields["message"] = str(exc)
        fields["notes"] = "\n".join(getattr(exc, "__notes__", []))
        if not isinstance(exc, cv.CkptError):
            fields["trace"] = traceback.format_exc()
        if stamp.exists():
            fields["seconds"] = time.time() - float(stamp.read_text())
    if rank == 0:
        fields["committed"] = committed(where, opts)
    with open(result / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(fields) + "\n")
    end = time.monotonic() + 30  # rank 0 hosts the store: it stays until the others said
    while len(list(result.glob("rank*.jsonl"))) < size - 1 and time.monotonic() < end:
        time.sleep(0.05)
    os._exit(0)  # the group lost a process: no orderly teardown
