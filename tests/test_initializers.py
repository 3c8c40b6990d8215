"""Initializers (API.md §2, §9): factories, seeds, statistics, TF fan conventions."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar import initializers as I
from ckptvar.errors import DTypeLockError, ShapeLockError
from ckptvar.initializers import compute_fans

pytestmark = pytest.mark.usefixtures("fresh_graph")

SEEDED = [
    I.random_uniform(seed=1),
    I.random_normal(seed=1),
    I.truncated_normal(seed=1),
    I.glorot_uniform(seed=1),
    I.glorot_normal(seed=1),
    I.he_normal(seed=1),
    I.orthogonal(seed=1),
]


@pytest.mark.parametrize("init", SEEDED, ids=repr)
def test_seeded_initializers_are_reproducible(init) -> None:
    a, b = init((20, 30), "float32"), init((20, 30), "float32")
    assert a.dtype == np.float32 and a.shape == (20, 30)
    np.testing.assert_array_equal(a, b)
    other = type(init)(**{**init.get_config(), "seed": 2})((20, 30), "float32")
    assert not np.array_equal(a, other)


@pytest.mark.parametrize("name", ["zeros", "ones", "glorot_uniform", "glorot_normal",
                                  "he_normal", "orthogonal"])
def test_parameterless_usable_bare_or_called(name) -> None:
    factory = getattr(I, name)
    bare = factory((4, 4), "float64")
    called = factory()((4, 4), "float64")
    assert bare.shape == called.shape == (4, 4) and bare.dtype == np.float64
    v = cv.get_variable(f"{name}_v", [4, 4], initializer=factory)
    w = cv.get_variable(f"{name}_w", [4, 4], initializer=factory())
    assert v.shape == w.shape == (4, 4)
    if name != "orthogonal":  # an int is a 1-D shape
        assert factory(4).shape == (4,)


def test_zeros_ones_constant_all_dtypes() -> None:
    assert I.zeros((2,), "int8").tolist() == [0, 0]
    assert I.ones((2,), "bool").tolist() == [True, True]
    assert I.ones((2,), "bfloat16").dtype == ml_dtypes.bfloat16
    assert I.constant(7)((2, 2), "int32").tolist() == [[7, 7], [7, 7]]
    assert I.constant([1, 2, 3, 4])((2, 2), "float32").tolist() == [[1, 2], [3, 4]]
    assert I.constant([1, 2])((3, 2), "float32").tolist() == [[1, 2]] * 3
    assert I.constant(1 + 1j)((1,), "complex64").tolist() == [1 + 1j]
    assert I.zeros((), "float32").shape == ()
    with pytest.raises(ValueError, match="does not fit"):
        I.constant([1, 2, 3])((2, 2), "float32")


@pytest.mark.parametrize(
    ("value", "dtype", "message"),
    [
        (1.5, "int32", "of dtype float32 to dtype int32"),
        ([1.5, 2.5], "int32", "of dtype float32 to dtype int32"),
        (float("nan"), "int64", "to dtype int64"),
        (1j, "float32", "of dtype complex128 to dtype float32"),
        (2, "bool", "of dtype int32 to dtype bool"),
        (-1, "uint8", "-1 is outside its range"),
        (300, "uint8", "300 is outside its range"),
        (np.array([1.5]), "int32", "of dtype float64 to dtype int32"),
    ],
)
def test_constant_refuses_a_value_the_dtype_cannot_hold(value, dtype, message) -> None:
    # TensorFlow's constant_initializer raises TypeError where the kind changes; none
    # of these becomes a silently truncated, wrapped or garbage value
    with pytest.raises(cv.errors.DTypeLockError, match=message):
        I.constant(value)((2,), dtype)
    v = cv.Variable(I.constant(value), shape=(2,), dtype=dtype, name="c")
    with pytest.raises(TypeError, match=r"constant\("):
        v.numpy()
    assert I.constant(True)((1,), "float32").tolist() == [1.0]
    assert I.constant(255)((1,), "uint8").tolist() == [255]


def test_default_dtype_is_float32() -> None:
    for init in (I.zeros, I.glorot_uniform, I.random_normal()):
        assert init((2, 2)).dtype == np.float32


def test_random_uniform_range_and_ints() -> None:
    x = I.random_uniform(minval=-2.0, maxval=3.0, seed=0)((10000,), "float64")
    assert x.min() >= -2.0 and x.max() < 3.0 and abs(x.mean() - 0.5) < 0.1
    y = I.random_uniform(seed=0)((1000,), "float32")
    assert y.min() >= 0.0 and y.max() < 1.0  # TF1 default [0, 1)
    n = I.random_uniform(0, 10, seed=0)((1000,), "int32")
    assert n.dtype == np.int32 and n.min() >= 0 and n.max() <= 9
    with pytest.raises(ValueError, match="maxval"):
        I.random_uniform()((3,), "int32")


def test_random_normal_statistics() -> None:
    x = I.random_normal(mean=1.0, stddev=0.5, seed=0)((100000,), "float64")
    assert abs(x.mean() - 1.0) < 0.01 and abs(x.std() - 0.5) < 0.01
    positional = I.random_normal(1.0, 0.5, 0)((100000,), "float64")
    np.testing.assert_array_equal(x, positional)


def test_truncated_normal_within_two_stddev() -> None:
    x = I.truncated_normal(mean=3.0, stddev=2.0, seed=0)((100000,), "float64")
    assert x.min() >= 3.0 - 4.0 and x.max() <= 3.0 + 4.0
    assert abs(x.mean() - 3.0) < 0.02
    assert abs(x.std() - 2.0 * 0.8796) < 0.02  # std of a normal truncated at 2 sigma


def test_compute_fans_tensorflow_conventions() -> None:
    assert compute_fans(()) == (1, 1)
    assert compute_fans((7,)) == (7, 7)
    assert compute_fans((3, 4)) == (3, 4)
    assert compute_fans((5, 5, 3, 8)) == (75, 200)
    assert compute_fans((2, 3, 4)) == (6, 8)


@pytest.mark.parametrize("shape", [(300, 200), (3, 3, 64, 32)])
def test_glorot_uniform_limit(shape) -> None:
    fan_in, fan_out = compute_fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    x = I.glorot_uniform(seed=0)(shape, "float64")
    assert np.abs(x).max() <= limit
    assert np.abs(x).max() > 0.99 * limit  # the whole range is used
    assert abs(x.var() - limit**2 / 3) < 0.05 * limit**2 / 3


def test_glorot_normal_and_he_normal_variance() -> None:
    shape = (400, 600)
    g = I.glorot_normal(seed=0)(shape, "float64")
    assert abs(g.var() - 2.0 / (400 + 600)) < 0.05 * 2.0 / 1000
    assert np.abs(g).max() <= 2 * math.sqrt(2.0 / 1000) / 0.87962566103423978 + 1e-12
    h = I.he_normal(seed=0)(shape, "float64")
    assert abs(h.var() - 2.0 / 400) < 0.05 * 2.0 / 400
    conv = I.he_normal(seed=0)((3, 3, 16, 8), "float64")
    assert abs(conv.var() - 2.0 / (9 * 16)) < 0.1 * 2.0 / (9 * 16)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (3, 3, 4, 5), (5, 5)])
def test_orthogonal(shape) -> None:
    q = I.orthogonal(gain=2.0, seed=3)(shape, "float64")
    assert q.shape == shape
    flat = q.reshape(-1, shape[-1]) / 2.0
    rows, cols = flat.shape
    if rows >= cols:
        np.testing.assert_allclose(flat.T @ flat, np.eye(cols), atol=1e-10)
    else:
        np.testing.assert_allclose(flat @ flat.T, np.eye(rows), atol=1e-10)
    with pytest.raises(ValueError, match="2 dimensions"):
        I.orthogonal((3,))


def test_float_only_initializers_refuse_other_kinds() -> None:
    with pytest.raises(TypeError, match="int32"):
        I.glorot_uniform((2, 2), "int32")
    assert I.glorot_uniform((2, 2), "bfloat16").dtype == ml_dtypes.bfloat16
    assert I.he_normal((2, 2), "float16").dtype == np.float16


def test_any_callable_is_an_initializer() -> None:
    def my_init(shape, dtype):
        return np.full(shape, 0.5, dtype)

    v = cv.Variable(my_init, shape=(2,), dtype="float32")
    assert v.numpy().tolist() == [0.5, 0.5]
    w = cv.get_variable("w", [3], initializer=my_init)
    assert w.numpy().tolist() == [0.5] * 3
    assert I.is_initializer(my_init) and I.is_initializer(I.zeros) and I.is_initializer(I.Zeros)
    assert not I.is_initializer(lambda: 1) and not I.is_initializer(np.zeros(2))
    assert cv.Variable(I.Ones, shape=(1,)).numpy().tolist() == [1.0]


def test_unseeded_initializers_differ() -> None:
    a = I.random_normal()((50,), "float64")
    b = I.random_normal()((50,), "float64")
    assert not np.array_equal(a, b)


def test_repr() -> None:
    assert repr(I.random_normal(mean=1.0)) == "RandomNormal(mean=1.0, stddev=1.0, seed=None)"
    assert "glorot_uniform" in repr(I.glorot_uniform)


@pytest.mark.parametrize("name", ["zeros", "ones", "glorot_uniform", "he_normal", "orthogonal",
                                  "random_normal", "random_uniform", "truncated_normal"])
@pytest.mark.parametrize("shape", [(2, None), [2.0, 3], ("2",)])
def test_a_shape_that_is_not_one_is_said_to_be_so(name, shape) -> None:
    # zeros((2, None)) said "Zeros() takes no arguments"; glorot_uniform((2.0, 3)) made an
    # initializer seeded with the tuple, failing only when called
    with pytest.raises(ValueError, match=r"a shape is a tuple or list of non-negative ints"):
        getattr(I, name)(shape)


def test_random_uniform_integer_bounds_are_never_truncated() -> None:
    # random_uniform(0.5, 2.7) for int32 drew from [0, 2): 2 never came out
    with pytest.raises(TypeError, match="not 0.5"):
        I.random_uniform(0.5, 3)((4,), "int32")
    with pytest.raises(TypeError, match="not 2.7"):
        I.random_uniform(0, 2.7)((4,), "int64")
    drawn = I.random_uniform(1.0, 3, seed=0)((200,), "int32")
    assert set(drawn.tolist()) == {1, 2}
    assert I.random_uniform(0.5, 2.7, seed=0)((3,), "float32").min() >= 0.5


@pytest.mark.parametrize(
    "make",
    [
        lambda: cv.Variable(I.glorot_uniform, shape=(2, 3), dtype="int32", name="k"),
        lambda: cv.Variable(I.random_normal(seed=1), shape=(2,), dtype="bool", name="k"),
        lambda: cv.get_variable("k", shape=(2,), dtype="int32", initializer=I.he_normal),
        lambda: cv.get_variable("k", shape=(4, 2), dtype="uint8", initializer=I.Orthogonal,
                                partitioner=cv.fixed_size_partitioner(2)),
        lambda: cv.Module(name="m").add_variable("k", (2,), dtype="int32",
                                                  initializer=I.truncated_normal()),
    ],
)
def test_an_initializer_that_cannot_make_the_dtype_is_refused_at_creation(make) -> None:
    # the variable was made, and its first read raised a TypeError that named no variable
    with pytest.raises(cv.errors.DTypeLockError, match=r"Cannot make (partitioned )?variable 'k'"
                       r": \w+ cannot produce dtype"):
        make()
    assert cv.global_variables() == []


def test_an_initializer_that_cannot_fill_a_variable_is_a_ckpt_error_naming_it() -> None:
    """API.md section 10: a float-only initializer asked for int32 raised a plain TypeError,
    orthogonal given a vector and constant a value of another shape a plain ValueError,
    at the variable's first read and without its name."""
    with cv.Graph().as_default():
        with pytest.raises(DTypeLockError, match="variable 'k': GlorotUniform cannot produce"):
            cv.Variable(cv.initializers.glorot_uniform, shape=(2, 2), dtype="int32", name="k")
        o = cv.get_variable("o", shape=(3,), initializer=cv.initializers.orthogonal)
        with pytest.raises(ShapeLockError, match="variable 'o': orthogonal needs"):
            o.numpy()
        c = cv.get_variable("c", shape=(3,), initializer=cv.initializers.constant([1.0, 2.0]))
        with pytest.raises(ShapeLockError, match="variable 'c'"):
            c.numpy()
    with pytest.raises(DTypeLockError):
        cv.initializers.he_normal()((2, 2), "int32")


def test_a_bare_constant_is_zeros_as_in_tensorflow_1() -> None:
    """initializer=cv.initializers.constant (not called) raised TypeError
    'Constant.__init__() takes from 1 to 2 positional arguments but 3 were given' at the
    first read (get_variable: '... unexpected keyword argument 'dtype''); a bare factory is
    now its default initializer, as a bare tf.constant_initializer is."""
    with cv.Graph().as_default():
        got = cv.get_variable("c", shape=(2,), initializer=cv.initializers.constant)
        made = cv.Variable(cv.initializers.constant, shape=(2,), dtype="int32", name="m")
        added = cv.Module(name="mod").add_variable("k", (1,), initializer=cv.initializers.constant)
        assert got.numpy().tolist() == [0.0, 0.0] and made.numpy().tolist() == [0, 0]
        assert added.numpy().tolist() == [0.0]
        seeded = cv.get_variable("s", shape=(), initializer=cv.initializers.random_normal)
        assert seeded.numpy().shape == ()
