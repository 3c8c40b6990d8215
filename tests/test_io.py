"""The public loading functions: list_variables, load_variable, load, open, save."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptvar as cv
from ckptvar.errors import DTypeLockError, MissingKeyError


@pytest.fixture(params=["h5", "zarr"])
def fmt(request: pytest.FixtureRequest) -> str:
    return request.param


def values() -> dict[str, np.ndarray]:
    return {
        "model/dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model/dense/bias": np.zeros(4, np.float32),
        "model/big": np.ones((200, 100), ml_dtypes.bfloat16),
        "step": np.array(3, np.int64),
    }


def test_save_list_load(tmp_path: Path, fmt: str) -> None:
    p = cv.save(tmp_path / f"c.{fmt}", values(), metadata={"note": "hi"},
                attrs={"step": {"trainable": False}})
    assert p == tmp_path / f"c.{fmt}"
    listed = cv.list_variables(p)
    assert [(k, s) for k, s, _ in listed] == [(k, v.shape) for k, v in values().items()]
    assert listed[2][2] == np.dtype(ml_dtypes.bfloat16)
    loaded = cv.load(p)
    assert list(loaded) == list(values())
    for k, v in values().items():
        np.testing.assert_array_equal(loaded[k], v)
        assert loaded[k].dtype == v.dtype
    np.testing.assert_array_equal(cv.load_variable(p, "model/dense/kernel"), values()["model/dense/kernel"])
    assert list(cv.load(p, keys=["step"])) == ["step"]
    with cv.open(p) as r:
        assert r.metadata() == {"note": "hi"}
        assert r.info("step").attrs == {"trainable": False, "name": "step"}
        assert r.info("model/dense/bias").attrs["name"] == "model/dense/bias"
        np.testing.assert_array_equal(r["model/dense/kernel"][1:3], values()["model/dense/kernel"][1:3])


def test_format_argument_overrides_suffix(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "noext", {"w": np.ones(2)}, format="zarr")
    assert p.is_dir()
    with cv.open(p) as r:
        assert r.format == "zarr"


def test_errors(tmp_path: Path, fmt: str) -> None:
    p = cv.save(tmp_path / f"c.{fmt}", {"w": np.ones(2)})
    with pytest.raises(MissingKeyError):
        cv.load_variable(p, "nope")
    with pytest.raises(KeyError):
        cv.load(p, keys=["nope"])
    with pytest.raises(cv.CheckpointNotFoundError):
        cv.load(tmp_path / f"missing.{fmt}")
    with pytest.raises(FileNotFoundError):
        cv.list_variables(tmp_path / f"missing.{fmt}")
    with pytest.raises(cv.UnsupportedFormatError):
        cv.save(tmp_path / "x.h5", {"w": np.ones(2)}, format="nosuch")
    with pytest.raises(cv.UnsupportedFormatError):
        cv.save(tmp_path / "x.weird", {"w": np.ones(2)})
    with pytest.raises(cv.DeviceError):
        cv.load(p, device="GPU:7")


def test_load_with_cpu_device_and_no_verify(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.h5", values())
    out = cv.load(p, device="CPU:0", verify=False)
    np.testing.assert_array_equal(out["model/dense/kernel"], values()["model/dense/kernel"])


def test_load_many_small_values_verifies_each(tmp_path: Path, fmt: str) -> None:
    vals = {f"v{i}": np.full(i % 50, i, np.int16) for i in range(500)}
    p = cv.save(tmp_path / f"c.{fmt}", vals)
    out = cv.load(p)
    for k, v in vals.items():
        np.testing.assert_array_equal(out[k], v)


@pytest.mark.gpu
def test_load_onto_gpu(tmp_path: Path) -> None:
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    if cp.cuda.runtime.getDeviceCount() == 0:  # pragma: no cover
        pytest.skip("no CUDA device")
    vals = {"w": np.arange(1 << 20, dtype=np.float32), "s": np.ones(3, np.int64)}
    p = cv.save(tmp_path / "c.h5", vals)
    out = cv.load(p, device="GPU:0")
    for k, v in vals.items():
        assert isinstance(out[k], cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(out[k]), v)


@pytest.mark.gpu
def test_load_onto_gpu_streams_through_bounded_host_memory(tmp_path: Path) -> None:
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    if cp.cuda.runtime.getDeviceCount() == 0:  # pragma: no cover
        pytest.skip("no CUDA device")
    import tracemalloc

    n = 16 * (1 << 20)  # 16 values of 64 MiB: 1 GiB
    vals = {f"w{i}": np.full(n, i, np.float32) for i in range(16)}
    p = cv.save(tmp_path / "big.h5", vals)
    del vals
    tracemalloc.start()  # NumPy reports its buffers to tracemalloc
    try:
        out = cv.load(p, device="GPU:0")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # through the pinned buffer (CUDA memory, not traced): no host copy of any value
    assert peak < 32 << 20, f"host peak {peak >> 20} MiB while loading 1 GiB onto the GPU"
    for i in range(16):
        assert float(out[f"w{i}"][-1].get()) == i


@pytest.mark.parametrize("name", ["a.h5", "a.zarr", "a.npz", "a.safetensors"])
def test_save_creates_missing_parents(tmp_path: Path, name: str) -> None:
    target = tmp_path / "new" / "deeper" / name
    out = cv.save(target, {"w": np.arange(3, dtype=np.float32)})
    assert Path(out) == target
    np.testing.assert_array_equal(cv.load(target)["w"], [0, 1, 2])


@pytest.mark.parametrize("name", ["x.h5", "x.zarr"])
def test_a_write_error_names_the_users_path(tmp_path: Path, name: str,
                                            fresh_graph: cv.Graph) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for write in (
        lambda p: cv.save(p, {"w": np.zeros(2)}),
        lambda p: cv.Checkpoint(w=cv.Variable([1.0])).write(p),
    ):
        with pytest.raises(OSError) as info:
            write(blocker / "sub" / name)
        msg = str(info.value)
        assert ".partial" not in msg and str(blocker / "sub" / name) in msg, msg
    assert blocker.read_text() == "not a directory"


def test_list_and_load_variable_take_a_directory_of_checkpoints(tmp_path: Path,
                                                                fmt: str) -> None:
    """As TensorFlow's tf.train.list_variables/load_variable(ckpt_dir_or_file): a
    directory of checkpoints stands for its latest one."""
    v = cv.Variable([1.0, 2.0], name="v")
    manager = cv.CheckpointManager(cv.Checkpoint(v=v), tmp_path / "run", format=fmt)
    manager.save()
    v.assign([3.0, 4.0])
    manager.save()
    assert cv.list_variables(tmp_path / "run") == cv.list_variables(manager.latest_checkpoint)
    assert cv.load_variable(str(tmp_path / "run"), "v").tolist() == [3.0, 4.0]
    with cv.Graph().as_default():
        w = cv.Variable([5.0], name="w")
        cv.Saver([w]).save(tmp_path / "by_name" / "model", global_step=7)
    assert cv.load_variable(tmp_path / "by_name", "w").tolist() == [5.0]
    (tmp_path / "empty").mkdir()
    with pytest.raises(cv.UnsupportedFormatError, match="is a directory, not a checkpoint"):
        cv.list_variables(tmp_path / "empty")


@pytest.mark.parametrize("value", [np.array([None, 1]), np.array(["x"])])
def test_a_value_of_no_checkpoint_dtype_is_a_ckpt_error_naming_its_key(tmp_path: Path, fmt: str,
                                                                      value: np.ndarray) -> None:
    """It was a plain TypeError 'Unsupported dtype object; ...' that named no key."""
    with pytest.raises(DTypeLockError, match="Cannot store 'model/w'") as err:
        cv.save(tmp_path / f"c.{fmt}", {"ok": np.ones(2), "model/w": value})
    assert isinstance(err.value, TypeError)
    assert not (tmp_path / f"c.{fmt}").exists()


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_a_complex_value_saves_compressed(tmp_path: Path, dtype: str) -> None:
    """cv.save(..., compression=) of a complex value raised zarr-python's TypeError
    'Cannot convert object [0.0, 0.0] ... to a scalar' (its fill value in JSON form)."""
    z = (np.arange(12) + 1j * np.arange(12)).astype(dtype).reshape(3, 4)
    p = cv.save(tmp_path / "c.zarr", {"z": z}, compression="zstd")
    back = cv.load(p)["z"]
    assert back.dtype == z.dtype
    np.testing.assert_array_equal(back, z)
