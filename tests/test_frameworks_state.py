"""Framework state in cv.Checkpoint: torch modules, optimizers and LR schedulers (anything
with state_dict()/load_state_dict()) saved under their state-dict keys and restored in
place, all or nothing; training resumed from a checkpoint is bit-identical to training
that never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")


def _build(device: str = "cpu") -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


_X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
_Y = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))


def _step(model: Any, opt: Any, sched: Any) -> float:
    opt.zero_grad()
    loss = ((model(_X) - _Y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def test_resumed_training_is_bit_identical(tmp_path: Path) -> None:
    model, opt, sched = _build()
    uninterrupted = [_step(model, opt, sched) for _ in range(6)]

    model, opt, sched = _build()
    first = [_step(model, opt, sched) for _ in range(3)]
    path = cv.Checkpoint(model=model, optimizer=opt, sched=sched).save(tmp_path / "ckpt")
    keys = {k for k, _, _ in cv.list_variables(path)}
    with cv.open(path) as reader:  # a module's parameters train; optimizer state does not
        assert reader.info("model/0.weight").attrs["trainable"] is True
        assert reader.info("optimizer/state/0/exp_avg").attrs["trainable"] is False
    assert {"model/0.weight", "model/2.bias", "optimizer/state/0/exp_avg",
            "optimizer/state/3/exp_avg_sq", "optimizer/state/0/step"} <= keys

    model2, opt2, sched2 = _build()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    assert not opt2.state  # a fresh optimizer: its state comes from the checkpoint
    status = cv.Checkpoint(model=model2, optimizer=opt2, sched=sched2).restore(path)
    status.assert_consumed()
    assert [p.data_ptr() for p in model2.parameters()] == ptrs  # in place
    groups = opt2.state_dict()["param_groups"]
    assert groups[0]["betas"] == (0.8, 0.99) and type(groups[0]["betas"]) is tuple
    assert sched2.last_epoch == 3 and isinstance(sched2.state_dict()["_last_lr"], list)
    resumed = [_step(model2, opt2, sched2) for _ in range(3)]
    assert first + resumed == uninterrupted


def test_restore_changes_nothing_when_a_value_does_not_fit(tmp_path: Path) -> None:
    model, opt, sched = _build()
    _step(model, opt, sched)
    path = cv.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")
    torch.manual_seed(3)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(cv.CheckpointMismatchError, match=r"model/2\.weight"):
        cv.Checkpoint(model=other, optimizer=other_opt).restore(path)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    assert not other_opt.state and other_opt.param_groups[0]["lr"] == 0.5


def test_module_on_meta_device_gets_its_storage_from_the_checkpoint(tmp_path: Path) -> None:
    model, _, _ = _build()
    path = cv.Checkpoint(model=model).save(tmp_path / "ckpt")
    lazy, _, _ = _build(device="meta")
    assert all(p.is_meta for p in lazy.parameters())
    cv.Checkpoint(model=lazy).restore(path).assert_consumed()
    for a, b in zip(model.parameters(), lazy.parameters(), strict=True):
        assert not b.is_meta and torch.equal(a, b)
    out = lazy(_X)  # a working module
    assert out.shape == (16, 1)


def test_python_state_keeps_its_types(tmp_path: Path) -> None:
    class Thing:
        def __init__(self) -> None:
            self.sd: dict[str, Any] = {"w": torch.ones(3), "meta": {1: (2, 3.5), "n": None,
                                                                   "names": ["a", "b"]}}

        def state_dict(self) -> dict[str, Any]:
            return self.sd

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.sd = sd

    src = Thing()
    path = cv.Checkpoint(thing=src).save(tmp_path / "ckpt")
    assert cv.load(path)["thing/w"].tolist() == [1.0, 1.0, 1.0]
    dst = Thing()
    dst.sd = {"w": torch.zeros(3), "meta": {}}
    cv.Checkpoint(thing=dst).restore(path).assert_consumed()
    assert dst.sd["meta"] == {1: (2, 3.5), "n": None, "names": ["a", "b"]}
    assert type(dst.sd["meta"][1]) is tuple and torch.equal(dst.sd["w"], torch.ones(3))


def test_status_reports_tensors_the_checkpoint_lacks(tmp_path: Path) -> None:
    small = torch.nn.Linear(2, 2)
    path = cv.Checkpoint(model=small).save(tmp_path / "ckpt")
    big = torch.nn.Sequential(torch.nn.Linear(2, 2))
    status = cv.Checkpoint(model=big).restore(path)
    with pytest.raises(cv.RestoreAssertionError, match=r"model/0\.weight"):
        status.assert_consumed()
    np.testing.assert_array_equal(cv.load(path)["model/weight"], small.weight.detach().numpy())


class _CountingLinear(torch.nn.Linear):
    """A module that records each ``state_dict()`` call and whether autograd was on."""

    calls: list[bool]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.setdefault("calls", []).append(torch.is_grad_enabled())
        return super().state_dict(*args, **kwargs)


class _OwnStateDict(torch.nn.Module):
    """A module whose own ``state_dict`` takes no arguments (no ``keep_vars``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(4.0))

    def state_dict(self) -> Any:  # type: ignore[override]
        return {"w": self.w.detach()}


def test_a_module_with_its_own_state_dict_signature_is_saved(tmp_path: Path) -> None:
    path = cv.Checkpoint(model=_OwnStateDict()).write(tmp_path / "own.h5")
    assert cv.load(path)["model/w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_save_asks_each_object_once_without_autograd_and_sees_new_state(tmp_path: Path) -> None:
    # The fixed cost of a (background) save is the walk of the state dicts: it asks each
    # object for its state dict once (not once for the tensors and again for the Python
    # state) and walks it with autograd off (a DTensor's to_local() is then its local
    # tensor, not an autograd op). What a save keeps for the next (the variables over
    # the same tensors) never hides a change: new optimizer state and a replaced
    # parameter are saved as they are now.
    torch.manual_seed(0)
    model = _CountingLinear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = cv.Checkpoint(model=model, optimizer=opt)
    first = ckpt.write(tmp_path / "a.h5")
    assert model.calls == [False]
    assert not any(k.startswith("optimizer/state") for k, _, _ in cv.list_variables(first))

    model(torch.ones(3, 4)).sum().backward()
    opt.step()  # new optimizer state: exp_avg, exp_avg_sq, step
    with torch.no_grad():
        model.bias = torch.nn.Parameter(torch.full((2,), 7.0))  # a replaced parameter
    ckpt.write(tmp_path / "b.h5", blocking=False).wait()
    assert model.calls == [False, False]
    back = cv.load(tmp_path / "b.h5")
    assert {"optimizer/state/0/exp_avg", "optimizer/state/1/step"} <= set(back)
    assert back["model/bias"].tolist() == [7.0, 7.0]
    np.testing.assert_array_equal(back["optimizer/state/0/exp_avg"],
                                  opt.state[model.weight]["exp_avg"].numpy())
    assert torch.is_grad_enabled()  # the caller's mode is back as it was


class _Counter:
    """An object with state_dict()/load_state_dict(): a tensor and a plain count."""

    def __init__(self, shape: tuple[int, ...] = (3,)) -> None:
        self.n = 0
        self.w = torch.zeros(shape)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.w = sd["n"], sd["w"]


def test_background_saves_of_the_same_tensors_still_see_every_change(tmp_path: Path) -> None:
    # A background save of the same objects over the same tensors reuses the last save's
    # variables (no walk); whatever training changes between saves is still saved:
    # hyper-parameters, a scheduler's step, a plain value, a tensor given new memory
    # (.data), a transposed view over the same memory, an object replaced.
    model, opt, sched = _build()
    counter = _Counter()
    ckpt = cv.Checkpoint(model=model, optimizer=opt, scheduler=sched, counter=counter)
    for i in range(2):  # twice the same: the second save reuses the first's variables
        ckpt.write(tmp_path / f"warm{i}.h5", blocking=False).wait()

    def saved(name: str) -> tuple[dict[str, Any], Any, Any, Any]:
        ckpt.write(tmp_path / name, blocking=False).wait()
        m2, o2, s2 = _build()
        c2 = _Counter(tuple(ckpt.counter.w.shape))
        cv.Checkpoint(model=m2, optimizer=o2, scheduler=s2, counter=c2).restore(
            tmp_path / name).assert_consumed()
        return cv.load(tmp_path / name), o2, s2, c2

    _step(model, opt, sched)
    opt.param_groups[0]["lr"] = 0.125
    opt.param_groups[0]["betas"] = (0.5, 0.75)
    counter.n = 7
    counter.w += 2.0  # in place: the same memory
    values, o2, s2, c2 = saved("a.h5")
    assert o2.param_groups[0]["lr"] == 0.125 and o2.param_groups[0]["betas"] == (0.5, 0.75)
    assert s2.last_epoch == sched.last_epoch == 1
    assert c2.n == 7 and c2.w.tolist() == [2.0, 2.0, 2.0]
    np.testing.assert_array_equal(values["optimizer/state/0/exp_avg"],
                                  opt.state[model[0].weight]["exp_avg"].numpy())

    saved("b.h5")  # the same tensors again: reused
    sched.step()
    counter.n = 8
    with torch.no_grad():
        model[0].bias.data = torch.full((8,), 5.0)  # the same Parameter, new memory
        square = torch.arange(16.0).reshape(4, 4)
        counter.w = square
    values, _, s2, c2 = saved("c.h5")
    assert s2.last_epoch == 2 and c2.n == 8
    assert values["model/0.bias"].tolist() == [5.0] * 8
    counter.w = square.t()  # a new tensor object over the same memory, other strides
    values, _, _, c2 = saved("d.h5")
    np.testing.assert_array_equal(values["counter/w"], square.t().numpy())
    counter.w.data = square  # the same tensor object, its strides changed back
    values = saved("e.h5")[0]
    np.testing.assert_array_equal(values["counter/w"], square.numpy())

    ckpt.counter = _Counter()  # an object replaced
    values = saved("f.h5")[0]
    assert values["counter/w"].tolist() == [0.0, 0.0, 0.0]


def test_a_background_snapshot_is_the_state_at_the_call_with_reused_variables(
        tmp_path: Path) -> None:
    # The values of a reused-variables save are copied before write() returns: training
    # that changes them in place afterwards does not reach the file.
    model, opt, sched = _build()
    ckpt = cv.Checkpoint(model=model, optimizer=opt)
    _step(model, opt, sched)
    ckpt.write(tmp_path / "a.h5", blocking=False).wait()
    before = model[0].weight.detach().clone()
    handle = ckpt.write(tmp_path / "b.h5", blocking=False)
    opt.param_groups[0]["lr"] = 9.0
    with torch.no_grad():
        model[0].weight.add_(1.0)
    handle.wait()
    assert cv.load(tmp_path / "b.h5")["model/0.weight"].tolist() == before.tolist()
    m2, o2, _ = _build()
    cv.Checkpoint(model=m2, optimizer=o2).restore(tmp_path / "b.h5")
    assert o2.param_groups[0]["lr"] == 1e-2


class _Pair(NamedTuple):
    lo: Any
    hi: Any


class _Plain:
    """An object whose state dict is whatever the test sets, beside two tensors."""

    def __init__(self) -> None:
        self.a, self.b = torch.zeros(2), torch.ones(2)
        self.extra: Any = {"x": 0.0}
        self.loaded: Any = None

    def state_dict(self) -> dict[Any, Any]:
        return {"a": self.a, "b": self.b, **self.extra}

    def load_state_dict(self, sd: dict[Any, Any]) -> None:
        self.loaded = sd


@pytest.mark.parametrize(("before", "after"), [
    ({"x": 0.0}, {"x": -0.0}),  # equal floats of another sign
    ({"x": 1}, {"x": True}),  # 1 == True: another type
    ({"x": 1}, {"x": 1.0}),
    ({"x": (1, 2)}, {"x": [1, 2]}),  # a tuple became a list
    ({"x": _Pair(1, 2)}, {"x": (1, 2)}),  # a namedtuple became an equal plain tuple
    ({"x": [1, 2]}, {"x": [1, 2, 3]}),  # a list grew in place (the same list object)
    ({1: "k"}, {"1": "k"}),  # an int key became a str key
    ({"x": 1, "y": 2}, {"y": 2, "x": 1}),  # the same items in another order
    ({"x": {"n": 1}}, {"x": {"n": 1, "m": 2}}),  # a nested dict grew in place
])
def test_an_unchanged_state_dict_is_told_apart_from_one_equal_but_different(
        tmp_path: Path, before: dict[Any, Any], after: dict[Any, Any]) -> None:
    # A save whose state dict equals the last one by value (same tensors, equal plain
    # values) reuses the last encoding; a change that == does not see must be saved.
    obj = _Plain()
    obj.extra = before
    ckpt = cv.Checkpoint(obj=obj)
    for i in range(2):
        ckpt.write(tmp_path / f"w{i}.h5", blocking=False).wait()
    if isinstance(before.get("x"), list | dict) and type(after["x"]) is type(before["x"]):
        before["x"].update(after["x"]) if isinstance(after["x"], dict) else before["x"].append(3)
        obj.extra = before  # the very same objects, changed in place
    else:
        obj.extra = after
    ckpt.write(tmp_path / "c.h5", blocking=False).wait()
    fresh = _Plain()
    fresh.extra = dict(after)
    cv.Checkpoint(obj=fresh).restore(tmp_path / "c.h5").assert_consumed()
    got = {k: v for k, v in fresh.loaded.items() if k not in ("a", "b")}
    assert list(got) == list(after) and all(type(got[k]) is type(after[k]) for k in after)
    assert repr(got) == repr(after)  # -0.0, True, [1, 2] spelled as they are
    assert [type(k) for k in got] == [type(k) for k in after]


@pytest.mark.parametrize(("before", "after"), [
    ({"x": {"n": 1}, "m": 2}, {"x": {"n": 1, "m": 2}}),  # the same items, nested otherwise
    ({"x": [[1], 2]}, {"x": [[1, 2]]}),
    ({"x": ("k",)}, {"x": (b"k",)}),  # a str became bytes
    ({"x": None, "y": 0}, {"x": 0, "y": None}),
    ({"x": 2.5}, {"x": 3.5}),  # a hyper-parameter changed
    ({"x": np.float32(1.5)}, {"x": np.float32(2.5)}),  # a NumPy scalar (encoded anew)
    ({"x": np.float64(0.0)}, {"x": np.float64(-0.0)}),  # (equal, but not the same)
    ({"x": 1}, {"x": 1, "z": 1}),  # a new key
])
def test_a_state_dict_kept_from_the_last_save_is_never_stale(
        tmp_path: Path, before: dict[Any, Any], after: dict[Any, Any]) -> None:
    # A save whose state dict has the last one's signature (structure, keys, plain values
    # by type and value) over the very same tensors reuses the last encoding and its
    # msgpack bytes: any other state dict is encoded anew, after three saves that reused.
    obj = _Plain()
    obj.extra = before
    ckpt = cv.Checkpoint(obj=obj)
    for i in range(3):
        ckpt.write(tmp_path / f"w{i}.h5", blocking=False).wait()
    fresh = _Plain()
    for name, state in (("c", after), ("d", before)):  # then back: the first, not the kept
        obj.extra = state
        ckpt.write(tmp_path / f"{name}.h5", blocking=False).wait()
        cv.Checkpoint(obj=fresh).restore(tmp_path / f"{name}.h5").assert_consumed()
        got = {k: v for k, v in fresh.loaded.items() if k not in ("a", "b")}
        plain = {k: v.item() if isinstance(v, np.generic) else v for k, v in state.items()}
        assert repr(got) == repr(plain)


def test_the_kept_msgpack_bytes_are_only_the_kept_encodings() -> None:
    # A state-dict object asked for its packed state without a walk just before (not
    # what a save does) packs the state as it is now, never the kept save's bytes.
    import msgpack  # noqa: PLC0415

    from ckptvar.checkpoint._frameworks import StateDictTrackable  # noqa: PLC0415

    obj = _Plain()
    obj.extra = {"x": 1}
    adapter = StateDictTrackable(obj)
    for _ in range(2):
        adapter.trackable_children()
        kept = adapter.packed_state("obj")
    obj.extra = {"x": 2}
    now = msgpack.unpackb(adapter.packed_state("obj"), strict_map_key=False)
    assert msgpack.unpackb(kept, strict_map_key=False)["d"][2] == ["x", {"v": 1}]
    assert now["d"][2] == ["x", {"v": 2}]


def test_tensors_swapped_between_keys_are_saved_where_they_now_are(tmp_path: Path) -> None:
    obj = _Plain()
    ckpt = cv.Checkpoint(obj=obj)
    for i in range(2):
        ckpt.write(tmp_path / f"w{i}.h5", blocking=False).wait()
    obj.a, obj.b = obj.b, obj.a
    ckpt.write(tmp_path / "c.h5", blocking=False).wait()
    values = cv.load(tmp_path / "c.h5")
    assert values["obj/a"].tolist() == [1.0, 1.0] and values["obj/b"].tolist() == [0.0, 0.0]


class _FailingStateDict(torch.nn.Linear):
    """A module whose ``state_dict()`` raises (after recording the autograd mode)."""

    calls: list[bool]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__.setdefault("calls", []).append(torch.is_grad_enabled())
        raise RuntimeError("no state today")


def test_autograd_is_off_for_every_state_dict_and_back_as_it_was(tmp_path: Path) -> None:
    # A checkpoint turns autograd off once a save for all its state-dict objects; each
    # object turns it off itself when asked otherwise (here after a nested checkpoint,
    # which makes the checkpoint walk its object graph), and the caller's mode is back
    # as it was, after an error too.
    def walked(obj: Any) -> Any:
        return cv.Checkpoint(inner=cv.Checkpoint(v=cv.Variable(1.0)), model=obj)

    model = _CountingLinear(4, 2)
    walked(model).write(tmp_path / "walked.h5", blocking=False).wait()
    assert model.calls == [False]
    assert torch.is_grad_enabled()
    assert cv.load(tmp_path / "walked.h5")["model/bias"].shape == (2,)
    with torch.no_grad():  # off already: left off
        cv.Checkpoint(model=model).write(tmp_path / "off.h5")
        assert not torch.is_grad_enabled()
    assert model.calls == [False, False]
    failing = _FailingStateDict(4, 2)
    for root in (cv.Checkpoint(model=failing), walked(failing)):
        with pytest.raises(RuntimeError, match="no state today"):
            root.write(tmp_path / "failing.h5")
        assert torch.is_grad_enabled()
    assert failing.calls == [False, False]


class _Columns(torch.nn.Module):
    """A module whose buffer is a non-contiguous view (columns of a larger tensor): the
    host cannot view its memory as one array, so a save copies it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)
        self.register_buffer("cols", torch.zeros(8, 8)[:, :4])
        self.register_buffer("t", torch.zeros(6, 5).t())


@pytest.mark.parametrize("incremental", [False, True])
def test_a_non_contiguous_tensor_is_saved_as_it_is_at_each_save(
        tmp_path: Path, incremental: bool) -> None:
    """Every save (and a restore after it) of a tensor the host cannot view in place
    takes its value at that call, not the first save's copy."""
    model = _Columns()
    ckpt = cv.Checkpoint(model=model)
    manager = cv.CheckpointManager(ckpt, tmp_path, max_to_keep=None, incremental=incremental)
    saved = []
    for step in range(3):
        with torch.no_grad():
            model.cols[step, 1] += 1.0
            model.t[2, step] -= 1.0
        path = manager.save()
        saved.append((path, model.cols.clone(), model.t.clone()))
        got = cv.load(path)
        assert np.array_equal(got["model/cols"], model.cols.numpy()), step
        assert np.array_equal(got["model/t"], model.t.numpy()), step
    path, cols, t = saved[1]
    with torch.no_grad():
        model.cols.fill_(7.0)
        model.t.fill_(7.0)
    ckpt.restore(path)  # into the very tensors, whose values the saves took
    assert torch.equal(model.cols, cols) and torch.equal(model.t, t)


class _Transposed(torch.nn.Module):
    """A module whose parameter is a non-contiguous view (restored through a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3).t())


@pytest.mark.parametrize("case", ["non-contiguous parameter", "tensor learning rate"])
def test_a_value_load_state_dict_copies_still_counts_as_restored(
        tmp_path: Path, case: str) -> None:
    # load_state_dict copies some restored tensors (into a non-contiguous parameter; an
    # optimizer's param_groups, deep-copied): the object's tensor is then another one
    # than the restore filled, yet it holds the stored value and the status says so
    if case == "non-contiguous parameter":
        make: Any = lambda: {"model": _Transposed()}  # noqa: E731
    else:
        def make() -> dict[str, Any]:
            model = torch.nn.Linear(3, 2)
            return {"model": model, "opt": torch.optim.Adam(
                model.parameters(), lr=torch.tensor(0.5))}
    saved = make()
    if "opt" in saved:
        saved["model"](torch.ones(1, 3)).sum().backward()
        saved["opt"].step()
        saved["opt"].param_groups[0]["lr"].fill_(0.01)
    path = cv.Checkpoint(**saved).save(tmp_path / "ckpt")
    fresh = make()
    status = cv.Checkpoint(**fresh).restore(path)
    status.assert_consumed()
    for name, obj in saved.items():
        want, got = obj.state_dict(), fresh[name].state_dict()
        if name == "opt":
            assert torch.equal(got["param_groups"][0]["lr"], torch.tensor(0.01))
            want, got = want["state"][0], got["state"][0]
        for k, v in want.items():
            assert torch.equal(v, got[k]), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_state_made_at_restore_takes_the_dtypes_numpy_lacks(tmp_path: Path, dtype: str) -> None:
    # a bfloat16 model's optimizer restored into a fresh optimizer (no state before its
    # first step), and a module on the meta device: their tensors are made at the restore
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model = torch.nn.Linear(3, 2, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    model.register_buffer("scale", torch.arange(4.0).to(dt))
    path = cv.Checkpoint(model=model, opt=opt).save(tmp_path / "ckpt")
    fresh = torch.nn.Linear(3, 2, dtype=torch.bfloat16)
    fresh.register_buffer("scale", torch.zeros(4).to(dt))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    cv.Checkpoint(model=fresh, opt=fresh_opt).restore(path).assert_consumed()
    got = fresh_opt.state[fresh.weight]["exp_avg"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, opt.state[model.weight]["exp_avg"])
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2, dtype=torch.bfloat16)
        meta.register_buffer("scale", torch.zeros(4).to(dt))
    cv.Checkpoint(model=meta).restore(path).expect_partial()
    assert meta.scale.dtype == dt and meta.weight.device.type == "cpu"
    assert torch.equal(meta.scale.view(torch.uint8 if dt.itemsize == 1 else torch.int16),
                       model.scale.view(torch.uint8 if dt.itemsize == 1 else torch.int16))
    assert torch.equal(meta.weight, model.weight)


def test_a_0d_tensor_the_host_cannot_view_keeps_its_shape(tmp_path: Path) -> None:
    # a conjugate or negative view of a 0-d tensor is copied at the save: still 0-d
    class Scalars(torch.nn.Module):
        def __init__(self, c: complex, n: float) -> None:
            super().__init__()
            self.register_buffer("c", torch.tensor(c).conj())
            self.register_buffer("n", torch.tensor(n)._neg_view())

    path = cv.Checkpoint(m=Scalars(1 + 2j, 3.0)).save(tmp_path / "ckpt")
    shapes = {k: s for k, s, _ in cv.list_variables(path)}
    assert shapes["m/c"] == () and shapes["m/n"] == ()
    back = Scalars(0j, 0.0)
    cv.Checkpoint(m=back).restore(path).assert_consumed()
    assert back.c.resolve_conj().item() == 1 - 2j and back.n.resolve_neg().item() == -3.0


class _Keyed:
    """An object whose state dict is given as it is."""

    def __init__(self, sd: dict[Any, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[Any, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[Any, Any]) -> None:
        self.sd = sd


@pytest.mark.parametrize("sd", [
    {0: torch.ones(2), "0": torch.zeros(2)},
    {"state": {1: {"m": torch.ones(2)}, "1": {"m": torch.zeros(2)}}},
    {0: torch.ones(2), "0": {"x": torch.zeros(2)}},
    {"0": {"x": torch.zeros(2)}, 0: torch.ones(2)},
])
def test_state_dict_keys_that_name_one_key_are_refused(tmp_path: Path, sd: Any) -> None:
    # 0 and "0" are both stored as "0": one of the tensors would be lost silently
    with pytest.raises(cv.CkptError, match=r"stored as '(state/)?[01](/m)?'") as info:
        cv.Checkpoint(s=_Keyed(sd)).save(tmp_path / "ckpt")
    assert isinstance(info.value, TypeError)
    assert not list(tmp_path.iterdir())


def test_state_dict_keys_of_one_spelling_on_different_paths_are_kept(tmp_path: Path) -> None:
    # 0/x and "0"/y are two stored keys: nothing is lost, both are saved and restored
    sd = {0: {"x": torch.ones(2)}, "0": {"y": torch.full((2,), 2.0)}}
    path = cv.Checkpoint(s=_Keyed(sd)).save(tmp_path / "ckpt")
    back = _Keyed({0: {"x": torch.zeros(2)}, "0": {"y": torch.zeros(2)}})
    cv.Checkpoint(s=back).restore(path).assert_consumed()
    assert back.sd[0]["x"].tolist() == [1, 1] and back.sd["0"]["y"].tolist() == [2, 2]


def test_a_load_state_dict_that_fails_leaves_no_object_restoring(tmp_path: Path) -> None:
    # the optimizer refuses the stored param_groups; the scheduler after it must not be
    # left mid-restore: a later save writes its live state, not the checkpoint's
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    path = cv.Checkpoint(model=model, opt=opt, sched=sched).save(tmp_path / "a")
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD([{"params": [model2.weight]}, {"params": [model2.bias]}], lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    ckpt = cv.Checkpoint(model=model2, opt=opt2, sched=sched2)
    with pytest.raises(ValueError, match="parameter groups"):
        ckpt.restore(path)
    for _ in range(5):
        opt2.step()
        sched2.step()
    saved = ckpt.save(tmp_path / "b")
    fresh = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 1)
    cv.Checkpoint(sched=fresh).restore(saved).expect_partial()
    assert fresh.last_epoch == sched2.last_epoch  # what it is now, saved


class _Flaky(_Keyed):
    """An object whose ``state_dict()`` raises while ``broken``."""

    broken = False

    def state_dict(self) -> dict[Any, Any]:
        if self.broken:
            raise RuntimeError("not ready")
        return self.sd


def test_an_object_that_fails_to_begin_a_restore_leaves_none_restoring(tmp_path: Path) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    flaky = _Flaky({"x": torch.ones(2)})
    ckpt = cv.Checkpoint(sched=sched, flaky=flaky)
    path = ckpt.save(tmp_path / "a")
    flaky.broken = True
    with pytest.raises(RuntimeError, match="not ready"):
        ckpt.restore(path)
    flaky.broken = False
    for _ in range(4):
        opt.step()
        sched.step()
    saved = ckpt.save(tmp_path / "b")  # the scheduler as it is now, not as stored
    fresh = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 1)
    cv.Checkpoint(sched=fresh).restore(saved).expect_partial()
    assert fresh.last_epoch == sched.last_epoch == 7


def test_a_restore_without_python_state_never_takes_an_earlier_restores(tmp_path: Path) -> None:
    # restored once from a checkpoint with the object's Python state, then from a file of
    # tensors only: the second restore keeps the object's own Python values
    obj = _Keyed({"t": torch.ones(2, 3).t(), "v": 1})  # non-contiguous: a new tensor
    ckpt = cv.Checkpoint(s=obj)
    first = ckpt.save(tmp_path / "a")
    ckpt.restore(first).assert_consumed()
    obj.sd = {"t": torch.zeros(2, 3).t(), "v": 2}
    tensors = cv.save(tmp_path / "b.h5", {"s/t": np.full((3, 2), 5, np.float32)})
    ckpt.restore(tensors).expect_partial()
    assert obj.sd["v"] == 2 and obj.sd["t"].tolist() == [[5, 5]] * 3


def test_namedtuples_of_a_state_dict_come_back_as_the_live_state_dict_has_them(
        tmp_path: Path) -> None:
    """A namedtuple in a state dict's Python state came back as a plain tuple without a
    word; now it takes its type from the restoring object's current state_dict() at that
    place, and where that has none, a warning names the place."""
    src = _Plain()
    src.extra = {"hp": {"range": _Pair(0.5, (1, 2)), "n": 3}, "pairs": [_Pair(1, 2)]}
    path = cv.Checkpoint(obj=src).save(tmp_path / "ckpt")
    dst = _Plain()
    dst.extra = {"hp": {"range": _Pair(0.0, (0, 0))}, "pairs": [_Pair(0, 0)]}
    cv.Checkpoint(obj=dst).restore(path).assert_consumed()
    assert dst.loaded["hp"] == {"range": _Pair(0.5, (1, 2)), "n": 3}
    assert type(dst.loaded["hp"]["range"]) is _Pair and type(dst.loaded["pairs"][0]) is _Pair
    assert type(dst.loaded["hp"]["range"].hi) is tuple
    other = _Plain()
    other.extra = {}  # no namedtuple at those places: plain tuples, and said
    with pytest.warns(UserWarning, match=r"'obj'.*hp/range \(.*_Pair\).*pairs/0.*state_dict"):
        cv.Checkpoint(obj=other).restore(path).assert_consumed()
    assert type(other.loaded["hp"]["range"]) is tuple and other.loaded["pairs"] == [(1, 2)]
