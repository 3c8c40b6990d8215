"""Multi-process ``.zarr`` saves whose regular grids become global Zarr arrays.

Usage (under ``mpiexec -n N python -m mpi4py``): ``zarr_global_cases.py save DIR`` or
``zarr_global_cases.py restore DIR N...``; each rank appends one JSON line per case
to ``$RESULT_DIR/rank<r>.jsonl`` (``{"case", "rank", "ok", ...}``).

- ``save DIR``: N ranks save the model below to ``DIR/n<N>/ckpt-1.zarr``, then each
  rank reads every variable back with plain zarr-python (no ckptvar) and compares.
- ``restore DIR N...``: M ranks restore each ``DIR/n<N>`` checkpoint into their own boxes.

The model (:data:`SHAPES`/:func:`box`; all but ``small`` at least 64 KiB):
``rows`` split by rows into chunks of ``ceil(37 / N)`` rows (uneven last edge); ``blocks`` a 2-D grid of 2 x N/2 blocks (1 x N for odd N)
with truncated edges; ``gap`` split into N-1 equal row blocks, the last rank holding a
zero-size box; ``irregular`` an uneven row split that is no grid; ``nested/deep/v`` a
column split under nested groups; ``rep`` a replicated value; ``small`` a row split
too small to be its own array.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

import numpy as np

import ckptvar as cv

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"

SHAPES = {
    "rows": ((37, 512), "float32"),
    "blocks": ((91, 203), "int32"),
    "gap": ((6, 2048), "float64"),
    "irregular": ((37, 256), "int64"),
    "nested/deep/v": ((40, 2001), "uint8"),
    "small": ((4, 6), "float32"),
}


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def full(key: str) -> np.ndarray:
    if key == "rep":
        return np.arange(10_000, dtype="float64") / 4
    shape, dtype = SHAPES[key]
    return (np.arange(math.prod(shape)) * 7 + 3).astype(dtype).reshape(shape)


def box(key: str, rank: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box ``rank`` of ``size`` holds of ``key``: ``(offset, shape)``."""
    (n0, n1), _ = SHAPES[key]
    if key in ("rows", "small"):
        c = -(-n0 // size)
        lo, hi = min(rank * c, n0), min((rank + 1) * c, n0)
        return (lo, 0), (hi - lo, n1)
    if key == "blocks":
        gr = 2 if size % 2 == 0 else 1
        gc = size // gr
        c0, c1 = -(-n0 // gr), -(-n1 // gc)
        i, j = divmod(rank, gc)
        o0, o1 = i * c0, j * c1
        return (o0, o1), (min(c0, n0 - o0), min(c1, n1 - o1))
    if key == "gap":
        parts = max(size - 1, 1)
        c = n0 // parts
        if rank >= parts:
            return (n0, 0), (0, n1)
        return (rank * c, 0), (c if rank < parts - 1 else n0 - rank * c, n1)
    if key == "irregular":
        edges = np.linspace(0, n0, size + 1).astype(int)
        if size > 1:
            edges[1] -= 1  # never a regular grid
        return (int(edges[rank]), 0), (int(edges[rank + 1] - edges[rank]), n1)
    c = -(-n1 // size)  # nested/deep/v: columns
    lo, hi = min(rank * c, n1), min((rank + 1) * c, n1)
    return (0, lo), (n0, hi - lo)


def model(fill: bool) -> tuple[cv.Checkpoint, dict[str, cv.Variable]]:
    vs: dict[str, cv.Variable] = {}
    for key, (shape, dtype) in SHAPES.items():
        offset, extent = box(key, RANK, SIZE)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        value = full(key)[sl] if fill else np.zeros(extent, dtype)
        vs[key] = cv.Variable(value, name=key.replace("/", "_"),
                              shard=cv.Shard(full_shape=shape, offset=offset))
    vs["rep"] = cv.Variable(full("rep") if fill else np.zeros(10_000), name="rep")
    nested = cv.Checkpoint(deep=cv.Checkpoint(v=vs["nested/deep/v"]))
    flat = {k: v for k, v in vs.items() if "/" not in k}
    return cv.Checkpoint(nested=nested, **flat), vs


def bad_values(vs: dict[str, cv.Variable]) -> list[str]:
    bad = []
    for key in SHAPES:
        offset, extent = box(key, RANK, SIZE)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        if not np.array_equal(vs[key].numpy(), full(key)[sl]):
            bad.append(key)
    if not np.array_equal(vs["rep"].numpy(), full("rep")):
        bad.append("rep")
    return bad


def save(d: Path) -> None:
    import zarr  # plain zarr-python: what a user without ckptvar has

    ckpt, _ = model(True)
    path = ckpt.save(d / f"n{SIZE}" / "ckpt.zarr", coordinator=coord, timeout=30)
    group = zarr.open_group(path, mode="r")
    plain = {}
    for key in [*SHAPES, "rep"]:
        try:
            plain[key] = bool(np.array_equal(group[key][...], full(key)))
        except KeyError:
            plain[key] = None  # not a global array
    report("save", ok=True, path=path, plain=plain)


def restore(d: Path, sources: list[str]) -> None:
    for n in sources:
        ckpt, vs = model(False)
        try:
            ckpt.restore(d / f"n{n}" / "ckpt-1.zarr", coordinator=coord, timeout=30)
            report(f"restore{n}", ok=not bad_values(vs), bad=bad_values(vs))
        except Exception as exc:  # noqa: BLE001 - reported
            report(f"restore{n}", ok=False, error=repr(exc))


def main() -> None:
    action, d = sys.argv[1], Path(sys.argv[2])
    try:
        if action == "save":
            save(d)
        elif action == "restore":
            restore(d, sys.argv[3:])
    except Exception:
        report("crash", ok=False, error=traceback.format_exc())
        raise


main()
