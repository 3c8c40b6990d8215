"""A rank that stops inside one vote of a multi-process save, run on every rank:
``mpiexec -n N python -m mpi4py stall_cases.py STAGE WHERE`` (``STAGE``: ``prepare``,
``write`` or ``commit``; ``WHERE``: a shared directory, or an s3:// URL with
``$S3_OPTIONS``), or on torch.distributed (gloo): ``CASES_MODULE=stall_cases
torch_launch.py N STAGE WHERE``.

Every rank saves step 1, then step 2 with the coordinator's timeout ``$STALL_TIMEOUT``;
in step 2, rank 1's (``$STALL_RANK``'s) ``vote`` (``$STALL_CALL``, e.g. ``broadcast``) of
``STAGE`` stops: it writes ``$RESULT_DIR/stalled`` and sleeps until the others have
reported (each its ``$RESULT_DIR/released-<rank>``), then ends without a word to its peers
(``os._exit``), as a stopped process would. The other ranks report what their save
raised and what the location holds afterwards (``coordinator_cases.report``). With
``$STALL_RESUME`` set, the stopped rank instead goes on once the others reported (as a
process stopped and continued would; ``$STALL_AFTER`` seconds later), and every rank
then saves again (case ``STAGE-retry``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from coordinator_cases import CURRENT, error_fields, report

import ckptvar as cv
from ckptvar.distributed import from_env

ROWS = 4


def _join_torch() -> None:
    """Join the gloo group of a rank forked by torch_launch.py."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["INIT_METHOD"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main(args: list[str]) -> None:
    stage, where = args[:2]
    if os.environ.get("ENGINE") == "torch":
        _join_torch()
    coord = from_env(timeout=float(os.environ.get("STALL_TIMEOUT", "3")))
    CURRENT["case"] = stage
    results = Path(os.environ["RESULT_DIR"])
    opts = json.loads(os.environ["S3_OPTIONS"]) if "://" in where else None
    rank, size = coord.rank, coord.size
    late = int(os.environ.get("STALL_RANK", "1"))
    w = cv.Variable(np.full((ROWS, 8), 1.0), name="w",
                    shard=cv.Shard(full_shape=(ROWS * size, 8), offset=(rank * ROWS, 0)))
    mgr = cv.CheckpointManager(cv.Checkpoint(w=w), where, max_to_keep=3, coordinator=coord,
                               storage_options=opts)
    first = mgr.save()
    w.assign(np.full((ROWS, 8), 2.0))
    if rank == late:
        call = os.environ.get("STALL_CALL", "vote")
        real = getattr(coord, call)

        def stalled(*args: Any, tag: str, timeout: float | None = None) -> Any:
            if tag.endswith(f":{stage}"):
                (results / "stalled").write_text(tag, encoding="utf-8")
                deadline = time.monotonic() + 120
                others = [results / f"released-{r}" for r in range(size) if r != late]
                while not all(p.exists() for p in others) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not os.environ.get("STALL_RESUME"):
                    report(coord, stalled=tag)
                    os._exit(0)
                time.sleep(float(os.environ.get("STALL_AFTER", "0")))
                setattr(coord, call, real)
            return real(*args, tag=tag, timeout=timeout)

        setattr(coord, call, stalled)
    t0 = time.monotonic()
    try:
        second: str | None = mgr.save()
        out: dict[str, object] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported
        second, out = None, error_fields(exc)
        out["notes"] = "\n".join(getattr(exc, "__notes__", []))
    out["seconds"] = time.monotonic() - t0
    latest = cv.latest_checkpoint(where, storage_options=opts)
    loaded = None
    if latest is not None:
        try:
            loaded = float(cv.load(latest, storage_options=opts)["w"].mean())
        except Exception as exc:  # noqa: BLE001 - reported
            loaded = f"{type(exc).__name__}: {exc}"
    if os.environ.get("STALL_RESUME") and rank == late:
        out["stalled"] = (results / "stalled").read_text(encoding="utf-8")
    report(coord, first=first, second=second, latest=latest, loaded=loaded,
           manager_latest=mgr.latest_checkpoint, **out)
    if rank != late:
        (results / f"released-{rank}").touch()
    if os.environ.get("STALL_RESUME"):  # every rank goes on: the next save commits
        CURRENT["case"] = f"{stage}-retry"
        try:
            again: str | None = mgr.save()
            fields: dict[str, object] = {"error": None}
        except Exception as exc:  # noqa: BLE001 - reported
            again, fields = None, error_fields(exc)
        report(coord, again=again, latest=cv.latest_checkpoint(where, storage_options=opts),
               manager_latest=mgr.latest_checkpoint, **fields)


if __name__ == "__main__":
    main(sys.argv[1:3])
