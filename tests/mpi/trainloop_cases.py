"""A torch training loop on N gloo processes checkpointed by a CheckpointManager.

Run through torch_launch.py with ``CASES_MODULE=trainloop_cases``:
``torch_launch.py N run DIR STEPS STOP``. FSDP2 (``fully_shard`` over
``init_device_mesh("cpu", (N,))``) of a small MLP with dropout, AdamW, a LambdaLR
scheduler and the global RNG (``torch.default_generator``) in a ``cv.Checkpoint``; a
``cv.CheckpointManager(coordinator=)`` on DIR restores its latest step if there is one,
then the loop trains up to step STEPS, saving every 2 steps, and stops after step STOP.
Rank 0 writes ``{"losses", "start", "params"}`` to ``$RESULT_DIR/rank0.jsonl``.

Losses are bit-identical on any process count: the batch lives on rank 0 only (the
others' losses are multiplied by 0), gradients are summed, and every rank draws the same
dropout masks from the same seed, so its RNG state is the same on every rank.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import ckptvar as cv


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.2 * step)


def build(mesh: Any) -> tuple[Any, Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Linear(10, 3))
    if mesh is not None:
        shards = [fully_shard(layer, mesh=mesh) for layer in model
                  if isinstance(layer, torch.nn.Linear)]
        for fsdp in [*shards, fully_shard(model, mesh=mesh)]:
            fsdp.set_gradient_divide_factor(1.0)  # a sum: rank 0's gradient, exactly
            fsdp.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    torch.manual_seed(123)  # the dropout masks, the same on every rank
    return model, opt, sched


def train(model: Any, opt: Any, sched: Any, rank: int, start: int, stop: int,
          mgr: Any = None) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    losses = []
    for step in range(start + 1, stop + 1):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() * (1.0 if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.item()))
        if mgr is not None and step % 2 == 0:
            mgr.save(checkpoint_number=step)
    return losses


def full_params(model: Any) -> list[list[float]]:
    out = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out.append(t.flatten().tolist())
    return out


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
    _, d, steps, stop = cases[0], Path(cases[1]), int(cases[2]), int(cases[3])
    try:
        model, opt, sched = build(init_device_mesh("cpu", (size,)))
        ckpt = cv.Checkpoint(model=model, optimizer=opt, scheduler=sched,
                             rng=torch.default_generator)
        mgr = cv.CheckpointManager(ckpt, d, max_to_keep=2, coordinator=coord)
        restored = mgr.restore_or_initialize()
        if restored is not None:
            mgr.restore_status.assert_consumed()
        start = sched.last_epoch  # the steps done
        losses = train(model, opt, sched, rank, start, min(stop, steps), mgr)
        params = full_params(model)
        if rank == 0:
            with open(Path(os.environ["RESULT_DIR"]) / "rank0.jsonl", "a",
                      encoding="utf-8") as f:
                f.write(json.dumps({"case": "run", "rank": 0, "losses": losses,
                                    "start": start, "params": params}) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
