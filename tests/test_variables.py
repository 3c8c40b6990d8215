"""Variable behaviour (API.md §1) and the hooks the checkpoint layer relies on."""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import DTypeLockError, ShapeLockError, UninitializedVariableError
from ckptvar.variables import VariableStateError, register_creation_hook

pytestmark = pytest.mark.usefixtures("fresh_graph")


def _ptr(v: cv.Variable) -> int:
    return v.value().ctypes.data


# --- creation and dtype inference ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (1.5, "float32"),
        (3, "int32"),
        (True, "bool"),
        (1 + 2j, "complex128"),
        ([[1.0, 2.0], [3.0, 4.0]], "float32"),
        ([1, 2, 3], "int32"),
        ([False, True], "bool"),
        ([5 + 4j, 6 + 1j], "complex128"),
        ([1, 2.5], "float32"),
        (np.arange(3, dtype=np.int64), "int64"),
        (np.float64(2.0), "float64"),
        (np.zeros(2, np.float16), "float16"),
    ],
)
def test_dtype_inference_follows_tensorflow(value, dtype) -> None:
    assert cv.Variable(value).dtype == np.dtype(dtype)


def test_dtype_argument_converts_same_kind_only() -> None:
    assert cv.Variable([1, 2], dtype="float64").dtype == np.float64
    assert cv.Variable([1, 2], dtype="bfloat16").dtype == ml_dtypes.bfloat16
    with pytest.raises(DTypeLockError, match="float.*int32"):
        cv.Variable([1.5, 2.0], dtype="int32")
    with pytest.raises(TypeError):
        cv.Variable(["a", "b"])


@pytest.mark.parametrize(
    "dtype",
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "bfloat16", "complex64", "complex128"],
)
def test_every_dtype_round_trips_and_assigns(dtype) -> None:
    dt = cv.initializers.zeros((1,), dtype).dtype
    v = cv.Variable(np.ones((2, 3), dt), name="v")
    assert v.dtype == dt and v.shape == (2, 3)
    v.assign(np.zeros((2, 3), dt))
    assert v.numpy().dtype == dt and not v.numpy().astype(bool).any()
    if dt.kind != "b":
        v.assign_add(np.ones((2, 3), dt))
        assert (v.numpy().astype(np.complex128) == 1).all()


def test_attributes_and_repr() -> None:
    v = cv.Variable([[1.0, 2.0], [3.0, 4.0]], name="w", trainable=False)
    assert v.name == "w" and v.shape == (2, 2) and v.dtype == np.float32
    assert v.device == "CPU:0" and v.trainable is False and v.initialized
    assert v.constraint is None and v.ndim == 2
    assert repr(v) == (
        "<cv.Variable 'w' shape=(2, 2) dtype=float32, numpy=\n"
        "array([[1., 2.],\n       [3., 4.]], dtype=float32)>"
    )
    assert "dtype=bfloat16" in repr(cv.Variable([1.0], dtype="bfloat16"))


def test_initial_value_from_variable_is_a_copy() -> None:
    a = cv.Variable([2.0, 3.0])
    b = cv.Variable(a)
    assert not np.shares_memory(a.value(), b.value())
    a.assign([5, 6])
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(a.numpy(), [5.0, 6.0])
    assert b.dtype == np.float32


def test_initial_value_array_is_copied() -> None:
    src = np.array([1.0, 2.0], np.float32)
    v = cv.Variable(src)
    src[0] = 99
    assert v.numpy()[0] == 1.0
    assert not np.shares_memory(src, v.value())


def test_callable_initial_value() -> None:
    v = cv.Variable(lambda: np.zeros(3))
    assert v.dtype == np.float64 and v.shape == (3,)
    calls = []

    def make() -> np.ndarray:
        calls.append(1)
        return np.ones((2,), np.float32)

    lazy = cv.Variable(make, shape=(2,), dtype="float32")
    assert calls == []  # both shape and dtype known: taken at first read
    np.testing.assert_array_equal(lazy.numpy(), [1, 1])
    assert calls == [1]


def test_callable_result_is_not_aliased() -> None:
    shared = np.zeros(2, np.float32)
    v = cv.Variable(lambda: shared, shape=(2,), dtype="float32")
    v.assign_add([1, 1])
    assert shared.sum() == 0


@pytest.mark.parametrize("init", [cv.initializers.ones, cv.initializers.ones(),
                                  lambda shape, dtype: np.ones(shape, dtype)])
def test_initializer_with_shape_and_dtype(init) -> None:
    v = cv.Variable(init, shape=(2, 3), dtype="float64")
    assert v.shape == (2, 3) and v.dtype == np.float64
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 3)))


def test_initializer_needs_a_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        cv.Variable(cv.initializers.zeros)
    with pytest.raises(ValueError):
        cv.Variable(None)


def test_initializer_default_dtype_is_float32() -> None:
    assert cv.Variable(cv.initializers.zeros, shape=(2,)).dtype == np.float32


# --- reading ---------------------------------------------------------------------------------


def test_reads_return_copies() -> None:
    v = cv.Variable([1.0, 2.0])
    for read in (v.numpy(), v.read_value(), np.asarray(v), np.array(v)):
        assert isinstance(read, np.ndarray)
        assert not np.shares_memory(read, v.value())
        read[0] = 42
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert v.value() is v.value()  # the backing array itself


def test_asarray_without_copy_is_read_only() -> None:
    v = cv.Variable([1.0, 2.0])
    view = np.asarray(v, copy=False)
    assert np.shares_memory(view, v.value()) and not view.flags.writeable
    assert np.asarray(v, dtype=np.float64).dtype == np.float64


def test_indexing_returns_arrays() -> None:
    v = cv.Variable([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype="float32")
    part = v[:2, :2]
    assert isinstance(part, np.ndarray)
    np.testing.assert_array_equal(part, [[1, 2], [4, 5]])
    assert not np.shares_memory(part, v.value())
    assert type(part + 1) is np.ndarray
    assert v[1, 1] == 5.0
    assert len(v) == 3
    with pytest.raises(TypeError):
        len(cv.Variable(1.0))
    assert [row.tolist() for row in v] == v.numpy().tolist()
    assert float(cv.Variable(2.5)) == 2.5 and int(cv.Variable(3)) == 3
    assert list(range(cv.Variable(3))) == [0, 1, 2]


def test_operators_return_arrays_and_never_change_the_variable() -> None:
    v = cv.Variable([[1.0, 2.0], [3.0, 4.0]])
    before = v.numpy()
    m = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    results = {
        "add": (v + 1, before + 1), "radd": (1 + v, 1 + before),
        "sub": (v - 1, before - 1), "rsub": (1 - v, 1 - before),
        "mul": (v * 2, before * 2), "rmul": (2 * v, 2 * before),
        "div": (v / 2, before / 2), "rdiv": (2 / v, 2 / before),
        "floordiv": (v // 2, before // 2), "rfloordiv": (7 // v, 7 // before),
        "mod": (v % 2, before % 2), "rmod": (7 % v, 7 % before),
        "pow": (v ** 2, before ** 2), "rpow": (2 ** v, 2 ** before),
        "matmul": (v @ m, before @ m), "rmatmul": (m @ v, m @ before),
        "neg": (-v, -before), "pos": (+v, +before), "abs": (abs(-v), before),
        "vv": (v + v, before + before), "arr_left": (m + v, m + before),
    }
    for key, (got, want) in results.items():
        assert isinstance(got, np.ndarray), key
        np.testing.assert_allclose(got, want, err_msg=key)
    np.testing.assert_array_equal(v.numpy(), before)


def test_comparisons_are_elementwise() -> None:
    my_tensor = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    a = cv.Variable(my_tensor, name="Mark")
    b = cv.Variable(my_tensor + 1, name="Mark")
    assert (a == b).tolist() == [[False, False], [False, False]]
    assert (a != b).all() and (a < b).all() and (b > a).all() and (a <= a).all()
    assert (a >= 2).tolist() == [[False, True], [True, True]]
    assert {a: 1}[a] == 1  # hashable by identity


def test_numpy_functions_return_arrays_and_never_change_the_variable() -> None:
    v = cv.Variable([[1.0, 5.0], [3.0, 4.0]])
    before = v.numpy()
    assert np.argmax(v) == 1
    r = np.reshape(v, (1, 4))
    assert r.shape == (1, 4) and v.shape == (2, 2)
    assert not np.shares_memory(r, v.value())
    assert np.sum(v) == 13.0 and np.mean(v) == 3.25
    t = np.transpose(v)
    assert not np.shares_memory(t, v.value())
    assert np.concatenate([v, v]).shape == (4, 2)
    np.testing.assert_array_equal(np.sqrt(v), np.sqrt(before))
    with pytest.raises(ValueError):
        np.copyto(v, np.zeros((2, 2)))  # the variable is only written through assign
    v.assign_add(1)
    np.testing.assert_array_equal(r, before.reshape(1, 4))  # no aliasing of earlier results
    np.testing.assert_array_equal(v.numpy(), before + 1)


def test_ufunc_out_variable_writes_through_assign() -> None:
    v = cv.Variable([1.0, 2.0])
    ptr = _ptr(v)
    np.add(v, 1, out=v)
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
    assert _ptr(v) == ptr
    with pytest.raises(DTypeLockError):
        np.add(v, 1.5, out=cv.Variable([1, 2]))


# --- writing -----------------------------------------------------------------------------------


def test_assign_family_in_place() -> None:
    a = cv.Variable([2.0, 3.0])
    buf, ptr = a.value(), _ptr(a)
    assert a.assign([1, 2]) is a
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(a.assign_add([2, 3]).numpy(), [3.0, 5.0])
    np.testing.assert_array_equal(a.assign_sub([3, 5]).numpy(), [0.0, 0.0])
    a[1].assign(7)
    a[:1].assign([4])
    np.testing.assert_array_equal(a.numpy(), [4.0, 7.0])
    assert a.value() is buf and _ptr(a) == ptr
    assert ctypes.addressof(ctypes.c_char.from_address(ptr)) == ptr


def test_slice_assign_like_tensorflow() -> None:
    A = cv.Variable([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype="float32")
    ptr = _ptr(A)
    np.testing.assert_array_equal(A[:2, :2], [[1, 2], [4, 5]])
    out = A[:2, :2].assign(22.0 * np.ones((2, 2)))
    assert out is A and _ptr(A) == ptr
    np.testing.assert_array_equal(A.numpy(), [[22, 22, 3], [22, 22, 6], [7, 8, 9]])
    A[2] = [0, 0, 0]
    A[:, 2] = 1  # setitem broadcasts into the slice
    np.testing.assert_array_equal(A.numpy(), [[22, 22, 1], [22, 22, 1], [0, 0, 1]])
    with pytest.raises(ShapeLockError, match=r"slice's shape \(2, 2\)"):
        A[:2, :2].assign(np.ones((3,)))
    assert not hasattr(A[:2, :2] + 1, "assign")  # derived arrays are plain NumPy


def test_in_place_operators_write_into_the_variable() -> None:
    v = cv.Variable([1.0, 2.0])
    ptr = _ptr(v)
    alias = v
    v += 1
    v *= 2
    assert v is alias and isinstance(v, cv.Variable) and _ptr(v) == ptr
    np.testing.assert_array_equal(v.numpy(), [4.0, 6.0])


def test_shape_lock_message_names_variable_and_shapes() -> None:
    with cv.name_scope("dense"):
        k = cv.Variable([1.0, 2.0], name="kernel")
    with pytest.raises(ShapeLockError) as err:
        k.assign([1.0, 2.0, 3.0])
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "Cannot assign to variable 'dense/kernel': shape (3,) does not match the variable's "
        "shape (2,)."
    )
    with pytest.raises(ShapeLockError):
        k.assign_add(np.ones((2, 2)))
    np.testing.assert_array_equal(k.numpy(), [1.0, 2.0])


def test_dtype_lock_same_kind() -> None:
    f = cv.Variable([1.0, 2.0])
    f.assign(np.array([3, 4], np.int64))  # int -> float is fine
    i = cv.Variable([1, 2])
    with pytest.raises(DTypeLockError) as err:
        i.assign([1.5, 2.5])
    assert isinstance(err.value, TypeError) and "int32" in str(err.value)
    with pytest.raises(TypeError):
        i.assign_add(np.array([0.5, 0.5]))
    with pytest.raises(TypeError):
        f.assign(np.array([1j, 2j]))
    np.testing.assert_array_equal(i.numpy(), [1, 2])


@pytest.mark.parametrize("value", ["abc", [None], {"a": 1}, object(), np.array(["a"]),
                                   np.array([None])])
def test_a_value_that_is_no_array_is_a_ckpt_error_naming_the_variable(value: object) -> None:
    """API.md section 10: it was a plain TypeError ('Cannot convert str ...') without the name."""
    with pytest.raises(DTypeLockError, match="variable 'odd'") as err:
        cv.Variable(value, name="odd")
    assert isinstance(err.value, cv.CkptError) and isinstance(err.value, TypeError)
    with pytest.raises(DTypeLockError, match="'odd_get'"):
        cv.get_variable("odd_get", initializer=value)


def test_a_ragged_value_is_a_ckpt_error_naming_the_variable() -> None:
    """It was NumPy's ValueError ('setting an array element with a sequence') alone."""
    for ragged in ([[1, 2], [3]], [[1.0], [2.0, 3.0]]):
        with pytest.raises(cv.CkptError, match="initial value of variable 'rag'") as err:
            cv.Variable(ragged, name="rag")
        assert isinstance(err.value, ValueError)
    v = cv.Variable([[1, 2], [3, 4]], name="square")
    for write in (v.assign, v.assign_add, v.assign_sub, v[0].assign):
        with pytest.raises(ShapeLockError, match="variable 'square'"):
            write([[1], [2, 3]])
    np.testing.assert_array_equal(v.numpy(), [[1, 2], [3, 4]])


def test_ufunc_at_writes_through_the_variable() -> None:
    """np.add.at(v, ...) wrote into the variable's buffer through its read-only view (NumPy's
    ufunc.at ignores the flag): no version change, no constraint, no dtype lock. It now
    writes as assign does."""
    v = cv.Variable([1.0, 2.0, 3.0], name="at", constraint=lambda x: np.minimum(x, 10.0))
    before = v._writes
    np.add.at(v, [0, 0, 2], [1.0, 20.0, 1.0])
    np.testing.assert_array_equal(v.numpy(), [10.0, 2.0, 4.0])  # the constraint ran
    assert v._writes > before  # a write, as incremental checkpoints see it
    ints = cv.Variable([1, 2], name="ints")
    with pytest.raises(DTypeLockError, match="add.at"):
        np.add.at(ints, [0], 0.5)  # NumPy alone would truncate it away
    np.subtract.at(ints, [1], 2)
    np.testing.assert_array_equal(ints.numpy(), [1, 0])


def test_a_ufunc_into_a_variable_with_where_keeps_the_other_elements() -> None:
    """np.add(v, 1, out=v, where=mask) set the elements the mask leaves out to whatever
    uninitialized memory held ([2, 0] for [1, 2]), with NumPy's warning about it."""
    v = cv.Variable([1.0, 2.0, 3.0], name="masked")
    np.add(v, 1, out=v, where=np.array([True, False, True]))
    np.testing.assert_array_equal(v.numpy(), [2.0, 2.0, 4.0])
    other = np.zeros(2, np.float32)
    w = cv.Variable([0.0, 0.0], name="frac")
    np.modf(np.array([1.5, 2.25], np.float32), out=(w, other), where=[False, True])
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.25])
    np.testing.assert_array_equal(other, [0.0, 2.0])


def test_numpy_functions_with_out_write_through_the_variable() -> None:
    """np.clip(v, 0, 1, out=v) raised NumPy's 'output array is read-only' (ufuncs with
    out=v wrote; functions such as clip, cumsum, around did not). They now write as assign
    does: the constraint runs, a dtype the variable cannot take is a DTypeLockError."""
    v = cv.Variable([-1.0, 2.0], name="clipped", constraint=lambda x: np.maximum(x, -0.5))
    before = v._writes
    assert np.clip(v, -2.0, 1.5, out=v) is v
    np.testing.assert_array_equal(v.numpy(), [-0.5, 1.5])
    assert v._writes > before
    np.cumsum(np.ones(2, np.float32), out=v)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    ints = cv.Variable([1, 2], name="ints")
    with pytest.raises(DTypeLockError, match="clip.*'ints'"):
        np.clip(ints, 0, 1.5, out=ints)
    with pytest.raises(ShapeLockError, match="'ints'"):
        np.clip(np.ones(3, np.int32), 0, 1, out=ints)
    np.testing.assert_array_equal(ints.numpy(), [1, 2])


def test_failed_writes_leave_value_unchanged() -> None:
    def bad_constraint(x):
        if x.sum() > 100:
            raise RuntimeError("too big")
        return x

    v = cv.Variable([1.0, 2.0], constraint=bad_constraint)
    attempts = [
        lambda: v.assign([1.0]),
        lambda: v.assign(["x", "y"]),
        lambda: v.assign([1000.0, 0.0]),
        lambda: v.assign_add([1000.0, 0.0]),
        lambda: v[0].assign(500.0),
        lambda: v.assign_sub(np.ones(3)),
    ]
    for attempt in attempts:
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            attempt()
        np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


def test_constraint_applied_after_every_write() -> None:
    v = cv.Variable([0.5, -0.5], constraint=lambda x: np.clip(x, 0, 1))
    np.testing.assert_array_equal(v.numpy(), [0.5, -0.5])  # not at creation
    ptr = _ptr(v)
    v.assign([2.0, -3.0])
    np.testing.assert_array_equal(v.numpy(), [1.0, 0.0])
    v.assign_sub([2.0, 0.0])
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
    v.assign_add([0.25, 5.0])
    np.testing.assert_array_equal(v.numpy(), [0.25, 1.0])
    v[0].assign(9.0)
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    assert _ptr(v) == ptr
    with pytest.raises(ShapeLockError, match="constraint"):
        cv.Variable([1.0, 2.0], constraint=lambda x: x[:1]).assign([1.0, 1.0])


def test_unlocked_dimensions() -> None:
    v = cv.Variable(np.zeros((2, 3)), shape=(None, 3))
    assert v.shape == (None, 3)
    v.assign(np.ones((5, 3)))
    assert v.numpy().shape == (5, 3)
    with pytest.raises(ShapeLockError, match=r"\(None, 3\)"):
        v.assign(np.ones((5, 4)))
    free = cv.Variable([1.0, 2.0], validate_shape=False)
    assert free.shape is None
    free.assign(np.ones((4, 4)))
    assert free.numpy().shape == (4, 4)
    with pytest.raises(ShapeLockError):
        cv.Variable(np.zeros((2, 3)), shape=(3, None))


def test_variables_are_freed_when_unreferenced() -> None:
    v = cv.Variable(np.zeros(10), name="temp")
    ref = weakref.ref(v)
    assert cv.global_variables() == [v]
    del v
    gc.collect()
    assert ref() is None
    assert cv.global_variables() == []


# --- checkpoint-layer hooks ---------------------------------------------------------------------


def test_uid_is_unique_and_increasing() -> None:
    uids = [cv.Variable(1.0)._uid for _ in range(5)]
    assert uids == sorted(uids) and len(set(uids)) == 5


def test_concrete_value_is_materialized_at_construction() -> None:
    assert cv.Variable([1.0])._materialized


def test_initializer_variable_is_not_materialized_until_read() -> None:
    calls = []

    def init(shape, dtype):
        calls.append(shape)
        return np.full(shape, 3, dtype)

    v = cv.Variable(init, shape=(2,), dtype="float32")
    assert not v._materialized and v.initialized and calls == []
    assert v._host_buffer() is None
    np.testing.assert_array_equal(v.numpy(), [3, 3])
    assert v._materialized and calls == [(2,)]
    buf = v._host_buffer()
    assert buf is v.value() and buf.flags.c_contiguous


def test_set_initial_value_source_replaces_initializer_and_is_adopted() -> None:
    def init(shape, dtype):
        raise AssertionError("the initializer must not run")

    v = cv.Variable(init, shape=(2, 2), dtype="float32", lazy=True)
    assert not v.initialized
    stored = np.arange(4, dtype=np.float32).reshape(2, 2)
    v._set_initial_value_source(lambda: stored)
    assert v.initialized and not v._materialized
    assert v.value() is stored  # adopted without a copy on the CPU
    np.testing.assert_array_equal(v.numpy(), stored)
    with pytest.raises(RuntimeError) as err:
        v._set_initial_value_source(lambda: stored)
    assert isinstance(err.value, VariableStateError)


def test_set_initial_value_source_before_first_write() -> None:
    v = cv.Variable(cv.initializers.zeros, shape=(2,), dtype="float32")
    v._set_initial_value_source(lambda: np.array([5, 6], np.float32))
    v.assign_add([1, 1])
    np.testing.assert_array_equal(v.numpy(), [6, 7])


def test_restore_value_in_place_when_materialized() -> None:
    v = cv.Variable([1.0, 2.0], constraint=lambda x: x * 0)
    buf = v.value()
    new = np.array([7.0, 8.0], np.float32)
    v._restore_value(new)
    assert v.value() is buf and not np.shares_memory(buf, new)
    np.testing.assert_array_equal(v.numpy(), [7.0, 8.0])  # the constraint is not applied


def test_restore_value_adopts_when_not_materialized() -> None:
    calls = []
    v = cv.Variable(lambda shape, dtype: calls.append(1), shape=(2,), dtype="float32")
    arr = np.array([1.0, 2.0], np.float32)
    v._restore_value(arr)
    assert v.value() is arr and calls == []
    deferred = cv.Variable(cv.initializers.ones, shape=(2,), lazy=True)
    deferred._restore_value(arr.copy())
    assert deferred.initialized and cv.report_uninitialized_variables() == []


def test_host_buffer_reads_straight_into_the_variable() -> None:
    v = cv.Variable(np.zeros((2, 2), np.float32))
    buf = v._host_buffer()
    buf[...] = 5  # what a loader does with file bytes
    assert (v.numpy() == 5).all()
    assert cv.Variable(cv.initializers.zeros, shape=(2,), lazy=True)._host_buffer() is None


def test_creation_hooks_run_in_order_before_materialisation() -> None:
    seen = []

    def first(v):
        seen.append(("first", v.name, v.shape, v.dtype, v.device, v.trainable,
                     v._materialized, v in cv.global_variables()))

    def second(v):
        seen.append(("second", v.name))
        if v.name == "restored":
            v._set_initial_value_source(lambda: np.full((3,), 9, np.float32))

    h1, h2 = register_creation_hook(first), register_creation_hook(second)
    try:
        v = cv.Variable(cv.initializers.random_normal(seed=1), shape=(3,), name="restored")
    finally:
        h1.remove()
        h2.remove()
        h2.remove()  # idempotent
    assert seen == [("first", "restored", (3,), np.float32, "CPU:0", True, False, True),
                    ("second", "restored")]
    np.testing.assert_array_equal(v.numpy(), [9, 9, 9])
    cv.Variable(1.0)
    assert len(seen) == 2  # removed hooks no longer run


def test_creation_hook_sees_get_variable() -> None:
    names = []
    with register_creation_hook(lambda v: names.append(v.name)):
        with cv.variable_scope("s"):
            cv.get_variable("w", shape=(1,))
    assert names == ["s/w"]


def test_copy_and_deepcopy() -> None:
    import copy

    v = cv.Variable([1.0, 2.0], name="orig", shape=(None,), trainable=False)
    assert copy.copy(v) is v
    d = copy.deepcopy(v)
    assert d is not v and d.name == "orig" and d.shape == (None,) and not d.trainable
    assert not np.shares_memory(d.value(), v.value())
    d.assign_add([1.0, 1.0])
    assert v.numpy().tolist() == [1.0, 2.0] and d.numpy().tolist() == [2.0, 3.0]
    holder = copy.deepcopy({"a": v, "b": v})
    assert holder["a"] is holder["b"]


@pytest.mark.parametrize(
    "module", ["ckptvar._naming", "ckptvar.device", "ckptvar.graph", "ckptvar.initializers",
               "ckptvar.storage.rawio", "ckptvar.storage.checksum",
               "ckptvar.variables"],
)
def test_module_doctests(module) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_same_kind_follows_numpy_for_arrays_and_kind_for_python_values() -> None:
    i32 = cv.Variable([1, 2])
    i32.assign(np.array([3, 4], np.uint8))  # uint8 -> int32 is same_kind
    assert i32.numpy().tolist() == [3, 4]
    u8 = cv.Variable([1, 2], dtype="uint8")
    u8.assign([5, 6])  # Python ints are weak: only their kind counts
    with pytest.raises(DTypeLockError):
        u8.assign(np.array([1, 2], np.int32))  # int32 -> uint8 is not same_kind
    b16 = cv.Variable([1.0], dtype="bfloat16")
    b16.assign(np.array([2], np.int8))
    b16.assign(np.array([3.0], np.float64))
    with pytest.raises(DTypeLockError):
        cv.Variable([1], dtype="int8").assign(b16.numpy())
    assert b16.numpy().tolist() == [3.0]


def test_pickle_round_trip() -> None:
    import pickle

    v = cv.Variable(np.arange(4.0).reshape(2, 2), name="p", shape=(None, 2), trainable=False)
    cv.reset_default_graph()
    w = pickle.loads(pickle.dumps(v))
    assert w.name == "p" and w.shape == (None, 2) and not w.trainable and w.dtype == np.float64
    assert w.numpy().tolist() == v.numpy().tolist()
    assert cv.global_variables() == [w]
    b = pickle.loads(pickle.dumps(cv.Variable([1.5], dtype="bfloat16")))
    assert str(b.dtype) == "bfloat16" and b.numpy().tolist() == [1.5]


def test_scalar_repr_is_inline() -> None:
    assert repr(cv.Variable(5.0, name="s")) == "<cv.Variable 's' shape=() dtype=float32, numpy=5.0>"


# --- integer narrowing never wraps a value --------------------------------------------------


@pytest.mark.parametrize(
    ("var_dtype", "value"),
    [
        ("int8", np.array([1000, 0], np.int64)),
        ("int32", np.array([2**40, 0], np.int64)),
        ("int32", np.array([2**32 - 1, 0], np.uint32)),
        ("uint8", [-1, 0]),
        ("uint8", [300, 0]),
        ("int64", [2**63, 0]),  # beyond 64 bits: NumPy's bare OverflowError, no name said
        ("int64", [-(2**64), 0]),
        ("uint64", [2**64, 0]),
    ],
)
def test_integer_write_out_of_range_is_refused_not_wrapped(var_dtype: str, value: object) -> None:
    """same_kind lets int64 -> int8 through; NumPy's cast wrapped 1000 to -24 silently."""
    v = cv.Variable(np.array([1, 2], var_dtype), name="narrow")
    writes = [
        lambda: v.assign(value),
        lambda: v.assign_add(value),
        lambda: v[0:2].assign(value),
        lambda: v.scatter_update([0, 1], value),
    ]
    for write in writes:
        with pytest.raises(DTypeLockError, match=r"outside its range.*wrap"):
            write()
        assert v.numpy().tolist() == [1, 2]
    with pytest.raises(DTypeLockError, match="outside its range"):
        cv.Variable(value, dtype=var_dtype)
    # values that fit still convert, as same_kind promises
    assert v.assign(np.array([-5, 7], np.int64) if var_dtype[0] != "u" else [5, 7]).numpy().tolist()[1] == 7


def test_python_int_beyond_int32_infers_int64_as_tensorflow() -> None:
    """``tf.constant(2**40)`` is int64; ckptvar raised OverflowError (NumPy's, no CkptError)."""
    assert cv.Variable(2**40).numpy() == 2**40
    assert cv.Variable(2**40).dtype == np.int64
    assert cv.Variable([1, -(2**40)]).dtype == np.int64
    assert cv.Variable([1, 2]).dtype == np.int32
    assert cv.Variable(-(2**31)).dtype == np.int32
    with pytest.raises(DTypeLockError, match="'big'.*9223372036854775808 is outside its range"):
        cv.Variable(2**63, name="big")
    with pytest.raises(DTypeLockError, match="outside its range"):
        cv.Variable(1, dtype="int64").assign_add(2**64)


@pytest.mark.parametrize(
    "make",
    [
        lambda: cv.Variable(lambda: [1, 2], shape=(2,), dtype="float32"),
        lambda: cv.Variable(lambda shape, dtype: (1, 2), shape=(2,), dtype="float32"),
        lambda: cv.get_variable("w", shape=(2,), initializer=lambda shape, dtype: [1.0, 2.0]),
    ],
)
def test_initial_value_function_returning_a_list_gives_an_array_of_the_dtype(make) -> None:
    v = make()
    value = v.numpy()
    assert isinstance(value, np.ndarray) and value.dtype == np.float32
    assert value.tolist() == [1.0, 2.0]
    v.assign_add([1, 1])
    v[0].assign(5)
    assert v.numpy().tolist() == [5.0, 3.0]


def test_initial_value_function_returning_a_list_keeps_the_dtype_lock() -> None:
    fractional = cv.Variable(lambda: [1.5], shape=(1,), dtype="int32", name="f")
    with pytest.raises(DTypeLockError, match="'f'"):
        fractional.numpy()
    wrapped = cv.Variable(lambda shape, dtype: [300], shape=(1,), dtype="uint8", name="u")
    with pytest.raises(DTypeLockError, match="300 is outside"):
        wrapped.numpy()
    wrong_shape = cv.Variable(lambda: [1.0, 2.0, 3.0], shape=(2,), dtype="float32", name="s")
    with pytest.raises(ShapeLockError, match=r"\(3,\)"):
        wrong_shape.numpy()



@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("assign_add", lambda v: v.assign_add([True, True])),
        ("assign_sub", lambda v: v.assign_sub([True, False])),
        ("scatter_add", lambda v: v.scatter_add([0], [True])),
        ("scatter_sub", lambda v: v.scatter_sub([1], [True])),
    ],
)
def test_adding_to_a_bool_variable_is_refused_as_in_tensorflow(method, call) -> None:
    # NumPy made assign_add a silent logical or, and assign_sub raised its own TypeError
    flags = cv.Variable([False, True], name="flags")
    with pytest.raises(DTypeLockError, match=f"{method} on bool variable 'flags'"):
        call(flags)
    assert flags.numpy().tolist() == [False, True]
    flags.scatter_update([0], [True])  # writes that are not arithmetic still work
    assert flags.numpy().tolist() == [True, True]



@pytest.mark.parametrize("method", ["scatter_update", "scatter_add", "scatter_sub"])
@pytest.mark.parametrize("indices", [[-1], [0, -3], [3], [1, 4]])
def test_scatter_rows_outside_the_variable_are_refused_as_in_tensorflow(method, indices) -> None:
    # TensorFlow: "indices[0] = -1 is not in [0, 3)"; -1 wrote the last row before
    v = cv.Variable(np.zeros((3, 2)), name="table")
    updates = np.ones((len(indices), 2))
    with pytest.raises(IndexError, match=r"'table': row -?\d is outside its 3 rows \[0, 3\)"):
        getattr(v, method)(indices, updates)
    assert not v.numpy().any()



def test_a_ragged_nested_list_is_a_shape_error_naming_the_variable() -> None:
    # NumPy's bare "setting an array element with a sequence" named nothing
    ragged = [[1.0, 2.0], [3.0]]
    with pytest.raises(ShapeLockError, match="initial value of variable 'r'.*not rectangular"):
        cv.Variable(ragged, name="r")
    v = cv.Variable([[1.0, 2.0], [3.0, 4.0]], name="v")
    for write in (v.assign, v.assign_add, lambda x: v.scatter_update([0, 1], x)):
        with pytest.raises(ShapeLockError, match="variable 'v'.*not rectangular"):
            write(ragged)
    assert v.numpy().tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert cv.global_variables() == [v]  # the refused one took no name



@pytest.mark.parametrize("shape", [(2.5,), [2.7, 3], ("3",), np.array([2.0, 3.0])])
def test_a_shape_with_an_entry_that_is_not_an_int_is_refused_not_truncated(shape) -> None:
    # shape=(2.5,) made a (2,) variable, ("3",) a (3,) one, as TensorFlow's TensorShape refuses
    with pytest.raises(ValueError, match="A shape is a tuple of ints"):
        cv.Variable(cv.initializers.zeros, shape=shape)
    with pytest.raises(ValueError, match="tuple of ints"):
        cv.get_variable("w", shape=shape)
    with pytest.raises(ValueError, match="tuple of ints"):
        cv.initializers.zeros._cls()(shape)
    assert cv.global_variables() == []
    assert cv.Variable(cv.initializers.zeros, shape=(np.int64(2), 3)).shape == (2, 3)



def test_an_initializer_returning_an_array_it_keeps_shares_no_memory() -> None:
    # the array was adopted as it was: every variable made from the initializer, and the
    # user's array, were one buffer, and a write to one changed the others unseen
    kept = np.zeros(2, np.float32)

    def init(shape, dtype=None):  # type: ignore[no-untyped-def]
        return kept

    class Init:
        def __call__(self, shape, dtype=None):  # type: ignore[no-untyped-def]
            return kept

    made = [
        cv.get_variable("a", shape=(2,), initializer=init),
        cv.get_variable("b", shape=(2,), initializer=Init()),
        cv.Variable(init, shape=(2,), dtype="float32", name="c"),
        cv.Variable(Init(), shape=(2,), dtype="float32", name="d"),
        cv.Module(name="m").add_variable("e", (2,), initializer=init),
    ]
    for v in made:
        v.assign_add([1.0, 1.0])
    assert kept.tolist() == [0.0, 0.0]
    assert [v.numpy().tolist() for v in made] == [[1.0, 1.0]] * len(made)


# --- threads ---------------------------------------------------------------------------------


class _Held(np.ndarray):
    """An operand whose ufuncs compute at once, then hand the result back only when ``go``
    is set: the moment between a read-modify-write's read and its write, held open."""

    inside: threading.Event
    go: threading.Event

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):  # type: ignore[no-untyped-def]
        result = getattr(ufunc, method)(*(np.asarray(x) for x in inputs), **kwargs)
        self.inside.set()
        assert self.go.wait(10)
        return result


@pytest.mark.parametrize(
    "update",
    [lambda v, x: v.__iadd__(x), lambda v, x: np.add(v, x, out=v)],
    ids=["iadd", "ufunc-out"],
)
def test_read_modify_write_loses_no_write_of_another_thread(update) -> None:
    v = cv.Variable([0.0])
    held = np.ones(1).view(_Held)
    held.inside, held.go = threading.Event(), threading.Event()
    first = threading.Thread(target=update, args=(v, held))
    first.start()
    assert held.inside.wait(10)  # v + 1 is computed (1.0), not yet written
    second = threading.Thread(target=v.assign_add, args=([10.0],))
    second.start()
    second.join(0.3)  # waits for the first update to be written
    held.go.set()
    first.join(10)
    second.join(10)
    assert v.numpy().tolist() == [11.0]  # not 1.0: the assign_add was not overwritten


@pytest.mark.parametrize(
    "read",
    [cv.Variable.numpy, cv.Variable.read_value, np.asarray, lambda v: v[:], lambda v: v[::2]],
    ids=["numpy", "read_value", "asarray", "slice", "strided"],
)
def test_a_copy_read_beside_writes_is_never_torn(read) -> None:
    # as a TensorFlow variable's read: the old value or the new one, never a mix
    v = cv.Variable(np.zeros(1 << 18))
    stop = threading.Event()

    def write() -> None:
        k = 0.0
        while not stop.is_set():
            k += 1
            v.assign(np.full(1 << 18, k))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        torn = 0
        for _ in range(150):
            value = np.asarray(read(v))
            torn += int(value.min() != value.max())
    finally:
        stop.set()
        writer.join(10)
    assert torn == 0


def test_deepcopy_of_an_uninitialized_variable_is_uninitialized_and_apart() -> None:
    # deepcopy (of a model built under deferred_init, say) raised UninitializedVariableError
    import copy

    source = np.array([1.0, 2.0])
    with cv.deferred_init():
        kernel = cv.Variable(cv.initializers.ones, shape=(2, 2), name="kernel")
        bias = cv.Variable(source, name="bias")
    model = {"kernel": kernel, "bias": bias}
    twin = copy.deepcopy(model)
    assert not twin["kernel"].initialized and not twin["bias"].initialized
    assert twin["kernel"].name == "kernel" and twin["kernel"].shape == (2, 2)
    twin["kernel"].initialize()
    twin["bias"].initialize()
    assert twin["kernel"].numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert not kernel.initialized and not bias.initialized  # the originals are untouched
    bias.initialize()
    assert not np.shares_memory(bias.value(), twin["bias"].value())
    twin["bias"].assign_add([1.0, 1.0])
    assert bias.numpy().tolist() == [1.0, 2.0] and twin["bias"].numpy().tolist() == [2.0, 3.0]
