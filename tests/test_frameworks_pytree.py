"""Pytrees in cv.save/cv.load: nested dicts, lists, tuples and namedtuples of NumPy, torch
and JAX arrays and Python values, stored under their /-joined paths and loaded back with
like= into the same structure and the same kinds of arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")
jax = pytest.importorskip("jax", reason="JAX is not installed (the test extra has it)")
jnp = jax.numpy


class AdamState(NamedTuple):
    """The shape of optax's ScaleByAdamState (optax is not installed here)."""

    count: Any
    mu: Any
    nu: Any


def _tree() -> dict[str, Any]:
    return {
        "params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                   "t": torch.arange(4, dtype=torch.bfloat16)},
        "opt": [AdamState(jnp.int32(3), {"w": jnp.ones((2, 3))}, {"w": jnp.full((2, 3), 2.0)}),
                None],
        "hyper": {"lr": 1e-3, "betas": (0.9, 0.99), "name": "adamw", "steps": 7, "on": True},
        "scale": np.float64(0.5),
        "empty": [],
        3: "int key",
    }


def _zeros() -> dict[str, Any]:
    return {
        "params": {"w": np.zeros((2, 3), np.float32), "t": torch.zeros(4, dtype=torch.bfloat16)},
        "opt": [AdamState(jnp.int32(0), {"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((2, 3))}),
                None],
        "hyper": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "steps": 0, "on": False},
        "scale": np.float64(0),
        "empty": [],
        3: "",
    }


def test_a_tree_round_trips_with_its_structure_and_kinds(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "t.h5", _tree())
    assert [k for k, _, _ in cv.list_variables(path)] == [
        "params/w", "params/t", "opt/0/count", "opt/0/mu/w", "opt/0/nu/w", "scale"]
    out = cv.load(path, like=_zeros())
    assert isinstance(out["params"]["w"], np.ndarray)
    assert out["params"]["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    t = out["params"]["t"]
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.tolist() == [0, 1, 2, 3]
    state = out["opt"][0]
    assert type(state) is AdamState and isinstance(state.count, jax.Array)
    assert int(state.count) == 3 and state.count.dtype == jnp.int32
    assert np.asarray(state.nu["w"]).tolist() == [[2.0] * 3] * 2
    assert out["opt"][1] is None
    assert out["hyper"] == {"lr": 1e-3, "betas": (0.9, 0.99), "name": "adamw", "steps": 7,
                            "on": True}
    assert type(out["hyper"]["betas"]) is tuple and type(out["hyper"]["steps"]) is int
    assert type(out["scale"]) is np.float64 and out["scale"] == 0.5
    assert out["empty"] == [] and out[3] == "int key"
    # one plain process still sees the arrays by their keys
    assert cv.load(path)["opt/0/mu/w"].tolist() == [[1.0] * 3] * 2
    assert cv.load(path)["params/t"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_a_leaf_that_does_not_fit_names_its_key_and_nothing_is_loaded(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "t.h5", _tree())
    like = _zeros()
    like["opt"][0] = AdamState(jnp.int32(0), {"w": jnp.zeros((3, 2))}, {"w": jnp.zeros((2, 3))})
    with pytest.raises(cv.CheckpointMismatchError, match=r"'opt/0/mu/w'.*\(3, 2\)"):
        cv.load(path, like=like)
    like = _zeros()
    like["params"]["w"] = np.zeros((2, 3), np.float64)
    with pytest.raises(cv.CheckpointMismatchError, match=r"'params/w'.*float64.*float32"):
        cv.load(path, like=like)
    with pytest.warns(UserWarning, match=r"'params/w' \(float32 -> float64\)"):
        out = cv.load(path, like=like, cast=True)
    assert out["params"]["w"].dtype == np.float64 and out["params"]["w"][1, 2] == 5
    like = _zeros()
    like["hyper"]["missing"] = 1
    with pytest.raises(cv.CheckpointMismatchError, match=r"'hyper/missing'"):
        cv.load(path, like=like)


def test_a_like_key_the_checkpoint_lacks_is_a_key_error_too(tmp_path: Path) -> None:
    """API.md section 10: missing keys are KeyErrors (as cv.load(keys=...) and
    Saver.restore raise); a like= tree's key was only a CheckpointMismatchError."""
    path = cv.save(tmp_path / "t.h5", {"w": np.ones(2), "step": 3})
    for like in ({"w": np.zeros(2), "b": np.zeros(1)}, {"w": np.zeros(2), "epoch": 0}):
        with pytest.raises(KeyError) as err:
            cv.load(path, like=like)
        assert isinstance(err.value, cv.CheckpointMismatchError)
        assert "has no value for" in str(err.value) and not str(err.value).startswith('"')


def test_flat_dicts_save_as_before_and_bad_leaves_are_named(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "flat.h5", {"a/b": np.ones(2), "c": np.zeros(1)},
                   metadata={"run": 1})
    assert [k for k, _, _ in cv.list_variables(path)] == ["a/b", "c"]
    with cv.open(path) as reader:
        assert reader.metadata() == {"run": 1}
    out = cv.load(path, like={"a": {"b": np.empty(2)}, "c": np.empty(1)})  # same keys
    assert out["a"]["b"].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match=r"'x/0'.*builtins\.object"):
        cv.save(tmp_path / "bad.h5", {"x": [object()]})
    assert not (tmp_path / "bad.h5").exists()
    p = cv.save(tmp_path / "m.h5", {"x": 1, "y": np.ones(1)}, metadata={"run": 2})
    with cv.open(p) as reader:
        assert reader.metadata()["run"] == 2


def test_jax_arrays_come_back_with_the_target_sharding(tmp_path: Path) -> None:
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    path = cv.save(tmp_path / "j.h5", {"w": jnp.arange(6.0).reshape(2, 3)})
    out = cv.load(path, like={"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=sharding)})
    assert isinstance(out["w"], jax.Array) and out["w"].sharding == sharding
    assert np.asarray(out["w"]).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_64_bit_jax_like_without_x64_is_refused_not_narrowed(tmp_path: Path) -> None:
    """A ShapeDtypeStruct may say float64 while JAX runs without 64-bit types: the result
    used to be a float32 jax.Array (the values narrowed, nothing said); it is an error
    naming the key and the way out, and cast=True with a 32-bit like converts."""
    if jax.config.jax_enable_x64:
        pytest.skip("JAX runs with 64-bit types here")
    path = cv.save(tmp_path / "j.h5", {"w": np.arange(3.0) / 3, "z": np.ones(2, np.complex128)})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for kw in ({}, {"sharding": sharding}):
        like = {"w": jax.ShapeDtypeStruct((3,), np.float64, **kw),
                "z": jax.ShapeDtypeStruct((2,), np.complex128, **kw)}
        with pytest.raises(cv.CheckpointMismatchError,
                           match=r"jax_enable_x64.*'w' \(float64 -> float32\), 'z' "
                                 r"\(complex128 -> complex64\)"):
            cv.load(path, like=like)
    like = {"w": jax.ShapeDtypeStruct((3,), np.float32), "z": np.zeros(2, np.complex128)}
    with pytest.warns(UserWarning, match=r"'w' \(float64 -> float32\)"):
        out = cv.load(path, like=like, cast=True)
    assert out["w"].dtype == np.float32 and float(out["w"][1]) == np.float32(1 / 3)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_are_saved_as_their_key_data(tmp_path: Path, impl: str) -> None:
    # a typed key (jax.random.key) is a jax.Array with no NumPy dtype: its key data is
    # stored, and a like= key (an array or a ShapeDtypeStruct) gives back a typed key
    key = jax.random.key(7, impl=impl)
    keys = jax.random.split(jax.random.key(1, impl=impl), 3)
    tree = {"rng": key, "per_layer": keys, "w": jnp.ones(2)}
    path = cv.save(tmp_path / "k.h5", tree)
    stored = {k: (shape, dtype) for k, shape, dtype in cv.list_variables(path)}
    assert stored["rng"] == (jax.random.key_data(key).shape, np.dtype("uint32"))
    like = {"rng": jax.random.key(0, impl=impl),
            "per_layer": jax.ShapeDtypeStruct(keys.shape, keys.dtype), "w": jnp.zeros(2)}
    back = cv.load(path, like=like)
    for name in ("rng", "per_layer"):
        assert back[name].dtype == tree[name].dtype, name
        assert (jax.random.key_data(back[name]) == jax.random.key_data(tree[name])).all()
    assert (jax.random.uniform(back["rng"]) == jax.random.uniform(key)).all()
    assert (cv.load(path)["rng"] == np.asarray(jax.random.key_data(key))).all()  # the bits


def test_a_step_saved_as_a_0d_array_loads_into_a_python_number(tmp_path: Path) -> None:
    # a train state's step is an int before the first jitted step and a 0-d array after:
    # like= with the int takes the stored 0-d array as that Python number
    path = cv.save(tmp_path / "s.h5", {"step": jnp.int32(5), "loss": np.float32(0.25),
                                       "done": np.bool_(True), "lr": 0.1, "w": jnp.ones(2)})
    out = cv.load(path, like={"step": 0, "loss": 0.0, "done": False, "lr": 0.0,
                              "w": jnp.zeros(2)})
    assert out["step"] == 5 and type(out["step"]) is int
    assert out["loss"] == 0.25 and type(out["loss"]) is float
    assert out["done"] is True
    # what does not fit is said as it is, nothing loaded
    for like, said in (({"step": 0.0}, r"'step' is stored as an array \(int32, shape \(\)\)"),
                       ({"w": 0.0}, r"'w' is stored as an array \(float32, shape \(2,\)\)"),
                       ({"lr": jnp.zeros(())}, r"'lr' is stored as a Python value \(0\.1\)")):
        with pytest.raises(cv.CheckpointMismatchError, match=said):
            cv.load(path, like=like)


def test_a_like_tensor_on_the_meta_device_gives_the_stored_values(tmp_path: Path) -> None:
    # like= a meta module's state dict (no storage): the values come back on the CPU, to
    # load_state_dict(..., assign=True), never as meta tensors that dropped them
    model = torch.nn.Linear(3, 2)
    path = cv.save(tmp_path / "m.h5", model.state_dict())
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    out = cv.load(path, like=meta.state_dict())
    assert all(v.device.type == "cpu" for v in out.values())
    meta.load_state_dict(out, assign=True)
    assert torch.equal(meta.weight, model.weight) and torch.equal(meta.bias, model.bias)


class EmptyState(NamedTuple):
    """optax's EmptyState: a namedtuple with no fields (adamw's state holds two)."""


def test_empty_namedtuples_come_back_as_their_type(tmp_path: Path) -> None:
    from collections import OrderedDict  # noqa: PLC0415

    tree = {"opt": (AdamState(jnp.int32(1), {"w": jnp.ones(2)}, {"w": jnp.ones(2)}),
                    EmptyState(), EmptyState()),
            "od": OrderedDict(), "t": (), "l": []}
    path = cv.save(tmp_path / "o.h5", tree)
    back = cv.load(path, like=tree)
    assert type(back["opt"][1]) is EmptyState and type(back["opt"][2]) is EmptyState
    assert type(back["od"]) is OrderedDict and back["t"] == () and back["l"] == []
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_python_int_beyond_64_bits_is_refused_naming_where(tmp_path: Path, suffix: str) -> None:
    # msgpack holds 64-bit integers: a bigger one is named by its place, before writing
    path = tmp_path / f"t{suffix}"
    with pytest.raises(TypeError, match=r"2361183241434822606848.*'pytree/hyper/seed'"):
        cv.save(path, {"w": np.ones(2), "hyper": {"seed": 2**71, "lr": 0.1}})
    with pytest.raises(TypeError, match=r"-9223372036854775809.*'run/1'"):
        cv.save(path, {"w": np.ones(2)}, metadata={"run": [1, -2**63 - 1]})
    assert not list(tmp_path.iterdir())
    cv.save(path, {"w": np.ones(2)}, metadata={"edges": [2**64 - 1, -2**63]})  # the range


def test_a_bare_array_and_an_empty_key_load_back_with_like(tmp_path: Path) -> None:
    """cv.save(path, array) stores the array under the empty key (a leaf at the root), as
    cv.save keeps any key: cv.load(path, like=array) raised VariableArgumentError 'A variable
    name is a non-empty string, not '''."""
    bare = cv.save(tmp_path / "bare.h5", np.arange(3.0))
    assert cv.list_variables(bare) == [("", (3,), np.dtype("float64"))]
    assert cv.load(bare, like=np.zeros(3)).tolist() == [0.0, 1.0, 2.0]
    keyed = cv.save(tmp_path / "keyed.zarr", {"": np.ones(2, np.float32), "b": np.zeros(1)})
    back = cv.load(keyed, like={"": np.zeros(2, np.float32), "b": np.ones(1)})
    assert back[""].tolist() == [1.0, 1.0] and back["b"].tolist() == [0.0]
    with pytest.raises(cv.CheckpointMismatchError, match=r"expected shape \(4,\)"):
        cv.load(bare, like=np.zeros(4))
