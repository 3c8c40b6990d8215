"""The ``fsdp`` benchmark: an FSDP2 model + AdamW saved on 4 processes, restored on 3,
by ckptvar and by ``torch.distributed.checkpoint`` (DCP), in one run on this machine.

Run ``python -m benchmarks.fsdp [--mib M] [--repeats N] [--dir D] [--processes P]``.
Each process count is one job of forked ranks (torch imported once) in a gloo group on
127.0.0.1: the save on ``--processes`` (default 4), the restore on one fewer (at least 1).
The model: ``--mib`` MiB of float32 parameters in 8 ``Linear`` layers, each
``fully_shard``-ed, AdamW after one step (so the optimizer holds twice as much again).
Measured, each the slowest rank's time between two barriers, best of ``--repeats``
(each repeat's slowest rank, then the best repeat):

- ``save x4``: ``cv.Checkpoint(model=, optimizer=).save(coordinator=)`` (checksums,
  fsync, atomic commit) against ``dcp.save(get_state_dict(model, opt))``;
- ``async blocking x4``: the time ``dcp.async_save`` blocks the caller, against
  ckptvar's background save (``blocking=False``), the slowest rank's and the median
  rank's; and one host copy of the rank's shard, each rank at once after a barrier as
  for the saves, on one thread: every tensor into a new array (``np.array(copy=True)``,
  what a user's snapshot does), and into arrays already written once (the floor of a
  copy: no page to fault in); and in CPU time (``time.thread_time``), each rank's
  blocking part over its copy into arrays written before, the median over the saves
  after the first (the slowest and the median rank): 4 ranks on fewer CPUs are
  pre-empted at random, which sets their wall time; and the same one rank at a time
  (``alone``: the other ranks wait at a barrier, their writers at the plan exchange),
  each rank's copy and then its blocking part, each after a copy that evicts the
  caches, the median over the saves after the first of each save's ratio: what the
  blocking part costs beyond a copy on a machine not shared with the other ranks;
- ``restore 4->3``: a fresh FSDP2 model and AdamW on 3 processes:
  ``Checkpoint.restore(coordinator=)`` against ``get_state_dict`` (which initialises the
  optimizer's state) + ``dcp.load`` + ``set_state_dict``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS = 8


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _build(mib: int, mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    width = int((mib * 2**20 / 4 / LAYERS) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _step(model: Any, opt: Any) -> None:
    import torch

    x = torch.ones(2, model[0].weight.shape[1])
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def _rank(action: str, d: Path, mib: int, repeats: int) -> dict[str, list[float]]:  # noqa: C901
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import ckptvar as cv

    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    coord = cv.distributed.from_env(timeout=300)
    model, opt = _build(mib, mesh)
    out: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.setdefault(name, []).append(time.perf_counter() - t0)

    if action == "save":
        _step(model, opt)
        ckpt = cv.Checkpoint(model=model, optimizer=opt)
        for i in range(repeats):
            timed("ckptvar save", lambda i=i: ckpt.write(str(d / f"cv-{i}.h5"),
                                                         coordinator=coord, timeout=300))
            timed("dcp save", lambda i=i: dcp.save(
                dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)),
                checkpoint_id=str(d / f"dcp-{i}")))
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(dict(zip(("model", "optim"), get_state_dict(model, opt),
                                          strict=True)), checkpoint_id=str(d / f"dcpa-{i}"))
            out.setdefault("dcp async blocking", []).append(time.perf_counter() - t0)
            fut.result()
            path = str(d / f"cva-{i}.h5")
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            handle = ckpt.write(path, coordinator=coord, timeout=300, blocking=False)
            c1 = time.thread_time()
            out.setdefault("ckptvar background blocking", []).append(time.perf_counter() - t0)
            out.setdefault("ckptvar background blocking, CPU", []).append(c1 - c0)
            handle.wait()
            shards = [t.to_local() if hasattr(t, "to_local") else t
                      for t in list(model.state_dict().values())
                      + [v for s in opt.state_dict()["state"].values() for v in s.values()]]
            dist.barrier()
            t0 = time.perf_counter()
            copies = [np.array(s.numpy(), copy=True) for s in shards]
            out.setdefault("one host copy", []).append(time.perf_counter() - t0)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for c, s in zip(copies, shards, strict=True):
                np.copyto(c, s.numpy())
            c1 = time.thread_time()
            out.setdefault("one host copy, reused", []).append(time.perf_counter() - t0)
            out.setdefault("one host copy, reused, CPU", []).append(c1 - c0)
            del copies
        # one rank at a time (the others wait at a barrier, their writers at the plan
        # exchange): each rank's copy of its shard into arrays written before, then its
        # background save's blocking part, each after a copy that evicts the caches
        copies = [np.array(s.numpy(), copy=True) for s in shards]
        scratch = np.ones(5 << 20, np.float64), np.empty(5 << 20, np.float64)
        for i in range(repeats):
            path = str(d / f"cvq-{i}.h5")
            handle = None
            for turn in range(size):
                dist.barrier()
                if turn != dist.get_rank():
                    continue
                np.copyto(scratch[1], scratch[0])
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                for c, s in zip(copies, shards, strict=True):
                    np.copyto(c, s.numpy())
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                np.copyto(scratch[1], scratch[0])
                w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
                handle = ckpt.write(path, coordinator=coord, timeout=300, blocking=False)
                c3, w3 = time.thread_time_ns(), time.perf_counter_ns()
                for k, v in (("alone: copy", w1 - w0), ("alone: copy, CPU", c1 - c0),
                             ("alone: blocking", w3 - w2), ("alone: blocking, CPU", c3 - c2)):
                    out.setdefault(k, []).append(v / 1e9)
            dist.barrier()
            assert handle is not None
            handle.wait()
        del copies, scratch
    else:
        for _ in range(repeats):
            model, opt = _build(mib, mesh)
            timed("ckptvar restore", lambda m=model, o=opt: cv.Checkpoint(
                model=m, optimizer=o).restore(str(d / "cv-0.h5"), coordinator=coord,
                                              timeout=300).assert_consumed())
            model, opt = _build(mib, mesh)

            def dcp_load(m: Any = model, o: Any = opt) -> None:
                msd, osd = get_state_dict(m, o)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=str(d / "dcp-0"))
                set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

            timed("dcp restore", dcp_load)
    return out


def _job(n: int, action: str, d: Path, mib: int, repeats: int) -> dict[str, float]:
    import torch.distributed  # noqa: F401 - imported once, before the fork

    result = Path(tempfile.mkdtemp(prefix="ckptvar-fsdp-"))
    init, port = result / "init", _port()
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                import datetime

                import torch.distributed as dist

                os.environ.update(RANK=str(rank), WORLD_SIZE=str(n))
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=rank, world_size=n,
                                        timeout=datetime.timedelta(seconds=300))
                got = _rank(action, d, mib, repeats)
                (result / f"rank{rank}.json").write_text(json.dumps(got))
                # rank 0 hosts the store the coordinator's votes read: nobody leaves
                # while another rank still reads its last one
                dist.barrier()
                dist.destroy_process_group()
            except BaseException:  # noqa: BLE001 - reported, then a non-zero exit
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    if any(codes):
        raise SystemExit(f"the {action} job on {n} processes failed: exit codes {codes}")
    del init
    ranks = [json.loads((result / f"rank{r}.json").read_text()) for r in range(n)]
    shutil.rmtree(result, ignore_errors=True)
    cpu = {}
    if "ckptvar background blocking, CPU" in ranks[0]:
        # each rank's CPU time of the blocking part over that of its copy, median over
        # the saves after the first (which makes the variables and the snapshot buffer):
        # the wall time of 4 ranks on fewer CPUs is mostly who was pre-empted
        def med(values: list[float]) -> float:
            return statistics.median(values[1:] or values)

        per_rank = sorted(med(r["ckptvar background blocking, CPU"])
                          / med(r["one host copy, reused, CPU"]) for r in ranks)
        cpu = {"blocking / copy, CPU": per_rank[-1],
               "blocking / copy, CPU (median rank)": statistics.median(per_rank),
               "blocking, CPU": max(med(r["ckptvar background blocking, CPU"]) for r in ranks),
               "copy, CPU": max(med(r["one host copy, reused, CPU"]) for r in ranks)}
        for r in ranks:
            del r["ckptvar background blocking, CPU"], r["one host copy, reused, CPU"]
    alone = {}
    if "alone: copy" in ranks[0]:
        # one rank at a time: each rank's per-save ratios (the blocking part over the copy
        # just before it, both of one rank on a machine otherwise idle), the median over
        # the saves after the first; then the slowest and the median rank
        for unit in ("", ", CPU"):
            per_rank = sorted(statistics.median(
                [b / c for b, c in zip(r[f"alone: blocking{unit}"], r[f"alone: copy{unit}"],
                                       strict=True)][1:] or [0.0]) for r in ranks)
            alone[f"alone: blocking / copy{unit}"] = per_rank[-1]
            alone[f"alone: blocking / copy{unit} (median rank)"] = statistics.median(per_rank)
            for k in (f"alone: blocking{unit}", f"alone: copy{unit}"):
                alone[k] = max(statistics.median(r[k][1:] or r[k]) for r in ranks)
        for r in ranks:
            for k in ("alone: copy", "alone: copy, CPU", "alone: blocking",
                      "alone: blocking, CPU"):
                del r[k]
    # each repeat's slowest rank, then the best repeat; and the same of the median rank
    out = {k: min(max(r[k][i] for r in ranks) for i in range(len(ranks[0][k])))
           for k in ranks[0]}
    out.update({f"{k} (median rank)": min(statistics.median(r[k][i] for r in ranks)
                                          for i in range(len(ranks[0][k])))
                for k in ranks[0]})
    out.update(cpu)
    out.update(alone)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=64, help="MiB of parameters (default 64)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--processes", type=int, default=4,
                    help="processes of the save (default 4); the restore runs on one fewer")
    args = ap.parse_args(argv)
    n = max(1, args.processes)
    m = max(1, n - 1)
    d = Path(args.dir or tempfile.mkdtemp(prefix="ckptvar-fsdp-bench-"))
    d.mkdir(parents=True, exist_ok=True)
    try:
        save = _job(n, "save", d, args.mib, args.repeats)
        restore = _job(m, "restore", d, args.mib, args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)
    rows = [(f"save x{n}", save["ckptvar save"], save["dcp save"]),
            (f"restore {n}->{m}", restore["ckptvar restore"], restore["dcp restore"]),
            (f"blocking part of a background save x{n}", save["ckptvar background blocking"],
             save["dcp async blocking"])]
    print(f"FSDP2 + AdamW, {args.mib} MiB of parameters ({3 * args.mib} MiB of state), "
          f"best of {args.repeats}, slowest rank")
    print(f"{'':40} {'ckptvar s':>10} {'DCP s':>10} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:40} {a:10.3f} {b:10.3f} {a / b:7.2f}x")
    block, mid = save["ckptvar background blocking"], save["ckptvar background blocking (median rank)"]
    for what in ("one host copy", "one host copy, reused"):
        copy, copy_mid = save[what], save[f"{what} (median rank)"]
        print(f"{what} of a process's shard: {copy:.4f} s (median rank {copy_mid:.4f} s); "
              f"ckptvar's background blocking {block:.4f} s is {block / copy:.2f}x it "
              f"(median rank: {mid:.4f} s, {mid / copy_mid:.2f}x)")
    print(f"in CPU time (each rank's median over the saves after the first): the blocking part "
          f"{save['blocking, CPU'] * 1e3:.2f} ms, one copy into arrays written before "
          f"{save['copy, CPU'] * 1e3:.2f} ms (the most of any rank); blocking / copy "
          f"{save['blocking / copy, CPU']:.2f}x on the slowest rank, "
          f"{save['blocking / copy, CPU (median rank)']:.2f}x on the median rank")
    if "alone: blocking / copy" in save:
        print(f"one rank at a time (the others waiting; each rank's median over the saves "
              f"after the first of the blocking part over the copy just before it): the "
              f"blocking part {save['alone: blocking'] * 1e3:.2f} ms "
              f"({save['alone: blocking, CPU'] * 1e3:.2f} ms of CPU), one copy into arrays "
              f"written before {save['alone: copy'] * 1e3:.2f} ms "
              f"({save['alone: copy, CPU'] * 1e3:.2f} ms of CPU) (the most of any rank); "
              f"blocking / copy {save['alone: blocking / copy']:.2f}x wall, "
              f"{save['alone: blocking / copy, CPU']:.2f}x CPU on the slowest rank, "
              f"{save['alone: blocking / copy (median rank)']:.2f}x wall, "
              f"{save['alone: blocking / copy, CPU (median rank)']:.2f}x CPU on the median rank")
    print(json.dumps({"save": save, "restore": restore}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
