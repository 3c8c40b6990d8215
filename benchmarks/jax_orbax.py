"""The ``jax`` benchmark: a sharded pytree saved and restored into another mesh, ckptvar
against orbax-checkpoint's ``StandardCheckpointer``, in one process with 8 CPU devices.

Run ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.jax_orbax
[--mib M] [--repeats N]`` (orbax-checkpoint must be importable; without it only ckptvar
is timed). The tree: ``--mib`` MiB of random float32 in 8 arrays sharded ``P("x", "y")`` over a
2 x 4 mesh; the restore target: the same shapes as ``jax.ShapeDtypeStruct``s sharded
``P("x", None)`` over a 4 x 2 mesh. Best of ``--repeats``; ckptvar with checksums, durable
(fsync, atomic rename; each shard written from its buffer, never assembled on the host);
orbax with its own commit.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ckptvar as cv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    devs = np.array(jax.devices()[:8])
    src, dst = Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("x", "y"))
    rows = max(8, int((args.mib * 2**20 / 4 / 8) ** 0.5) // 8 * 8)
    rng = np.random.default_rng(0)  # incompressible: Orbax compresses (constants to ~0 bytes)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((rows, rows), np.float32),
                                    NamedSharding(src, P("x", "y"))) for i in range(8)}
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(dst, P("x", None)))
            for k, v in tree.items()}
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        ocp = None
    d = Path(tempfile.mkdtemp(prefix="ckptvar-jax-bench-"))
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out) if out is not None and name.endswith("restore") else None
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    try:
        for i in range(args.repeats):
            timed("ckptvar save", lambda i=i: cv.save(d / f"cv-{i}.h5", tree))
            got = timed("ckptvar restore", lambda i=i: cv.load(d / f"cv-{i}.h5", like=like))
            assert got["w3"].sharding == like["w3"].sharding
            if ocp is not None:
                ckptr = ocp.StandardCheckpointer()
                timed("orbax save", lambda i=i: (ckptr.save(d / f"ob-{i}", tree),
                                                 ckptr.wait_until_finished()) and None)
                timed("orbax restore", lambda i=i: ckptr.restore(d / f"ob-{i}", like))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"JAX pytree, {8 * rows * rows * 4 / 2**20:.0f} MiB, 2x4 -> 4x2 mesh, best of "
          f"{args.repeats}")
    for op, mine in (("save", "ckptvar save"), ("restore", "ckptvar restore")):
        a = best[mine]
        b = best.get(f"orbax {op}")
        ratio = f"{a / b:.2f}x" if b else "(orbax not installed)"
        print(f"{mine:16} {a:.3f} s  orbax {op} {b if b else float('nan'):.3f} s  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
