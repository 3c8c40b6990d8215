"""Devices (API.md §3): parsing, placement, logging, errors, and the real CuPy path (gpu)."""

from __future__ import annotations

import importlib
import importlib.util
import logging

import numpy as np
import pytest
from conftest import gpu_test

import ckptvar as cv
from ckptvar.device import Device, default_device, gpu_count, placement_for

devmod = importlib.import_module("ckptvar.device")  # ``ckptvar.device`` is the context manager

pytestmark = pytest.mark.usefixtures("fresh_graph")


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("CPU:0", "CPU:0"), ("cpu", "CPU:0"), ("/cpu:0", "CPU:0"), ("/device:CPU:0", "CPU:0"),
        ("GPU:0", "GPU:0"), ("gpu", "GPU:0"), ("GPU", "GPU:0"), ("cuda", "GPU:0"),
        ("cuda:1", "GPU:1"), ("/device:GPU:1", "GPU:1"), ("/gpu:2", "GPU:2"),
        ("/job:localhost/replica:0/task:0/device:GPU:3", "GPU:3"), (" Cuda:0 ", "GPU:0"),
    ],
)
def test_parse_normalises(spec, want) -> None:
    assert str(Device.parse(spec)) == want


@pytest.mark.parametrize("spec", ["tpu:0", "GPU:-1", "GPU:x", "", "/device:", 3])
def test_parse_rejects_nonsense(spec) -> None:
    with pytest.raises(cv.DeviceError):
        Device.parse(spec)


def test_list_devices() -> None:
    devices = cv.list_devices()
    assert devices[0] == "CPU:0"
    assert devices[1:] == [f"GPU:{i}" for i in range(gpu_count())]


def test_missing_device_error_lists_the_devices_that_exist() -> None:
    missing = f"GPU:{gpu_count()}"
    with pytest.raises(cv.DeviceError) as err:
        with cv.device(missing):
            pass
    assert isinstance(err.value, ValueError)
    assert missing in str(err.value) and "CPU:0" in str(err.value)
    with pytest.raises(cv.DeviceError, match="available devices: CPU:0"):
        cv.Variable(1.0, device="cuda:7")
    with pytest.raises(cv.DeviceError):
        cv.device("CPU:1")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
@pytest.mark.parametrize("spec", ["GPU:0", "cuda:0", "/device:GPU:0"])
def test_a_gpu_without_cupy_says_cupy_is_not_installed(spec) -> None:
    # it said only that the device does not exist, not why
    said = r"does not exist here; available devices: CPU:0\. No GPU can be used: CuPy is not " \
           r"installed \(pip install 'ckptvar\[gpu\]'"
    with pytest.raises(cv.DeviceError, match=said):
        cv.Variable(1.0, device=spec)
    with pytest.raises(cv.DeviceError, match=said):
        cv.device(spec)


def test_cpu_placement_context_and_argument() -> None:
    with cv.device("CPU:0") as name:
        assert name == "CPU:0"
        a = cv.Variable([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        b = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
        c = a @ b
        with cv.device(None):
            d = cv.Variable(1.0)
    assert a.device == "CPU:0" and isinstance(a.value(), np.ndarray)
    assert c.tolist() == [[22.0, 28.0], [49.0, 64.0]]
    assert d.device == cv.list_devices()[1 if gpu_count() else 0]
    assert cv.Variable(1.0, device="/device:CPU:0").device == "CPU:0"


def test_default_placement_without_gpu(monkeypatch) -> None:
    monkeypatch.setattr(devmod, "_gpu_count", 0)
    assert str(default_device(np.dtype("float32"))) == "CPU:0"
    assert cv.Variable(1.0).device == "CPU:0"


def test_default_placement_prefers_gpu_for_supported_dtypes(monkeypatch) -> None:
    # Placement decision only (no variable is made): GPU:0 when one exists, CPU for bfloat16.
    monkeypatch.setattr(devmod, "_gpu_count", 1)
    bf16 = cv.initializers.zeros((1,), "bfloat16").dtype
    assert str(default_device(np.dtype("float32"))) == "GPU:0"
    assert str(default_device(bf16)) == "CPU:0"
    with cv.device("GPU:0"):
        assert str(placement_for(bf16)) == "CPU:0"  # soft placement inside a device block
        assert str(placement_for(np.dtype("int8"))) == "GPU:0"
    with pytest.raises(cv.DeviceError, match="bfloat16"):
        placement_for(bf16, "GPU:0")  # an explicit device must support the dtype


def test_log_device_placement(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ckptvar")
    cv.set_log_device_placement(True)
    try:
        with cv.device("CPU:0"):
            cv.Variable([1.0], name="logged")
    finally:
        cv.set_log_device_placement(False)
    cv.Variable([1.0], name="quiet")
    records = [r for r in caplog.records if r.name == "ckptvar"]
    assert len(records) == 1
    assert "'logged'" in records[0].getMessage() and "CPU:0" in records[0].getMessage()


def test_log_device_placement_adds_a_handler_when_none(capsys) -> None:
    logger = logging.getLogger("ckptvar")
    root = logging.getLogger()
    saved_root, saved_level = root.handlers[:], logger.level
    root.handlers[:] = []
    try:
        cv.set_log_device_placement(True)
        cv.Variable([1.0], name="shown")
        cv.set_log_device_placement(False)
    finally:
        root.handlers[:] = saved_root
        logger.setLevel(saved_level)
    assert "'shown'" in capsys.readouterr().err


# --- the real CuPy path ----------------------------------------------------------------------


@gpu_test
def test_gpu_variable_holds_a_cupy_array() -> None:
    import cupy as cp

    with cv.device("GPU:0"):
        v = cv.Variable([[1.0, 2.0], [3.0, 4.0]], name="g")
    assert v.device == "GPU:0" and isinstance(v.value(), cp.ndarray)
    host = v.numpy()
    assert isinstance(host, np.ndarray) and host.tolist() == [[1, 2], [3, 4]]
    assert isinstance(np.asarray(v), np.ndarray)
    assert isinstance(v.read_value(), cp.ndarray)
    assert "device=GPU:0" in repr(v)
    assert cv.Variable(1.0).device == "GPU:0"  # default placement


@gpu_test
def test_gpu_writes_are_in_place() -> None:
    import cupy as cp

    v = cv.Variable(np.zeros((3, 3), np.float32), device="cuda:0")
    ptr = v.value().data.ptr
    v.assign(np.ones((3, 3)))
    v.assign_add(cp.ones((3, 3), cp.float32))
    v.assign_sub([[1, 1, 1]] * 3)
    v[0, :].assign([5.0, 5.0, 5.0])
    v[1] = 7
    assert v.value().data.ptr == ptr
    assert v.numpy().tolist() == [[5, 5, 5], [7, 7, 7], [1, 1, 1]]
    with pytest.raises(cv.CkptError):
        v.assign(np.ones(4))
    assert isinstance(v + 1, cp.ndarray) and isinstance(v[0], cp.ndarray)


@gpu_test
def test_gpu_lazy_initializer_and_restore_hooks() -> None:
    import cupy as cp

    v = cv.Variable(cv.initializers.ones, shape=(4,), dtype="float32", device="GPU:0")
    assert not v._materialized and v._host_buffer() is None
    v._set_initial_value_source(lambda: np.arange(4, dtype=np.float32))
    assert isinstance(v.value(), cp.ndarray) and v.numpy().tolist() == [0, 1, 2, 3]
    ptr = v.value().data.ptr
    v._restore_value(np.full(4, 9, np.float32))
    assert v.value().data.ptr == ptr and v.numpy().tolist() == [9, 9, 9, 9]
    assert v._host_buffer() is None


@gpu_test
def test_gpu_bfloat16_falls_back_to_cpu() -> None:
    v = cv.Variable([1.0], dtype="bfloat16")
    assert v.device == "CPU:0"
    with pytest.raises(cv.DeviceError):
        cv.Variable([1.0], dtype="bfloat16", device="GPU:0")
