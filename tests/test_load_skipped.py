"""cv.load never drops a value silently: values a reader cannot give as arrays are named."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

import ckptvar as cv


def _plain_h5(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f["weights"] = np.arange(4, dtype=np.float32)
        f["note"] = "a string, not numbers"
        f["pairs"] = np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])
    return path


def test_load_warns_once_naming_every_skipped_value(tmp_path: Path) -> None:
    path = _plain_h5(tmp_path / "plain.h5")
    with pytest.warns(UserWarning, match="leaves out 2 value") as caught:
        values = cv.load(path)
    assert len([w for w in caught if "leaves out" in str(w.message)]) == 1
    message = str(caught[0].message)
    assert "'note'" in message and "'pairs'" in message
    assert list(values) == ["weights"]


def test_load_of_chosen_keys_does_not_warn(tmp_path: Path) -> None:
    path = _plain_h5(tmp_path / "plain.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = cv.load(path, keys=["weights"])
    np.testing.assert_array_equal(values["weights"], np.arange(4, dtype=np.float32))


def test_a_checkpoint_with_nothing_skipped_loads_quietly(tmp_path: Path) -> None:
    path = cv.save(tmp_path / "c.h5", {"w": np.ones(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(cv.load(path)) == {"w"}
