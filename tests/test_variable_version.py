"""Every write path of cv.Variable bumps its version counter (incremental checkpoints rely on it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv


def _var(name: str = "v") -> cv.Variable:
    return cv.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name=name)


def _slice_assign(v: cv.Variable) -> None:
    v[0, 1:] = [7, 8]


def _slice_method(v: cv.Variable) -> None:
    v[1].assign(np.zeros(3))


def _iadd(v: Any) -> None:
    v += 1


def _ufunc_out(v: cv.Variable) -> None:
    np.multiply(v, 2, out=v)


WRITES: dict[str, Callable[[cv.Variable], Any]] = {
    "assign": lambda v: v.assign(np.ones((2, 3))),
    "assign_same_value": lambda v: v.assign(v.numpy()),
    "assign_add": lambda v: v.assign_add(1),
    "assign_sub": lambda v: v.assign_sub(np.ones(3)),
    "setitem": _slice_assign,
    "slice_assign": _slice_method,
    "iadd": _iadd,
    "ufunc_out": _ufunc_out,
    "restore_value": lambda v: v._restore_value(np.zeros((2, 3), np.float32)),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_each_write_bumps_the_version(name: str, fresh_graph: cv.Graph) -> None:
    v = _var()
    before = v._version
    assert before is not None
    WRITES[name](v)
    assert v._version is not None and v._version > before


def test_reads_leave_the_version(fresh_graph: cv.Graph) -> None:
    v = _var()
    before = v._version
    v.numpy(), v.read_value(), np.asarray(v), v[0], v + 1, np.sum(v), repr(v)
    assert np.asarray(v, copy=False).flags.writeable is False  # no write through __array__
    assert v._version == before


def test_failed_write_leaves_the_version(fresh_graph: cv.Graph) -> None:
    v = _var()
    before = v._version
    with pytest.raises(cv.errors.ShapeLockError):
        v.assign(np.ones(5))
    assert v._version == before


def test_initialization_counts(fresh_graph: cv.Graph) -> None:
    v = cv.Variable(cv.initializers.zeros(), shape=(2,), dtype=np.float32, lazy=True)
    before = v._version
    v.initialize()
    assert v._version is not None and before is not None and v._version > before


def test_value_hands_out_the_buffer_and_the_version_becomes_unknown(
        fresh_graph: cv.Graph) -> None:
    """``value()`` returns the backing array; its in-place writes cannot be counted."""
    v = _var()
    buf = v.value()
    buf[0, 0] = 42.0  # a write nobody sees
    assert v.numpy()[0, 0] == 42.0
    assert v._version is None  # an incremental save then compares it by checksums


def test_restore_bumps_every_restored_variable(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    big = cv.Variable(np.zeros(100_000, np.float32), name="big")  # restored in place
    small = cv.Variable(np.zeros(3, np.float32), name="small")
    ckpt = cv.Checkpoint(big=big, small=small)
    path = ckpt.write(tmp_path / "c.h5")
    versions = (big._version, small._version)
    ckpt.restore(path)
    assert big._version != versions[0] and small._version != versions[1]
    assert None not in (big._version, small._version)


def test_save_does_not_count_as_a_write(tmp_path: Path, fresh_graph: cv.Graph) -> None:
    v = _var()
    ckpt = cv.Checkpoint(v=v)
    before = v._version
    ckpt.write(tmp_path / "c.zarr")
    ckpt.save(tmp_path / "s", blocking=False).wait()
    assert v._version == before
