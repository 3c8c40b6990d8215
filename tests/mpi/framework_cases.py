"""Framework state on N torch.distributed (gloo) processes: FSDP2 and DTensors.

Run through torch_launch.py with ``CASES_MODULE=framework_cases``:
``torch_launch.py N ACTION DIR``. Every rank joins a gloo group on 127.0.0.1, takes
``cv.distributed.from_env()`` and writes one JSON line per case to
``$RESULT_DIR/rank<r>.jsonl``. Actions:

- ``save``: FSDP2 (``fully_shard``) of a small MLP with AdamW trains 3 steps, saves
  ``cv.Checkpoint(model=, optimizer=)`` to ``DIR/fsdp-1.h5``, trains 3 more (the
  uninterrupted run); DTensors on a 2 x 2 mesh (``Shard(0), Shard(1)``), an uneven
  ``Shard(0)`` and a replicated one are saved with ``cv.save(..., coordinator=)`` to
  ``DIR/dt.h5``; background saves, each followed at once by a training step that
  changes the tensors in place (:func:`background`); then the host memory of saving and
  loading a 16 MiB shard per process;
- ``restore``: a fresh FSDP2 model and optimizer restore ``DIR/fsdp-1.h5`` and train
  3 steps; the DTensors of ``DIR/dt.h5`` are loaded into other placements in place;
  then :func:`failures`: a process failing a save or a restore fails every process,
  which raise naming it; nothing is committed, the model and DTensors are untouched.

Bit-identical losses on any process count: the batch lives on rank 0 only (the other
ranks' losses are multiplied by 0) and gradients are summed, not averaged
(``set_gradient_divide_factor(1.0)`` on every FSDP module), so each gradient is exactly rank 0's whatever
the process count, and AdamW works element by element.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import ckptvar as cv

STEPS = 3


def batch() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def build(mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    if mesh is not None:
        shards = [fully_shard(layer, mesh=mesh) for layer in model
                  if isinstance(layer, torch.nn.Linear)]
        for fsdp in [*shards, fully_shard(model, mesh=mesh)]:
            fsdp.set_gradient_divide_factor(1.0)  # a sum: rank 0's gradient, exactly
            fsdp.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, opt


def train(model: Any, opt: Any, rank: int, steps: int = STEPS) -> list[float]:
    x, y = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() * (1.0 if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return losses


def full(shape: tuple[int, ...], seed: int) -> Any:
    import torch

    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) * 0.5 + seed


def dtensors(size: int, fill: bool) -> dict[str, Any]:
    """The DTensors of the ``dt`` checkpoint on this job's meshes (another layout per size)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (size,))
    out = {}
    specs = {"uneven": ((13, 4), flat, [Shard(0)]),
             "rep": ((5,), flat, [Replicate()])}
    if size == 4:
        specs["grid"] = ((6, 10), init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
        specs["half"] = ((4, 6), init_device_mesh("cpu", (2, 2)), [Shard(1), Replicate()])
    else:
        specs["grid"] = ((6, 10), flat, [Shard(1)])
        specs["half"] = ((4, 6), flat, [Replicate()])
    for i, (key, (shape, mesh, placements)) in enumerate(sorted(specs.items())):
        value = full(shape, i) if fill else torch.zeros(shape)
        out[key] = distribute_tensor(value, mesh, placements)
    return out


def dt_shapes(size: int) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in dtensors(size, False).items()}


def failures(d: Path, mesh: Any, *, rank: int, size: int, coord: Any, report: Any) -> None:
    """Rank 1 cannot save its tree; no process finds a checkpoint; the last rank asks for a
    key the checkpoint lacks: every process raises naming the rank, nothing changes."""
    import torch

    model, opt = build(mesh)
    train(model, opt, rank, 1)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    trees = dtensors(size, True)
    bad = {"w": trees["uneven"], "oops": object() if rank == 1 else np.zeros(2)}
    try:
        cv.save(d / "fail" / "t.h5", bad, coordinator=coord, timeout=30)
        report("fail", raised=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report("fail", raised=type(exc).__name__, message=str(exc))
    try:
        cv.Checkpoint(model=model, optimizer=opt).restore(
            d / "missing-1.h5", coordinator=coord, timeout=30)
        report("fail_restore", raised=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report("fail_restore", raised=type(exc).__name__, message=str(exc))
    zeros = dtensors(size, False)
    bad_like = {"uneven": zeros["uneven"], "nope" if rank == size - 1 else "rep": zeros["rep"]}
    try:
        cv.load(d / "dt.h5", like=bad_like, coordinator=coord, timeout=30)
        report("fail_load", raised=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report("fail_load", raised=type(exc).__name__, message=str(exc),
               untouched=not zeros["uneven"].to_local().any().item())
    after = {k: v.to_local() for k, v in model.state_dict().items()}
    report("untouched", ok=all(torch.equal(before[k], after[k]) for k in before))


def background(d: Path, model: Any, opt: Any, ckpt: Any, *, rank: int, coord: Any
               ) -> dict[str, Any]:
    """Three background saves, each followed at once (before it is durable) by a training
    step that changes every parameter and optimizer tensor in place: each file holds the
    values of its call (the later snapshots are copied into the first one's buffer)."""
    paths, want = [], []
    for i in range(3):
        want.append([model[0].weight.full_tensor().flatten().tolist(),
                     opt.state[model[2].bias]["exp_avg"].full_tensor().tolist()])
        handle = ckpt.write(d / f"bg-{i}.h5", blocking=False, coordinator=coord, timeout=30)
        train(model, opt, rank, 1)  # in place, while the save is being written
        paths.append(handle)
    paths = [str(h.wait()) for h in paths]
    got = []
    for p in paths:
        values = cv.load(p)
        got.append([values["model/0.weight"].ravel().tolist(),
                    values["optimizer/state/3/exp_avg"].tolist()])
    return {"same": got == want, "changed": want[0] != want[1] != want[2]}


def memory(d: Path, size: int, coord: Any) -> dict[str, int]:
    """Peak host memory (tracemalloc: NumPy's allocations) of saving and loading a 16 MiB
    DTensor shard per process; a warm-up save first (imports, the plan cache)."""
    import tracemalloc

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (size,))
    rows, cols = 4096 * size, 1024
    big = distribute_tensor(torch.ones(rows, cols), mesh, [Shard(0)])
    shard = big.to_local().numel() * 4
    cv.save(d / "mem-warm.h5", {"w": big}, coordinator=coord, timeout=30)
    into = distribute_tensor(torch.zeros(rows, cols), mesh, [Shard(0)])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cv.save(d / "mem.h5", {"w": big}, coordinator=coord, timeout=30)
        save = tracemalloc.get_traced_memory()[1] - base
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cv.load(d / "mem.h5", like={"w": into}, coordinator=coord, timeout=30)
        load = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return {"shard": shard, "save": save, "load": load,
            "ok": bool(torch.equal(into.to_local(), big.to_local()))}


def main(cases: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

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
    mesh = init_device_mesh("cpu", (size,))
    try:
        if action == "save":
            model, opt = build(mesh)
            first = train(model, opt, rank)
            ckpt = cv.Checkpoint(model=model, optimizer=opt)
            path = ckpt.save(d / "fsdp", coordinator=coord, timeout=30)
            w0 = model[0].weight.full_tensor().flatten().tolist()
            avg = opt.state[model[0].bias]["exp_avg"].full_tensor().tolist()
            rest = train(model, opt, rank)
            report("fsdp", losses=first + rest, path=str(path), engine=type(coord).__name__,
                   w0=w0, avg=avg)
            # the same tensors saved again: each DTensor's box is known, not asked of torch
            from ckptvar.checkpoint import _frameworks as fw

            calls, box = [0], fw.dtensor_box

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return box(*args, **kwargs)

            fw.dtensor_box = counted
            try:
                ckpt.save(d / "again", coordinator=coord, timeout=30)
            finally:
                fw.dtensor_box = box
            report("again", box_calls=calls[0])
            report("background", **background(d, model, opt, ckpt, rank=rank, coord=coord))
            trees = dtensors(size, True)
            cv.save(d / "dt.h5", trees, coordinator=coord, timeout=30)
            report("dt", ok=True)
            report("memory", **memory(d, size, coord))
        elif action == "restore":
            model, opt = build(mesh)
            status = cv.Checkpoint(model=model, optimizer=opt).restore(
                d / "fsdp-1.h5", coordinator=coord, timeout=30)
            status.assert_consumed()
            report("fsdp", losses=train(model, opt, rank))
            trees = dtensors(size, False)
            locals_before = {k: v.to_local().data_ptr() for k, v in trees.items()}
            got = cv.load(d / "dt.h5", like=trees, coordinator=coord, timeout=30)
            ok = {}
            for i, key in enumerate(sorted(trees)):
                want = full(tuple(trees[key].shape), i)
                ok[key] = (got[key] is trees[key]
                           and trees[key].to_local().data_ptr() == locals_before[key]
                           and torch.equal(trees[key].full_tensor(), want))
            report("dt", ok=ok)
            if (d / "jax.h5").exists():  # written from jax arrays on a 4 x 2 mesh
                from torch.distributed.tensor import Shard, distribute_tensor

                t = distribute_tensor(torch.zeros(12, 8), mesh, [Shard(1)])
                cv.load(d / "jax.h5", like={"j": t}, coordinator=coord, timeout=30)
                report("from_jax", ok=torch.equal(t.full_tensor(), full((12, 8), 9)))
            failures(d, mesh, rank=rank, size=size, coord=coord, report=report)
        # rank 0 hosts the c10d store the coordinator's collectives read: it must not
        # leave while another rank still reads its last vote (a gloo barrier, no store)
        dist.barrier()
    finally:
        dist.destroy_process_group()
