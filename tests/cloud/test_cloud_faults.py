"""Network faults against a real local S3 server (moto behind a fault-injecting TCP proxy):
a save that lost the network raises a ckptvar error, leaves the last committed step the
latest, and never blocks the next save of the same process."""

from __future__ import annotations

import numpy as np
import pytest

import ckptvar as cv

from ._s3 import FaultProxy, S3Bucket

MiB = 1024 * 1024


def _through(s3: S3Bucket, proxy: FaultProxy) -> dict[str, object]:
    return {**s3.storage_options, "endpoint": proxy.endpoint, "timeout": "5s",
            "max_retries": 1, "retry_timeout": 3}


def test_a_zarr_save_that_lost_the_network_does_not_block_the_next_save(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    rng = np.random.default_rng(0)
    v = cv.Variable(rng.standard_normal(MiB // 2), name="v")  # 4 MiB
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), f"{s3.url}/run", max_to_keep=3,
                               format="zarr", storage_options=_through(s3, proxy))
    first = mgr.save()
    # The network goes down mid-upload and stays down through the failed save's cleanup
    # (its claim cannot be released), then comes back.
    proxy.break_after_upload(MiB)
    with pytest.raises(cv.CkptError):
        mgr.save()
    proxy.heal()
    assert mgr.latest_checkpoint == first
    v.assign(v.numpy() + 1)
    second = mgr.save()  # the same process saves again: its own dead claim never blocks it
    np.testing.assert_array_equal(cv.load(second, storage_options=s3.storage_options)["v"],
                                  v.numpy())
    assert mgr.checkpoints == [first, second]
    left = [o.key for o in s3.location("run").list() if ".claim" in o.key]
    assert left == [], left
