"""Lazy materialisation and deferred initialization (API.md §2, §9)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import UninitializedVariableError

pytestmark = pytest.mark.usefixtures("fresh_graph")

BIG = (4096, 4096)  # 64 MiB of float32


class CountingInit:
    def __init__(self, fill: float = 1.0) -> None:
        self.calls = 0
        self.fill = fill

    def __call__(self, shape, dtype):
        self.calls += 1
        return np.full(shape, self.fill, dtype)


def _allocated_during(fn) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    return peak - before


def test_initializer_variable_allocates_nothing_until_first_read() -> None:
    init = CountingInit()
    peak = _allocated_during(lambda: cv.Variable(init, shape=BIG, dtype="float32", name="big"))
    assert peak < 1 << 20 and init.calls == 0
    v = cv.Variable(init, shape=BIG, dtype="float32", name="big2")
    assert v.initialized and not v._materialized and init.calls == 0
    assert v.shape == BIG and v.dtype == np.float32 and len(v) == 4096
    assert v[0, 0] == 1.0 and init.calls == 1 and v._materialized
    v.numpy()
    assert init.calls == 1


def test_first_write_materialises_too() -> None:
    init = CountingInit(2.0)
    v = cv.Variable(init, shape=(2,), dtype="float32")
    v.assign_add([1.0, 1.0])
    assert init.calls == 1 and v.numpy().tolist() == [3.0, 3.0]


def test_full_assign_replaces_a_pending_initializer() -> None:
    init = CountingInit()
    v = cv.Variable(init, shape=(2,), dtype="float32")
    v.assign([5.0, 6.0])
    assert init.calls == 0 and v.numpy().tolist() == [5.0, 6.0]


def test_deferred_init_context_gives_no_value_and_no_memory() -> None:
    init = CountingInit()

    def make():
        with cv.deferred_init():
            return cv.Variable(init, shape=BIG, dtype="float32", name="deferred")

    assert _allocated_during(make) < 1 << 20
    with cv.deferred_init():
        v = cv.Variable(init, shape=(2, 2), dtype="float32", name="w")
        g = cv.get_variable("g", [3])
    assert not v.initialized and not g.initialized and init.calls == 0
    assert v.shape == (2, 2) and v.dtype == np.float32
    for read in (v.numpy, v.read_value, v.value, lambda: np.asarray(v), lambda: v + 1,
                 lambda: v[0], lambda: v.assign_add(np.ones((2, 2)))):
        with pytest.raises(UninitializedVariableError, match="'w'"):
            read()
    assert isinstance(UninitializedVariableError("x"), ValueError)
    assert "numpy=<uninitialized>" in repr(v)
    assert sorted(cv.report_uninitialized_variables()) == ["g", "w"]


def test_lazy_flag() -> None:
    init = CountingInit()
    v = cv.Variable(init, shape=(2,), dtype="float32", lazy=True)
    g = cv.get_variable("g", [2], initializer=init, lazy=True)
    assert not v.initialized and not g.initialized and init.calls == 0
    with cv.deferred_init():
        eager = cv.Variable(init, shape=(2,), dtype="float32", lazy=False)
    assert eager.initialized


def test_initialize_and_initialized_value() -> None:
    init = CountingInit(4.0)
    with cv.deferred_init():
        v = cv.Variable(init, shape=(2,), dtype="float32")
    assert v.initialize() is v
    assert init.calls == 1 and v._materialized and v.numpy().tolist() == [4.0, 4.0]
    v.assign([1.0, 1.0])
    v.initialize()  # already initialized: left alone
    assert init.calls == 1 and v.numpy().tolist() == [1.0, 1.0]
    with cv.deferred_init():
        w = cv.Variable(CountingInit(3.0), shape=(), dtype="float32")
    value = w.initialized_value()
    assert value == 3.0 and w.initialized
    value[...] = 0  # a copy
    assert w.numpy() == 3.0


def test_assign_initializes_a_deferred_variable() -> None:
    init = CountingInit()
    with cv.deferred_init():
        v = cv.Variable(init, shape=(2,), dtype="float32")
    v.assign([1.0, 2.0])
    assert v.initialized and init.calls == 0 and v.numpy().tolist() == [1.0, 2.0]


def test_deferred_concrete_value_waits_for_initialization() -> None:
    with cv.deferred_init():
        v = cv.Variable([1.0, 2.0], name="c")
    assert not v.initialized
    with pytest.raises(UninitializedVariableError, match="'c'"):
        v.numpy()
    assert cv.global_variables_initializer() == [v]
    assert v.numpy().tolist() == [1.0, 2.0]


def test_global_variables_initializer_leaves_initialized_and_local_alone() -> None:
    init = CountingInit(1.0)
    done = cv.Variable([9.0], name="done")
    with cv.deferred_init():
        a = cv.Variable(init, shape=(1,), dtype="float32", name="a")
        b = cv.get_variable("b", [1], initializer=init)
        restored = cv.Variable(init, shape=(1,), dtype="float32", name="restored")
        local = cv.get_variable("local", [1], initializer=init,
                                collections=[cv.GraphKeys.LOCAL_VARIABLES])
    restored._restore_value(np.array([7.0], np.float32))
    assert sorted(cv.report_uninitialized_variables()) == ["a", "b", "local"]
    initialized = cv.global_variables_initializer()
    assert {v.name for v in initialized} == {"a", "b"}
    assert init.calls == 2
    assert done.numpy().tolist() == [9.0] and restored.numpy().tolist() == [7.0]
    assert not local.initialized
    assert cv.report_uninitialized_variables() == ["local"]
    assert cv.report_uninitialized_variables([a, local]) == ["local"]
    local.initialize()
    assert cv.report_uninitialized_variables() == []


def test_tf1_initialized_value_pattern() -> None:
    with cv.deferred_init():
        v = cv.get_variable("v", shape=(), initializer=cv.initializers.zeros())
        w = cv.get_variable("w", initializer=v.initialized_value() + 1)
    assert v.initialized and not w.initialized  # a concrete value waits too, as in TF1
    cv.global_variables_initializer()
    assert w.numpy() == 1.0


def test_source_for_deferred_variable_before_initializer() -> None:
    init = CountingInit()
    with cv.deferred_init():
        v = cv.Variable(init, shape=(2,), dtype="float32")
    v._set_initial_value_source(lambda: np.array([3.0, 4.0], np.float32))
    assert v.initialized
    assert cv.global_variables_initializer() == []
    assert v.numpy().tolist() == [3.0, 4.0] and init.calls == 0


def test_concurrent_first_reads_run_the_initializer_once() -> None:
    import threading

    init = CountingInit(2.0)
    v = cv.Variable(init, shape=(256, 256), dtype="float32")
    barrier = threading.Barrier(8)
    buffers = []

    def read() -> None:
        barrier.wait()
        buffers.append(v.value())

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert init.calls == 1 and all(b is buffers[0] for b in buffers)
