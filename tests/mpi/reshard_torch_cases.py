"""DTensors of odd placements and dtypes saved by N torch.distributed (gloo) processes,
loaded by M.

Run through torch_launch.py with ``CASES_MODULE=reshard_torch_cases``:
``torch_launch.py N ACTION DIR``; ``exit``: see :func:`leave_at_once`; ``save`` writes ``DIR/dt.h5`` and ``DIR/dt.zarr`` with
``cv.save(..., coordinator=)``, ``restore`` loads both into zeroed DTensors of this
job's placements (``cv.load(like=)``) and reports the keys whose values differ.
Placements depend on the process count: on 4, 2 x 2 meshes (``Shard(0), Shard(1)``,
``Shard(1), Shard(0)``, ``Shard(0), Shard(0)``, ``Replicate(), Shard(1)``); on others,
one axis (uneven, more processes than rows).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import ckptvar as cv

#: key: (shape, torch dtype name)
VALUES = {
    "rows": ((7, 3), "float32"),
    "few": ((2, 5), "bfloat16"),
    "f8a": ((9, 6), "float8_e4m3fn"),
    "f8b": ((6, 9), "float8_e5m2"),
    "cplx": ((5, 4), "complex64"),
    "flag": ((5, 6), "bool"),
    "i8": ((3, 11), "int8"),
    "scalar": ((), "float32"),
    "big8": ((300, 260), "float8_e4m3fn"),
    "big": ((300, 70), "float32"),
}


def full(key: str) -> Any:
    import torch

    shape, name = VALUES[key]
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64) % 29 * 0.5 - 3
    dtype = getattr(torch, name)
    if name == "bool":
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if name == "complex64":
        return torch.complex(base, -base).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def placements(key: str, size: int) -> tuple[Any, list[Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    shape = VALUES[key][0]
    if not shape:
        return init_device_mesh("cpu", (size,)), [Replicate()]
    if size == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        choice = {"rows": [Shard(0), Shard(1)], "few": [Shard(1), Shard(0)],
                  "f8a": [Shard(0), Shard(0)], "f8b": [Replicate(), Shard(1)],
                  "cplx": [Shard(1), Shard(0)], "flag": [Shard(0), Shard(1)],
                  "i8": [Shard(1), Shard(1)], "big8": [Shard(1), Shard(0)],
                  "big": [Shard(0), Shard(1)]}
        return mesh, choice[key]
    mesh = init_device_mesh("cpu", (size,))
    return mesh, [Shard(1) if key in ("f8b", "i8", "big8") else Shard(0)]


def trees(size: int, fill: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for key in VALUES:
        value = full(key) if fill else torch.zeros_like(full(key))
        mesh, place = placements(key, size)
        out[key] = distribute_tensor(value, mesh, place, src_data_rank=None)  # no scatter:
        # gloo has no float8
    return out


def _same(a: Any, b: Any) -> bool:
    """Bit for bit (float8 has no ``torch.equal``)."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def leave_at_once(d: Path, coord: Any, rank: int, report: Any) -> None:
    """Rank 0, which hosts the store, leaves (``os._exit``, as a forked worker does) as
    soon as its save returns; the other ranks are slower to read the last vote's parts
    (each fetch waits 0.5 s first, as on a busy host). Each reports what its save did."""
    import numpy as np

    if rank != 0:
        fetch = coord._fetch

        def slow_fetch(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return fetch(*args, **kwargs)

        coord._fetch = slow_fetch
    w = cv.Variable(np.full((2, 3), rank, "float32"), name="w",
                    shard=cv.Shard((2 * coord.size, 3), (2 * rank, 0)))
    try:
        cv.Checkpoint(w=w).save(d / "ckpt", coordinator=coord, timeout=30)
        report("exit", ok=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report("exit", ok=False, error=f"{type(exc).__name__}: {exc}")


def main(cases: list[str]) -> None:
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=60),
    )
    coord = cv.distributed.from_env(timeout=60)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"

    def report(case: str, **fields: Any) -> None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "rank": rank, **fields}) + "\n")

    action, d = cases[0], Path(cases[1])
    if action == "exit":
        leave_at_once(d, coord, rank, report)
        return
    for suffix in (".h5", ".zarr"):
        try:
            if action == "save":
                cv.save(d / f"dt{suffix}", trees(size, True), coordinator=coord, timeout=60)
                report(f"save{suffix}", ok=True)
            else:
                like = trees(size, False)
                got = cv.load(d / f"dt{suffix}", like=like, coordinator=coord, timeout=60)
                want = trees(size, True)
                bad = [k for k in VALUES if got[k] is not like[k] or not _same(
                    like[k].to_local(), want[k].to_local())]
                report(f"restore{suffix}", ok=not bad, bad=bad)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report(f"{action}{suffix}", ok=False, error=f"{type(exc).__name__}: {exc}",
                   tb=traceback.format_exc()[-1500:])
    dist.destroy_process_group()
