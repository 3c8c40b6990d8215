"""A one-process save of a jax.Array over several devices writes each distinct shard's
box from its device buffer (no full host copy of the value) as one logical value, which a
restore onto another mesh reads bit for bit (run with 8 forced CPU devices in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvar.distributed import MPI_ENV_VARS

pytest.importorskip("jax", reason="JAX is not installed (the test extra has it)")

_CASE = r'''
import json, os, sys, tracemalloc
import numpy as np, jax, ml_dtypes
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ckptvar as cv

d = sys.argv[1]
devs = np.array(jax.devices()[:8])
src, dst = Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("x", "y"))
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 40)).astype(np.float32)
b = rng.standard_normal((8, 40)).astype(ml_dtypes.bfloat16)
tree = {"w": jax.device_put(w, NamedSharding(src, P("x", "y"))),      # 8 distinct boxes
        "b": jax.device_put(b, NamedSharding(src, P(None, "y"))),      # 4 boxes, 2 replicas each
        "r": jax.device_put(w[:4], NamedSharding(src, P())),           # replicated: one box
        "step": 3, "count": jax.numpy.int32(5)}  # a 0-d leaf on one device stays 0-d
path = cv.save(os.path.join(d, "t.h5"), tree)
like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(dst, P("x", None))),
        "b": jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(dst, P(None, "x"))),
        "r": jax.ShapeDtypeStruct((4, 40), w.dtype, sharding=NamedSharding(dst, P("y"))),
        "step": 0, "count": jax.numpy.int32(0)}
got = cv.load(path, like=like)
# a 0-d leaf restored onto a mesh (an optimizer's count, replicated): stays 0-d
on_mesh = cv.load(path, like={**like, "count": jax.ShapeDtypeStruct(
    (), np.int32, sharding=NamedSharding(dst, P()))})["count"]
plain = cv.load(path)  # one plain process: the logical values
# a zero-size value sharded over the devices (every shard empty) is kept, not dropped
empty = {"e": jax.device_put(np.zeros((0, 4), np.float32), NamedSharding(src, P(None, "y")))}
epath = cv.save(os.path.join(d, "e.h5"), empty)
empty_back = cv.load(epath, like=empty)
empty_kept = [cv.list_variables(epath)[0][:2], list(empty_back["e"].shape),
              empty_back["e"].sharding == empty["e"].sharding]
with cv.open(path) as reader:
    stored = {k: list(reader.info(k).shape) for k in ("w", "b", "r")}
index = os.path.join(path, "ckptvar-index.msgpack")
import msgpack
with open(index, "rb") as f:
    boxes = {k: len(v["boxes"]) for k, v in msgpack.unpackb(f.read())["variables"].items()}

# a .zarr step: the shards are the chunks of one global Zarr array, as plain zarr reads it
big_w = rng.standard_normal((512, 256)).astype(np.float32)
zpath = cv.save(os.path.join(d, "t.zarr"), {"w": jax.device_put(big_w, NamedSharding(src, P("x", "y"))),
                                            "w_small": tree["w"]})
import zarr
zlike = {"w": jax.ShapeDtypeStruct(big_w.shape, big_w.dtype, sharding=NamedSharding(dst, P("x"))),
         "w_small": like["w"]}
zgot = cv.load(zpath, like=zlike)
zarr_ok = [bool(np.array_equal(zarr.open_group(zpath, mode="r")["w"][:], big_w)),
           bool(np.array_equal(np.asarray(zgot["w"]), big_w)),
           bool(np.array_equal(np.asarray(zgot["w_small"]), w))]

try:  # writer options are the one-file writer's: refused, never dropped
    cv.save(os.path.join(d, "nd.h5"), tree, durable=False)
    refused = ""
except TypeError as exc:
    refused = str(exc)
refused = refused if not os.path.exists(os.path.join(d, "nd.h5")) else "written"

# a like= sharding that cannot split its shape (4 rows over 8 devices): named by its key
# before anything is read
try:
    cv.load(path, like={**like, "r": jax.ShapeDtypeStruct(
        (4, 40), w.dtype, sharding=NamedSharding(src, P(("x", "y"))))})
    indivisible = ""
except Exception as exc:
    indivisible = f"{type(exc).__name__}: {exc}"

# the host memory a save allocates: a fraction of the value, not a copy of it
big = jax.device_put(np.ones((2048, 1024), np.float32), NamedSharding(src, P("x", "y")))
tracemalloc.start()
cv.save(os.path.join(d, "big.h5"), {"big": big})
_, peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
print(json.dumps({
    "bits": {k: np.asarray(got[k]).view(np.uint8).tobytes() == ref.view(np.uint8).tobytes()
             for k, ref in (("w", w), ("b", b), ("r", w[:4]))},
    "plain": bool(np.array_equal(plain["w"], w) and np.array_equal(plain["b"], b)),
    "sharding": all(got[k].sharding == like[k].sharding for k in ("w", "b", "r")),
    "step": got["step"], "count": [int(got["count"]), list(plain["count"].shape)],
    "empty": [[e[0], list(e[1])] if isinstance(e, tuple) else e for e in empty_kept],
    "count_on_mesh": [int(on_mesh), list(on_mesh.shape), len(on_mesh.sharding.device_set)],
    "stored": stored, "boxes": boxes,
    "zarr": zarr_ok, "refused": refused, "indivisible": indivisible, "peak": peak,
    "nbytes": big.nbytes}))
'''


def test_a_multi_device_jax_array_is_saved_shard_by_shard(tmp_path: Path) -> None:
    script = tmp_path / "case.py"
    script.write_text(_CASE)
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                           env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bits"] == {"w": True, "b": True, "r": True}  # 2x4 -> 4x2 mesh, bit for bit
    assert got["sharding"] and got["plain"] and got["step"] == 3
    assert got["count"] == [5, []]
    assert got["count_on_mesh"] == [5, [], 8]
    assert got["empty"] == [["e", [0, 4]], [0, 4], True]
    assert got["zarr"] == [True, True, True]  # global array, and read back onto 4 x 2
    assert "writer options" in got["refused"] and "nd.h5" in got["refused"], got["refused"]
    # a like= sharding that cannot split its shape is named by its key, before any read
    assert got["indivisible"].startswith("CheckpointMismatchError: "), got["indivisible"]
    assert "'r'" in got["indivisible"] and "(4, 40)" in got["indivisible"], got["indivisible"]
    # one logical value each (its full shape), stored as its distinct boxes once each
    assert got["stored"] == {"w": [64, 40], "b": [8, 40], "r": [4, 40]}
    assert got["boxes"] == {"w": 8, "b": 4, "r": 1, "count": 1}
    # each shard written from its own buffer: no full-size (nor per-shard) host copies
    assert got["peak"] < 0.25 * got["nbytes"], got
