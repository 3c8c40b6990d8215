"""Network faults against a real local S3 server (moto behind a fault-injecting TCP proxy):
a save that lost the network raises a ckptvar error, leaves the last committed step the
latest, and never blocks the next save of the same process."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import StorageError, clean_uncommitted, list_committed_steps

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


def test_a_cleanup_during_a_save_of_an_older_step_never_leaves_a_broken_commit(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """A manager's save or ``ckpt gc`` deletes uncommitted objects of steps up to the latest
    committed one; a save of such a step in flight (its data and index uploaded, its marker
    not yet) must not commit a step whose data is gone."""
    opts = s3.storage_options
    cv.save(f"{s3.url}/run/ckpt-2.h5", {"w": np.ones(3)}, storage_options=opts)
    proxy.delay_requests(rb"^PUT \S+\.commit ", 1.5)  # the marker PUT of the save below waits
    out: dict[str, object] = {}

    def save_step_1() -> None:
        try:
            out["path"] = cv.save(f"{s3.url}/run/ckpt-1.h5", {"w": np.arange(10.0)},
                                  storage_options=_through(s3, proxy))
        except cv.CkptError as exc:
            out["error"] = exc

    writer = threading.Thread(target=save_step_1)
    writer.start()
    run = s3.location("run")
    for _ in range(1000):  # at most 10 s: the index PUT comes right after the data
        if any(o.key.endswith(".index") and o.key.startswith("ckpt-1.h5.") for o in run.list()):
            break
        time.sleep(0.01)
    else:
        pytest.fail("the index object of step 1 never appeared")
    removed = clean_uncommitted(run, older_than_latest=True)  # what `ckpt gc URL` runs
    assert any(k.startswith("ckpt-1.h5.") for k in removed), removed
    writer.join(30)
    assert not writer.is_alive()
    if "error" in out:  # refused: nothing of step 1 is committed, step 2 is untouched
        assert "ckpt-1.h5" in str(out["error"])
        assert list_committed_steps(run) == ["ckpt-2.h5"]
    else:  # or committed whole
        np.testing.assert_array_equal(
            cv.load(f"{s3.url}/run/ckpt-1.h5", storage_options=opts)["w"], np.arange(10.0))
    np.testing.assert_array_equal(cv.load(f"{s3.url}/run/ckpt-2.h5", storage_options=opts)["w"],
                                  np.ones(3))


def test_a_bucket_that_does_not_exist_is_named_as_such(s3: S3Bucket) -> None:
    opts = s3.storage_options
    url = "s3://no-such-bucket-here/run"
    saves = [lambda: cv.save(f"{url}/ckpt-1.h5", {"w": np.ones(3)}, storage_options=opts),
             lambda: cv.save(f"{url}/ckpt-1.zarr", {"w": np.ones(3)}, storage_options=opts),
             lambda: cv.latest_checkpoint(url, storage_options=opts),
             lambda: cv.CheckpointManager(cv.Checkpoint(v=cv.Variable(np.ones(3), name="v")),
                                          url, storage_options=opts).save()]
    for call in saves:
        with pytest.raises(cv.CkptError) as err:
            call()
        assert not isinstance(err.value, cv.CheckpointNotFoundError), err.value
        assert "bucket 'no-such-bucket-here' does not exist" in str(err.value), err.value


@pytest.mark.parametrize("path", ["x/../y/t.h5", "./t.h5", ""])
def test_a_url_that_names_no_object_key_is_a_clear_error(s3: S3Bucket, path: str) -> None:
    """Object stores resolve no ``..``; a bucket alone names no object (``a//b`` is ``a/b``,
    as on a file system)."""
    url = f"{s3.url}/{path}" if path else s3.url
    calls = [lambda: cv.save(url, {"w": np.ones(3)}, storage_options=s3.storage_options),
             lambda: cv.load(url, storage_options=s3.storage_options)]
    if path:  # a directory with such a part
        calls.append(lambda: cv.latest_checkpoint(url.rsplit("/", 1)[0],
                                                  storage_options=s3.storage_options))
    for call in calls:
        with pytest.raises(cv.CkptError, match=re.escape(s3.url)):
            call()


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_damaged_marker_of_an_old_step_never_stops_a_restart(s3: S3Bucket, fmt: str) -> None:
    """A manager opens, restores the newest step, saves and prunes the damaged one (its
    objects with it): one damaged marker never blocks a job from restarting."""
    opts = s3.storage_options
    v = cv.Variable(np.zeros(3), name="v")
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), f"{s3.url}/run", max_to_keep=2,
                               format=fmt, storage_options=opts)
    for i in range(3):
        v.assign(np.full(3, float(i)))
        mgr.save()
    run = s3.location("run")
    run.put(f"ckpt-2.{fmt}.commit", b"{not json")
    v.assign(np.full(3, -1.0))
    again = cv.CheckpointManager(cv.Checkpoint(v=v), f"{s3.url}/run", max_to_keep=2,
                                 format=fmt, storage_options=opts)
    assert again.restore_or_initialize() == f"{s3.url}/run/ckpt-3.{fmt}"
    np.testing.assert_array_equal(v.numpy(), np.full(3, 2.0))
    assert again.save() == f"{s3.url}/run/ckpt-4.{fmt}"
    assert again.checkpoints == [f"{s3.url}/run/ckpt-3.{fmt}", f"{s3.url}/run/ckpt-4.{fmt}"]
    assert not [o.key for o in run.list() if o.key.startswith(f"ckpt-2.{fmt}")]


def test_a_failed_delete_names_the_objects_url(s3: S3Bucket, proxy: FaultProxy) -> None:
    run = s3.location("run", endpoint=proxy.endpoint, max_retries=1, retry_timeout=2)
    proxy.break_after_upload(1)  # the first request drops, and every one after it
    with pytest.raises(StorageError) as err:
        run.delete(["ckpt-1.h5.commit", "ckpt-1.h5.abc.data"])
    assert f"{s3.url}/run/ckpt-1.h5.commit " in str(err.value), err.value
    assert "2 objects" in str(err.value), err.value


def test_a_prune_that_lost_the_network_does_not_fail_the_committed_save(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    v = cv.Variable(np.zeros(3), name="v")
    mgr = cv.CheckpointManager(cv.Checkpoint(v=v), f"{s3.url}/run", max_to_keep=1,
                               storage_options=_through(s3, proxy))
    mgr.save()
    proxy.drop_requests(rb"^DELETE |^POST \S+\?delete")  # every delete fails
    v.assign(np.ones(3))
    second = mgr.save()  # committed: its prune's failure is logged, and retried next time
    assert second == f"{s3.url}/run/ckpt-2.h5"
    assert mgr.checkpoints[-1] == second  # (step 1 is still committed: its prune failed)
    proxy.heal()
    np.testing.assert_array_equal(cv.load(second, storage_options=s3.storage_options)["v"],
                                  np.ones(3))
    third = mgr.save()
    assert mgr.checkpoints == [third]
    assert {o.key.split(".")[0] for o in s3.location("run").list()} == {"ckpt-3"}


def test_a_failed_commit_is_raised_even_when_its_cleanup_fails(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """The index upload fails, then so does removing what the save uploaded: the save
    raised the cleanup's error, hiding why it failed; now it raises the upload's error,
    the failed cleanup noted on it."""
    proxy.drop_requests(rb"^PUT \S+\.index |^DELETE |^POST \S+\?delete")
    url = f"{s3.url}/run/ckpt-1.h5"
    with pytest.raises(StorageError) as err:
        cv.save(url, {"w": np.ones(3)}, storage_options=_through(s3, proxy))
    proxy.heal()
    assert ".index" in str(err.value) and "PUT" in str(err.value), err.value
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "removing" in notes.lower() and ".data" in notes, notes
    assert list_committed_steps(s3.location("run")) == []
