"""Framework objects wherever a checkpoint meets them: a torch module, optimizer, LR
scheduler or GradScaler and a registered JAX pytree node held by a ``cv.Module`` or
tracked by a ``cv.Trackable`` are saved and restored as ``cv.Checkpoint`` saves its own
arguments; tied torch weights stay tied through a restore onto the meta device."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")


class TiedLM(torch.nn.Module):  # type: ignore[misc]
    """An embedding and an output head sharing one weight (as GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.body = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.embed.weight


def test_tied_weights_stay_tied_on_a_meta_restore(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    path = cv.Checkpoint(model=model).save(tmp_path / "ckpt")
    with torch.device("meta"):
        lazy = TiedLM()
    assert lazy.lm_head.weight is lazy.embed.weight
    cv.Checkpoint(model=lazy).restore(path).assert_consumed()
    assert not lazy.embed.weight.is_meta
    assert lazy.lm_head.weight is lazy.embed.weight  # one parameter, as before the save
    assert torch.equal(lazy.embed.weight, model.embed.weight)
    assert torch.equal(lazy.body.weight, model.body.weight)
    with torch.no_grad():
        lazy.embed.weight[0, 0] = 42.0
    assert lazy.lm_head.weight[0, 0].item() == 42.0


class Net(cv.Module):
    """A cv.Module holding torch objects as attributes, beside a variable of its own."""

    def __init__(self, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        with torch.device(device):
            self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                torch.nn.Linear(8, 1))
        self.opt = torch.optim.AdamW(self.backbone.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        self.steps = cv.Variable(0, dtype="int64", trainable=False)

    def step(self) -> float:
        x = torch.linspace(-1, 1, 32).reshape(8, 4)
        self.opt.zero_grad()
        loss = ((self.backbone(x) - x[:, :1]) ** 2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.steps.assign_add(1)
        return float(loss.item())


def test_torch_objects_held_by_a_module_are_saved_and_restored(tmp_path: Path) -> None:
    net = Net()
    for _ in range(3):
        net.step()
    path = cv.Checkpoint(net=net).save(tmp_path / "ckpt")
    keys = [k for k, _, _ in cv.list_variables(path)]
    # the keys a checkpoint's own arguments get, under the attribute's name
    direct = cv.Checkpoint(backbone=net.backbone, opt=net.opt).write(tmp_path / "d.h5")
    assert {f"net/{k}" for k, _, _ in cv.list_variables(direct)} <= set(keys)
    assert "net/backbone/0.weight" in keys and "net/opt/state/0/exp_avg" in keys
    expected = [net.step() for _ in range(2)]

    fresh = Net(seed=1)
    assert fresh.variables == (fresh.steps,)  # torch's tensors are no cv variables
    cv.Checkpoint(net=fresh).restore(path).assert_consumed()
    assert int(fresh.steps.numpy()) == 3 and fresh.sched.last_epoch == 3
    assert fresh.scaler.state_dict() == Net().scaler.state_dict() | {"scale": 2.0 ** 11,
                                                                      "_growth_tracker": 1}
    assert [fresh.step() for _ in range(2)] == expected  # bit for bit


def test_a_torch_object_tracked_or_attached_later_is_restored(tmp_path: Path) -> None:
    net = Net()
    net.step()
    holder = cv.Trackable()
    holder.track("model", net.backbone)  # a trackable's tracked child
    path = cv.Checkpoint(net=net, holder=holder).save(tmp_path / "ckpt")
    assert "holder/model/0.weight" in [k for k, _, _ in cv.list_variables(path)]

    class Late(cv.Module):
        pass

    late, other = Late(), cv.Trackable()
    status = cv.Checkpoint(net=late, holder=other).restore(path)
    assert "backbone" in late.deferred_names() and other.deferred_names() == ["model"]
    late.backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 1))
    late.opt = torch.optim.AdamW(late.backbone.parameters(), lr=1.0)
    other.track("model", model := torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    for a, b, c in zip(late.backbone.parameters(), net.backbone.parameters(),
                       model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(c, b)
    assert late.opt.param_groups[0]["lr"] == 1e-2  # the stored hyper-parameters
    assert torch.equal(late.opt.state_dict()["state"][0]["exp_avg"],
                       net.opt.state_dict()["state"][0]["exp_avg"])
    status.assert_existing_objects_matched()


def test_a_module_on_the_meta_device_held_by_a_module_takes_its_storage(tmp_path: Path) -> None:
    net = Net()
    path = cv.Checkpoint(net=net).save(tmp_path / "ckpt")
    lazy = Net(device="meta")
    cv.Checkpoint(net=lazy).restore(path).assert_consumed()
    for a, b in zip(lazy.backbone.parameters(), net.backbone.parameters(), strict=True):
        assert not a.is_meta and torch.equal(a, b)


def test_a_trackable_attribute_holding_a_torch_module_is_said(tmp_path: Path) -> None:
    class Holder(cv.Trackable):
        def __init__(self) -> None:
            self.model = torch.nn.Linear(2, 2)
            self._private = torch.nn.Linear(2, 2)  # not state: quiet

    with pytest.warns(UserWarning, match=r"'h/model' is a torch.nn.modules.linear.Linear held "
                                         r"by the attribute 'model' of .*Holder.*not saved.*"
                                         r"self.track\('model', self.model\)"):
        path = cv.Checkpoint(h=Holder()).save(tmp_path / "ckpt")
    assert [k for k, _, _ in cv.list_variables(path)] == ["save_counter"]

    class Tracking(Holder):
        def __init__(self) -> None:
            super().__init__()
            self.track("net", self.model)  # tracked under another name: saved, quiet

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = cv.Checkpoint(h=Tracking()).save(tmp_path / "tracking")
    assert "h/net/weight" in [k for k, _, _ in cv.list_variables(path)]


def test_a_jax_pytree_node_held_by_a_module_is_saved_and_restored(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from dataclasses import dataclass

    @dataclass
    class State:
        step: Any
        params: Any
        note: str = "static"

    jax.tree_util.register_dataclass(State, data_fields=["step", "params"],
                                     meta_fields=["note"])

    class Model(cv.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.state = State(jnp.int32(7), {"w": jnp.full((2, 3), scale), "b": jnp.ones(3)})

    model = Model(0.5)
    path = cv.Checkpoint(model=model).save(tmp_path / "ckpt")
    keys = [k for k, _, _ in cv.list_variables(path)]
    assert keys == ["save_counter", "model/state/step", "model/state/params/w",
                    "model/state/params/b"]
    model.state = State(model.state.step + 1, model.state.params)  # the next state: saved
    assert cv.load(cv.Checkpoint(model=model).save(tmp_path / "next"),
                   )["model/state/step"] == 8

    fresh = Model(0.0)
    like = fresh.state
    cv.Checkpoint(model=fresh).restore(path).assert_consumed()
    assert type(fresh.state) is State and fresh.state is not like
    assert int(fresh.state.step) == 7 and fresh.state.note == "static"
    assert isinstance(fresh.state.params["w"], jax.Array)
    np.testing.assert_array_equal(np.asarray(fresh.state.params["w"]), np.full((2, 3), 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cv.Checkpoint(model=fresh).restore(path).assert_consumed()  # again: nothing said
    # set after the restore, on a module or by track(): restored as it is set
    late, box = cv.Module(name="late"), cv.Trackable()
    box.track("tree", State(jnp.int32(3), {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}))
    box_path = cv.Checkpoint(model=model, box=box).write(tmp_path / "box.h5")
    late_box = cv.Trackable()
    status = cv.Checkpoint(model=late, box=late_box).restore(box_path)
    late.state = State(jnp.int32(0), {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)})
    late_box.track("tree", State(jnp.int32(0), {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}))
    assert int(late.state.step) == 8 and int(late_box.trackable_children()["tree"].step) == 3
    status.assert_consumed()


def test_a_dict_of_jax_arrays_held_by_a_module_is_saved_and_restored(tmp_path: Path) -> None:
    """A module's ``self.params = {"w": jnp...}`` (an optax state beside it) was left
    out with a warning per array, though ``cv.Checkpoint(params=...)`` takes such a tree
    whole: now a module's attribute holding one is saved and restored as that tree."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")

    class Model(cv.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.params = {"w": jnp.full((2, 3), scale), "b": jnp.ones(3)}
            self.opt_state = optax.adam(1e-2).init(self.params)

    model = Model(0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = cv.Checkpoint(model=model).save(tmp_path / "ckpt")
    keys = {k for k, _, _ in cv.list_variables(path)}
    assert {"model/params/w", "model/params/b", "model/opt_state/0/mu/w"} <= keys
    fresh = Model(0.0)
    cv.Checkpoint(model=fresh).restore(path).assert_consumed()
    assert isinstance(fresh.params["w"], jax.Array)
    np.testing.assert_array_equal(np.asarray(fresh.params["w"]), np.full((2, 3), 0.5))
    assert type(fresh.opt_state) is type(model.opt_state)


def test_a_like_tree_holding_one_tensor_at_two_keys_gets_one_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    cv.save(tmp_path / "sd.h5", dict(model.state_dict()))
    with torch.device("meta"):
        lazy = TiedLM()
    like = lazy.state_dict(keep_vars=True)  # the tied parameter: one object at both keys
    back = cv.load(tmp_path / "sd.h5", like=like)
    assert back["lm_head.weight"] is back["embed.weight"]
    lazy.load_state_dict(back, assign=True)
    assert lazy.lm_head.weight.data_ptr() == lazy.embed.weight.data_ptr()
    assert torch.equal(lazy.embed.weight, model.embed.weight)
    # stored values that differ are never merged: each key keeps its own, and it is said
    untied = dict(model.state_dict())
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    cv.save(tmp_path / "untied.h5", untied)
    with pytest.warns(UserWarning, match=r"'lm_head.weight' and 'embed.weight', but .* differ"):
        back = cv.load(tmp_path / "untied.h5", like=like)
    assert torch.equal(back["lm_head.weight"], back["embed.weight"] + 1)


class Small(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 3)


def test_a_saved_module_holding_torch_objects_copies_and_pickles(tmp_path: Path) -> None:
    import copy
    import pickle

    small = Small()
    cv.Checkpoint(m=small).save(tmp_path / "a")  # its stand-ins are kept beside it
    for twin in (copy.deepcopy(small), pickle.loads(pickle.dumps(small))):
        assert twin.body is not small.body
        with torch.no_grad():
            twin.body.weight.fill_(3.0)
        path = cv.Checkpoint(m=twin).write(tmp_path / f"{id(twin)}.h5")
        assert (cv.load(path)["m/body/weight"] == 3.0).all()  # the twin's own values
    assert not (cv.load(cv.Checkpoint(m=small).write(tmp_path / "b.h5"))["m/body/weight"]
                == 3.0).all()
