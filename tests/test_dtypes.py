"""dtype rules shared by variables and storage: NumPy's same_kind, extended to bfloat16."""

from __future__ import annotations

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
