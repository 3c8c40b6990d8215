"""Real JAX training loops (optax, a PRNG key in the state, a TrainState shaped like
flax's) checkpointed by a CheckpointManager: a run stopped at step k and resumed from
its latest checkpoint continues bit for bit like the run that never stopped, on one
device and restored onto another sharding of 8."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv

jax = pytest.importorskip("jax", reason="JAX is not installed (the test extra has it)")
optax = pytest.importorskip("optax", reason="optax is not installed (the test extra has it)")
jnp = jax.numpy


class TrainState:
    """Shaped like flax.training.train_state.TrainState, with the loop's PRNG key."""

    def __init__(self, step: Any, params: Any, opt_state: Any, key: Any, tx: Any) -> None:
        self.step, self.params, self.opt_state, self.key, self.tx = (
            step, params, opt_state, key, tx)


jax.tree_util.register_dataclass(TrainState, data_fields=["step", "params", "opt_state", "key"],
                                 meta_fields=["tx"])

_X = jax.random.normal(jax.random.key(1), (32, 8))
_Y = jax.random.normal(jax.random.key(2), (32, 1))
_TX = optax.chain(optax.clip_by_global_norm(1.0),
                  optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 20),
                              weight_decay=0.01))


def init(seed: int = 0) -> TrainState:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    params = {"dense": {"kernel": jax.random.normal(k1, (8, 16)) * 0.3, "bias": jnp.zeros(16)},
              "out": {"kernel": jax.random.normal(k2, (16, 1)) * 0.3, "bias": jnp.zeros(1)}}
    return TrainState(0, params, _TX.init(params), k3, _TX)


@jax.jit
def train_step(s: TrainState) -> tuple[TrainState, Any]:
    key, drop, batch = jax.random.split(s.key, 3)
    idx = jax.random.choice(batch, 32, (8,), replace=False)

    def loss_fn(p: Any) -> Any:
        h = jax.nn.relu(_X[idx] @ p["dense"]["kernel"] + p["dense"]["bias"])
        h = h * jax.random.bernoulli(drop, 0.8, h.shape) / 0.8
        return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"] - _Y[idx]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(s.params)
    updates, opt_state = s.tx.update(grads, s.opt_state, s.params)
    return TrainState(s.step + 1, optax.apply_updates(s.params, updates), opt_state, key,
                      s.tx), loss


def train(s: TrainState, steps: int, ckpt: Any = None, mgr: Any = None,
          every: int = 4) -> tuple[TrainState, list[float]]:
    losses = []
    for _ in range(steps):
        s, loss = train_step(s)
        losses.append(float(loss))
        if mgr is not None:
            ckpt.state = s
            if int(s.step) % every == 0:
                mgr.save()
    return s, losses


def same(a: Any, b: Any) -> bool:
    return all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                     strict=True))


@pytest.mark.parametrize("options", [
    {}, {"async_save": True}, {"incremental": True, "format": "zarr"}])
def test_a_stopped_run_resumes_bit_for_bit(tmp_path: Path, options: dict[str, Any]) -> None:
    ref, expected = train(init(), 13)

    s = init()
    ckpt = cv.Checkpoint(state=s)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2, **options)
    _, first = train(s, 10, ckpt, mgr)  # saved at 4 and 8, stopped at 10
    mgr.wait_until_finished()

    again = cv.Checkpoint(state=init(seed=7))  # a fresh state: its values are replaced
    mgr = cv.CheckpointManager(again, tmp_path, max_to_keep=2, **options)
    assert mgr.restore_or_initialize() is not None
    mgr.restore_status.assert_consumed()
    restored = again.state
    assert type(restored) is TrainState and restored.tx is _TX and restored.step == 8
    assert jnp.issubdtype(restored.key.dtype, jax.dtypes.prng_key)
    s, rest = train(restored, 5, again, mgr)
    mgr.wait_until_finished()
    assert first[:8] + rest == expected
    assert same(s.params, ref.params) and same(s.opt_state, ref.opt_state)


def test_restored_leaves_keep_the_like_trees_placement(tmp_path: Path) -> None:
    # a leaf jax placed by default (uncommitted: a jitted step may move it to the devices
    # of the other arguments) comes back so, not pinned to one device; a leaf the user
    # put on a device comes back there, as committed as it was
    key = jax.random.key(3)
    committed = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    tree = {"key": key, "w": jnp.ones(4), "c": committed}
    cv.save(tmp_path / "t.h5", tree)
    back = cv.load(tmp_path / "t.h5", like=tree)
    assert not back["key"].committed and not back["w"].committed
    assert back["c"].committed
    ckpt = cv.Checkpoint(state=init())
    ckpt.save(tmp_path / "ckpt")
    again = cv.Checkpoint(state=init(seed=1))
    again.restore(tmp_path / "ckpt-1.h5").assert_consumed()
    assert not any(leaf.committed for leaf in jax.tree.leaves(again.state)
                   if isinstance(leaf, jax.Array))


def test_a_plain_dict_of_jax_arrays_is_a_checkpoints_tree(tmp_path: Path) -> None:
    # a JAX loop without flax keeps its state in a dict (optax states are tuples)
    s, _ = train(init(), 3)
    state = {"params": s.params, "opt_state": s.opt_state, "key": s.key, "step": 3}
    ckpt = cv.Checkpoint(state=state)
    mgr = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    mgr.save()
    names = {k for k, _, _ in cv.list_variables(mgr.latest_checkpoint)}
    assert {"state/params/dense/kernel", "state/opt_state/1/0/mu/out/bias",
            "state/key"} <= names

    fresh = init(seed=5)
    again = cv.Checkpoint(state={"params": fresh.params, "opt_state": fresh.opt_state,
                                 "key": fresh.key, "step": 0})
    mgr = cv.CheckpointManager(again, tmp_path, max_to_keep=2)
    assert mgr.restore_or_initialize() is not None
    mgr.restore_status.assert_consumed()
    back = again.state
    assert type(back) is dict and back["step"] == 3
    assert type(back["opt_state"]) is type(s.opt_state)
    assert same(back["params"], s.params) and same(back["opt_state"], s.opt_state)
    assert bool((jax.random.key_data(back["key"]) == jax.random.key_data(s.key)).all())
    # NumPy arrays, which a user expects filled in place, still go in cv.Variables
    with pytest.raises(TypeError, match="holds arrays"):
        cv.Checkpoint(state={"w": np.zeros(3)})


@pytest.mark.slow
def test_a_run_sharded_over_8_devices_resumes_onto_another_mesh(tmp_path: Path) -> None:
    case = Path(__file__).parent / "mpi" / "jax_trainloop_case.py"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(case), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert checks["devices"] == 8 and checks["restored"] == "ckpt-2.h5" and checks["step"] == 8
    assert checks["same_bits"] and checks["sharding"] and checks["losses"]
