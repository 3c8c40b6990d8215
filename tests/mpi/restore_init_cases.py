"""Restore-as-initialization on many processes, run under ``mpiexec -n N python -m mpi4py``.

Usage: ``restore_init_cases.py ACTION DIR``; each rank appends one JSON line per case
to ``$RESULT_DIR/rank<r>.jsonl`` (``{"case", "rank", "ok", ...}``).

- ``save DIR``: N ranks save the model (``w`` row shards, ``t`` float16 row shards,
  ``e`` an int64 value every rank holds whole, ``b`` replicated) to ``DIR/ckpt-1.h5``
  and through a ``CheckpointManager`` to ``DIR/mgr``.
- ``restore DIR``: M ranks (their own boxes) restore it into variables created after
  ``restore`` (deferred), inside ``cv.restore_on_create``, through
  ``restore_or_initialize``, with ``cast=True``, and the failing variants of each.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

coord = cv.distributed.from_env()
RANK, SIZE = coord.rank, coord.size
OUT = Path(os.environ["RESULT_DIR"]) / f"rank{RANK}.jsonl"
SHAPES = {"w": ((37, 5), "float32"), "t": ((11, 3), "float16"), "e": ((6, 4), "int64")}
B = np.arange(4, dtype="float32") + 0.5


def report(case: str, **fields: object) -> None:
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"case": case, "rank": RANK, **fields}) + "\n")


def full(key: str) -> np.ndarray:
    shape, dtype = SHAPES[key]
    return (np.arange(int(np.prod(shape))) * 3 % 1001 + 1).astype(dtype).reshape(shape)


def rows(key: str, rank: int = RANK, size: int = SIZE) -> tuple[int, int]:
    n = SHAPES[key][0][0]
    return rank * n // size, (rank + 1) * n // size


def shard(key: str, value: Any, dtype: str | None = None, **kw: Any) -> cv.Variable:
    """This rank's row shard of ``key`` (``value``: an array, or an initializer)."""
    shape, stored = SHAPES[key]
    lo, hi = rows(key)
    if callable(value):
        kw.update(shape=(hi - lo, *shape[1:]), dtype=dtype or stored)
    return cv.Variable(value, name=key, shard=cv.Shard(full_shape=shape, offset=(lo, 0)), **kw)


def mine(key: str) -> np.ndarray:
    lo, hi = rows(key)
    return full(key)[lo:hi]


def never(shape: Any, dtype: Any) -> np.ndarray:
    raise AssertionError("an initializer ran although a stored value was restored")


def save(d: Path) -> None:
    vs = {k: shard(k, mine(k)) for k in ("w", "t")}
    vs["e"] = cv.Variable(full("e"), name="e")
    vs["b"] = cv.Variable(B, name="b")
    ckpt = cv.Checkpoint(**vs)
    path = ckpt.save(d / "ckpt", coordinator=coord, timeout=30)
    mgr = cv.CheckpointManager(ckpt, d / "mgr", max_to_keep=2, coordinator=coord)
    report("save", ok=True, path=path, mgr=mgr.save(timeout=30))


def expect_error(case: str, fn: Callable[[], object], variables: Callable[[], list[Any]]) -> None:
    """``fn`` must raise on this rank; ``variables()`` unchanged after.

    A rank that found the failure raises its own error (``own``), as one process
    would, with a note naming the failing ranks; the others ``DistributedError``.
    """
    try:
        fn()
        report(case, ok=False, error="no error")
    except cv.CkptError as exc:
        own = not isinstance(exc, cv.DistributedError)
        report(case, ok=True, own=own, type=type(exc).__name__,
               error=" ".join([str(exc), *getattr(exc, "__notes__", [])]),
               ranks=[RANK] if own else list(exc.ranks),
               unchanged=[bool(v) for v in variables()])


def deferred(d: Path) -> None:
    """Checkpoint.restore before the variables exist; each takes its box when attached."""
    ckpt = cv.Checkpoint()
    status = ckpt.restore(d / "ckpt-1.h5", coordinator=coord, timeout=30)
    ckpt.w = shard("w", never)
    ckpt.b = cv.Variable(never, shape=(4,), dtype="float32", name="b")
    ckpt.e = cv.Variable(np.zeros((6, 4), "int64"), name="e")
    ckpt.t = shard("t", never, dtype="float16")
    status.assert_consumed()
    ok = (np.array_equal(ckpt.w.numpy(), mine("w")) and np.array_equal(ckpt.b.numpy(), B)
          and np.array_equal(ckpt.e.numpy(), full("e"))
          and np.array_equal(ckpt.t.numpy(), mine("t")))
    report("deferred", ok=ok, counter=int(ckpt.save_counter.numpy()))

    # rank 1's w claims a bigger logical value: every rank raises at the attach
    ckpt = cv.Checkpoint()
    ckpt.restore(d / "ckpt-1.h5", coordinator=coord, timeout=30)
    lo, hi = rows("w")
    bad = cv.Variable(np.full((hi - lo, 5), -1, "float32"), name="w", shard=cv.Shard(
        full_shape=(40 if RANK == 1 else 37, 5), offset=(lo, 0)))
    expect_error("deferred_fail", lambda: setattr(ckpt, "w", bad),
                 lambda: [(bad.numpy() == -1).all()])


def on_create(d: Path) -> None:
    """cv.restore_on_create with a coordinator: shards, parts, replicated values."""
    with cv.Graph().as_default(), cv.restore_on_create(
            d / "ckpt-1.h5", coordinator=coord, timeout=30) as status:
        w = shard("w", never)
        b = cv.Variable(np.zeros(4, "float32"), name="b")
        # every rank holds all of e, as 3 parts (the partitioner's boxes)
        e = cv.get_variable("e", shape=(6, 4), dtype="int64", initializer=never,
                            partitioner=cv.fixed_size_partitioner(3))
        inside = np.asarray(e)  # used inside the block: its parts are read now
        t = shard("t", np.zeros((rows("t")[1] - rows("t")[0], 3), "float16"))
    status.assert_consumed()
    ok = (np.array_equal(w.numpy(), mine("w")) and np.array_equal(b.numpy(), B)
          and np.array_equal(np.asarray(e), full("e")) and np.array_equal(inside, full("e"))
          and np.array_equal(t.numpy(), mine("t")) and len(e) == 3)
    report("on_create", ok=ok)

    # rank 1 makes w an int32: no stored value is given to any variable anywhere
    made: list[cv.Variable] = []

    def run() -> None:
        with cv.Graph().as_default(), cv.restore_on_create(
                d / "ckpt-1.h5", coordinator=coord, timeout=30):
            made.append(cv.Variable(np.zeros(4, "float32"), name="b"))  # restored: fine
            lo, hi = rows("w")
            dtype = "int32" if RANK == 1 else "float32"
            made.append(cv.Variable(np.full((hi - lo, 5), -1, dtype), name="w",
                                    shard=cv.Shard(full_shape=(37, 5), offset=(lo, 0))))

    expect_error("on_create_fail", run, lambda: [len(made) == 1])


def manager(d: Path) -> None:
    """restore_or_initialize on M ranks, the variables created afterwards."""
    ckpt = cv.Checkpoint()
    mgr = cv.CheckpointManager(ckpt, d / "mgr", max_to_keep=2, coordinator=coord)
    got = mgr.restore_or_initialize()
    ckpt.w = shard("w", never)
    ckpt.b = cv.Variable(never, shape=(4,), dtype="float32", name="b")
    ok = np.array_equal(ckpt.w.numpy(), mine("w")) and np.array_equal(ckpt.b.numpy(), B)
    report("manager", ok=ok, path=got)
    calls: list[int] = []
    empty = cv.CheckpointManager(cv.Checkpoint(w=shard("w", np.zeros((rows("w")[1] - rows(
        "w")[0], 5), "float32"))), d / "empty", coordinator=coord, init_fn=lambda: calls.append(1))
    report("manager_init", ok=empty.restore_or_initialize() is None and calls == [1])


def cast(d: Path) -> None:
    """cast= in a multi-process restore: float16 into float32, said once on every rank."""
    def model() -> tuple[cv.Checkpoint, cv.Variable]:
        lo, hi = rows("t")
        t = cv.Variable(np.zeros((hi - lo, 3), "float32"), name="t",
                        shard=cv.Shard(full_shape=(11, 3), offset=(lo, 0)))
        w = shard("w", np.zeros((rows("w")[1] - rows("w")[0], 5), "float32"))
        return cv.Checkpoint(t=t, w=w), t

    ckpt, t = model()
    expect_error("cast_refused", lambda: ckpt.restore(d / "ckpt-1.h5", coordinator=coord,
                                                      timeout=30),
                 lambda: [not t.numpy().any()])
    ckpt, t = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.restore(d / "ckpt-1.h5", coordinator=coord, timeout=30, cast=True)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    report("cast", ok=np.array_equal(t.numpy(), mine("t").astype("float32"))
           and t.dtype == np.float32, warnings=said)
    # a cast same_kind forbids (float16 -> int32) on rank 2 only: everyone raises
    lo, hi = rows("t")
    dtype = "int32" if RANK == 2 else "float32"
    t = cv.Variable(np.zeros((hi - lo, 3), dtype), name="t",
                    shard=cv.Shard(full_shape=(11, 3), offset=(lo, 0)))
    expect_error("cast_forbidden", lambda: cv.Checkpoint(t=t).restore(
        d / "ckpt-1.h5", coordinator=coord, timeout=30, cast=True),
        lambda: [not t.numpy().any()])
    # and restore_on_create casts too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cv.Graph().as_default(), cv.restore_on_create(
                d / "ckpt-1.h5", coordinator=coord, timeout=30, cast=True):
            t = shard("t", never, dtype="float32")
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    report("cast_on_create", ok=np.array_equal(t.numpy(), mine("t").astype("float32")),
           warnings=said)


def main() -> None:
    action, d = sys.argv[1], Path(sys.argv[2])
    try:
        if action == "save":
            save(d)
        else:
            deferred(d)
            on_create(d)
            manager(d)
            cast(d)
    except Exception:
        report("crash", ok=False, error=traceback.format_exc())
        raise


main()
