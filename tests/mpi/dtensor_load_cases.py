"""``cv.load(path, like=tree)`` into DTensors on N torch.distributed (gloo) processes.

Run through torch_launch.py with ``CASES_MODULE=dtensor_load_cases``:
``torch_launch.py N DIR DEVICE`` (``DEVICE``: ``cpu`` or ``cuda``). ``DIR/plain.h5`` and
``DIR/plain.zarr`` are one-process checkpoints of the values :func:`full` makes (the
test writes them). Every rank:

1. builds zeroed DTensors on ``DEVICE`` (``Shard(0)``, ``Shard(1)``, uneven rows,
   ``Replicate``, bfloat16, 0-d) and loads each plain file into them with
   ``cv.load(like=tree, coordinator=)``: the result is the same DTensors, filled in
   place (the local tensor's memory unchanged), each local shard the box of the stored
   value its placement says;
2. saves DTensors of those values collectively (``DIR/dt.h5``: each writes its boxes)
   and loads them into DTensors of other placements (rows <-> columns) in place.

On CUDA the local shards are filled through the pinned staging buffer (set small by the
test, so many slabs); tracemalloc's peak of a load (NumPy's allocations) is reported.
Results: one JSON line per case in ``$RESULT_DIR/rank<r>.jsonl``.
"""

from __future__ import annotations

import datetime
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

#: key -> (shape, dtype name); the values are full(shape, i) in sorted-key order
SPECS: dict[str, tuple[tuple[int, ...], str]] = {
    "big": ((2048, 512), "float32"),  # 4 MiB: many slabs of a 64 KiB staging buffer
    "bf16": ((8, 6), "bfloat16"),
    "cols": ((5, 12), "float32"),
    "rep": ((3, 4), "int64"),
    "rows": ((10, 4), "float64"),
    "scalar": ((), "float32"),
    "uneven": ((7, 3), "float32"),
}


def full(shape: tuple[int, ...], seed: int, dtype: str) -> np.ndarray:
    """The stored value of a key (NumPy; bfloat16 through ml_dtypes)."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64).reshape(shape) * 0.5 + seed).astype(dt)


def values() -> dict[str, np.ndarray]:
    return {k: full(shape, i, dt) for i, (k, (shape, dt)) in enumerate(sorted(SPECS.items()))}


def _placements(flip: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    rows, cols = [Shard(0)], [Shard(1)]
    return {"big": cols if flip else rows, "bf16": rows, "cols": rows if flip else cols,
            "rep": [Replicate()], "rows": cols if flip else rows, "scalar": [Replicate()],
            "uneven": rows}


def dtensors(mesh: Any, device: str, flip: bool, fill: bool) -> dict[str, Any]:
    """DTensors of :data:`SPECS` made from their local shards (no collective), zeroed or
    holding :func:`values`' boxes."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    vals = values()
    for key, placements in _placements(flip).items():
        shape = SPECS[key][0]
        local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        box = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        host = vals[key][box] if fill else np.zeros(tuple(local), vals[key].dtype)
        t = _to_torch(np.array(host, order="C")).to(device)  # 0-d stays 0-d
        out[key] = DTensor.from_local(t, mesh, placements, run_check=False,
                                      shape=torch.Size(shape), stride=_strides(shape))
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def check(got: dict[str, Any], like: dict[str, Any], ptrs: dict[str, int]) -> dict[str, bool]:
    """Per key: the result is the like DTensor itself, filled in place with its box."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    vals = values()
    ok = {}
    for key, t in like.items():
        local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
        box = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        want = vals[key][box]
        have = _to_numpy(t.to_local())
        ok[key] = bool(got[key] is t and t.to_local().data_ptr() == ptrs[key]
                       and have.dtype == want.dtype and np.array_equal(have, want))
    return ok


def main(cases: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    d, device = Path(cases[0]), cases[1]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["INIT_METHOD"], rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=30))
    coord = cv.distributed.from_env(timeout=30)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"

    def report(case: str, **fields: Any) -> None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "rank": rank, **fields}) + "\n")

    if device == "cuda":
        import torch

        torch.cuda.set_device(0)  # every rank on the first GPU
    mesh = DeviceMesh(device, list(range(size)))
    try:
        for name in ("plain.h5", "plain.zarr"):
            like = dtensors(mesh, device, flip=False, fill=False)
            ptrs = {k: v.to_local().data_ptr() for k, v in like.items()}
            tracemalloc.start()
            try:
                got = cv.load(d / name, like=like, coordinator=coord, timeout=30)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            report(name, ok=check(got, like, ptrs), peak=peak)
        cv.save(d / "dt.h5", dtensors(mesh, device, flip=False, fill=True), coordinator=coord,
                timeout=30)
        like = dtensors(mesh, device, flip=True, fill=False)
        ptrs = {k: v.to_local().data_ptr() for k, v in like.items()}
        got = cv.load(d / "dt.h5", like=like, coordinator=coord, timeout=30)
        report("resharded", ok=check(got, like, ptrs))
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another still reads
    finally:
        dist.destroy_process_group()
