"""One of N ``jax.distributed`` processes (2 CPU devices each): a jax.Array sharded over
every process's devices is saved collectively and loaded into another sharding, in a
dict and in a registered pytree node (a train state's shape).

``python jax_dist_case.py DIR`` with ``JAX_COORDINATOR``, ``RANK``, ``WORLD_SIZE`` set
(and ``XLA_FLAGS=--xla_force_host_platform_device_count=2``); prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptvar as cv

FULL = np.arange(12 * 10, dtype=np.float32).reshape(12, 10) / 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """A train state's shape: ``fn`` is static (the like tree's on a load)."""

    step: Any
    params: Any
    fn: Any = dataclasses.field(default=None, metadata={"static": True})


def main() -> None:
    d = Path(sys.argv[1])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jax.distributed.initialize(os.environ["JAX_COORDINATOR"], num_processes=n,
                               process_id=rank, initialization_timeout=60)
    coord = cv.distributed.from_env(timeout=60)
    devices = np.array(jax.devices())
    rows = Mesh(devices.reshape(-1), ("x",))  # rows over every device of every process
    grid = Mesh(devices.reshape(2, -1), ("x", "y"))
    w = jax.make_array_from_callback(FULL.shape, NamedSharding(rows, P("x")), lambda i: FULL[i])
    r = jax.make_array_from_callback((3,), NamedSharding(rows, P()), lambda i: np.ones(3)[i])
    path = cv.save(d / "jd.h5", {"w": w, "r": r, "step": 4}, coordinator=coord, timeout=60)
    target = NamedSharding(grid, P(None, "y"))
    like = {"w": jax.ShapeDtypeStruct(FULL.shape, np.float32, sharding=target),
            "r": jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(grid, P())),
            "step": 0}
    out = cv.load(path, like=like, coordinator=coord, timeout=60)
    ok = all(np.array_equal(np.asarray(s.data), FULL[s.index])
             for s in out["w"].addressable_shards)
    state = State(4, {"w": w, "r": r}, fn=len)
    path = cv.save(d / "node.h5", state, coordinator=coord, timeout=60)
    back = cv.load(path, like=State(0, {"w": like["w"], "r": like["r"]}, fn=print),
                   coordinator=coord, timeout=60)
    node = [type(back).__name__, back.fn is print, back.step,
            all(np.array_equal(np.asarray(s.data), FULL[s.index])
                for s in back.params["w"].addressable_shards)]
    print(json.dumps({"rank": rank, "engine": type(coord).__name__, "ok": ok, "node": node,
                      "sharding": out["w"].sharding == target, "step": out["step"],
                      "r": all(np.asarray(s.data).tolist() == [1.0] * 3
                               for s in out["r"].addressable_shards),
                      "local": len(jax.local_devices()), "global": len(jax.devices())}),
          flush=True)


if __name__ == "__main__":
    main()
