"""Incremental managers at their edges: values with no bytes, numbers given by hand, the
CLI on steps that refer to others; each step checked bit-exact by every reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

import ckptvar as cv


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvar.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_value_with_no_bytes_is_read_from_a_step_that_shares_it(
        tmp_path: Path, fmt: str, fresh_graph: cv.Graph) -> None:
    """An empty embedding table (no rows yet) unchanged since the last step: the next
    step refers to it like any value, and every reader reads that step."""
    empty = cv.Variable(np.zeros((0, 4), np.float32), name="empty")
    w = cv.Variable(np.ones(3, np.float32), name="w")
    manager = cv.CheckpointManager(cv.Checkpoint(empty=empty, w=w), tmp_path, format=fmt,
                                   incremental=True)
    manager.save()
    w.assign_add(1.0)
    step = manager.save()
    got = cv.load(step)
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == np.float32
    assert np.array_equal(got["w"], w.numpy())
    with cv.open(step) as reader:
        assert reader["empty"][:].shape == (0, 4)
    empty.assign(np.ones((0, 4), np.float32))
    w.assign(np.zeros(3, np.float32))
    cv.Checkpoint(empty=empty, w=w).restore(step)
    assert np.array_equal(w.numpy(), np.full(3, 2, np.float32))
    verified = _ckpt("verify", str(step))
    assert verified.returncode == 0, verified.stderr
    if fmt == "h5":
        with h5py.File(step, "r") as f:  # plain h5py too
            assert f["empty"].shape == (0, 4)
