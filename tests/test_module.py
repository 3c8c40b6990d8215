"""cv.Module: tracking, views, names, name scopes and add_variable."""

from __future__ import annotations

import numpy as np
import pytest

import ckptvar as cv


class Dense(cv.Module):
    def __init__(self, units: int, name: str | None = None) -> None:
        super().__init__(name=name)
        self.units = units

    def build(self, fan_in: int) -> None:
        self.kernel = self.add_variable("kernel", (fan_in, self.units))
        self.bias = self.add_variable("bias", (self.units,), initializer=cv.initializers.zeros)


class MLPModel(cv.Module):
    pass


def test_default_name_is_snake_case_class_name(fresh_graph: cv.Graph) -> None:
    assert MLPModel().name == "mlp_model"
    assert Dense(2).name == "dense"
    assert Dense(2, name="head").name == "head"
    with pytest.raises(ValueError, match="without '/'"):
        Dense(2, name="a/b")


def test_variables_in_assignment_order_depth_first_without_duplicates(
    fresh_graph: cv.Graph,
) -> None:
    m = MLPModel()
    a = cv.Variable(1.0, name="a")
    b = cv.Variable(2.0, name="b", trainable=False)
    inner = Dense(1)
    inner.w = cv.Variable([1.0], name="w")
    m.z = a
    m.inner = inner
    m.blocks = [b, {"x": cv.Variable(3.0, name="x"), "again": a}, (inner,)]
    m.config = {"lr": 0.1}  # plain data: tracked as a container, holds no variables
    m.also_a = a
    assert [v.name for v in m.variables] == ["a", "w", "b", "x"]
    assert [v.name for v in m.trainable_variables] == ["a", "w", "x"]
    assert [v.name for v in m.non_trainable_variables] == ["b"]
    assert m.submodules == (inner,)


def test_reassigning_and_deleting_attributes_updates_tracking(fresh_graph: cv.Graph) -> None:
    m = MLPModel()
    m.v = cv.Variable(1.0, name="v")
    m.w = cv.Variable(2.0, name="w")
    m.v = 3  # no longer a variable
    assert [v.name for v in m.variables] == ["w"]
    del m.w
    assert m.variables == ()


def test_submodules_depth_first(fresh_graph: cv.Graph) -> None:
    root = MLPModel()
    a, b, c = Dense(1, name="a"), Dense(1, name="b"), Dense(1, name="c")
    a.child = c
    root.layers = [a, b]
    assert [m.name for m in root.submodules] == ["a", "c", "b"]


def test_add_variable_under_the_module_name_scope(fresh_graph: cv.Graph) -> None:
    d = Dense(3)
    d.build(2)
    assert d.kernel.name == "dense/kernel" and d.bias.name == "dense/bias"
    assert d.kernel.shape == (2, 3) and d.kernel.dtype == np.float32
    np.testing.assert_array_equal(d.bias.numpy(), np.zeros(3, np.float32))
    d2 = Dense(3)  # a second module of the same name gets its own scope
    d2.build(2)
    assert d2.kernel.name == "dense_1/kernel"
    with d.name_scope as scope:
        v = cv.Variable(1.0, name="extra")
    assert scope == "dense/" and v.name == "dense/extra"
    with d.name_scope:  # re-entering keeps the same prefix
        assert cv.Variable(1.0, name="more").name == "dense/more"


def test_add_variable_default_initializers(fresh_graph: cv.Graph) -> None:
    m = MLPModel()
    f = m.add_variable("f", (64, 64))
    i = m.add_variable("i", 4, dtype="int64", trainable=False)
    assert f.numpy().std() > 0  # glorot_uniform, not zeros
    assert i.dtype == np.int64 and i.shape == (4,) and not i.trainable
    np.testing.assert_array_equal(i.numpy(), np.zeros(4, np.int64))
    assert list(m._trackable_children()) == ["f", "i"]


# --- issue 13 item 6: private classes ------------------------------------------------------------


class _Block(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        with self.name_scope:
            self.w = cv.Variable([1.0, 2.0], name="w")


class _Outer(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        with self.name_scope:
            self.block = _Block()


def test_private_module_classes_get_their_default_names_and_round_trip(
    tmp_path, fresh_graph
) -> None:
    block = _Block()
    assert block.name == "__block" and block.w.name == "__block/w"
    outer = _Outer()
    assert outer.block.w.name == "__outer/__block/w"
    assert _Block().w.name == "__block_1/w"
    path = cv.Saver().save(tmp_path / "names.h5")
    assert "__block/w" in [entry[0] for entry in cv.list_variables(path)]
    ckpt_path = cv.Checkpoint(model=outer).write(tmp_path / "obj.h5")
    outer.block.w.assign([5.0, 6.0])
    cv.Checkpoint(model=outer).restore(ckpt_path)
    assert outer.block.w.numpy().tolist() == [1.0, 2.0]
    with cv.Graph().as_default(), cv.restore_on_create(path):
        again = _Block()
    assert again.w.numpy().tolist() == [1.0, 2.0]


def test_one_module_name_scope_open_in_two_threads_keeps_each_threads_scope(
    fresh_graph: cv.Graph,
) -> None:
    # the scopes were kept on one list for all threads: leaving popped the other thread's,
    # and each thread went on naming in the other's scope ("tb/va", "ta/vb2")
    import copy
    import pickle
    import threading

    encoder = cv.Module(name="enc")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    names: dict[str, str] = {}

    def first() -> None:
        with cv.name_scope("ta"):
            with encoder.name_scope:
                a_in.set()
                assert b_in.wait(10)
            a_out.set()
            names["a"] = cv.Variable(1.0, name="va").name

    def second() -> None:
        assert a_in.wait(10)
        with cv.name_scope("tb"):
            with encoder.name_scope:
                b_in.set()
                assert a_out.wait(10)
                names["b_inside"] = cv.Variable(1.0, name="vb").name
            names["b"] = cv.Variable(1.0, name="vb2").name

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert names == {"a": "ta/va", "b_inside": "enc/vb", "b": "tb/vb2"}
    for twin in (copy.deepcopy(encoder), pickle.loads(pickle.dumps(encoder))):
        with twin.name_scope as scope:
            assert scope == "enc/"


class _WithArrays(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = cv.Variable(np.ones(3), name="w")
        self.mask = np.ones(3)  # not a variable: not saved
        self._cache = np.zeros(2)  # private: not state
        self.lr = 0.1
        self.label = "model"


def test_an_array_attribute_of_a_module_is_said_not_saved_once(tmp_path, fresh_graph) -> None:
    """A bare array held by a module's attribute was silently left out of the save; now
    the first save warns once, naming its key and a cv.Variable to keep it. Private and
    non-array attributes stay quiet."""
    model = _WithArrays()
    ckpt = cv.Checkpoint(model=model)
    with pytest.warns(UserWarning) as said:
        path = ckpt.write(tmp_path / "a.h5")
    (warning,) = said
    text = str(warning.message)
    assert text.startswith("'model/mask' is a numpy.ndarray held by the attribute 'mask' of "
                           "_WithArrays: "), text
    assert "not saved" in text and "self.mask = cv.Variable(" in text, text
    assert [k for k, *_ in cv.list_variables(path)] == ["model/w"]
    ckpt.write(tmp_path / "b.h5")  # said once (pytest turns a warning into an error)
    cv.Checkpoint(model=model).restore(path)


def test_a_torch_tensor_attribute_of_a_trackable_is_said_not_saved(tmp_path, fresh_graph) -> None:
    torch = pytest.importorskip("torch")

    class Holder(cv.Trackable):
        def __init__(self) -> None:
            self.weights = torch.ones(2)
            self.track("v", cv.Variable(np.zeros(2), name="v"))

    with pytest.warns(UserWarning, match=r"'holder/weights' is a torch\.Tensor held by the "
                                         r"attribute 'weights' of .*Holder"):
        cv.Checkpoint(holder=Holder()).write(tmp_path / "t.h5")


def test_a_trackable_that_names_its_own_state_is_taken_at_its_word(tmp_path,
                                                                    fresh_graph) -> None:
    class Stateful(cv.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rng = np.arange(4)  # saved through python_state

        def python_state(self) -> object:
            return {"rng": self.rng.tolist()}

        def restore_python_state(self, state: dict[str, list[int]]) -> None:
            self.rng = np.asarray(state["rng"])

    model = Stateful()
    path = cv.Checkpoint(model=model).write(tmp_path / "s.h5")  # no warning
    model.rng = np.zeros(4, np.int64)
    cv.Checkpoint(model=model).restore(path)
    assert model.rng.tolist() == [0, 1, 2, 3]
