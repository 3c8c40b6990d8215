"""One checkpoint saved by N torch.distributed (gloo) processes and restored by M.

Run through torch_launch.py with ``CASES_MODULE=torch_save_cases``: ``torch_launch.py
N save DIR`` or ``torch_launch.py M restore DIR``. Every rank joins a gloo group at
``tcp://127.0.0.1:$MASTER_PORT`` (30 s timeout), takes ``cv.distributed.from_env()``
(a ``TorchCoordinator``) and writes one JSON line per case to
``$RESULT_DIR/rank<r>.jsonl``.

- ``save``: uneven row shards of ``w`` (float32), column shards of ``e`` (int64) and
  a replicated ``b``, to ``DIR/ckpt-1.h5`` and ``DIR/ckpt-1.zarr``;
- ``restore``: each rank restores its own (different) boxes from both, compares
  them bit for bit with the expected values.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

SHAPES = {"w": ((37, 5), "float32", 0), "e": ((6, 10), "int64", 1)}
B = np.arange(4, dtype="float32") / 3


def full(key: str) -> np.ndarray:
    shape, dtype, _ = SHAPES[key]
    return (np.arange(int(np.prod(shape))) * 7 / 3).astype(dtype).reshape(shape)


def box(key: str, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    shape, _, axis = SHAPES[key]
    lo, hi = rank * shape[axis] // size, (rank + 1) * shape[axis] // size
    if axis == 0:
        return (lo, 0), (hi - lo, shape[1])
    return (0, lo), (shape[0], hi - lo)


def model(rank: int, size: int, fill: bool) -> tuple[cv.Checkpoint, dict[str, cv.Variable]]:
    vs = {}
    for key, (shape, dtype, _) in SHAPES.items():
        offset, extent = box(key, rank, size)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        value = full(key)[sl] if fill else np.zeros(extent, dtype)
        vs[key] = cv.Variable(value, name=key, shard=cv.Shard(full_shape=shape, offset=offset))
    vs["b"] = cv.Variable(B if fill else np.zeros(4, "float32"), name="b")
    return cv.Checkpoint(**vs), vs


def exact(vs: dict[str, cv.Variable], rank: int, size: int) -> bool:
    for key in SHAPES:
        offset, extent = box(key, rank, size)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        want = full(key)[sl]
        got = vs[key].numpy()
        if got.dtype != want.dtype or got.tobytes() != want.tobytes():
            return False
    return vs["b"].numpy().tobytes() == B.tobytes()


def main(cases: list[str]) -> None:
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=30),
    )
    coord = cv.distributed.from_env(timeout=30)
    out = Path(os.environ["RESULT_DIR"]) / f"rank{rank}.jsonl"

    def report(case: str, **fields: Any) -> None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "rank": rank, **fields}) + "\n")

    action, d = cases[0], Path(cases[1])
    try:
        for suffix in (".h5", ".zarr"):
            if action == "save":
                ckpt, _ = model(rank, size, True)
                path = ckpt.save(d / f"ckpt{suffix}", coordinator=coord, timeout=30)
                report(f"save{suffix}", ok=True, path=path, engine=type(coord).__name__)
            else:
                ckpt, vs = model(rank, size, False)
                ckpt.restore(d / f"ckpt-1{suffix}", coordinator=coord, timeout=30)
                report(f"restore{suffix}", ok=exact(vs, rank, size),
                       counter=int(ckpt.save_counter.numpy()), engine=type(coord).__name__)
    finally:
        dist.destroy_process_group()
