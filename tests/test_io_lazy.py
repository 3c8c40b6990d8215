"""The read side against NumPy and against its neighbours: lazy slices of every form,
readers used after close or pickled, and a reader of a step a manager prunes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv


def test_a_compressed_zero_d_value_loads_zero_d(tmp_path: Path) -> None:
    p = cv.save(tmp_path / "c.zarr", {"s": np.array(3.5, np.float32),
                                      "v": np.arange(3, dtype=np.int64)}, compression="zstd")
    assert cv.load(p)["s"].shape == ()
    assert cv.load_variable(p, "s").shape == ()
    with cv.open(p) as reader:
        assert reader["s"].read().shape == ()
        assert reader["s"][()] == np.float32(3.5)
        assert reader["s"][None].shape == (1,)
        with pytest.raises(IndexError):
            reader["s"][0]
