"""cv.Checkpoint on both formats: naming, round trips, matching, status, safety, restore-as-init."""

from __future__ import annotations

import os
import tracemalloc
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.checkpoint import _apply
from ckptvar.storage import backend_for

DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
]


class Dense(cv.Module):
    def __init__(self, units: int, name: str | None = None) -> None:
        super().__init__(name=name)
        self.units = units

    def build(self, fan_in: int) -> None:
        self.kernel = self.add_variable("kernel", (fan_in, self.units))
        self.bias = self.add_variable("bias", (self.units,), initializer=cv.initializers.zeros)


class Model(cv.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = Dense(3)
        self.layers = [Dense(2), Dense(4)]

    def build(self) -> None:
        self.dense.build(4)
        self.layers[0].build(3)
        self.layers[1].build(2)


def _keys(path: str) -> list[str]:
    with backend_for(path).open_reader(Path(path)) as r:
        return list(r.keys())


def _built() -> Model:
    m = Model()
    m.build()
    return m


def _values(m: cv.Module) -> list[np.ndarray]:
    return [v.numpy() for v in m.variables]


# -- naming and formats -------------------------------------------------------------------


def test_save_names_files_with_the_counter(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(model=_built())
    suffix = {"h5": ".h5", "zarr": ".zarr"}[fmt]
    p1 = ckpt.save(tmp_path / "runs" / "ckpt", format=fmt)
    p2 = ckpt.save(str(tmp_path / "runs" / "ckpt"), format=fmt)
    assert p1 == str(tmp_path / "runs" / f"ckpt-1{suffix}")
    assert p2 == str(tmp_path / "runs" / f"ckpt-2{suffix}")
    assert int(ckpt.save_counter.numpy()) == 2
    assert "save_counter" in _keys(p2)
    assert int(cv.load_variable(p2, "save_counter")) == 2
    # the suffix of the prefix picks the format too
    p3 = ckpt.save(tmp_path / f"other{suffix}")
    assert p3 == str(tmp_path / f"other-3{suffix}")


def test_default_format_is_h5_and_write_uses_the_exact_path(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    ckpt = cv.Checkpoint(model=_built())
    assert ckpt.save(tmp_path / "ckpt").endswith("ckpt-1.h5")
    exact = tmp_path / "final.h5"
    assert ckpt.write(exact) == str(exact)
    assert int(ckpt.save_counter.numpy()) == 1  # write() leaves the counter alone
    fresh = cv.Checkpoint(model=_built())
    fresh.restore(exact).assert_consumed()  # the counter is in every file
    assert int(fresh.save_counter.numpy()) == 1
    plain = tmp_path / "nosuffix"
    ckpt.write(plain)
    assert backend_for(plain).name == "h5"


def test_write_zarr_by_suffix(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    path = cv.Checkpoint(model=_built()).write(tmp_path / "final.zarr")
    assert Path(path).is_dir() and backend_for(path).name == "zarr"


def test_writing_an_unwritable_suffix_is_refused(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(model=_built())
    with pytest.raises(cv.UnsupportedFormatError):
        ckpt.write(tmp_path / "model.safetensors")
    with pytest.raises(cv.UnsupportedFormatError):
        ckpt.write(tmp_path / "model.xyz")
    with pytest.raises(cv.UnsupportedFormatError):
        ckpt.save(tmp_path / "ckpt", format="nope")
    assert int(ckpt.save_counter.numpy()) == 0
    assert not list(tmp_path.iterdir())


def test_checkpoint_rejects_non_trackables_and_the_reserved_name(fresh_graph: cv.Graph) -> None:
    with pytest.raises(TypeError, match="trackable"):
        cv.Checkpoint(x=3)
    with pytest.raises(ValueError, match="reserved"):
        cv.Checkpoint(save_counter=cv.Variable(1))


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_scalar_and_zero_size(
    tmp_path: Path, fmt: str, dtype: str, fresh_graph: cv.Graph
) -> None:
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    full = (rng.standard_normal((3, 5)) * 10).astype(dt)
    scalar = np.asarray(full.flat[0], dtype=dt)
    empty = np.zeros((0, 4), dt)
    vs = {n: cv.Variable(a, name=n) for n, a in [("full", full), ("scalar", scalar), ("e", empty)]}
    path = cv.Checkpoint(**vs).save(tmp_path / "ckpt", format=fmt)
    targets = {n: cv.Variable(np.zeros_like(v.numpy()), name=n + "_t") for n, v in vs.items()}
    cv.Checkpoint(**targets).restore(path).assert_consumed()
    for n, v in vs.items():
        got = targets[n].numpy()
        assert got.dtype == dt and got.shape == v.numpy().shape
        assert got.tobytes() == v.numpy().tobytes()


def test_nested_modules_lists_dicts_and_escaped_names(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    m = _built()
    m.table = {"a/b": cv.Variable([1, 2], name="ab"), "plain": [cv.Variable(3.0, name="p")]}
    ckpt = cv.Checkpoint(model=m)
    path = ckpt.save(tmp_path / "ckpt", format=fmt)
    assert set(_keys(path)) == {
        "save_counter",
        "model/dense/kernel", "model/dense/bias",
        "model/layers/0/kernel", "model/layers/0/bias",
        "model/layers/1/kernel", "model/layers/1/bias",
        "model/table/a%2Fb", "model/table/plain/0",
    }
    m2 = _built()
    m2.table = {"a/b": cv.Variable([0, 0], name="ab2"), "plain": [cv.Variable(0.0, name="p2")]}
    cv.Checkpoint(model=m2).restore(path).assert_consumed()
    for a, b in zip(_values(m), _values(m2), strict=True):
        np.testing.assert_array_equal(a, b)
    with backend_for(path).open_reader(Path(path)) as r:
        assert r.info("model/dense/kernel").attrs["name"] == "dense/kernel"
        assert r.info("model/dense/kernel").attrs["trainable"] is True


def test_shared_variable_stored_once_restored_into_both_paths(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    shared = cv.Variable([1.0, 2.0, 3.0], name="shared")
    a, b = cv.Module(name="a"), cv.Module(name="b")
    a.w, b.w = shared, shared
    path = cv.Checkpoint(a=a, b=b).save(tmp_path / "ckpt", format=fmt)
    assert [k for k in _keys(path) if k != "save_counter"] == ["a/w"]
    # a program where the two paths hold two distinct variables gets the value in both
    a2, b2 = cv.Module(name="a"), cv.Module(name="b")
    a2.w, b2.w = cv.Variable(np.zeros(3, np.float32)), cv.Variable(np.zeros(3, np.float32))
    cv.Checkpoint(a=a2, b=b2).restore(path).assert_consumed()
    np.testing.assert_array_equal(a2.w.numpy(), [1, 2, 3])
    np.testing.assert_array_equal(b2.w.numpy(), [1, 2, 3])
    # and a program sharing it again restores it once
    s3 = cv.Variable(np.zeros(3, np.float32))
    a3, b3 = cv.Module(name="a"), cv.Module(name="b")
    a3.w, b3.w = s3, s3
    cv.Checkpoint(a=a3, b=b3).restore(path).assert_consumed()
    np.testing.assert_array_equal(s3.numpy(), [1, 2, 3])


def test_counter_is_restored(tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    ckpt = cv.Checkpoint(model=_built())
    ckpt.save(tmp_path / "ckpt", format=fmt)
    path = ckpt.save(tmp_path / "ckpt", format=fmt)
    again = cv.Checkpoint(model=_built())
    again.restore(path).assert_consumed()
    assert int(again.save_counter.numpy()) == 2
    assert again.save(tmp_path / "ckpt", format=fmt).endswith(f"ckpt-3.{fmt}")


# -- checks before anything changes -------------------------------------------------------


def test_mismatch_names_every_key_and_changes_nothing(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    path = cv.Checkpoint(model=_built()).save(tmp_path / "ckpt", format=fmt)
    m = _built()
    m.dense.bias = cv.Variable(np.zeros(5, np.float32), name="bias5")  # wrong shape
    m.layers[0].bias = cv.Variable(np.zeros(2, np.float64), name="bias64")  # wrong dtype
    before = _values(m)
    with pytest.raises(cv.CheckpointMismatchError) as info:
        cv.Checkpoint(model=m).restore(path)
    msg = str(info.value)
    assert "'model/dense/bias'" in msg and "expected shape (5,)" in msg
    assert "found shape (3,)" in msg
    assert "'model/layers/0/bias'" in msg and "dtype float64" in msg and "dtype float32" in msg
    for a, b in zip(before, _values(m), strict=True):
        np.testing.assert_array_equal(a, b)


def _corrupt_value(path: str, marker: np.ndarray) -> None:
    """Flip one byte inside the stored bytes of ``marker`` (found by content)."""
    needle = marker.tobytes()[:64]
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for f in files:
        data = bytearray(f.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 40] ^= 0xFF
            f.write_bytes(bytes(data))
            return
    pytest.skip("the value is not stored as raw bytes in this format (compressed)")


@pytest.mark.parametrize("budget", [None, 0], ids=["temporaries", "verify-first"])
def test_corruption_is_caught_before_anything_changes(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph, monkeypatch: pytest.MonkeyPatch,
    budget: int | None,
) -> None:
    if budget is not None:
        monkeypatch.setattr(_apply, "TEMPORARY_BUDGET", budget)
    big = np.arange(100_000, dtype=np.float64) * 1.5 + 0.25
    first = cv.Variable(np.ones(1000, np.float32), name="first")
    ckpt = cv.Checkpoint(first=first, big=cv.Variable(big, name="big"))
    path = ckpt.save(tmp_path / "ckpt", format=fmt)
    _corrupt_value(path, big)
    t_first = cv.Variable(np.zeros(1000, np.float32), name="t_first")
    t_big = cv.Variable(np.zeros_like(big), name="t_big")
    with pytest.raises(cv.CorruptCheckpointError):
        cv.Checkpoint(first=t_first, big=t_big).restore(path)
    assert not t_first.numpy().any() and not t_big.numpy().any()


def test_missing_file(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    with pytest.raises(cv.CheckpointNotFoundError):
        cv.Checkpoint(model=_built()).restore(tmp_path / "nope.h5")


# -- the status ---------------------------------------------------------------------------


def test_status_assertions_list_everything_at_once(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    m = _built()
    m.extra_a = cv.Variable(1.0, name="ea")
    m.extra_b = cv.Variable(2.0, name="eb")
    path = cv.Checkpoint(model=m).save(tmp_path / "ckpt", format=fmt)

    small = _built()  # no extras: the file has values nobody takes
    status = cv.Checkpoint(model=small).restore(path)
    status.assert_existing_objects_matched()
    with pytest.raises(cv.RestoreAssertionError) as info:
        status.assert_consumed()
    assert "model/extra_a" in str(info.value) and "model/extra_b" in str(info.value)

    bigger = _built()
    bigger.new_a = cv.Variable(1.0, name="na")
    bigger.new_b = cv.Variable(1.0, name="nb")
    status = cv.Checkpoint(model=bigger).restore(path).expect_partial()
    with pytest.raises(cv.RestoreAssertionError) as info:
        status.assert_existing_objects_matched()
    assert "model/new_a" in str(info.value) and "model/new_b" in str(info.value)
    assert isinstance(info.value, AssertionError)


def test_unused_values_warn_once_unless_silenced(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    m = _built()
    m.extra = cv.Variable(1.0, name="extra")
    path = cv.Checkpoint(model=m).save(tmp_path / "ckpt", format=fmt)
    with pytest.warns(UserWarning, match="model/extra") as record:
        cv.Checkpoint(model=_built()).restore(path)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cv.Checkpoint(model=_built()).restore(path).expect_partial()
        status = cv.Checkpoint(model=_built()).restore(path)
        status.assert_existing_objects_matched()
        del status
        cv.Checkpoint(model=m).restore(path)  # everything used: nothing to say


def test_a_dropped_status_does_not_warn_about_values_still_waiting(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    path = cv.Checkpoint(model=_built()).save(tmp_path / "ckpt", format=fmt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = Model()  # not built: every value waits for its variable
        ckpt = cv.Checkpoint(model=m)
        ckpt.restore(path)  # the status is dropped at once
        assert caught == []
        m.build()  # the variables take their values as they are created
        np.testing.assert_array_equal(m.dense.bias.numpy(), np.zeros(3, np.float32))
        del m, ckpt
        assert caught == []  # everything was used: nothing to say

        never = Model()  # never built: the values wait, then nothing can take them
        ckpt = cv.Checkpoint(model=never)
        ckpt.restore(path)
        assert caught == []
        del never, ckpt
    assert len(caught) == 1
    assert "model/dense/kernel" in str(caught[0].message)


def test_restore_none_is_a_no_op_status(fresh_graph: cv.Graph) -> None:
    status = cv.Checkpoint(model=_built()).restore(None)
    with pytest.raises(cv.RestoreAssertionError, match="None"):
        status.assert_consumed()


def test_assert_nontrivial_match_as_in_tensorflow(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    """TensorFlow code calls status.assert_nontrivial_match() after a restore: it raised
    AttributeError. It passes when some value besides the save counter went to an object
    (one created later too), and raises RestoreAssertionError otherwise."""
    path = cv.Checkpoint(w=cv.Variable([1.0, 2.0], name="w")).save(tmp_path / "c")
    cv.Checkpoint(w=cv.Variable([0.0, 0.0], name="w2")).restore(path).assert_nontrivial_match()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the unused value: said, then asserted
        wrong = cv.Checkpoint(other=cv.Variable([0.0, 0.0], name="o")).restore(path)
        with pytest.raises(cv.RestoreAssertionError, match="nothing but the save counter"):
            wrong.assert_nontrivial_match()
    later = cv.Checkpoint()
    status = later.restore(path)
    later.w = cv.Variable([0.0, 0.0], name="w3")
    assert status.assert_nontrivial_match() is status
    with pytest.raises(cv.RestoreAssertionError, match="None"):
        cv.Checkpoint().restore(None).assert_nontrivial_match()


# -- restore as initialization ------------------------------------------------------------


class CountingInit:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.calls += 1
        return np.full(shape, -1, dtype)


class Lazy(cv.Module):
    """Builds its variables on first use, in four different ways."""

    def __init__(self, init: CountingInit) -> None:
        super().__init__()
        self.init = init
        self.blocks = [Dense(2), Dense(2)]

    def build(self) -> None:
        self.kernel = cv.Variable(self.init, shape=(3, 2), dtype="float32", name="kernel")
        self.bias = self.add_variable("bias", (2,), initializer=self.init)
        with self.name_scope, cv.variable_scope("proj"):
            self.proj = cv.get_variable("w", shape=(2, 2), initializer=self.init)
        with cv.deferred_init():
            self.lazy = cv.Variable(self.init, shape=(4,), dtype="int64", name="lazy")
        self.concrete = cv.Variable(np.zeros(2, np.float32), name="concrete")
        for block in self.blocks:
            block.build(2)


def test_restore_before_build_never_calls_initializers(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    src = Lazy(CountingInit())
    src.build()
    for i, v in enumerate(src.variables):
        v.assign(np.full(v.shape, i + 1, v.dtype))
    path = cv.Checkpoint(model=src).save(tmp_path / "ckpt", format=fmt)

    init = CountingInit()
    dst = Lazy(init)
    status = cv.Checkpoint(model=dst).restore(path)
    with pytest.raises(cv.RestoreAssertionError):
        status.assert_consumed()  # nothing built yet: values are waiting
    with cv.Graph().as_default():  # as in a new process: get_variable names are free again
        dst.build()
    assert init.calls == 0
    assert dst.lazy.initialized
    for a, b in zip(_values(src), _values(dst), strict=True):
        np.testing.assert_array_equal(a, b)
    status.assert_consumed()
    assert init.calls == 0
    # blocks' glorot initializers never ran either: the values are the stored ones
    np.testing.assert_array_equal(dst.blocks[1].kernel.numpy(), src.blocks[1].kernel.numpy())


def test_restore_before_build_checks_shapes(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    src = Dense(3)
    src.build(4)
    path = cv.Checkpoint(model=src).save(tmp_path / "ckpt", format=fmt)
    dst = Dense(3)
    status = cv.Checkpoint(model=dst).restore(path)
    with pytest.raises(cv.CheckpointMismatchError, match="model/kernel"):
        dst.build(5)
    status.expect_partial()


def test_objects_attached_to_the_checkpoint_later(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    src = _built()
    path = cv.Checkpoint(model=src).save(tmp_path / "ckpt", format=fmt)
    ckpt = cv.Checkpoint()
    status = ckpt.restore(path)
    ckpt.model = _built()  # concrete values already there: they are overwritten
    for a, b in zip(_values(src), _values(ckpt.model), strict=True):
        np.testing.assert_array_equal(a, b)
    status.assert_consumed()


def test_restore_as_init_allocates_no_second_copy(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    n = 8 * 2**20 // 4  # 8 MiB of float32
    src = cv.Module(name="m")
    src.w = cv.Variable(np.arange(n, dtype=np.float32), name="w")
    path = cv.Checkpoint(model=src).save(tmp_path / "ckpt", format=fmt)
    del src
    init = CountingInit()
    dst = cv.Module(name="m")
    status = cv.Checkpoint(model=dst).restore(path)
    tracemalloc.start()
    try:
        dst.w = cv.Variable(init, shape=(n,), dtype="float32", name="w")
        value = dst.w.value()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert init.calls == 0
    assert value[123] == 123.0
    assert peak < 1.25 * n * 4, f"peak {peak} bytes for a {n * 4}-byte value"
    status.assert_consumed()


@pytest.mark.slow
def test_round_trip_larger_than_2_gib(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    n = (2**31 + 4096) // 8
    big = np.empty(n, np.float64)
    big[::4096] = np.arange(len(big[::4096]))
    big[-1] = 7.0
    v = cv.Variable(big, name="big")
    del big
    for fmt in ["h5", "zarr"]:
        path = cv.Checkpoint(v=v).write(tmp_path / f"big.{fmt}")
        target = cv.Variable(cv.initializers.zeros, shape=(n,), dtype="float64", name="t")
        cv.Checkpoint(v=target).restore(path).assert_consumed()
        np.testing.assert_array_equal(target.value()[::4096], v.value()[::4096])
        assert target.value()[-1] == 7.0
        del target
        os.sync()


@pytest.mark.gpu
def test_gpu_variables_round_trip_and_restore_as_init(
    tmp_path: Path, fmt: str, fresh_graph: cv.Graph
) -> None:
    from conftest import GPU_SKIP_REASON

    if GPU_SKIP_REASON is not None:
        pytest.skip(GPU_SKIP_REASON)
    with cv.device("GPU:0"):
        src = Dense(3)
        src.build(4)
    path = cv.Checkpoint(model=src).save(tmp_path / "ckpt", format=fmt)
    with cv.device("GPU:0"):
        same = Dense(3)
        same.build(4)
        cv.Checkpoint(model=same).restore(path).assert_consumed()
        lazy = Dense(3)
        status = cv.Checkpoint(model=lazy).restore(path)
        init = CountingInit()
        lazy.kernel = cv.Variable(init, shape=(4, 3), dtype="float32", name="kernel")
        lazy.bias = cv.Variable(init, shape=(3,), dtype="float32", name="bias")
    status.assert_consumed()
    assert init.calls == 0 and lazy.kernel.device == "GPU:0"
    for a, b, c in zip(_values(src), _values(same), _values(lazy), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_restore_without_a_coordinator_walks_the_object_graph_once(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from ckptvar.checkpoint import _checkpoint, _frameworks, _walk

    walks: list[int] = []
    real = _walk.walk

    def counting(root, *args, **kwargs):  # type: ignore[no-untyped-def]
        walks.append(root is ck)  # (an object restored whole: its own children, once)
        return real(root, *args, **kwargs)

    ck = cv.Checkpoint(a=cv.Variable(np.arange(3.0), name="a"))
    path = ck.write(tmp_path / "c.h5")
    monkeypatch.setattr(_frameworks, "walk", counting)
    monkeypatch.setattr(_checkpoint, "gather", lambda *a, **k: pytest.fail("gathered"))
    ck.restore(path).assert_consumed()
    assert walks == [True]


def test_dict_keys_one_int_one_str_naming_the_same_value_are_refused(
    tmp_path: Path, fresh_graph: cv.Graph
) -> None:
    """``{1: a, "1": b}`` saved one value under ``d/1`` and dropped the other silently."""
    m = cv.Module(name="m")
    m.d = {1: cv.Variable([1.0]), "1": cv.Variable([2.0])}
    with pytest.raises(TypeError, match=r"keys 1 and '1' would both name"):
        cv.Checkpoint(model=m).save(tmp_path / "c")
    assert not list(tmp_path.iterdir())
    m.d = {1: cv.Variable([1.0]), "2": cv.Variable([2.0]), "1x": 0.5}  # distinct: fine
    path = cv.Checkpoint(model=m).save(tmp_path / "c")
    assert {k for k, _, _ in cv.list_variables(path)} == {"model/d/1", "model/d/2", "save_counter"}
