"""Multi-process saves and restores at an object-store URL, under ``mpiexec -n N python -m mpi4py``.

Usage: ``cloud_cases.py ACTION URL [ARGS]``; ``$S3_OPTIONS`` holds the JSON storage
options of the local S3 server. Each rank appends one JSON line per case to
``$RESULT_DIR/rank<r>.jsonl``, as tests/mpi/scale_cases.py does (whose model this uses).

- ``save URL``: N ranks save the test model to ``URL/n<N>/ckpt-1.h5`` and ``.zarr``.
- ``restore URL N...``: M ranks restore every ``URL/n<N>`` checkpoint into their shards.
- ``fault URL``: a good save, then one whose write fails on rank 1.
- ``netdrop URL``: a write that loses the network (through the test's proxy), then the
  same step again once it is back: the second write commits.
- ``divergent URL``: each rank saves to a URL of its own (``URL/r<rank>/ckpt``), then
  rank 1 to a local directory, then each rank to a local directory of its own: each
  must raise on every rank, naming what differs.
- ``reshard URL save|restore BUDGET``: N ranks save 24 MiB of row slabs (``URL/rs``);
  M ranks restore them, their temporary budget lowered to ``BUDGET`` bytes (``-``: the
  default), each reporting the bytes its slabs hold.
- ``manager URL``: a CheckpointManager (max_to_keep=2) saving three steps, restoring on
  a fresh model; a Saver; a background save.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from scale_cases import check, coord, model, report  # noqa: E402

import ckptvar as cv  # noqa: E402
from ckptvar.errors import DistributedError  # noqa: E402
from ckptvar.storage import _h5  # noqa: E402

OPTS = json.loads(os.environ["S3_OPTIONS"])
RANK, SIZE = coord.rank, coord.size


def save(url: str) -> None:
    ckpt, _ = model(True)
    for suffix in (".h5", ".zarr"):
        path = ckpt.save(f"{url}/n{SIZE}/ckpt{suffix}", coordinator=coord, timeout=60,
                         storage_options=OPTS)
        ckpt.save_counter.assign(0)
        report(f"save{suffix}", ok=True, path=path)


def restore(url: str, sources: list[str]) -> None:
    for n in sources:
        for suffix in (".h5", ".zarr"):
            ckpt, vs = model(False)
            try:
                ckpt.restore(f"{url}/n{n}/ckpt-1{suffix}", coordinator=coord, timeout=60,
                             storage_options=OPTS)
                report(f"restore{n}{suffix}", ok=not check(vs), bad=check(vs),
                       counter=int(ckpt.save_counter.numpy()))
            except Exception as exc:  # noqa: BLE001 - reported
                report(f"restore{n}{suffix}", ok=False, error=repr(exc))


def fault(url: str) -> None:
    ckpt, _ = model(True)
    good = ckpt.save(f"{url}/run/ckpt.h5", coordinator=coord, timeout=60,
                     storage_options=OPTS)
    if RANK == 1:
        def add(self, key, array, attrs=None):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device (injected)")

        _h5.H5Writer.add = add  # type: ignore[method-assign]
    try:
        ckpt.save(f"{url}/run/ckpt.h5", coordinator=coord, timeout=60, storage_options=OPTS)
        report("fault", ok=False, error="no error")
    except (DistributedError, OSError) as exc:  # rank 1 raises its own OSError, as alone
        report("fault", ok=True, type=type(exc).__name__,
               error=" ".join([str(exc), *getattr(exc, "__notes__", [])]), good=good)


def divergent(url: str) -> None:
    ckpt, _ = model(True)
    here = Path(os.environ["RESULT_DIR"])
    for case, dest in (("divergent-url", f"{url}/r{RANK}/ckpt"),
                       ("divergent-local", f"{url}/x/ckpt" if RANK == 0 else
                        str(here / "ckpt")),
                       ("divergent-dirs", str(here / f"d{RANK}" / "ckpt"))):
        try:
            path = ckpt.save(dest, coordinator=coord, timeout=30, storage_options=OPTS)
            report(case, ok=False, error=f"saved {path}")
        except cv.CkptError as exc:
            report(case, ok=True, type=type(exc).__name__, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - reported: not a ckptvar error
            report(case, ok=False, type=type(exc).__name__, error=str(exc))


def netdrop(url: str) -> None:
    """Write ``URL/nd/ckpt-1.h5`` while the test's proxy drops rank 1's uploads and every
    delete; rank 0 then says so (``$FLAG_DIR/failed``), waits for the proxy to heal
    (``$FLAG_DIR/healed``), and every rank writes the same step again."""
    import time

    ckpt, _ = model(True)
    dest, flags = f"{url}/nd/ckpt-1.h5", Path(os.environ["FLAG_DIR"])
    try:
        ckpt.write(dest, coordinator=coord, timeout=30, storage_options=OPTS)
        first = "saved"
    except Exception as exc:  # noqa: BLE001 - reported
        first = f"{type(exc).__name__}: {exc}"
    if RANK == 0:
        (flags / "failed").write_text(first)
        for _ in range(300):
            if (flags / "healed").exists():
                break
            time.sleep(0.1)
    coord.barrier(tag="healed", timeout=60)
    try:
        path = ckpt.write(dest, coordinator=coord, timeout=30, storage_options=OPTS)
        report("netdrop", ok=first != "saved", first=first, path=path)
    except Exception as exc:  # noqa: BLE001 - reported
        report("netdrop", ok=False, first=first, error=f"{type(exc).__name__}: {exc}")


def manager(url: str) -> None:
    ckpt, _ = model(True)
    mgr = cv.CheckpointManager(ckpt, f"{url}/mgr", max_to_keep=2, coordinator=coord,
                               storage_options=OPTS)
    paths = [mgr.save(timeout=60) for _ in range(3)]
    report("manager", ok=True, paths=paths, kept=mgr.checkpoints,
           latest=mgr.latest_checkpoint)
    fresh, vs = model(False)
    again = cv.CheckpointManager(fresh, f"{url}/mgr", max_to_keep=2, coordinator=coord,
                                 storage_options=OPTS)
    got = again.restore_or_initialize()
    report("manager_restore", ok=not check(vs) and got == paths[-1],
           counter=int(fresh.save_counter.numpy()))
    _, vs = model(True)
    saver = cv.Saver(var_list=vs, max_to_keep=1)
    first = saver.save(f"{url}/saver/model", global_step=6, coordinator=coord, timeout=60,
                       storage_options=OPTS)
    path = saver.save(f"{url}/saver/model", global_step=7, coordinator=coord, timeout=60,
                      storage_options=OPTS)
    _, vs = model(False)
    cv.Saver(var_list=vs).restore(path, coordinator=coord, timeout=60, storage_options=OPTS)
    report("saver", ok=not check(vs), path=path, first=first)
    ckpt, vs = model(True)
    handle = ckpt.save(f"{url}/bg/ckpt", coordinator=coord, blocking=False, timeout=60,
                       storage_options=OPTS)
    vs["w"].assign(np.zeros(vs["w"].shape, "float32"))  # after the snapshot: not saved
    done = handle.wait()
    fresh, vs = model(False)
    fresh.restore(done, coordinator=coord, timeout=60, storage_options=OPTS)
    report("background", ok=not check(vs), path=done)


RS_SHAPE = (1530, 4096)  # float32: 24 MiB; 256 KiB checksum blocks of 16 rows, slabs not on them


def _slab(size: int, rank: int) -> tuple[int, int]:
    rows = RS_SHAPE[0]
    return rank * rows // size, (rank + 1) * rows // size


def reshard(url: str, what: str, budget: str) -> None:
    lo, hi = _slab(SIZE, RANK)
    full = np.arange(np.prod(RS_SHAPE), dtype=np.float32).reshape(RS_SHAPE)
    value = full[lo:hi] if what == "save" else np.zeros((hi - lo, RS_SHAPE[1]), np.float32)
    var = cv.Variable(value, name="w", shard=cv.Shard(full_shape=RS_SHAPE, offset=(lo, 0)))
    ckpt = cv.Checkpoint(w=var)
    if what == "save":
        path = ckpt.save(f"{url}/rs/ckpt.h5", coordinator=coord, timeout=60, storage_options=OPTS)
        report("reshard_save", ok=True, path=path)
        return
    if budget != "-":  # the module constant the restore reads (no other way to lower it)
        from ckptvar.checkpoint import _collective_restore

        _collective_restore.TEMPORARY_BUDGET = int(budget)  # type: ignore[attr-defined]
    ckpt.restore(f"{url}/rs/ckpt-1.h5", coordinator=coord, timeout=60, storage_options=OPTS)
    report("reshard_restore", ok=bool(np.array_equal(var.numpy(), full[lo:hi])),
           need=int(value.nbytes))


def main() -> None:
    action, url = sys.argv[1], sys.argv[2]
    try:
        if action == "save":
            save(url)
        elif action == "restore":
            restore(url, sys.argv[3:])
        elif action == "fault":
            fault(url)
        elif action == "divergent":
            divergent(url)
        elif action == "netdrop":
            netdrop(url)
        elif action == "reshard":
            reshard(url, sys.argv[3], sys.argv[4])
        elif action == "manager":
            manager(url)
    except Exception:
        report("crash", ok=False, error=traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
