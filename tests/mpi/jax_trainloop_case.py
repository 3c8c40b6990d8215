"""A JAX training loop on 8 CPU devices of one process, resumed onto another sharding.

``XLA_FLAGS=--xla_force_host_platform_device_count=8 python jax_trainloop_case.py DIR``
prints one JSON object of checks. The loop of tests/test_trainloop_jax.py (optax, a
PRNG key in a TrainState) trains with its parameters and optimizer state sharded over a
2 x 4 mesh, saved by a CheckpointManager every 4 steps, and stops after step 10; a
fresh process state (``jax.ShapeDtypeStruct`` leaves sharded over a 4 x 2 mesh, a fresh
key placed by default) restores step 8: the same bits, the new sharding, and the
training goes on as the saved state moved to that sharding by hand does, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import test_trainloop_jax as tl  # noqa: E402 - the loop, from beside this folder

import ckptvar as cv  # noqa: E402


def spec(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    axes = [a for a, n in zip(("x", "y"), mesh.devices.shape, strict=True)][: len(shape)]
    if not shape or any(d % mesh.shape[a] for d, a in zip(shape, axes, strict=False)):
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(*axes))


def placed(s: tl.TrainState, mesh: Mesh) -> tl.TrainState:
    put = lambda x: jax.device_put(x, spec(jnp.shape(x), mesh))  # noqa: E731
    # the key placed by default, as a fresh one is (committed to the other mesh, a jitted
    # step would refuse it beside arrays on this one)
    key = jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(s.key))))
    return tl.TrainState(int(s.step), jax.tree.map(put, s.params), jax.tree.map(put, s.opt_state),
                         key, s.tx)


def main() -> None:
    d = Path(sys.argv[1])
    m24 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    m42 = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    checks: dict[str, Any] = {"devices": len(jax.devices())}

    s = placed(tl.init(), m24)
    ckpt = cv.Checkpoint(state=s)
    mgr = cv.CheckpointManager(ckpt, d, max_to_keep=2)
    s8, first = tl.train(s, 8, ckpt, mgr)
    tl.train(s8, 2, ckpt, mgr)  # stopped after step 10
    mgr.wait_until_finished()

    fresh = tl.init(seed=3)
    def abstract(a: Any) -> Any:
        return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a),
                                    sharding=spec(jnp.shape(a), m42))

    like = tl.TrainState(0, jax.tree.map(abstract, fresh.params),
                         jax.tree.map(abstract, fresh.opt_state), fresh.key, fresh.tx)
    again = cv.Checkpoint(state=like)
    mgr = cv.CheckpointManager(again, d, max_to_keep=2)
    checks["restored"] = Path(mgr.restore_or_initialize() or "").name
    mgr.restore_status.assert_consumed()
    back = again.state
    checks["step"] = back.step
    checks["same_bits"] = tl.same((back.params, back.opt_state), (s8.params, s8.opt_state)) \
        and bool((jax.random.key_data(back.key) == jax.random.key_data(s8.key)).all())
    checks["sharding"] = all(
        leaf.sharding == spec(leaf.shape, m42) for leaf in jax.tree.leaves(back.params))
    _, resumed = tl.train(back, 5, again, mgr)
    _, by_hand = tl.train(placed(s8, m42), 5)
    checks["losses"] = resumed == by_hand
    checks["first"] = first
    print(json.dumps(checks))


if __name__ == "__main__":
    main()
