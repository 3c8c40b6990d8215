"""Incremental steps on an object store against what users and jobs do to them: objects
deleted by hand from the latest step."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import ckptvar as cv

from ._s3 import S3Bucket


def _model(coordinated: bool) -> tuple[cv.Checkpoint, cv.Variable, cv.Variable]:
    big = np.random.default_rng(0).random((256, 1024), dtype=np.float32)  # 1 MiB
    shard = cv.Shard(full_shape=big.shape, offset=(0, 0)) if coordinated else None
    frozen = cv.Variable(big, name="frozen", shard=shard)
    head = cv.Variable(np.zeros(1024, np.float32), name="head")
    return cv.Checkpoint(frozen=frozen, head=head), frozen, head


@pytest.mark.parametrize("coordinated", [False, True], ids=["one-process", "process-files"])
def test_an_object_deleted_from_the_latest_zarr_step_is_not_built_on(
        s3: S3Bucket, coordinated: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A chunk object of an unchanged value deleted by hand from the latest step (an
    interrupted ``aws s3 rm --recursive``): every later save failed on its server-side
    copy (CheckpointNotFoundError ... (COPY)); now the save writes the values of that
    file whole, says so, and the step after it builds on it again."""
    ckpt, frozen, head = _model(coordinated)
    coord = cv.distributed.SingleProcessCoordinator() if coordinated else None
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/run", format="zarr", max_to_keep=2,
                                   incremental=True, coordinator=coord,
                                   storage_options=s3.storage_options)
    for _ in range(2):
        head.assign_add(1.0)
        manager.save()
    loc = s3.location("run")
    chunk = [o.key for o in loc.list("ckpt-2.zarr/") if "/frozen/" in o.key
             and not o.key.endswith("zarr.json")]
    assert len(chunk) == 1, chunk
    loc.delete(chunk)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptvar"):
        for _ in range(2):
            head.assign_add(1.0)
            manager.save()
    assert "written whole" in caplog.text and chunk[0].partition("/")[2] in caplog.text, (
        caplog.text)
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-3.zarr", "ckpt-4.zarr"]
    for step in (3, 4):
        got = cv.load(f"{s3.url}/run/ckpt-{step}.zarr", storage_options=s3.storage_options)
        assert np.array_equal(got["frozen"], frozen.numpy()) and got["head"][0] == step
    # step 3 was written whole and holds nothing left of the failed attempt (no object
    # of a value not in its record); step 4 copied from it again
    keys = sorted(o.key for o in loc.list("ckpt-3.zarr/"))
    again = sorted(o.key.replace("ckpt-4", "ckpt-3") for o in loc.list("ckpt-4.zarr/"))
    assert keys == again, (keys, again)
