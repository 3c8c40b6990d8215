"""Registered JAX pytree nodes (a TrainState-shaped ``register_dataclass``, classes
registered with keys or without, FrozenDict-like mappings) in cv.save/cv.load and as a
cv.Checkpoint's argument: leaves named by their key paths as Orbax names them, rebuilt
from the like tree's structure with its static fields."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.distributed import MPI_ENV_VARS, SingleProcessCoordinator

jax = pytest.importorskip("jax", reason="JAX is not installed (the test extra has it)")
optax = pytest.importorskip("optax", reason="optax is not installed (the test extra has it)")
jnp = jax.numpy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Shaped like flax's ``TrainState`` (a ``flax.struct.dataclass``): ``apply_fn`` and
    ``tx`` are static fields, in the treedef, not leaves."""

    step: Any
    params: Any
    opt_state: Any
    apply_fn: Callable[..., Any] = dataclasses.field(metadata={"static": True})
    tx: Any = dataclasses.field(metadata={"static": True})

    @classmethod
    def create(cls, apply_fn: Callable[..., Any], params: Any, tx: Any) -> TrainState:
        return cls(0, params, tx.init(params), apply_fn, tx)


def _apply(params: Any, x: Any) -> Any:
    return x @ params["dense"]["kernel"] + params["dense"]["bias"]


def _params(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"dense": {"kernel": jnp.asarray(rng.standard_normal((4, 3), np.float32)),
                      "bias": jnp.asarray(rng.standard_normal(3).astype(jnp.bfloat16))},
            "scale": jnp.float32(seed)}


_TX = optax.adamw(1e-2)


def _next(s: TrainState) -> TrainState:
    """A step's worth of change to every leaf (no gradients: nothing to compile)."""
    bump = functools.partial(  # (in NumPy: no JAX op to compile)
        jax.tree.map, lambda a: jnp.asarray((np.asarray(a) * 1.5 + 1).astype(a.dtype)))
    return dataclasses.replace(s, step=jnp.int32(int(s.step) + 1), params=bump(s.params),
                               opt_state=bump(s.opt_state))


@functools.cache
def _trained(steps: int = 2) -> TrainState:
    """A state after ``steps`` steps (made once: JAX arrays are immutable)."""
    state = TrainState.create(_apply, _params(0), _TX)
    state = dataclasses.replace(state, step=jnp.int32(0))
    for _ in range(steps):
        state = _next(state)
    return state


def _fresh() -> TrainState:
    return TrainState.create(lambda p, x: None, jax.tree.map(jnp.zeros_like, _params(1)), _TX)


def _same(a: Any, b: Any) -> bool:
    """Same structure (node types, static fields) and bit-identical leaves."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(np.asarray(x).dtype == np.asarray(y).dtype
               and np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


#: (a jitted step gives dicts with sorted keys)
NAMES = ["step", "params/dense/bias", "params/dense/kernel", "params/scale",
         "opt_state/0/count", "opt_state/0/mu/dense/bias", "opt_state/0/mu/dense/kernel",
         "opt_state/0/mu/scale", "opt_state/0/nu/dense/bias", "opt_state/0/nu/dense/kernel",
         "opt_state/0/nu/scale"]


def test_a_train_state_round_trips_bit_exact_under_its_key_path_names(tmp_path: Path) -> None:
    state = _trained()
    path = cv.save(tmp_path / "ts.h5", state)
    assert [k for k, _, _ in cv.list_variables(path)] == NAMES
    with h5py.File(path, "r") as f:  # a plain reader sees the names
        assert f["opt_state/0/mu/dense/kernel"].shape == (4, 3)
        assert f["params/dense/kernel"].dtype == np.float32
    like = _fresh()
    back = cv.load(path, like=like)
    assert type(back) is TrainState and type(back.opt_state[0]) is type(state.opt_state[0])
    # the static fields are the like tree's, never the file's
    assert back.apply_fn is like.apply_fn and back.tx is like.tx
    assert _same(back.params, state.params) and _same(back.opt_state, state.opt_state)
    assert jax.tree.structure(dataclasses.replace(back, apply_fn=_apply, tx=state.tx)) == \
        jax.tree.structure(state)
    assert isinstance(back.params["dense"]["kernel"], jax.Array)
    # training goes on from it as from the state saved
    x = jnp.ones((2, 4))
    assert (_apply(back.params, x) == _apply(state.params, x)).all()
    # without like=, the plain names
    flat = cv.load(path)
    assert list(flat) == NAMES and int(flat["step"]) == 2


def test_a_step_stored_as_an_array_loads_into_the_likes_python_int(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "ts.h5", _trained())
    back = cv.load(path, like=_fresh())  # TrainState.create's step is the int 0
    assert back.step == 2 and type(back.step) is int


class Pair(NamedTuple):
    first: Any
    second: Any


class Keyed:
    """A class registered with keys: a dict key, an attribute and a sequence index."""

    def __init__(self, table: Any, attr: Any, seq: Any, tag: str) -> None:
        self.table, self.attr, self.seq, self.tag = table, attr, seq, tag


jax.tree_util.register_pytree_with_keys(
    Keyed,
    lambda k: (((jax.tree_util.DictKey("t"), k.table), (jax.tree_util.GetAttrKey("attr"),
                k.attr), (jax.tree_util.SequenceKey(3), k.seq)), k.tag),
    lambda tag, kids: Keyed(*kids, tag),
)


class Plain:
    """A class registered without keys (its children get FlattenedIndexKeys)."""

    def __init__(self, *kids: Any) -> None:
        self.kids = kids


jax.tree_util.register_pytree_node(Plain, lambda p: (p.kids, None), lambda _, kids: Plain(*kids))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Empty:
    """A node without children (its fields all static)."""

    name: str = dataclasses.field(default="e", metadata={"static": True})


def _nodes(v: float) -> dict[str, Any]:
    return {"k": Keyed(np.full(2, v), Pair(jnp.float32(v), None), [np.int64(v), "s"], "tag"),
            "p": [Plain(np.arange(3) * v, {"n": 1.5 * v}), Empty()]}


def test_custom_nodes_are_named_by_attribute_key_and_index(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "n.h5", _nodes(2.0))
    assert [k for k, _, _ in cv.list_variables(path)] == [
        "k/t", "k/attr/first", "k/3/0", "p/0/0"]
    back = cv.load(path, like=_nodes(0.0))
    assert type(back["k"]) is Keyed and back["k"].tag == "tag"
    assert back["k"].table.tolist() == [2.0, 2.0] and float(back["k"].attr.first) == 2.0
    assert type(back["k"].attr) is Pair and back["k"].attr.second is None
    assert back["k"].seq == [np.int64(2), "s"] and type(back["k"].seq[0]) is np.int64
    plain = back["p"][0]
    assert type(plain) is Plain and plain.kids[0].tolist() == [0, 2, 4]
    assert plain.kids[1] == {"n": 3.0}
    assert type(back["p"][1]) is Empty
    assert jax.tree.structure(back) == jax.tree.structure(_nodes(0.0))


class FrozenMap(Mapping[str, Any]):
    """A mapping registered with JAX (as flax's FrozenDict and nnx.State are)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._d = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


jax.tree_util.register_pytree_with_keys(
    FrozenMap,
    lambda m: ([(jax.tree_util.DictKey(k), m[k]) for k in sorted(m)], tuple(sorted(m))),
    lambda keys, kids: FrozenMap(dict(zip(keys, kids, strict=True))),
)


def test_a_registered_mapping_at_the_root_is_a_tree(tmp_path: Path) -> None:
    tree = FrozenMap({"b": np.ones(2), "a": {"c": np.zeros(1)}, "n": 3})
    path = cv.save(tmp_path / "m.h5", tree)  # not taken for a flat {name: array} mapping
    assert [k for k, _, _ in cv.list_variables(path)] == ["a/c", "b"]
    back = cv.load(path, like=FrozenMap({"a": {"c": np.ones(1)}, "b": np.zeros(2), "n": 0}))
    assert type(back) is FrozenMap and back["b"].tolist() == [1, 1] and back["n"] == 3


def test_a_key_that_cannot_name_a_value_is_refused_naming_where(tmp_path: Path) -> None:
    class Odd:
        def __init__(self, a: Any) -> None:
            self.a = a

    jax.tree_util.register_pytree_with_keys(
        Odd, lambda o: ((("not-a-key-type", o.a),), None), lambda _, kids: Odd(*kids),
        flatten_func=lambda o: ((o.a,), None))
    with pytest.raises(TypeError, match=r"child of 'x/1'.*'not-a-key-type'.*str.*GetAttrKey"):
        cv.save(tmp_path / "o.h5", {"x": [np.ones(1), Odd(np.ones(2))]})
    with pytest.raises(TypeError, match=r"child of 'x/1'"):
        cv.load(cv.save(tmp_path / "ok.h5", {"x": [np.ones(1)]}),
                like={"x": [np.ones(1), Odd(np.ones(2))]})

    class TupleKeys:
        def __init__(self, a: Any) -> None:
            self.a = a

    jax.tree_util.register_pytree_with_keys(
        TupleKeys, lambda o: (((jax.tree_util.DictKey((1, 2)), o.a),), None),
        lambda _, kids: TupleKeys(*kids))
    with pytest.raises(TypeError, match=r"child of 'the tree'.*\(1, 2\).*neither a str nor an int"):
        cv.save(tmp_path / "t.h5", TupleKeys(np.ones(1)))
    assert not list(tmp_path.glob("[ot].h5"))


def test_two_leaves_of_one_name_are_refused(tmp_path: Path) -> None:
    class Twice:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

    jax.tree_util.register_pytree_with_keys(
        Twice, lambda t: (((jax.tree_util.GetAttrKey("w"), t.a),
                           (jax.tree_util.DictKey("w"), t.b)), None),
        lambda _, kids: Twice(*kids))
    with pytest.raises(ValueError, match=r"Two leaves of the tree have the key 'm/w'"):
        cv.save(tmp_path / "t.h5", {"m": Twice(np.ones(1), np.ones(1))})


def test_a_leaf_that_does_not_fit_names_its_key_and_nothing_is_loaded(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "ts.h5", _trained())
    like = _fresh()
    bad = dataclasses.replace(like, params={**like.params, "scale": jnp.zeros((2,))})
    with pytest.raises(cv.CheckpointMismatchError, match=r"'params/scale'.*\(2,\)"):
        cv.load(path, like=bad)
    kernel = jnp.zeros((4, 3), jnp.float16)
    bad = dataclasses.replace(like, params={**like.params,
                                            "dense": {**like.params["dense"], "kernel": kernel}})
    with pytest.raises(cv.CheckpointMismatchError, match=r"'params/dense/kernel'.*float16"):
        cv.load(path, like=bad)
    with pytest.warns(UserWarning, match=r"'params/dense/kernel' \(float32 -> float16\)"):
        out = cv.load(path, like=bad, cast=True)
    assert out.params["dense"]["kernel"].dtype == jnp.float16
    more = dataclasses.replace(like, params={**like.params, "extra": jnp.zeros(2)})
    with pytest.raises(cv.CheckpointMismatchError, match=r"'params/extra'"):
        cv.load(path, like=more)


def test_abstract_leaves_give_arrays_with_their_sharding(tmp_path: Path) -> None:
    state = _trained()
    path = cv.save(tmp_path / "ts.h5", state)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        if isinstance(a, jax.Array) else a, _fresh())
    back = cv.load(path, like=abstract)
    assert back.params["dense"]["kernel"].sharding == sharding
    assert _same(back.params, state.params) and _same(back.opt_state, state.opt_state)


def test_a_collective_save_names_the_leaves_alike(tmp_path: Path) -> None:
    state = _trained()
    path = cv.save(tmp_path / "ts.h5", state, coordinator=SingleProcessCoordinator())
    assert sorted(k for k, _, _ in cv.list_variables(path)) == sorted(NAMES)
    back = cv.load(path, like=_fresh(), coordinator=SingleProcessCoordinator())
    assert _same(back.opt_state, state.opt_state) and back.step == 2


def test_a_checkpoint_saves_a_train_state_and_restores_into_a_like_one(tmp_path: Path) -> None:
    state = _trained()
    ckpt = cv.Checkpoint(state=state)
    path = ckpt.save(tmp_path / "ckpt")
    assert sorted(k for k, _, _ in cv.list_variables(path)) == sorted(
        ["save_counter"] + [f"state/{k}" for k in NAMES])
    like = _fresh()
    other = cv.Checkpoint(state=like)
    other.restore(path).assert_consumed()
    back = other.state  # the restored tree, a new one: JAX arrays are not written in place
    assert type(back) is TrainState and back.apply_fn is like.apply_fn and back.step == 2
    assert _same(back.params, state.params) and _same(back.opt_state, state.opt_state)
    # a mismatch changes nothing
    bad = dataclasses.replace(like, params={**like.params, "scale": jnp.zeros(3)})
    third = cv.Checkpoint(state=bad)
    with pytest.raises(cv.CheckpointMismatchError, match=r"state/params/scale"):
        third.restore(path)
    assert third.state is bad
    missing = cv.Checkpoint(state=dataclasses.replace(like, params={**like.params, "x": 1}))
    with pytest.raises(cv.CheckpointMismatchError, match=r"'state/params/x'"):
        missing.restore(path)


def test_a_train_state_in_a_container_of_a_checkpoint_is_refused() -> None:
    with pytest.raises(TypeError, match=r"'states/1' \(.*TrainState\).*own argument"):
        cv.Checkpoint(states=[cv.Variable(1.0), _fresh()])


def test_a_train_state_added_to_a_tracked_list_later_is_said_to_be_left_out(
        tmp_path: Path) -> None:
    states = [cv.Variable(1.0, name="lr")]
    ckpt = cv.Checkpoint(states=states)
    states.append(_fresh())  # after the constructor's check: the save says what it leaves out
    with pytest.warns(UserWarning, match=r"'states/1' is a .*TrainState in a container.*"
                                         r"own argument"):
        path = ckpt.save(tmp_path / "ckpt")
    assert [k for k, _, _ in cv.list_variables(path)] == ["save_counter", "states/0"]


def test_a_train_state_attached_after_the_restore_is_restored_then(tmp_path: Path) -> None:
    state = _trained()
    path = cv.Checkpoint(state=state).save(tmp_path / "ckpt")
    ckpt = cv.Checkpoint()
    status = ckpt.restore(path)
    like = _fresh()
    ckpt.state = like  # the restore's deferred values: the whole tree, built now
    assert ckpt.state is not like and type(ckpt.state) is TrainState and ckpt.state.step == 2
    assert ckpt.state.apply_fn is like.apply_fn
    assert _same(ckpt.state.params, state.params) and _same(ckpt.state.opt_state, state.opt_state)
    status.assert_consumed()


def test_a_manager_restores_the_latest_train_state(tmp_path: Path) -> None:
    state = _trained(1)
    ckpt = cv.Checkpoint(state=state)
    mgr = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=2)
    for _ in range(3):
        ckpt.state = _next(ckpt.state)
        mgr.save()
    fresh = cv.Checkpoint(state=_fresh())
    restored = cv.CheckpointManager(fresh, tmp_path / "run", max_to_keep=2)
    assert restored.restore_or_initialize() == mgr.latest_checkpoint
    assert fresh.state.step == 4
    assert _same(fresh.state.params, ckpt.state.params)
    assert _same(fresh.state.opt_state, ckpt.state.opt_state)
    # the restored tree saves again under the same names (the step as the array it was)
    again = fresh.save(tmp_path / "again")
    assert sorted(k for k, _, _ in cv.list_variables(again)) == sorted(
        ["save_counter"] + [f"state/{k}" for k in NAMES])


def test_an_incremental_manager_writes_only_the_leaves_a_new_state_changed(
        tmp_path: Path) -> None:
    # each step gives the checkpoint a new state; a leaf that is the very same jax.Array
    # (frozen parameters) keeps its variable, so an incremental step does not rewrite it
    frozen = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256), np.float32))
    ckpt = cv.Checkpoint(state=TrainState(jnp.int32(0), {"frozen": frozen, "w": jnp.zeros(3)},
                                          (), _apply, _TX))
    mgr = cv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=5, incremental=True)
    first = Path(mgr.save())
    ckpt.state = dataclasses.replace(ckpt.state, step=jnp.int32(1),
                                     params={"frozen": frozen, "w": jnp.ones(3)})
    second = Path(mgr.save())
    assert second.stat().st_size < first.stat().st_size // 10
    back = cv.Checkpoint(state=dataclasses.replace(
        ckpt.state, params={"frozen": jnp.zeros((256, 256)), "w": jnp.zeros(3)}))
    back.restore(second).assert_consumed()
    assert back.state.step == 1 and back.state.params["w"].tolist() == [1.0, 1.0, 1.0]
    assert (back.state.params["frozen"] == frozen).all()


_SHARDED = r'''
import dataclasses, json, sys
from typing import Any
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ckptvar as cv

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    step: Any
    params: Any
    fn: Any = dataclasses.field(metadata={"static": True}, default=None)

d = sys.argv[1]
devs = np.array(jax.devices()[:8])
src, dst = Mesh(devs.reshape(2, 4), ("x", "y")), Mesh(devs.reshape(4, 2), ("x", "y"))
w = np.arange(64 * 40, dtype=np.float32).reshape(64, 40)
params = {"w": jax.device_put(w, NamedSharding(src, P("x", "y"))), "b": jnp.ones(40)}
state = State(jnp.int32(3), params, fn=len)
path = cv.save(d + "/s.h5", state)  # a multi-device leaf: saved box by box
names = [k for k, _, _ in cv.list_variables(path)]
target = NamedSharding(dst, P("x", None))
like = State(0, {"w": jax.ShapeDtypeStruct((64, 40), jnp.float32, sharding=target),
                 "b": jax.ShapeDtypeStruct((40,), jnp.float32)}, fn=print)
back = cv.load(path, like=like)
ckpt = cv.Checkpoint(state=State(0, {"w": jax.ShapeDtypeStruct((64, 40), jnp.float32,
                                                              sharding=target),
                                     "b": jnp.zeros(40)}, fn=print))
ckpt.restore(cv.Checkpoint(state=state).save(d + "/ck")).assert_consumed()
out = {}
for name, tree in (("load", back), ("restore", ckpt.state)):
    out[name] = [type(tree).__name__, tree.fn is print, tree.step,
                 tree.params["w"].sharding == target,
                 bool((np.asarray(tree.params["w"]) == w).all()),
                 bool((np.asarray(tree.params["b"]) == 1).all())]
print(json.dumps({"names": names, **out}))
'''


def test_abstract_leaves_with_a_named_sharding_on_a_device_mesh(tmp_path: Path) -> None:
    script = tmp_path / "case.py"
    script.write_text(_SHARDED)
    env = {k: v for k, v in os.environ.items() if k not in MPI_ENV_VARS}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                           env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=180, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["names"] == ["step", "params/b", "params/w"] or sorted(got["names"]) == [
        "params/b", "params/w", "step"]
    assert got["load"] == ["State", True, 3, True, True, True]
    assert got["restore"] == ["State", True, 3, True, True, True]


def test_trees_need_no_jax(tmp_path: Path) -> None:
    # without JAX importable, trees of dicts, lists, tuples and namedtuples save and load
    # as always; with JAX installed but not imported, none of it imports JAX
    code = (
        "import sys, collections\n"
        "if sys.argv[2] == 'blocked': sys.modules['jax'] = None\n"
        "import numpy as np, ckptvar as cv\n"
        "P = collections.namedtuple('P', 'a b')\n"
        "tree = {'p': P(np.ones(2), [1, None]), 't': (np.zeros(1),)}\n"
        "path = cv.save(sys.argv[1] + '/t.h5', tree)\n"
        "back = cv.load(path, like=tree)\n"
        "assert type(back['p']) is P and back['p'].b == [1, None]\n"
        "ckpt = cv.Checkpoint(v=cv.Variable(np.ones(2)))\n"
        "ckpt.restore(ckpt.save(sys.argv[1] + '/c')).assert_consumed()\n"
        "try:\n"
        "    cv.save(sys.argv[1] + '/bad.h5', {'x': object()})\n"
        "except TypeError as exc:\n"
        "    print(exc)\n"
        "print('jax' in sys.modules and sys.modules['jax'] is not None)\n"
    )
    for how in ("blocked", "installed"):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), how],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(Path(__file__).parents[1]),
                                   os.environ.get("PYTHONPATH", "")])})
        assert proc.returncode == 0, proc.stderr[-3000:]
        said, imported = proc.stdout.strip().splitlines()
        assert "'x'" in said and "builtins.object" in said, said
        assert imported == "False", how
