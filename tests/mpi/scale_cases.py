"""Multi-process saves and resharding restores, run under ``mpiexec -n N python -m mpi4py``.

Usage: ``scale_cases.py ACTION DIR [ARGS]``; each rank appends one JSON line per case
to ``$RESULT_DIR/rank<r>.jsonl`` (``{"case", "rank", "ok", ...}``).

- ``save DIR``: N ranks save the test model (uneven row shards, a column-sharded
  int64 value, a value with a zero-size shard, a replicated value) to
  ``DIR/n<N>/ckpt-1.h5`` and ``.zarr``.
- ``restore DIR N...``: M ranks restore every ``DIR/n<N>`` checkpoint into their own shards.
- ``fault DIR KIND``: a save that fails on rank 1 (``raise``, ``slow``) after a good one.
- ``badrestore DIR KIND``: a restore that fails on rank 1 only.
- ``big DIR``: N ranks save a 16 MiB value; ``bigread DIR``: M ranks restore it, counting bytes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

import ckptvar as cv
from ckptvar.errors import DistributedError, DistributedTimeoutError
from ckptvar.storage import _h5

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"

#: key: (full shape, dtype, the axis it is split along); "h" is bfloat16 (kept by name)
SHAPES = {
    "w": ((37, 5), "float32", 0),
    "e": ((6, 10), "int64", 1),
    "z": ((3, 2), "float64", 0),
    "h": ((9, 4), ml_dtypes.bfloat16, 0),
}


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def full(key: str) -> np.ndarray:
    shape, dtype, _ = SHAPES[key]
    return (np.arange(int(np.prod(shape))) * 3 + 1).astype(dtype).reshape(shape)


def my_box(key: str, rank: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, _, axis = SHAPES[key]
    edges = np.linspace(0, shape[axis], size + 1).astype(int)
    if key == "z" and size > 1:  # the last rank holds nothing of z
        edges = np.array([*np.linspace(0, shape[0], size).astype(int), shape[0]])
    offset = [0] * len(shape)
    extent = list(shape)
    offset[axis] = int(edges[rank])
    extent[axis] = int(edges[rank + 1] - edges[rank])
    return tuple(offset), tuple(extent)


def model(fill: bool) -> tuple[cv.Checkpoint, dict[str, cv.Variable]]:
    vs = {}
    for key, (shape, dtype, _) in SHAPES.items():
        offset, extent = my_box(key, RANK, SIZE)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        value = full(key)[sl] if fill else np.zeros(extent, dtype)
        vs[key] = cv.Variable(value, name=key, shard=cv.Shard(full_shape=shape, offset=offset))
    rep = np.arange(4, dtype="float32") + 0.5
    vs["b"] = cv.Variable(rep if fill else np.zeros(4, "float32"), name="b")
    return cv.Checkpoint(**vs), vs


def check(vs: dict[str, cv.Variable]) -> list[str]:
    bad = []
    for key in SHAPES:
        offset, extent = my_box(key, RANK, SIZE)
        sl = tuple(slice(o, o + e) for o, e in zip(offset, extent, strict=True))
        if not np.array_equal(vs[key].numpy(), full(key)[sl]):
            bad.append(key)
    if not np.array_equal(vs["b"].numpy(), np.arange(4, dtype="float32") + 0.5):
        bad.append("b")
    return bad


def save(d: Path) -> None:
    ckpt, _ = model(True)
    for suffix in (".h5", ".zarr"):
        path = ckpt.save(d / f"n{SIZE}" / f"ckpt{suffix}", coordinator=coord, timeout=30)
        ckpt.save_counter.assign(0)
        report(f"save{suffix}", ok=True, path=path)


def restore(d: Path, sources: list[str]) -> None:
    for n in sources:
        for suffix in (".h5", ".zarr"):
            ckpt, vs = model(False)
            try:
                ckpt.restore(d / f"n{n}" / f"ckpt-1{suffix}", coordinator=coord, timeout=30)
                report(f"restore{n}{suffix}", ok=not check(vs), bad=check(vs),
                       counter=int(ckpt.save_counter.numpy()))
            except Exception as exc:  # noqa: BLE001 - reported
                report(f"restore{n}{suffix}", ok=False, error=repr(exc))


def fault(d: Path, kind: str) -> None:
    ckpt, _ = model(True)
    good = ckpt.save(d / "run" / "ckpt.h5", coordinator=coord, timeout=30)
    original = _h5.H5Writer.add
    slept: list[bool] = []
    if RANK == 1:
        def add(self, key, array, attrs=None):  # type: ignore[no-untyped-def]
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind in ("raise", "bgraise"):
                raise OSError(28, "No space left on device (injected)")
            if not slept:
                slept.append(True)
                time.sleep(5)
            return original(self, key, array, attrs)

        _h5.H5Writer.add = add  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        if kind == "bgraise":  # a background save: the error surfaces at wait()
            ckpt.save(d / "run" / "ckpt.h5", coordinator=coord, blocking=False,
                      timeout=30).wait()
        else:
            ckpt.save(d / "run" / "ckpt.h5", coordinator=coord,
                      timeout=30 if kind == "raise" else 2)
        report("fault", ok=False, error="no error")
    except (DistributedError, OSError) as exc:  # rank 1 raises its own OSError, as alone
        report("fault", ok=True, type=type(exc).__name__,
               error=" ".join([str(exc), *getattr(exc, "__notes__", [])]), good=good,
               seconds=time.monotonic() - t0,
               timeout=isinstance(exc, DistributedTimeoutError))


def badrestore(d: Path, kind: str) -> None:
    src = d / "n2" / "ckpt-1.h5"
    ckpt, vs = model(False)
    if RANK == 1 and kind == "uncovered":
        vs["w"] = cv.Variable(np.zeros((3, 5), "float32"), name="w",
                              shard=cv.Shard(full_shape=(40, 5), offset=(37, 0)))
        ckpt = cv.Checkpoint(**vs)
    if RANK == 1 and kind == "missing":
        ckpt.extra = cv.Variable(1.0, name="extra")
    before = {k: v.numpy().copy() for k, v in vs.items()}
    try:
        ckpt.restore(src, coordinator=coord, timeout=30)
        report("bad", ok=False, error="no error")
    except cv.CkptError as exc:  # rank 1 raises its own error, as alone; the others name it
        same = all(np.array_equal(vs[k].numpy(), before[k]) for k in before)
        own = not isinstance(exc, DistributedError)
        report("bad", ok=same and own == (RANK == 1), type=type(exc).__name__,
               error=" ".join([str(exc), *getattr(exc, "__notes__", [])]))


def manager(d: Path) -> None:
    ckpt, _ = model(True)
    mgr = cv.CheckpointManager(ckpt, d / "mgr", max_to_keep=2, coordinator=coord)
    paths = [mgr.save(timeout=30) for _ in range(3)]
    report("manager", ok=True, paths=paths, kept=[Path(p).name for p in mgr.checkpoints],
           latest=mgr.latest_checkpoint, listed=sorted(os.listdir(d / "mgr")))
    fresh, vs = model(False)
    again = cv.CheckpointManager(fresh, d / "mgr", max_to_keep=2, coordinator=coord)
    got = again.restore_or_initialize()
    report("manager_restore", ok=not check(vs) and got == paths[-1],
           counter=int(fresh.save_counter.numpy()))
    _, vs = model(True)
    path = cv.Saver(var_list=vs).save(d / "saver" / "model", global_step=7,
                                      coordinator=coord, timeout=30)
    _, vs = model(False)
    cv.Saver(var_list=vs).restore(path, coordinator=coord, timeout=30)
    report("saver", ok=not check(vs), path=path)
    ckpt, vs = model(True)
    handle = ckpt.save(d / "bg" / "ckpt", coordinator=coord, blocking=False, timeout=30)
    vs["w"].assign(np.zeros(vs["w"].shape, "float32"))  # after the snapshot: not saved
    done = handle.wait()
    fresh, vs = model(False)
    fresh.restore(done, coordinator=coord, timeout=30)
    report("background", ok=not check(vs), path=done)


BIG = (1024, 4096)


def big(d: Path) -> None:
    offset, extent = (RANK * BIG[0] // SIZE, 0), ((RANK + 1) * BIG[0] // SIZE - RANK * BIG[0]
                                                 // SIZE, BIG[1])
    value = np.arange(offset[0] * BIG[1], (offset[0] + extent[0]) * BIG[1], dtype="float32")
    v = cv.Variable(value.reshape(extent), name="big", shard=cv.Shard(BIG, offset))
    cv.Checkpoint(big=v).save(d / "big" / "ckpt.h5", coordinator=coord, timeout=60)
    report("big", ok=True)


def bigread(d: Path) -> None:
    offset, extent = (RANK * BIG[0] // SIZE, 0), ((RANK + 1) * BIG[0] // SIZE - RANK * BIG[0]
                                                 // SIZE, BIG[1])
    v = cv.Variable(np.zeros(extent, "float32"), name="big", shard=cv.Shard(BIG, offset))
    ckpt = cv.Checkpoint(big=v)

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        return 0

    before = rchar()
    ckpt.restore(d / "big" / "ckpt-1.h5", coordinator=coord, timeout=60)
    read = rchar() - before
    want = np.arange(offset[0] * BIG[1], (offset[0] + extent[0]) * BIG[1], dtype="float32")
    report("bigread", ok=bool(np.array_equal(v.numpy().ravel(), want)), read=read,
           needed=int(v.numpy().nbytes))


def main() -> None:
    action, d = sys.argv[1], Path(sys.argv[2])
    try:
        if action == "save":
            save(d)
        elif action == "restore":
            restore(d, sys.argv[3:])
        elif action == "fault":
            fault(d, sys.argv[3])
        elif action == "badrestore":
            badrestore(d, sys.argv[3])
        elif action == "manager":
            manager(d)
        elif action == "big":
            big(d)
        elif action == "bigread":
            bigread(d)
    except Exception:
        report("crash", ok=False, error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
