"""dtype rules shared by variables and storage: NumPy's same_kind, extended to bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("uint8", "int32", True),
        ("int32", "uint8", False),
        ("int64", "float16", True),
        ("float64", "int64", False),
        ("bool", "int8", True),
        ("int8", "bool", False),
        ("float32", "complex64", True),
        ("complex64", "float32", False),
        ("int32", "bfloat16", True),
        ("uint8", "bfloat16", True),
        ("bfloat16", "float32", True),
        ("bfloat16", "int32", False),
        ("float32", "bfloat16", True),
    ],
)
def test_same_kind_rule_matches_numpy(src: str, dst: str, ok: bool) -> None:
    import numpy as np

    from ckptvar._dtypes import as_dtype, check_castable

    if ok:
        check_castable(as_dtype(src), as_dtype(dst))
    else:
        with pytest.raises(TypeError, match="same_kind"):
            check_castable(as_dtype(src), as_dtype(dst))
    if "bfloat16" not in (src, dst):
        assert bool(np.can_cast(src, dst, casting="same_kind")) is ok


@pytest.mark.parametrize("suffix", ["h5", "zarr", "npz", "safetensors"])
def test_a_big_endian_array_is_stored_by_value_and_loads_little_endian(
        tmp_path: Path, suffix: str) -> None:
    """docs/FORMAT.md, "Byte order": the values are kept, the byte order is not."""
    import warnings

    import numpy as np

    import ckptvar as cv

    arrays = {"f4": (np.arange(12, dtype=">f4") - 5.5).reshape(3, 4),
              "i2": np.array([-2, 300, 7], dtype=">i2"),
              "c8": np.array([1 + 2j, -3.5j], dtype=">c8")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: no value changes
        path = cv.save(tmp_path / f"big.{suffix}", arrays)
        got = cv.load(path)
    for key, given in arrays.items():
        assert got[key].dtype == given.dtype.newbyteorder("<"), key
        assert got[key].dtype.byteorder in ("=", "<")
        np.testing.assert_array_equal(got[key], given)  # the same values
    if suffix == "h5":  # as the file says to h5py: little-endian
        import h5py

        with h5py.File(path, "r") as f:
            assert f["f4"].dtype.str == "<f4" and f["i2"].dtype.str == "<i2"


def test_a_variable_of_a_big_endian_array_is_native_and_restores_by_value(
        tmp_path: Path) -> None:
    import numpy as np

    import ckptvar as cv

    given = np.linspace(-1, 1, 8, dtype=">f8")
    v = cv.Variable(given)
    assert v.dtype == np.dtype("<f8")  # native from the start, like a dtype= conversion
    path = cv.Checkpoint(v=v).write(tmp_path / "ckpt.h5")
    into = cv.Variable(np.zeros(8, ">f8"))
    cv.Checkpoint(v=into).restore(path).assert_consumed()
    assert into.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(into.numpy(), given)
