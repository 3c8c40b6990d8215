#!/usr/bin/env python3
"""Regenerate the foreign-format fixtures in ``fixtures/`` with the real libraries.

Each section runs only when its library is importable (TensorFlow + Keras,
PyTorch, safetensors, NumPy) and records, in ``fixtures/manifest.json``, every
tensor's key, dtype, shape and the SHA-256 of its C-order little-endian bytes
*as the producing library reports them* (``tf.train.load_checkpoint(...).get_tensor``,
``torch.load``, ``safetensors.numpy.load_file``, Keras' ``get_weights`` / h5py).
Sections whose library is missing keep their previous manifest entries, so the
script can be run once per environment::

    /path/to/tf-venv/bin/python scripts/make_fixtures.py     # tf, safetensors, npz
    KERAS_BACKEND=jax /path/to/keras-venv/bin/python scripts/make_fixtures.py keras
    /path/to/torch-venv/bin/python scripts/make_fixtures.py  # torch

ckptvar itself is never imported here: the fixtures are what other tools write.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = ROOT / "manifest.json"


def _sha(arr: np.ndarray) -> str:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _entry(dtype: str, shape: Any, arr: np.ndarray) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [int(d) for d in shape], "sha256": _sha(arr)}


def _have(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- TensorFlow


def make_tf(manifest: dict[str, Any]) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    producer = f"tensorflow {tf.__version__}"
    rng = _rng(0)

    # TF2 object-based checkpoint of a small module tree with many dtypes.
    out = ROOT / "tf2_object"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    class Dense(tf.Module):
        def __init__(self, n_in: int, n_out: int, name: str) -> None:
            super().__init__(name=name)
            self.kernel = tf.Variable(rng.normal(size=(n_in, n_out)).astype("float32"))
            self.bias = tf.Variable(rng.normal(size=(n_out,)).astype("float32"))

    class Model(tf.Module):
        def __init__(self) -> None:
            super().__init__(name="model")
            self.dense = Dense(4, 3, "dense")
            self.layers = [Dense(3, 2, "d0"), Dense(2, 2, "d1")]
            self.half = tf.Variable(rng.normal(size=(3, 2)).astype("float16"))
            self.bf16 = tf.Variable(tf.cast(rng.normal(size=(2, 5)), tf.bfloat16))
            self.steps = tf.Variable(np.array([1, -2, 3, 2**40], dtype="int64"))
            self.mask = tf.Variable(np.array([[True, False], [False, True]]))
            self.z = tf.Variable(
                (rng.normal(size=(3,)) + 1j * rng.normal(size=(3,))).astype("complex64")
            )
            self.z128 = tf.Variable(np.array([1 + 2j, -3.5j], dtype="complex128"))
            self.f64 = tf.Variable(rng.normal(size=(2, 2, 2)))
            self.i8 = tf.Variable(np.array([-128, 0, 127], dtype="int8"))
            self.u8 = tf.Variable(np.array([0, 200, 255], dtype="uint8"))
            self.i16 = tf.Variable(np.array([-30000, 5], dtype="int16"))
            self.i32 = tf.Variable(np.array(7, dtype="int32"))
            self.u16 = tf.Variable(np.array([65535, 1], dtype="uint16"))
            self.scalar = tf.Variable(3.25)
            self.empty = tf.Variable(np.zeros((0, 3), dtype="float32"))

    model = Model()
    opt_like = tf.Module(name="optimizer")
    opt_like.iterations = tf.Variable(np.int64(12))
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt_like)
    prefix = ckpt.write(str(out / "ckpt-1"))
    _record_tf(manifest, "tf2_object/ckpt-1", prefix, producer)

    # TF1 name-based checkpoint (Saver V2) with a partitioned variable.
    out = ROOT / "tf1_saver"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    graph = tf.Graph()
    with graph.as_default():
        v1 = tf.compat.v1
        with v1.variable_scope("layer1"):
            v1.get_variable("weights", initializer=rng.normal(size=(3, 4)).astype("float32"))
            v1.get_variable("biases", initializer=np.arange(4, dtype="float32"))
        v1.get_variable(
            "embedding",
            shape=(10, 3),
            dtype=tf.float32,
            initializer=v1.random_normal_initializer(seed=1),
            partitioner=v1.fixed_size_partitioner(3),
        )
        v1.get_variable(
            "wide",
            shape=(2, 7),
            dtype=tf.float64,
            initializer=v1.random_normal_initializer(seed=2, dtype=tf.float64),
            partitioner=v1.fixed_size_partitioner(2, axis=1),
        )
        v1.Variable(np.int64(5), name="global_step")
        saver = v1.train.Saver()
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            prefix = saver.save(sess, str(out / "model.ckpt"), write_meta_graph=False)
    _record_tf(manifest, "tf1_saver/model.ckpt", prefix, producer)
    for junk in out.glob("checkpoint"):
        junk.unlink()
    for junk in (ROOT / "tf2_object").glob("checkpoint"):
        junk.unlink()


def make_tf_sharded(manifest: dict[str, Any]) -> None:
    """A TF2 checkpoint split over three data files (``MaxShardSizePolicy``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    out = ROOT / "tf2_sharded"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = _rng(4)
    module = tf.Module(name="net")
    module.w = tf.Variable(rng.normal(size=(8, 8)).astype("float32"))
    module.v = tf.Variable(rng.normal(size=(64,)))
    module.n = tf.Variable(np.arange(10, dtype="int32"))
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=300)
    options = tf.train.CheckpointOptions(experimental_sharding_callback=policy)
    prefix = tf.train.Checkpoint(net=module).write(str(out / "ckpt"), options=options)
    assert len(list(out.glob("ckpt.data-*"))) > 1
    _record_tf(manifest, "tf2_sharded/ckpt", prefix, f"tensorflow {tf.__version__}")
    for junk in out.glob("checkpoint"):
        junk.unlink()


#: Value names that other formats escape, collide on or refuse (the conversion matrix,
#: tests/test_convert_matrix.py): dots, spaces, Unicode, a leading digit, ``:0``, a slash
#: and TF's own escape sequences inside a name, one longer than 255 bytes.
TRICKY_NAMES = ("a.b", "with space", "\u00fcn\u00ef", "0lead", "x:0", "a/b", "..S", "L" * 300)


def make_tf_names(manifest: dict[str, Any]) -> None:
    """A TF2 checkpoint of the names in ``TRICKY_NAMES`` (TensorFlow escapes ``.`` as
    ``..`` and ``/`` as ``.S`` in object keys), uint32/64 and a string; and a bundle of
    every ml_dtypes type TensorFlow names (float8 variants, int4/uint4, int2/uint2,
    float4)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    out = ROOT / "tf2_names"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    exp = tf.dtypes.experimental
    module = tf.Module(name="m")
    module.d = {name: tf.Variable(np.full(2, i, np.float32)) for i, name in enumerate(TRICKY_NAMES)}
    module.u32 = tf.Variable(np.array([1, 2**32 - 1], np.uint32))
    module.u64 = tf.Variable(np.array([1, 2**64 - 1], np.uint64))
    module.f8 = tf.Variable(np.array([0.5, -2.0]).astype(exp.float8_e4m3fn.as_numpy_dtype))
    module.i4 = tf.Variable(np.array([1, -8]).astype(exp.int4.as_numpy_dtype))
    module.text = tf.Variable("not a number")
    prefix = tf.train.Checkpoint(m=module).write(str(out / "ckpt-1"))
    _record_tf(manifest, "tf2_names/ckpt-1", prefix, f"tensorflow {tf.__version__}")
    # Every type tf.dtypes.experimental names, by SaveV2 itself (TensorFlow's CPU kernels
    # make no variable of the fnuz float8 types); built from NumPy arrays of TensorFlow's
    # own numpy types (its CPU Cast lacks some).
    names, tensors = [], []
    floats = np.array([0.5, 1.5, -2.0, 0.0], np.float32)
    ints = {"int4": [1, -2, 7, -8], "uint4": [1, 2, 15, 0], "int2": [1, -2, 0, -1],
            "uint2": [1, 2, 3, 0]}
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e4m3b11fnuz", "float4_e2m1fn", *ints):
        np_type = getattr(exp, name).as_numpy_dtype
        values = np.array(ints[name]) if name in ints else floats
        names.append(f"dtypes/{name}")
        tensors.append(tf.constant(values.astype(np_type)))
    tf.raw_ops.SaveV2(prefix=str(out / "dtypes"), tensor_names=names,
                      shape_and_slices=[""] * len(names), tensors=tensors)
    _record_tf(manifest, "tf2_names/dtypes", str(out / "dtypes"), f"tensorflow {tf.__version__}")
    for junk in out.glob("checkpoint"):
        junk.unlink()


def _record_tf(manifest: dict[str, Any], rel: str, prefix: str, producer: str) -> None:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    tensors = {}
    for key, shape in tf.train.list_variables(prefix):
        if dtypes[key] == tf.string:
            continue
        value = reader.get_tensor(key)
        tensors[key] = _entry(dtypes[key].name, shape, np.asarray(value))
    manifest["files"][rel] = {"format": "tf", "producer": producer, "tensors": tensors}


# --------------------------------------------------------------------------- Keras


def make_keras(manifest: dict[str, Any]) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import h5py
    import keras

    producer = f"keras {keras.__version__}"
    keras.utils.set_random_seed(1)
    out = ROOT / "keras"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    # One layer per dtype Keras stores: float32 and float16 as themselves, bfloat16 as
    # raw 16-bit integers with attrs["dtype"] = "bfloat16" (Keras 3's H5IOStore).
    inputs = keras.Input(shape=(5,), name="x")
    h = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Dense(3, name="half", dtype="float16")(h)
    h = keras.layers.Dense(3, name="brain", dtype="bfloat16")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    model = keras.Model(inputs, outputs, name="tiny")
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 2), "float32"), epochs=1, verbose=0)

    path = out / "tiny.weights.h5"
    model.save_weights(str(path))
    tensors = _keras_h5_tensors(path)
    # Cross-check with Keras' own view: every model weight is in the file, bit for bit.
    stored = {(t["dtype"], t["sha256"]) for t in tensors.values()}
    for w in model.weights:
        arr = np.asarray(w.numpy())
        assert (str(arr.dtype), _sha(arr)) in stored, w.path
    assert {"float32", "float16", "bfloat16"} <= {t["dtype"] for t in tensors.values()}
    manifest["files"]["keras/tiny.weights.h5"] = {
        "format": "keras",
        "producer": producer,
        "tensors": tensors,
    }

    # The whole model as a .keras archive: config.json, metadata.json, model.weights.h5.
    archive = out / "tiny.keras"
    model.save(str(archive))
    import zipfile

    with zipfile.ZipFile(archive) as zf:
        names = set(zf.namelist())
        assert {"config.json", "metadata.json", "model.weights.h5"} <= names, names
        inner = out / "_inner.weights.h5"
        inner.write_bytes(zf.read("model.weights.h5"))
    tensors = _keras_h5_tensors(inner)
    inner.unlink()
    reloaded = keras.models.load_model(str(archive))
    for a, b in zip(reloaded.weights, model.weights, strict=True):
        assert np.array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    manifest["files"]["keras/tiny.keras"] = {
        "format": "keras",
        "producer": producer,
        "tensors": tensors,
    }

    # Legacy Keras HDF5 weights as tf.keras 2.x wrote them (layer_names / weight_names
    # attributes). Keras 3 only reads this layout, so it is written with h5py in
    # exactly the structure of tf.keras' legacy ``save_weights_to_hdf5_group``, from
    # the model's own weights, and then loaded back by Keras to prove it is valid.
    # tf.keras 2.x had no bfloat16 convention for h5 weights: this model is float32.
    inputs = keras.Input(shape=(5,), name="x")
    h = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    model = keras.Model(inputs, outputs, name="tiny")
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 2), "float32"), epochs=1, verbose=0)
    legacy = out / "tiny_legacy.h5"
    tensors = {}
    with h5py.File(legacy, "w") as f:
        f.attrs["layer_names"] = np.array([ly.name.encode() for ly in model.layers])
        f.attrs["backend"] = b"tensorflow"
        f.attrs["keras_version"] = b"2.15.0"
        for layer in model.layers:
            g = f.create_group(layer.name)
            names = [f"{layer.name}/{_legacy_name(w)}:0" for w in layer.weights]
            g.attrs["weight_names"] = np.array([n.encode() for n in names])
            for name, w in zip(names, layer.weights, strict=True):
                arr = np.asarray(w.numpy())
                g.create_dataset(name, data=arr)
                tensors[name] = _entry(str(arr.dtype), arr.shape, arr)
    clone = keras.models.clone_model(model)
    clone.load_weights(str(legacy))  # Keras accepts the file as legacy h5 weights
    for a, b in zip(clone.weights, model.weights, strict=True):
        assert np.array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    manifest["files"]["keras/tiny_legacy.h5"] = {
        "format": "keras",
        "producer": producer + " (legacy h5 layout)",
        "tensors": tensors,
    }


def _keras_h5_tensors(path: Path) -> dict[str, Any]:
    """Every dataset of a Keras 3 weights file, read as Keras reads it (H5IOStore)."""
    import h5py
    import ml_dtypes

    tensors: dict[str, Any] = {}
    with h5py.File(path, "r") as f:

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                if obj.attrs.get("dtype") == "bfloat16":
                    arr = np.array(obj, dtype=ml_dtypes.bfloat16)
                else:
                    arr = obj[()]
                tensors[name] = _entry(str(arr.dtype), arr.shape, arr)

        f.visititems(visit)
    return tensors


def _legacy_name(w: Any) -> str:
    return w.path.split("/")[-1] if hasattr(w, "path") else w.name.split("/")[-1].split(":")[0]


# --------------------------------------------------------------------------- safetensors


def make_safetensors(manifest: dict[str, Any]) -> None:
    import ml_dtypes
    import safetensors
    from safetensors.numpy import load_file, save_file

    producer = f"safetensors {safetensors.__version__}"
    rng = _rng(2)
    out = ROOT / "safetensors"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tensors = {
        "model.embed.weight": rng.normal(size=(6, 4)).astype("float32"),
        "model.layers.0.attn.q_proj.weight": rng.normal(size=(4, 4)).astype("float16"),
        "model.layers.0.attn.q_proj.bias": rng.normal(size=(4,)).astype(ml_dtypes.bfloat16),
        "model.norm.eps": np.array(1e-6, dtype="float64"),
        "ids": np.array([[1, 2, 3], [4, 5, 6]], dtype="int64"),
        "flags": np.array([True, False, True]),
        "u8": np.arange(5, dtype="uint8"),
        "i32": np.array([-1, 2**31 - 1], dtype="int32"),
        "empty": np.zeros((2, 0), dtype="float32"),
    }
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "np", "note": "fixture"})
    loaded = load_file(str(path))
    names = {
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
        "float64": "F64",
        "int64": "I64",
        "bool": "BOOL",
        "uint8": "U8",
        "int32": "I32",
    }
    manifest["files"]["safetensors/model.safetensors"] = {
        "format": "safetensors",
        "producer": producer,
        "metadata": {"format": "np", "note": "fixture"},
        "tensors": {k: _entry(names[str(v.dtype)], v.shape, v) for k, v in sorted(loaded.items())},
    }


# --------------------------------------------------------------------------- npz


def make_npz(manifest: dict[str, Any]) -> None:
    rng = _rng(3)
    out = ROOT / "npz"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    arrays = {
        "weights": rng.normal(size=(5, 3)).astype("float32"),
        "fortran": np.asfortranarray(rng.normal(size=(3, 4))),
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "counts": np.arange(10, dtype="uint16"),
        "scalar": np.array(2.5),
        "flags": np.array([True, False]),
        "c64": np.array([1 + 1j, 2 - 3j], dtype="complex64"),
    }
    np.savez(out / "plain.npz", **arrays)
    np.savez_compressed(out / "compressed.npz", **arrays)
    for name in ("plain.npz", "compressed.npz"):
        with np.load(out / name, allow_pickle=False) as data:
            manifest["files"][f"npz/{name}"] = {
                "format": "npz",
                "producer": f"numpy {np.__version__}",
                "tensors": {
                    k: _entry(str(data[k].dtype.newbyteorder("=")), data[k].shape, data[k])
                    for k in data.files
                },
            }


# --------------------------------------------------------------------------- PyTorch


def make_torch(manifest: dict[str, Any]) -> None:
    import torch

    producer = f"torch {torch.__version__}"
    torch.manual_seed(0)
    out = ROOT / "torch"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state: dict[str, Any] = dict(net.state_dict())
    state.update(
        {
            "extra.bf16": torch.randn(3, 2).to(torch.bfloat16),
            "extra.fp16": torch.randn(5).to(torch.float16),
            "extra.int64": torch.tensor([1, -2, 2**40]),
            "extra.bool": torch.tensor([True, False, True]),
            "extra.f64": torch.randn(2, 2, dtype=torch.float64),
            "extra.c64": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
            "extra.u8": torch.tensor([0, 255], dtype=torch.uint8),
            "extra.i8": torch.tensor([-3, 3], dtype=torch.int8),
            "extra.i16": torch.tensor([-300, 300], dtype=torch.int16),
            "extra.i32": torch.tensor([7], dtype=torch.int32),
            # Views sharing one storage: a transpose (strided), a column, a row with offset.
            "shared.base": base,
            "shared.transposed": base.t(),
            "shared.column": base[:, 2],
            "shared.row_offset": base[3],
            "shared.every_other": base[::2, 1::3],
            "extra.scalar": torch.tensor(1.5),
            "extra.empty": torch.zeros(0, 3),
        }
    )
    full = {
        "model": state,
        "epoch": 3,
        "name": "fixture",
        "history": [0.5, 0.25],
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }
    torch.save(state, out / "state_dict.pt")
    torch.save(full, out / "nested.pth")
    torch.save(state, out / "legacy.bin", _use_new_zipfile_serialization=False)

    def rec(rel: str, obj: Any) -> None:
        tensors: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, torch.Tensor):
                t = value.detach().contiguous()
                arr = (
                    t.view(torch.int16).numpy().view("<u2")
                    if t.dtype == torch.bfloat16
                    else t.numpy()
                )
                tensors[prefix] = _entry(str(t.dtype).replace("torch.", ""), t.shape, arr)
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(value, list | tuple):
                for i, v in enumerate(value):
                    walk(f"{prefix}.{i}" if prefix else str(i), v)

        walk("", obj)
        manifest["files"][rel] = {"format": "torch", "producer": producer, "tensors": tensors}

    for name in ("state_dict.pt", "nested.pth", "legacy.bin"):
        rec(f"torch/{name}", torch.load(out / name, weights_only=True))


# --------------------------------------------------------------------------- PyTorch DCP


def _dcp_rank(rank: int, world: int, init: str, out: str) -> None:
    """One rank of the two-process DCP save: a row-sharded and a column-sharded DTensor."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full_rows = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    full_cols = torch.arange(36, dtype=torch.float64).reshape(3, 12) / 7
    state = {
        "rows": distribute_tensor(full_rows, mesh, [Shard(0)]),
        "cols": distribute_tensor(full_cols, mesh, [Shard(1)]),
        "bf16": distribute_tensor(torch.linspace(-2, 2, 10).to(torch.bfloat16), mesh, [Shard(0)]),
        "replicated": torch.tensor([1, 2, 3], dtype=torch.int64),
        "step": 11,
    }
    dcp.save(state, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def make_dcp(manifest: dict[str, Any]) -> None:
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    producer = f"torch {torch.__version__}"
    torch.manual_seed(0)
    out = ROOT / "dcp"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    # One process: a model and its Adam state after one step.
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    dcp.save(state, checkpoint_id=str(out / "single"))

    # Two processes (gloo): DTensors sharded across two .distcp files.
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.start_processes(
            _dcp_rank, args=(2, init, str(out / "two_ranks")), nprocs=2, start_method="spawn"
        )

    def rec(rel: str, expected: dict[str, Any]) -> None:
        tensors = {}
        for key, value in expected.items():
            arr = value.view(torch.int16).numpy() if value.dtype == torch.bfloat16 else value.numpy()
            dtype = str(value.dtype).removeprefix("torch.")
            tensors[key] = _entry(dtype, value.shape, arr)
        manifest["files"][rel] = {"format": "dcp", "producer": producer, "tensors": tensors}

    # What DCP's own loader reads back (dcp.load into empty tensors of the right shape).
    from torch.distributed.checkpoint import FileSystemReader

    for rel in ("dcp/single", "dcp/two_ranks"):
        meta = FileSystemReader(str(ROOT / rel)).read_metadata()
        target = {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if hasattr(m, "size")
        }
        dcp.load(target, checkpoint_id=str(ROOT / rel), no_dist=True)
        rec(rel, target)


# --------------------------------------------------------------------------- Orbax


def _orbax_tree() -> dict[str, Any]:
    import jax.numpy as jnp

    rng = _rng(7)
    return {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((4, 3)).astype(np.float32),
                "bias": np.arange(3, dtype=np.float32),
            },
            "embed": jnp.asarray(rng.standard_normal((5, 2)), dtype=jnp.bfloat16),
            "big": np.arange(600, dtype=np.float32).reshape(30, 20),
        },
        "opt_state": {"count": np.array(7, dtype=np.int32), "mu": np.ones((3,), np.float64)},
        "mask": np.array([True, False, True]),
    }


def make_orbax(manifest: dict[str, Any]) -> None:
    import jax
    import orbax.checkpoint as ocp

    version = importlib.metadata.version("orbax-checkpoint")
    producer = f"orbax-checkpoint {version}"
    out = ROOT / "orbax"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tree = _orbax_tree()

    # OCDBT (the default), through a CheckpointManager: step 5 of a run directory.
    with ocp.CheckpointManager(out / "ocdbt_run") as mngr:
        mngr.save(5, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
    # Per-array Zarr (use_ocdbt=False), the older layout, straight to a directory.
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save((out / "zarr_step").absolute(), args=ocp.args.PyTreeSave(tree))

    def rec(rel: str, restored: Any) -> None:
        tensors = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
            key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
            arr = np.asarray(leaf)
            name = str(arr.dtype)
            raw = arr.view(np.uint16) if name == "bfloat16" else arr
            tensors[key] = _entry(name, arr.shape, raw)
        manifest["files"][rel] = {"format": "orbax", "producer": producer, "tensors": tensors}

    with ocp.CheckpointManager(out / "ocdbt_run") as mngr:
        rec("orbax/ocdbt_run/5", mngr.restore(5, args=ocp.args.StandardRestore()))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        rec("orbax/zarr_step", ckptr.restore((out / "zarr_step").absolute()))


def make_orbax_more(manifest: dict[str, Any]) -> None:
    """A CheckpointManager run of two steps (per-array Zarr), and use_zarr3=True steps."""
    import jax
    import orbax.checkpoint as ocp

    version = importlib.metadata.version("orbax-checkpoint")
    producer = f"orbax-checkpoint {version}"
    out = ROOT / "orbax"
    small = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.array(0, np.int32)}
    for name in ("run", "zarr3_step"):
        shutil.rmtree(out / name, ignore_errors=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=None)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.CheckpointManager(
        (out / "run").absolute(), options=options, item_handlers=handler
    ) as mngr:
        for step in (2, 10):  # 10 is the latest: numerically, not by name
            tree = {"w": small["w"] + step, "step": np.array(step, np.int32)}
            mngr.save(step, args=ocp.args.PyTreeSave(tree))
        mngr.wait_until_finished()
    # Zarr v3 (use_zarr3=True): per-array folders, and OCDBT; "zeros" equals the fill
    # value, so Orbax stores no chunk for it.
    tree3 = {**_orbax_tree()["params"], "mask": np.array([True, False, True]),
             "zeros": np.zeros((4, 4), np.float32)}
    for name, ocdbt in (("zarr3_step", False), ("ocdbt_zarr3_step", True)):
        shutil.rmtree(out / name, ignore_errors=True)
        handler3 = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
        with ocp.Checkpointer(handler3) as ckptr:
            ckptr.save((out / name).absolute(), args=ocp.args.PyTreeSave(tree3))

    def rec(rel: str, restored: Any) -> None:
        tensors = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
            key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
            arr = np.asarray(leaf)
            name = str(arr.dtype)
            raw = arr.view(np.uint16) if name == "bfloat16" else arr
            tensors[key] = _entry(name, arr.shape, raw)
        manifest["files"][rel] = {"format": "orbax", "producer": producer, "tensors": tensors}

    with ocp.CheckpointManager((out / "run").absolute(), item_handlers=handler) as mngr:
        for step in (2, 10):
            rec(f"orbax/run/{step}", mngr.restore(step))
    for name in ("zarr3_step", "ocdbt_zarr3_step"):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as ckptr:
            rec(f"orbax/{name}", ckptr.restore((out / name).absolute()))


def make_orbax_names(manifest: dict[str, Any]) -> None:
    """A per-array Zarr step whose pytree has a key holding ``/`` beside the same path
    nested (``{"a/b": ..., "a": {"b": ...}}``: Orbax keeps both, in ``a/b/`` and ``a.b/``)
    and the other names of ``TRICKY_NAMES`` a file system takes."""
    import jax
    import orbax.checkpoint as ocp

    producer = f"orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')}"
    out = ROOT / "orbax" / "names_step"
    shutil.rmtree(out, ignore_errors=True)
    tree: dict[str, Any] = {"a/b": np.full(2, 1, np.float32), "a": {"b": np.full(2, 2, np.float32)}}
    tree["n"] = {name: np.full(2, i, np.float32)
                 for i, name in enumerate(TRICKY_NAMES) if "/" not in name and len(name) < 100}
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(out.absolute(), args=ocp.args.PyTreeSave(tree))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        restored = ckptr.restore(out.absolute())
    tensors = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        arr = np.asarray(leaf)
        if key in tensors:  # two pytree paths, one key: the manifest keeps the one nested
            continue
        tensors[key] = _entry(str(arr.dtype), arr.shape, arr)
    manifest["files"]["orbax/names_step"] = {"format": "orbax", "producer": producer,
                                             "tensors": tensors}


# --------------------------------------------------------------------------- HF sharded


def make_hf_sharded(manifest: dict[str, Any]) -> None:
    import torch
    import transformers

    producer = f"transformers {transformers.__version__}"
    torch.manual_seed(0)
    out = ROOT / "hf_sharded"
    shutil.rmtree(out, ignore_errors=True)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    model = transformers.BertModel(config)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20KB")
    # What transformers reads back is what the manifest records.
    loaded = transformers.BertModel.from_pretrained(out)
    tensors = {}
    for key, value in loaded.state_dict().items():
        tensors[key] = _entry("float32", value.shape, value.numpy())
    manifest["files"]["hf_sharded"] = {
        "format": "hf-safetensors",
        "producer": producer,
        "tensors": tensors,
    }


def main() -> int:
    manifest: dict[str, Any] = {"files": {}}
    if MANIFEST.exists():
        manifest = json.loads(MANIFEST.read_text())
    ran = []
    sections = [
        ("tensorflow", make_tf),
        ("tensorflow", make_tf_sharded),
        ("tensorflow", make_tf_names),
        ("keras", make_keras),
        ("safetensors", make_safetensors),
        ("numpy", make_npz),
        ("torch", make_torch),
        ("torch", make_dcp),
        ("orbax", make_orbax),
        ("orbax", make_orbax_more),
        ("orbax", make_orbax_names),
        ("transformers", make_hf_sharded),
    ]
    only = set(sys.argv[1:])
    for lib, fn in sections:
        if only and fn.__name__.removeprefix("make_") not in only:
            continue
        if _have(lib):
            fn(manifest)
            ran.append(fn.__name__.removeprefix("make_"))
        else:
            print(f"skipping {fn.__name__}: {lib} is not installed")
    manifest["files"] = dict(sorted(manifest["files"].items()))
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    print("regenerated:", ", ".join(ran) or "nothing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
