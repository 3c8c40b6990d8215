"""JAX on 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) in one process.

``python jax_framework_case.py DIR``: prints one JSON object of checks.

- a pytree of ``jax.Array``s with a ``NamedSharding`` on a 2 x 4 mesh and an optimizer
  state (namedtuples, an int step, ``None``) is saved, then loaded with ``like=`` into
  ``jax.ShapeDtypeStruct``s on a 4 x 2 and an 8 x 1 mesh: the same bits, the target
  sharding;
- ``DIR/dt.h5`` and ``DIR/fsdp-1.h5`` (written by 4 torch processes from DTensors,
  when present) load into jax arrays sharded over the 8 devices, bit for bit;
- ``DIR/jax.h5`` is written from sharded jax arrays for a torch job to read back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptvar as cv


class AdamState(NamedTuple):  # what optax.ScaleByAdamState looks like
    count: Any
    mu: Any
    nu: Any


def full(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """What the torch cases fill their DTensors with (framework_cases.full)."""
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.5 + seed)


def mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), ("x", "y"))


def main() -> None:
    d = Path(sys.argv[1])
    checks: dict[str, Any] = {"devices": len(jax.devices())}
    m24, m42, m81 = mesh((2, 4)), mesh((4, 2)), mesh((8, 1))
    w = jax.device_put(jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12) / 7,
                       NamedSharding(m24, P("x", "y")))
    b = jax.device_put(jnp.arange(12, dtype=jnp.bfloat16), NamedSharding(m24, P("y")))
    tree = {"params": {"w": w, "b": b},
            "opt": (AdamState(jnp.int32(5), {"w": w * 2, "b": b}, {"w": w * 3, "b": b}), None),
            "step": 7}
    path = cv.save(d / "tree.h5", tree)
    checks["keys"] = sorted(k for k, _, _ in cv.list_variables(path))

    def abstract(x: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    for name, target in (("4x2", m42), ("8x1", m81)):
        ws, bs = NamedSharding(target, P("x", None)), NamedSharding(target, P(None))
        like = {"params": {"w": abstract(w, ws), "b": abstract(b, bs)},
                "opt": (AdamState(jnp.int32(0), {"w": abstract(w, ws), "b": abstract(b, bs)},
                                  {"w": abstract(w, ws), "b": abstract(b, bs)}), None),
                "step": 0}
        out = cv.load(path, like=like)
        checks[name] = {
            "w": np.asarray(out["params"]["w"]).tobytes() == np.asarray(w).tobytes(),
            "sharding": out["params"]["w"].sharding == ws,
            "nu": np.asarray(out["opt"][0].nu["w"]).tobytes() == np.asarray(w * 3).tobytes(),
            "count": int(out["opt"][0].count) == 5 and isinstance(out["opt"][0], AdamState),
            "none": out["opt"][1] is None, "step": out["step"] == 7,
            "bf16": out["params"]["b"].dtype == jnp.bfloat16,
        }
    try:
        cv.load(path, like={"params": {"w": jax.ShapeDtypeStruct((8, 11), jnp.float32)}})
        checks["mismatch"] = None
    except cv.CheckpointMismatchError as exc:
        checks["mismatch"] = str(exc)
    if (d / "dt.h5").exists():  # written by 4 torch processes
        ok = {}
        for i, (key, shape) in enumerate(sorted({"grid": (6, 10), "half": (4, 6),
                                                 "rep": (5,), "uneven": (13, 4)}.items())):
            spec = P("x") if shape[0] % 8 == 0 else P()
            like = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(
                mesh((8, 1)), spec if len(shape) > 1 else P()))
            if key == "grid":
                like = jax.ShapeDtypeStruct(shape, jnp.float32,
                                            sharding=NamedSharding(m24, P("x", None)))
            got = cv.load(d / "dt.h5", like={key: like})[key]
            ok[key] = np.asarray(got).tobytes() == full(shape, i).tobytes()
        checks["from_torch"] = ok
        stored = cv.load(d / "fsdp-1.h5")
        w0 = cv.load(d / "fsdp-1.h5", like={"model": {"0.weight": jax.ShapeDtypeStruct(
            (10, 6), jnp.float32, sharding=NamedSharding(m24, P(None, None)))}})
        checks["fsdp_to_jax"] = (np.asarray(w0["model"]["0.weight"]).tobytes()
                                 == stored["model/0.weight"].tobytes())
    # for the torch job: a value sharded over a 4 x 2 mesh
    src = jax.device_put(jnp.asarray(full((12, 8), 9)), NamedSharding(m42, P("x", "y")))
    cv.save(d / "jax.h5", {"j": src})
    print(json.dumps(checks))


if __name__ == "__main__":
    main()
