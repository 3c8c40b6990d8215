"""cv.restore_on_create: variables created in the block take stored values by name."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv


class CountingInit:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.calls += 1
        return np.zeros(shape, dtype)


def _build(init: CountingInit) -> tuple[cv.Variable, cv.Variable, cv.Variable]:
    with cv.variable_scope("encoder"):
        w = cv.get_variable("w", shape=(3, 2), initializer=init)
    with cv.name_scope("head"):
        b = cv.Variable(init, shape=(2,), dtype="float32", name="b")
    c = cv.Variable(np.zeros(4, np.int32), name="count")  # a concrete value: overwritten
    return w, b, c


def _fill(vs: tuple[cv.Variable, ...]) -> None:
    for i, v in enumerate(vs):
        v.assign(np.arange(np.prod(v.shape)).reshape(v.shape) + i + 1)


@pytest.mark.parametrize("writer", ["saver", "checkpoint"])
def test_by_name_for_saver_and_checkpoint_files(
    tmp_path: Path, fmt: str, writer: str, fresh_graph: cv.Graph
) -> None:
    src = _build(CountingInit())
    _fill(src)
    if writer == "saver":
        path = cv.Saver(list(src)).save(tmp_path / "s", format=fmt)
    else:  # object-graph keys differ from the names; the stored names are what matter
        path = cv.Checkpoint(parts=list(src)).write(tmp_path / f"c.{fmt}")
    expected = [v.numpy() for v in src]

    init = CountingInit()
    with cv.Graph().as_default(), cv.restore_on_create(path) as status:
        dst = _build(init)
        unrelated = cv.Variable(init, shape=(2,), dtype="float32", name="unrelated")
    assert init.calls == 0
    for v, e in zip(dst, expected, strict=True):
        np.testing.assert_array_equal(v.numpy(), e)
    status.assert_consumed()
    unrelated.numpy()
    assert init.calls == 1  # the variable that had nothing stored is initialized normally


def test_deferred_variables_become_initialized(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    v = cv.Variable([1.5, 2.5], name="v")
    path = cv.Saver([v]).save(tmp_path / "s", format=fmt)
    with cv.Graph().as_default():
        with cv.restore_on_create(path), cv.deferred_init():
            d = cv.Variable(cv.initializers.ones, shape=(2,), dtype="float32", name="v")
        assert d.initialized
        assert cv.report_uninitialized_variables() == []
        np.testing.assert_array_equal(d.numpy(), [1.5, 2.5])


def test_mismatch_and_unconsumed(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    v = cv.Variable([1.0, 2.0], name="v")
    other = cv.Variable(1.0, name="other")
    path = cv.Saver([v, other]).save(tmp_path / "s", format=fmt)
    with cv.Graph().as_default(), cv.restore_on_create(path) as status:
        with pytest.raises(cv.CheckpointMismatchError, match=r"'v'.*expected shape \(3,\)"):
            cv.Variable(cv.initializers.zeros, shape=(3,), dtype="float32", name="v")
        with pytest.raises(cv.RestoreAssertionError, match="other"):
            status.assert_consumed()
    # outside the block nothing is restored any more
    with cv.Graph().as_default():
        assert float(cv.Variable(0.0, name="other").numpy()) == 0.0


def test_peak_memory_is_one_copy(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    n = 8 * 2**20 // 8
    v = cv.Variable(np.arange(n, dtype=np.float64), name="big")
    path = cv.Saver([v]).save(tmp_path / "s", format=fmt)
    del v
    init = CountingInit()
    with cv.Graph().as_default(), cv.restore_on_create(path):
        tracemalloc.start()
        try:
            big = cv.Variable(init, shape=(n,), dtype="float64", name="big")
            value = big.value()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert init.calls == 0 and value[n - 1] == n - 1
    assert peak < 1.25 * n * 8, f"peak {peak} bytes for a {n * 8}-byte value"
