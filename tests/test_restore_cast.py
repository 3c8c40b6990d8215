"""Restoring with a dtype cast: ``restore(path, cast=True)`` (opt-in, never silent).

A float16/bfloat16 checkpoint goes into a float32 model only when asked, under the
same_kind rules, value by value (no second copy of the model), with one warning
naming every key cast. Without ``cast`` (or for a cast same_kind does not allow)
the restore fails before anything changes.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv

BF16 = np.dtype(ml_dtypes.bfloat16)


def _half_checkpoint(path: Path, fmt: str) -> str:
    src = cv.Module(name="m")
    src.a = cv.Variable(np.array([1.5, -2.25, 3.0], np.float16), name="a")
    src.b = cv.Variable(np.array([[0.5, 4.0]], BF16), name="b")
    src.n = cv.Variable(np.array([7, 8], np.int32), name="n")
    return cv.Checkpoint(model=src).save(path / "half", format=fmt)


def _float32_model(*, built: bool = True) -> cv.Module:
    m = cv.Module(name="m")
    if built:
        m.a = cv.Variable(np.zeros(3, np.float32), name="a")
        m.b = cv.Variable(np.zeros((1, 2), np.float32), name="b")
        m.n = cv.Variable(np.zeros(2, np.int64), name="n")
    return m


def test_without_cast_a_half_checkpoint_is_refused(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    path = _half_checkpoint(tmp_path, fmt)
    m = _float32_model()
    with pytest.raises(cv.CheckpointMismatchError, match=r"cast=True") as info:
        cv.Checkpoint(model=m).restore(path)
    assert "'model/a'" in str(info.value) and "float16" in str(info.value)
    assert not m.a.numpy().any() and not m.b.numpy().any()


def test_cast_into_existing_variables(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    path = _half_checkpoint(tmp_path, fmt)
    m = _float32_model()
    buf = m.a.value()
    with pytest.warns(UserWarning, match="cast 3 stored value") as record:
        cv.Checkpoint(model=m).restore(path, cast=True).assert_consumed()
    assert len(record) == 1
    msg = str(record[0].message)
    assert "'model/a' (float16 -> float32)" in msg
    assert "'model/b' (bfloat16 -> float32)" in msg and "'model/n' (int32 -> int64)" in msg
    assert m.a.value() is buf  # converted into the variable's own buffer
    np.testing.assert_array_equal(m.a.numpy(), np.array([1.5, -2.25, 3.0], np.float32))
    np.testing.assert_array_equal(m.b.numpy(), [[0.5, 4.0]])
    assert m.a.dtype == np.float32 and m.n.dtype == np.int64
    np.testing.assert_array_equal(m.n.numpy(), [7, 8])


def test_cast_into_variables_created_later(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    path = _half_checkpoint(tmp_path, fmt)
    m = _float32_model(built=False)
    status = cv.Checkpoint(model=m).restore(path, cast=True)
    calls = []

    def init(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        calls.append(shape)
        return np.zeros(shape, dtype)

    with pytest.warns(UserWarning, match=r"'model/a' \(float16 -> float32\)"):
        m.a = cv.Variable(init, shape=(3,), dtype="float32", name="a")
    with pytest.warns(UserWarning, match=r"'model/b' \(bfloat16 -> float32\)"):
        m.b = cv.Variable(init, shape=(1, 2), dtype="float32", name="b")
    with pytest.warns(UserWarning, match=r"'model/n' \(int32 -> int64\)"):
        m.n = cv.Variable(init, shape=(2,), dtype="int64", name="n")
    status.assert_consumed()
    assert calls == []
    np.testing.assert_array_equal(m.a.numpy(), [1.5, -2.25, 3.0])
    assert m.b.numpy().dtype == np.float32


def test_cast_that_same_kind_forbids_is_refused(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    src = cv.Module(name="m")
    src.a = cv.Variable(np.array([1.5, 2.5], np.float32), name="a")
    src.b = cv.Variable(np.array([1.0], np.float16), name="b")
    path = cv.Checkpoint(model=src).save(tmp_path / "f", format=fmt)
    m = cv.Module(name="m")
    m.a = cv.Variable(np.zeros(2, np.int32), name="a")  # float -> int: never
    m.b = cv.Variable(np.zeros(1, np.float32), name="b")  # fine, but all or nothing
    with pytest.raises(cv.CheckpointMismatchError, match="not a same_kind cast") as info:
        cv.Checkpoint(model=m).restore(path, cast=True)
    assert "'model/a'" in str(info.value) and "'model/b'" not in str(info.value)
    assert not m.a.numpy().any() and not m.b.numpy().any()


def test_saver_and_restore_on_create_cast(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    with cv.Graph().as_default():
        v = cv.Variable(np.array([0.5, 1.5], np.float16), name="v")
        path = cv.Saver([v]).save(tmp_path / "s")
    with cv.Graph().as_default():
        w = cv.Variable(np.zeros(2, np.float32), name="v")
        saver = cv.Saver([w])
        with pytest.raises(cv.CheckpointMismatchError):
            saver.restore(path)
        with pytest.warns(UserWarning, match=r"'v' \(float16 -> float32\)"):
            saver.restore(path, cast=True)
        np.testing.assert_array_equal(w.numpy(), [0.5, 1.5])
    with cv.Graph().as_default():
        with (
            pytest.warns(UserWarning, match=r"'v' \(float16 -> float32\)"),
            cv.restore_on_create(path, cast=True) as status,
        ):
            x = cv.get_variable("v", shape=(2,), dtype="float32")
        status.assert_consumed()
        np.testing.assert_array_equal(x.numpy(), [0.5, 1.5])
        assert x.dtype == np.float32


def test_cast_streams_value_by_value(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    n, count = 2**20, 8  # eight float32 values of 4 MiB: a 32 MiB model, 16 MiB stored
    src = cv.Module(name="m")
    src.ws = [cv.Variable(np.full(n, i, np.float16), name=f"w{i}") for i in range(count)]
    path = cv.Checkpoint(model=src).save(tmp_path / "big", format=fmt)
    del src
    m = cv.Module(name="m")
    m.ws = [cv.Variable(np.zeros(n, np.float32), name=f"w{i}") for i in range(count)]
    tracemalloc.start()
    try:
        with pytest.warns(UserWarning, match="cast 8 stored value"):
            cv.Checkpoint(model=m).restore(path, cast=True).assert_consumed()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [float(w.numpy()[-1]) for w in m.ws] == [float(i) for i in range(count)]
    # at most about one stored value (2 MiB) at a time: far below the stored 16 MiB
    assert peak < 3 * n * 2, f"peak {peak} bytes"


@pytest.mark.parametrize("built", [True, False])
def test_cast_that_would_wrap_an_integer_is_refused(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph, built: bool
) -> None:
    """int64 2**40 cast into an int32 variable was stored as 0 (with only a 'cast' warning)."""
    src = cv.Module(name="m")
    src.a = cv.Variable(np.array([1.5], np.float32), name="a")
    src.n = cv.Variable(np.array([7, 2**40], np.int64), name="n")
    path = cv.Checkpoint(model=src).save(tmp_path / "wide", format=fmt)
    m = cv.Module(name="m")
    m.a = cv.Variable(np.zeros(1, np.float64), name="a")
    if built:
        m.n = cv.Variable(np.zeros(2, np.int32), name="n")
        with pytest.raises(cv.CheckpointMismatchError, match=r"'model/n' to dtype int32: 1099511627776"):
            cv.Checkpoint(model=m).restore(path, cast=True)
        assert not m.n.numpy().any() and not m.a.numpy().any()  # nothing half-restored
    else:
        with pytest.warns(UserWarning, match="cast"):
            cv.Checkpoint(model=m).restore(path, cast=True)
        with pytest.raises(cv.CheckpointMismatchError, match=r"'model/n' to dtype int32: 1099511627776"):
            m.n = cv.Variable(cv.initializers.zeros, shape=(2,), dtype="int32", name="n")
    # a value that fits still casts
    small = cv.Module(name="m")
    small.n = cv.Variable(np.array([7, -8], np.int64), name="n")
    path2 = cv.Checkpoint(model=small).save(tmp_path / "small", format=fmt)
    into = cv.Module(name="m")
    into.n = cv.Variable(np.zeros(2, np.int32), name="n")
    with pytest.warns(UserWarning, match="int64 -> int32"):
        cv.Checkpoint(model=into).restore(path2, cast=True)
    np.testing.assert_array_equal(into.n.numpy(), [7, -8])


@pytest.mark.parametrize("built", [True, False])
def test_cast_that_would_make_a_float_inf_is_refused(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph, built: bool
) -> None:
    """float64 1e300 cast into a float32 variable became inf, with only NumPy's
    RuntimeWarning naming no key; now refused naming the key, before anything changes."""
    src = cv.Module(name="m")
    src.a = cv.Variable(np.array([1.5], np.float32), name="a")
    src.w = cv.Variable(np.array([0.5, 1e300, np.inf]), name="w")
    path = cv.Checkpoint(model=src).save(tmp_path / "wide", format=fmt)
    m = cv.Module(name="m")
    m.a = cv.Variable(np.zeros(1, np.float64), name="a")
    said = r"'model/w' to dtype float32: 1e\+300 is outside its finite range .*inf"
    if built:
        m.w = cv.Variable(np.zeros(3, np.float32), name="w")
        with pytest.raises(cv.CheckpointMismatchError, match=said):
            cv.Checkpoint(model=m).restore(path, cast=True)
        assert not m.w.numpy().any() and not m.a.numpy().any()  # nothing half-restored
    else:
        with pytest.warns(UserWarning, match="cast"):
            cv.Checkpoint(model=m).restore(path, cast=True)
        with pytest.raises(cv.CheckpointMismatchError, match=said):
            m.w = cv.Variable(cv.initializers.zeros, shape=(3,), dtype="float32", name="w")
    # finite values in range, and infinities, still cast
    fits = cv.Module(name="m")
    fits.w = cv.Variable(np.array([1e30, -np.inf, 2.0**-140]), name="w")
    path2 = cv.Checkpoint(model=fits).save(tmp_path / "fits", format=fmt)
    into = cv.Module(name="m")
    into.w = cv.Variable(np.zeros(3, np.float32), name="w")
    with pytest.warns(UserWarning, match="float64 -> float32"):
        cv.Checkpoint(model=into).restore(path2, cast=True)
    np.testing.assert_array_equal(into.w.numpy(), np.array([1e30, -np.inf, 2.0**-140], np.float32))


def test_cast_into_partitions_that_would_make_a_float_inf_is_refused(tmp_path: Path) -> None:
    with cv.Graph().as_default():
        cv.get_variable("emb", shape=(4, 2), dtype="float64",
                        initializer=cv.initializers.constant(1e300))
        path = cv.Saver().save(tmp_path / "wide")
    with cv.Graph().as_default():
        w = cv.get_variable("emb", shape=(4, 2), dtype="bfloat16",
                            initializer=cv.initializers.zeros,
                            partitioner=cv.fixed_size_partitioner(2))
        with pytest.raises(cv.CheckpointMismatchError, match="'emb' to dtype bfloat16: 1e"):
            cv.Saver().restore(path, cast=True)
        assert not np.asarray(w).astype(np.float32).any()


def test_cast_into_partitions_that_would_wrap_is_refused(tmp_path: Path) -> None:
    with cv.Graph().as_default():
        cv.get_variable("emb", shape=(4, 2), dtype="int64",
                        initializer=cv.initializers.constant(2**40))
        path = cv.Saver().save(tmp_path / "wide")
    with cv.Graph().as_default():
        w = cv.get_variable("emb", shape=(4, 2), dtype="int32", initializer=cv.initializers.zeros,
                            partitioner=cv.fixed_size_partitioner(2))
        with pytest.raises(cv.CheckpointMismatchError, match="'emb' to dtype int32: 1099511627776"):
            cv.Saver().restore(path, cast=True)
        assert not np.asarray(w).any()


@pytest.mark.parametrize(("stored", "target", "big", "said"), [
    ("float64", "float32", 1e300, r"1e\+300 is outside its finite range"),
    ("int64", "int8", 1000, r"1000 is outside its range"),
])
def test_a_collective_restore_refuses_a_cast_that_changes_a_number(
        tmp_path: Path, stored: str, target: str, big: float, said: str) -> None:
    """The multi-process restore (a coordinator and a sharded variable) made 1e300 inf and
    wrapped 1000 to -24 silently; it refuses them as a single-process restore does."""
    coord = cv.distributed.SingleProcessCoordinator()
    shard = cv.Shard(full_shape=(2, 2), offset=(0, 0))
    with cv.Graph().as_default():
        v = cv.Variable(np.array([[1, big], [2, 3]], stored), name="v", shard=shard)
        path = cv.Checkpoint(v=v).save(tmp_path / "c", coordinator=coord)
    with cv.Graph().as_default():
        w = cv.Variable(np.zeros((2, 2), target), name="v", shard=shard)
        with pytest.raises(cv.CheckpointMismatchError, match=f"'v' to dtype {target}: {said}"):
            cv.Checkpoint(v=w).restore(path, coordinator=coord, cast=True)
        assert not w.numpy().any()  # nothing restored


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_a_coordinated_cast_that_would_wrap_an_integer_is_refused(
    tmp_path: Path, suffix: str, fresh_graph: cv.Graph
) -> None:
    """With a coordinator, int64 2**40 cast into an int32 shard was stored as -1684967296."""
    coord = cv.distributed.SingleProcessCoordinator()
    whole = cv.Shard(full_shape=(2, 2), offset=(0, 0))
    n = cv.Variable(np.array([[7, 2**40], [1, -2]], np.int64), name="n", shard=whole)
    a = cv.Variable(np.array([1.5], np.float32), name="a")
    path = cv.Checkpoint(n=n, a=a).save(tmp_path / f"wide{suffix}", coordinator=coord)
    n32 = cv.Variable(np.zeros((2, 2), np.int32), name="n", shard=whole)
    a64 = cv.Variable(np.zeros(1, np.float64), name="a")
    with pytest.raises(cv.CheckpointMismatchError, match=r"'n' to dtype int32: 1099511627776"):
        cv.Checkpoint(n=n32, a=a64).restore(path, coordinator=coord, cast=True)
    assert not n32.numpy().any() and not a64.numpy().any()  # nothing half-restored
    row = cv.Variable(np.zeros((1, 2), np.int32), name="n",
                      shard=cv.Shard(full_shape=(2, 2), offset=(1, 0)))
    with pytest.warns(UserWarning, match="int64 -> int32"):  # a box that fits still casts
        cv.Checkpoint(n=row, a=a64).restore(path, coordinator=coord, cast=True)
    np.testing.assert_array_equal(row.numpy(), [[1, -2]])
