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


def test_a_zarr_step_pruned_and_reused_under_a_reader_is_not_found_never_damaged(
    fresh_graph: cv.Graph, tmp_path: Path
) -> None:
    """A local incremental manager sets a pruned Zarr step aside and writes its next step
    into it: a reader still holding the pruned step then finds other bytes in its files."""
    big = cv.Variable(np.random.default_rng(0).random((2048, 256), dtype=np.float32),
                      name="big")  # 2 MiB: block checksums, lazy slices by runs
    head = cv.Variable(np.zeros(20000, np.float32), name="head")
    small = cv.Variable(np.zeros(10, np.float32), name="small")
    mgr = cv.CheckpointManager(cv.Checkpoint(big=big, head=head, small=small), tmp_path,
                               max_to_keep=1, incremental=True, format="zarr")
    first = mgr.save()
    expect = cv.load(first)
    with cv.open(first) as reader:
        for _ in range(3):  # the step set aside, then taken over by the next save
            for v in (big, head, small):
                v.assign_add(np.ones(v.shape, np.float32))
            mgr.save()
            for key in ("big", "head", "small"):
                for read, want in ((lambda k: reader[k].read(), np.s_[...]),
                                   (lambda k: reader[k][1:3], np.s_[1:3]),
                                   (lambda k: reader[k][-1], np.s_[-1])):
                    try:
                        got = read(key)
                    except cv.CheckpointNotFoundError as exc:
                        assert "was deleted while it was being read" in str(exc)
                    else:  # the right bytes, or none
                        assert np.array_equal(got, expect[key][want])
