"""Odd layouts and dtypes saved by N processes and restored by M, under ``mpiexec``.

Usage: ``reshard_cases.py ACTION DIR LAYOUT``; each rank appends one JSON line per
case to ``$RESULT_DIR/rank<r>.jsonl`` (``{"case", "rank", "ok", ...}``).

- ``save DIR LAYOUT``: N ranks save every value of :data:`VALUES`, each holding its
  box under ``LAYOUT``, to ``DIR/ckpt-1.h5`` and ``DIR/ckpt-1.zarr``.
- ``restore DIR LAYOUT``: M ranks restore both into their boxes under ``LAYOUT`` and
  report the keys whose values differ.
- ``psave DIR same|mixed`` and ``prestore DIR NAME``: a partitioned table (:func:`psave`,
  :func:`prestore`).
- ``bad DIR KIND``: a restore that cannot succeed (:func:`bad`).

Layouts: ``rows`` (rows split as evenly as possible), ``ceil`` (rows in chunks of
``ceil(rows / M)``: the last ranks may hold fewer or none), ``cols`` (the last axis
split), ``grid`` (a 2 x 2 mesh of the first two axes on 4 ranks).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

import ckptvar as cv

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"

F8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3",
      "float8_e3m4", "float8_e4m3b11fnuz", "float8_e8m0fnu"]

#: key: (full shape, dtype); "big*" values are over 64 KiB (global Zarr arrays where
#: their dtype allows), "huge*" ones over 1 MiB (a part of a box is read as its run)
VALUES: dict[str, tuple[tuple[int, ...], object]] = {
    "odd": ((7, 3), "float32"),
    "tiny": ((2, 4), "float64"),
    "empty": ((0, 5), "float32"),
    "cplx": ((5, 6), "complex64"),
    "cplx2": ((6, 5), "complex128"),
    "flag": ((7, 5), "bool"),
    "bf16": ((9, 4), ml_dtypes.bfloat16),
    "i4": ((8, 6), ml_dtypes.int4),
    "u4": ((5, 7), ml_dtypes.uint4),
    **{f"f8/{name}": ((9, 6), getattr(ml_dtypes, name)) for name in F8},
    "big": ((301, 70), "float32"),
    "bigf8": ((600, 256), ml_dtypes.float8_e4m3fn),
    "bigf8b": ((600, 256), ml_dtypes.float8_e5m2),
    "bigbf16": ((300, 128), ml_dtypes.bfloat16),
    "huge": ((1100, 256), "float32"),
    "hugeflag": ((1100, 1024), "bool"),
    "hugef8": ((1100, 1024), ml_dtypes.float8_e4m3fn),
    "hugec": ((300, 500), "complex64"),
}


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def full(key: str) -> np.ndarray:
    shape, dtype = VALUES[key]
    n = math.prod(shape)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dt.name in ("int4", "uint4"):
        base = np.arange(n) % 8
        return (base if dt.name == "uint4" else base - 4).astype(dt).reshape(shape)
    if dt.kind == "c":
        return (np.arange(n) + 1j * np.arange(n)[::-1]).astype(dt).reshape(shape)
    if dt.name == "float8_e8m0fnu":  # powers of two only
        return np.exp2((np.arange(n) % 16) - 8.0).astype(dt).reshape(shape)
    return ((np.arange(n) % 61) * 0.25 - 5).astype(dt).reshape(shape)


def _split(n: int, size: int, rank: int, ceil: bool) -> tuple[int, int]:
    if ceil:
        step = -(-n // size) if n else 0
        lo = min(n, rank * step)
        return lo, min(n, lo + step) - lo
    edges = np.linspace(0, n, size + 1).astype(int)
    return int(edges[rank]), int(edges[rank + 1] - edges[rank])


def box(key: str, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = VALUES[key][0]
    offset, extent = [0] * len(shape), list(shape)
    if layout in ("rows", "ceil"):
        offset[0], extent[0] = _split(shape[0], SIZE, RANK, layout == "ceil")
    elif layout == "cols":
        offset[-1], extent[-1] = _split(shape[-1], SIZE, RANK, False)
    elif layout == "grid":
        assert SIZE == 4
        offset[0], extent[0] = _split(shape[0], 2, RANK // 2, False)
        offset[1], extent[1] = _split(shape[1], 2, RANK % 2, False)
    else:
        raise ValueError(layout)
    return tuple(offset), tuple(extent)


def sl(offset: tuple[int, ...], extent: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))


def model(layout: str, fill: bool) -> tuple[cv.Checkpoint, dict[str, cv.Variable]]:
    vs: dict[str, cv.Variable] = {}
    for key, (shape, dtype) in VALUES.items():
        offset, extent = box(key, layout)
        value = full(key)[sl(offset, extent)] if fill else np.zeros(extent, dtype)
        if fill and key == "odd":  # a non-contiguous local value
            value = np.asfortranarray(value)
        vs[key] = cv.Variable(value, name=key, shard=cv.Shard(full_shape=shape, offset=offset))
    vs["scalar"] = cv.Variable(np.float32(2.5) if fill else np.float32(0), name="scalar")
    vs["rep"] = cv.Variable(np.arange(3.0) if fill else np.zeros(3), name="rep")
    tree: dict[str, object] = {}
    for key, v in vs.items():  # "f8/x" keys nest
        head, _, tail = key.partition("/")
        if tail:
            tree.setdefault(head, {})[tail] = v  # type: ignore[index]
        else:
            tree[key] = v
    return cv.Checkpoint(**tree), vs


def wrong(vs: dict[str, cv.Variable], layout: str) -> list[str]:
    bad = []
    for key in VALUES:
        want = full(key)[sl(*box(key, layout))]
        got = vs[key].numpy()
        if got.dtype != want.dtype or got.shape != want.shape or \
                got.tobytes() != want.tobytes():
            bad.append(key)
    if float(vs["scalar"].numpy()) != 2.5:
        bad.append("scalar")
    if vs["rep"].numpy().tolist() != [0.0, 1.0, 2.0]:
        bad.append("rep")
    return bad


def save(d: Path, layout: str) -> None:
    ckpt, _ = model(layout, True)
    for suffix in (".h5", ".zarr"):
        path = ckpt.write(d / f"ckpt-1{suffix}", coordinator=coord, timeout=60)
        report(f"save{suffix}", ok=True, path=str(path))


def restore(d: Path, layout: str) -> None:
    for suffix in (".h5", ".zarr"):
        ckpt, vs = model(layout, False)
        try:
            ckpt.restore(d / f"ckpt-1{suffix}", coordinator=coord, timeout=60).assert_consumed()
            bad = wrong(vs, layout)
            report(f"restore{suffix}", ok=not bad, bad=bad)
        except Exception as exc:  # noqa: BLE001 - reported
            report(f"restore{suffix}", ok=False, error=f"{type(exc).__name__}: {exc}")


def bad(d: Path, kind: str) -> None:
    """A restore of ``DIR/ckpt-1.*`` (saved with ``rows``) that cannot succeed:
    ``shape`` (every rank's ``odd`` claims 8 rows), ``shape1``/``dtype1``/``extra1``
    (rank 1 alone: 8 rows, a float32 ``bf16``, a variable the file lacks). Reports the
    error and whether any variable changed."""
    for suffix in (".h5", ".zarr"):
        ckpt, vs = model("rows", False)
        mine = kind == "shape" or RANK == 1
        if mine and kind.startswith("shape"):
            offset, extent = box("odd", "rows")
            vs["odd"] = cv.Variable(np.zeros(extent, "float32"), name="odd",
                                    shard=cv.Shard(full_shape=(8, 3), offset=offset))
            ckpt.odd = vs["odd"]
        elif mine and kind == "dtype1":
            offset, extent = box("bf16", "rows")
            vs["bf16"] = cv.Variable(np.zeros(extent, "float32"), name="bf16",
                                     shard=cv.Shard(full_shape=(9, 4), offset=offset))
            ckpt.bf16 = vs["bf16"]
        elif mine and kind == "extra1":
            ckpt.nothere = cv.Variable(np.zeros(3, "float32"), name="nothere")
        before = {k: v.numpy().tobytes() for k, v in vs.items()}
        try:
            ckpt.restore(d / f"ckpt-1{suffix}", coordinator=coord, timeout=60)
            report(f"bad{suffix}", error=None)
        except Exception as exc:  # noqa: BLE001 - reported
            changed = [k for k, v in vs.items() if v.numpy().tobytes() != before[k]]
            report(f"bad{suffix}", error=type(exc).__name__, message=str(exc),
                   ranks=list(getattr(exc, "ranks", ())), changed=changed)


PFULL = np.arange(11 * 6, dtype="float32").reshape(11, 6)


def partitioned(parts: int) -> cv.PartitionedVariable:
    """``emb/table`` (11 x 6), in ``parts`` partitions, zeros."""
    cv.reset_default_graph()
    with cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(parts)):
        return cv.get_variable("table", shape=(11, 6), initializer=cv.initializers.zeros)


def fill(table: cv.PartitionedVariable) -> None:
    for part in table:
        info = part.save_slice_info
        part.assign(PFULL[sl(info.var_offset, info.var_shape)])


def psave(d: Path, how: str) -> None:
    """Every rank holds the whole table in ``RANK + 2`` (``mixed``) or 3 partitions."""
    table = partitioned(RANK + 2 if how == "mixed" else 3)
    fill(table)
    for suffix in (".h5", ".zarr"):
        try:
            path = cv.Checkpoint(table=table).write(d / f"p{how}{suffix}", coordinator=coord,
                                                    timeout=60)
            ok = np.array_equal(cv.load(path)["table"], PFULL)
            report(f"psave{suffix}", ok=ok, path=str(path))
        except Exception as exc:  # noqa: BLE001 - reported
            report(f"psave{suffix}", ok=False, error=f"{type(exc).__name__}: {exc}")


def prestore(d: Path, name: str) -> None:
    """Restore ``DIR/<name>.h5``/``.zarr`` (key ``table`` or ``w``) into partitioned
    tables: by a Checkpoint into ``RANK + 1`` partitions (each rank its own count), and by
    restore_on_create into ``SIZE + 2`` (every rank creates the same parts)."""
    for suffix in (".h5", ".zarr"):
        path = d / f"{name}{suffix}"
        for how in ("ckpt", "create"):
            try:
                if how == "ckpt":
                    table = partitioned(RANK + 1)
                    cv.Checkpoint(table=table).restore(path, coordinator=coord, timeout=60)
                else:
                    cv.reset_default_graph()
                    with cv.restore_on_create(path, coordinator=coord, timeout=60), \
                            cv.variable_scope("emb", partitioner=cv.fixed_size_partitioner(
                                SIZE + 2)):
                        table = cv.get_variable("table", shape=(11, 6))
                report(f"prestore{suffix}{how}", ok=np.array_equal(np.asarray(table), PFULL))
            except Exception as exc:  # noqa: BLE001 - reported
                report(f"prestore{suffix}{how}", ok=False, error=f"{type(exc).__name__}: {exc}")


def main() -> None:
    action, d, layout = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    try:
        {"save": save, "restore": restore, "psave": psave, "prestore": prestore,
         "bad": bad}[action](
            d, layout)
    except Exception:
        report("crash", ok=False, error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
