"""Names, name and variable scopes, get_variable, collections and weak references (API.md §2)."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvar as cv
from ckptvar._naming import NameRegistry
from ckptvar.errors import VariableScopeError
from ckptvar.graph import GraphStateError
from ckptvar.variables import get_variable_scope

pytestmark = pytest.mark.usefixtures("fresh_graph")


# --- names ---------------------------------------------------------------------------------------


def test_default_name_and_uniquification() -> None:
    names = [cv.Variable(1.0).name for _ in range(3)]
    assert names == ["Variable", "Variable_1", "Variable_2"]
    assert [cv.Variable(1.0, name="Mark").name for _ in range(3)] == ["Mark", "Mark_1", "Mark_2"]


def test_unique_name_follows_tensorflow() -> None:
    g = cv.get_default_graph()
    assert g.unique_name("x") == "x"
    assert g.unique_name("X") == "X_1"  # case-insensitive
    assert g.unique_name("x_1") == "x_1_1"  # the composed name was marked as used
    assert g.unique_name("y", mark_as_used=False) == "y"
    assert g.unique_name("y") == "y"
    r = NameRegistry()
    seen = {r.unique_name("a").lower() for _ in range(50)}
    assert len(seen) == 50


def test_names_are_unique_across_threads() -> None:
    names: list[str] = []
    lock = threading.Lock()
    graph = cv.get_default_graph()

    def work() -> None:
        with graph.as_default():
            made = [cv.Variable(0.0, name="t").name for _ in range(50)]
        with lock:
            names.extend(made)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 200


def test_name_scope_prefixes_and_nests() -> None:
    with cv.name_scope("block") as scope:
        assert scope == "block/"
        a = cv.Variable(1.0, name="a")
        with cv.name_scope("inner") as inner:
            assert inner == "block/inner/"
            b = cv.Variable(1.0, name="b")
    with cv.name_scope("block") as again:
        assert again == "block_1/"
    assert (a.name, b.name) == ("block/a", "block/inner/b")
    with cv.name_scope("abs/"):  # an absolute scope is used exactly
        assert cv.Variable(1.0, name="c").name == "abs/c"
    with cv.name_scope("x"), cv.name_scope(None):
        assert cv.Variable(1.0, name="root").name == "root"
    with pytest.raises(VariableScopeError):
        with cv.name_scope("bad name!"):
            pass


def test_explicit_absolute_variable_name() -> None:
    with cv.name_scope("s"):
        assert cv.Variable(1.0, name="exact/name/").name == "exact/name"


def test_graphs_are_separate_namespaces() -> None:
    outer = cv.Variable(1.0, name="v")
    g = cv.Graph()
    with g.as_default():
        assert cv.get_default_graph() is g
        v = cv.Variable(1.0, name="v")
        assert v.name == "v" and v.graph is g
        assert cv.global_variables() == [v]
    assert cv.get_default_graph() is not g
    assert cv.global_variables() == [outer]


def test_reset_default_graph() -> None:
    keep = cv.Variable(1.0, name="v")
    old = cv.get_default_graph()
    cv.reset_default_graph()
    assert cv.get_default_graph() is not old
    assert cv.global_variables() == []
    assert cv.Variable(1.0, name="v").name == "v"
    assert keep.graph is old
    with cv.Graph().as_default(), pytest.raises(GraphStateError):
        cv.reset_default_graph()


# --- variable scopes and get_variable -----------------------------------------------------------


def test_get_variable_defaults() -> None:
    v = cv.get_variable("my_variable", [1, 2, 3])
    assert v.name == "my_variable" and v.shape == (1, 2, 3) and v.dtype == np.float32
    limit = np.sqrt(6 / (2 + 3))  # glorot_uniform; receptive field 1: fan_in=2, fan_out=3
    assert np.abs(v.numpy()).max() <= limit
    i = cv.get_variable("my_int_variable", [1, 2, 3], dtype="int32",
                        initializer=cv.initializers.zeros)
    assert i.dtype == np.int32 and not i.numpy().any()
    assert cv.get_variable("int_default", [2], dtype="int64").numpy().tolist() == [0, 0]


def test_get_variable_from_a_value() -> None:
    other = cv.get_variable("other_variable", dtype="int32", initializer=np.array([23, 42]))
    assert other.numpy().tolist() == [23, 42] and other.dtype == np.int32
    with pytest.raises(VariableScopeError, match="do not specify shape"):
        cv.get_variable("x", shape=[2], initializer=[1.0, 2.0])
    with pytest.raises(VariableScopeError, match="fully defined"):
        cv.get_variable("y")
    v = cv.get_variable("v", shape=(), initializer=cv.initializers.zeros())
    w = cv.get_variable("w", initializer=v.initialized_value() + 1)
    assert w.numpy() == 1.0 and w.shape == ()


def test_get_variable_clashes() -> None:
    cv.get_variable("v", [1])
    with pytest.raises(VariableScopeError, match="already exists"):
        cv.get_variable("v", [1])
    with cv.variable_scope("", reuse=True):
        with pytest.raises(VariableScopeError, match="does not exist"):
            cv.get_variable("missing", [1])
        with pytest.raises(VariableScopeError, match="shape"):
            cv.get_variable("v", [2])
        with pytest.raises(VariableScopeError, match="dtype"):
            cv.get_variable("v", [1], dtype="float64")
    assert issubclass(VariableScopeError, ValueError)


def _conv_relu(kernel_shape, bias_shape):
    weights = cv.get_variable("weights", kernel_shape, initializer=cv.initializers.random_normal())
    biases = cv.get_variable("biases", bias_shape, initializer=cv.initializers.constant(0.0))
    return weights, biases


def _my_image_filter():
    with cv.variable_scope("conv1"):
        w1, b1 = _conv_relu([5, 5, 32, 32], [32])
    with cv.variable_scope("conv2"):
        w2, b2 = _conv_relu([5, 5, 32, 32], [32])
    return [w1, b1, w2, b2]


def test_variable_scope_names_and_reuse() -> None:
    _conv_relu([5, 5, 32, 32], [32])
    with pytest.raises(VariableScopeError):
        _conv_relu([5, 5, 32, 32], [32])  # unclear: create or reuse?
    with cv.variable_scope("model"):
        first = _my_image_filter()
    assert [v.name for v in first] == ["model/conv1/weights", "model/conv1/biases",
                                       "model/conv2/weights", "model/conv2/biases"]
    with cv.variable_scope("model", reuse=True):
        second = _my_image_filter()
    assert all(a is b for a, b in zip(first, second, strict=True))


def test_reuse_variables_and_scope_objects() -> None:
    with cv.variable_scope("model") as scope:
        first = _my_image_filter()
        scope.reuse_variables()
        assert scope.reuse is True
        second = _my_image_filter()
    assert all(a is b for a, b in zip(first, second, strict=True))
    with cv.variable_scope("elsewhere"):
        with cv.variable_scope(scope, reuse=True) as again:
            assert again.name == "model"
            third = _my_image_filter()
    assert all(a is b for a, b in zip(first, third, strict=True))
    with cv.variable_scope(scope):  # the scope object carries its reuse flag
        assert get_variable_scope().reuse is True
    with cv.variable_scope("fresh") as fresh:
        pass
    with cv.variable_scope("elsewhere"), cv.variable_scope(fresh), cv.variable_scope("new"):
        assert cv.get_variable("v", [1]).name == "fresh/new/v"
        assert cv.Variable(1.0, name="p").name == "fresh/new/p"


def test_auto_reuse() -> None:
    def shared():
        with cv.variable_scope("shared", reuse=cv.AUTO_REUSE):
            return cv.get_variable("v", [1])

    assert shared() is shared()
    with cv.variable_scope("outer", reuse=cv.AUTO_REUSE):
        with cv.variable_scope("inner"):  # inherited
            assert get_variable_scope().reuse is cv.AUTO_REUSE
            a = cv.get_variable("x", [2])
        with cv.variable_scope("inner"):
            assert cv.get_variable("x", [2]) is a


def test_reuse_is_inherited_and_cannot_be_switched_off() -> None:
    with cv.variable_scope("a"):
        cv.get_variable("v", [1])
    with cv.variable_scope("a", reuse=True):
        with cv.variable_scope("b", reuse=False):
            assert get_variable_scope().reuse is True


def test_name_scope_does_not_prefix_get_variable() -> None:
    with cv.name_scope("ns"):
        v = cv.get_variable("v", [1])
        w = cv.Variable(1.0, name="w")
        with cv.variable_scope("vs"):
            x = cv.get_variable("x", [1])
            y = cv.Variable(1.0, name="y")
    assert (v.name, w.name, x.name, y.name) == ("v", "ns/w", "vs/x", "ns/vs/y")


def test_variable_scope_prefixes_plain_variables_and_reentry_reuses_prefix() -> None:
    with cv.variable_scope("foo") as scope:
        assert scope.original_name_scope == "foo/"
        a = cv.Variable(1.0, name="v")
        b = cv.get_variable("g", [1])
    with cv.variable_scope("foo"):
        c = cv.Variable(1.0, name="v")
        with pytest.raises(VariableScopeError):
            cv.get_variable("g", [1])
    assert (a.name, b.name, c.name) == ("foo/v", "foo/g", "foo/v_1")


def test_variable_scope_initializer_and_dtype_defaults() -> None:
    with cv.variable_scope("s", initializer=cv.initializers.ones, dtype="float64"):
        v = cv.get_variable("v", [2])
        with cv.variable_scope("t"):
            w = cv.get_variable("w", [2])
        z = cv.get_variable("z", [2], initializer=cv.initializers.zeros)
    assert v.dtype == np.float64 and v.numpy().tolist() == [1.0, 1.0]
    assert w.dtype == np.float64 and w.numpy().tolist() == [1.0, 1.0]
    assert z.numpy().tolist() == [0.0, 0.0]


def test_default_name_scopes_are_uniquified() -> None:
    names = []
    for _ in range(3):
        with cv.variable_scope(None, default_name="layer") as s:
            names.append(s.name)
            cv.get_variable("w", [1])
    assert names == ["layer", "layer_1", "layer_2"]
    with pytest.raises(VariableScopeError):
        with cv.variable_scope(None, default_name="x", reuse=True):
            pass
    with pytest.raises(VariableScopeError):
        with cv.variable_scope(None):
            pass


def test_scope_get_variable_method() -> None:
    with cv.variable_scope("m") as scope:
        pass
    assert scope.get_variable("k", [1]).name == "m/k"


# --- collections ----------------------------------------------------------------------------------


def test_default_collections() -> None:
    a = cv.Variable(1.0, name="a")
    b = cv.Variable(1.0, name="b", trainable=False)
    assert cv.global_variables() == [a, b]
    assert cv.trainable_variables() == [a]
    assert cv.local_variables() == []
    assert cv.get_collection(cv.GraphKeys.GLOBAL_VARIABLES) == [a, b]


def test_local_collection_and_custom_collections() -> None:
    my_local = cv.get_variable("my_local", shape=(), collections=[cv.GraphKeys.LOCAL_VARIABLES])
    assert cv.local_variables() == [my_local]
    assert my_local not in cv.global_variables() and not my_local.trainable
    cv.add_to_collection("my_collection_name", my_local)
    cv.add_to_collection("my_collection_name", "not a variable")
    assert cv.get_collection("my_collection_name")[0] is my_local
    assert cv.get_collection("my_collection_name")[1] == "not a variable"
    assert cv.get_collection("nothing") == []
    t = cv.get_variable("t", shape=(), collections=[cv.GraphKeys.LOCAL_VARIABLES], trainable=True)
    assert cv.trainable_variables() == [t]


def test_get_collection_scope_filter() -> None:
    with cv.variable_scope("enc"):
        e = cv.get_variable("w", [1])
    with cv.variable_scope("dec"):
        d = cv.get_variable("w", [1])
    assert cv.get_collection(cv.GraphKeys.GLOBAL_VARIABLES, scope="enc") == [e]
    assert cv.global_variables(scope="dec") == [d]
    assert cv.trainable_variables("e.c/") == [e]


def test_collections_hold_variables_weakly_but_store_keeps_get_variable_alive() -> None:
    plain = cv.Variable(np.zeros(3), name="plain")
    cv.add_to_collection("mine", plain)
    stored = cv.get_variable("stored", [3])
    plain_ref, stored_ref = weakref.ref(plain), weakref.ref(stored)
    del plain, stored
    gc.collect()
    assert plain_ref() is None
    assert stored_ref() is not None
    assert [v.name for v in cv.global_variables()] == ["stored"]
    assert cv.get_collection("mine") == []
    obj = [1, 2]
    cv.add_to_collection("strong", obj)
    del obj
    gc.collect()
    assert cv.get_collection("strong") == [[1, 2]]  # non-variables are held normally


@given(st.lists(st.text(alphabet="aAbB_1", min_size=1, max_size=4), max_size=40))
@settings(max_examples=60, deadline=None)
def test_unique_name_never_repeats(requests) -> None:
    r = NameRegistry()
    made = [r.unique_name(name) for name in requests]
    assert len({m.lower() for m in made}) == len(made)
    for asked, got in zip(requests, made, strict=True):
        assert got == asked or (got.startswith(asked + "_") and got[len(asked) + 1:].isdigit())


# --- issue 13 item 7: initializers called as TensorFlow's get_variable calls them ----------------


class AllDefaults:
    """The signature of many initializer classes: every parameter has a default."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, shape=None, dtype=None, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append((shape, dtype, kwargs))
        return np.full(shape, 3, dtype=dtype)


def test_get_variable_calls_an_all_defaults_initializer_with_shape_and_dtype_once() -> None:
    init = AllDefaults()
    v = cv.get_variable("x", shape=(2,), initializer=init)
    assert v.numpy().tolist() == [3.0, 3.0] and v.numpy().tolist() == [3.0, 3.0]
    assert len(init.calls) == 1
    shape, dtype, kwargs = init.calls[0]
    assert tuple(shape) == (2,) and np.dtype(dtype) == np.float32
    assert kwargs == {"partition_info": None}  # **kwargs accepts it, as in TF1


def test_get_variable_passes_partition_info_only_when_accepted() -> None:
    seen = []

    def no_info(shape, dtype=None):  # type: ignore[no-untyped-def]
        seen.append((shape, dtype))
        return np.zeros(shape, dtype)

    cv.get_variable("a", shape=(3,), dtype="int32", initializer=no_info).numpy()
    assert seen == [((3,), np.dtype("int32"))]


def test_get_variable_initializer_the_same_inside_restore_on_create(tmp_path) -> None:
    other = cv.Variable([7.0], name="stored")
    path = cv.Saver([other]).save(tmp_path / "ckpt.h5")
    init = AllDefaults()
    with cv.Graph().as_default(), cv.restore_on_create(path):
        fresh = cv.get_variable("x", shape=(2,), initializer=init)
        stored = cv.get_variable("stored", shape=(1,), initializer=init)
    assert fresh.numpy().tolist() == [3.0, 3.0] and stored.numpy().tolist() == [7.0]
    assert [tuple(c[0]) for c in init.calls] == [(2,)]  # once, for the one not stored


def test_variable_keeps_calling_an_initial_value_function_with_no_arguments() -> None:
    calls = []

    def value(shape=None, dtype=None):  # type: ignore[no-untyped-def]
        calls.append((shape, dtype))
        return [1.0, 2.0]

    v = cv.Variable(value)
    assert v.numpy().tolist() == [1.0, 2.0] and calls == [(None, None)]


def test_get_variable_refuses_an_initializer_it_cannot_call_with_shape_and_dtype() -> None:
    with pytest.raises(VariableScopeError, match=r"initializer\(shape, dtype=...\)"):
        cv.get_variable("z", shape=(2,), initializer=lambda: np.zeros(2))
    assert cv.global_variables() == []


@pytest.mark.parametrize("name", [None, "", 3])
def test_get_variable_without_a_string_name_is_refused(name) -> None:
    # None made a variable "Variable" (stored under None) and, in a scope, "s/None"
    for scope in ("", "s"):
        with cv.variable_scope(scope):
            with pytest.raises(ValueError, match="get_variable needs a name: a non-empty string"):
                cv.get_variable(name, shape=())
    assert cv.global_variables() == []


@pytest.mark.parametrize(
    "make",
    [lambda: cv.Variable(1.0, name="v", collections="mine"),
     lambda: cv.get_variable("w", shape=(), collections="mine")],
)
def test_collections_given_as_one_string_are_refused_as_in_tensorflow(make) -> None:
    # "mine" filed the variable under the collections "m", "i", "n" and "e"
    with pytest.raises(ValueError, match="collections is a list, tuple or set"):
        make()
    assert cv.get_default_graph().get_all_collection_keys() == []
    mine = cv.Variable(1.0, name="v", collections=("mine",))
    assert cv.get_collection("mine") == [mine]


@pytest.mark.parametrize("reuse", [cv.AUTO_REUSE, False])
def test_get_variable_of_one_name_from_two_threads_makes_one_variable(reuse) -> None:
    # both threads found no "shared/w" and each made one: "shared/w" and "shared/w_1"
    from ckptvar.variables import register_creation_hook

    inside, go = threading.Event(), threading.Event()

    def hold_first(variable: cv.Variable) -> None:
        if not inside.is_set():
            inside.set()
            assert go.wait(10)

    got: list[object] = []

    def ask() -> None:
        with cv.variable_scope("shared", reuse=reuse):
            try:
                got.append(cv.get_variable("w", shape=(2,)))
            except VariableScopeError as exc:
                got.append(exc)

    with register_creation_hook(hold_first):
        first = threading.Thread(target=ask)
        first.start()
        assert inside.wait(10)  # the first thread is creating "shared/w"
        second = threading.Thread(target=ask)
        second.start()
        second.join(0.3)  # waits for the first creation to be stored
        go.set()
        first.join(10)
        second.join(10)
    made = [g for g in got if isinstance(g, cv.Variable)]
    assert len({id(v) for v in made}) == 1 and made[0].name == "shared/w"
    assert [v.name for v in cv.global_variables()] == ["shared/w"]
    if reuse is False:  # the second thread was told it exists
        assert len(made) == 1 and "already exists" in str(next(g for g in got if g is not made[0]))
