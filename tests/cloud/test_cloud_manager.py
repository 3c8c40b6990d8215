"""CheckpointManager, Checkpoint.save/write and latest_checkpoint on an s3:// directory, and
two writers racing for one step (local S3 server)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import list_committed_steps, marker_key, read_commit

from ._s3 import S3Bucket


def _model(value: float = 0.0) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full((64, 32), value, np.float32), name="v")
    return cv.Checkpoint(v=v), v


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_manager_lists_committed_steps_and_prunes(s3: S3Bucket, fmt: str) -> None:
    opts = s3.storage_options
    ckpt, v = _model()
    run = f"{s3.url}/run"
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=2, format=fmt, storage_options=opts)
    saved = []
    for i in range(4):
        v.assign(np.full((64, 32), i, np.float32))
        saved.append(manager.save())
    assert saved == [f"{run}/ckpt-{i}.{fmt}" for i in range(1, 5)]
    assert manager.checkpoints == saved[2:]
    assert manager.latest_checkpoint == saved[-1] == cv.latest_checkpoint(run, storage_options=opts)
    loc = s3.location("run")
    assert list_committed_steps(loc) == [f"ckpt-3.{fmt}", f"ckpt-4.{fmt}"]
    # Pruned steps are gone entirely: marker and data.
    assert not any(o.key.startswith(("ckpt-1.", "ckpt-2.")) for o in loc.list())
    np.testing.assert_array_equal(
        cv.load(saved[-1], storage_options=opts)["v"], np.full((64, 32), 3)
    )

    # A new manager sees the same list, and cleans a failed save's leftover older than the
    # latest committed step (never a newer one, which may be a save in flight).
    loc.put(f"ckpt-0.{fmt}/zarr.json" if fmt == "zarr" else "ckpt-0.h5.x.data", b"partial")
    loc.put("ckpt-9.h5.y.data", b"in flight")
    again = cv.CheckpointManager(
        cv.Checkpoint(v=v), run, max_to_keep=2, format=fmt, storage_options=opts
    )
    assert again.checkpoints == saved[2:]
    keys = [o.key for o in loc.list()]
    assert not any(k.startswith("ckpt-0.") for k in keys) and "ckpt-9.h5.y.data" in keys


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_steps_are_kept_in_save_order_on_an_object_store(s3: S3Bucket, fmt: str) -> None:
    """Steps 100, 500, then 200 (a run gone back): the latest is the step committed last
    (its marker's time), for the manager, a new manager and cv.latest_checkpoint, and
    max_to_keep prunes the oldest saved."""
    opts = s3.storage_options
    ckpt, v = _model()
    run = f"{s3.url}/run"
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=3, format=fmt, storage_options=opts)
    for number in (100, 500, 200):
        v.assign(np.full((64, 32), number, np.float32))
        manager.save(checkpoint_number=number)
    order = [f"{run}/ckpt-{n}.{fmt}" for n in (100, 500, 200)]
    assert manager.checkpoints == order
    assert manager.latest_checkpoint == order[-1] == cv.latest_checkpoint(
        run, storage_options=opts)
    v.assign(np.full((64, 32), 300, np.float32))
    manager.save(checkpoint_number=300)
    kept = [f"{run}/ckpt-{n}.{fmt}" for n in (500, 200, 300)]
    assert manager.checkpoints == kept  # 100 pruned: the oldest saved
    ckpt2, v2 = _model(-1.0)
    again = cv.CheckpointManager(ckpt2, run, max_to_keep=3, format=fmt, storage_options=opts)
    assert again.checkpoints == kept
    assert again.restore_or_initialize() == kept[-1]
    np.testing.assert_array_equal(v2.numpy(), np.full((64, 32), 300))


def test_uncommitted_step_is_not_listed(s3: S3Bucket) -> None:
    opts = s3.storage_options
    ckpt, _ = _model()
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/run", storage_options=opts)
    first = manager.save()
    loc = s3.location("run")
    data = read_commit(loc, "ckpt-1.h5").data
    loc.put("ckpt-2.h5.z.data", loc.read(data))  # bytes of a save whose marker never came
    assert cv.latest_checkpoint(f"{s3.url}/run", storage_options=opts) == first
    assert cv.CheckpointManager(ckpt, f"{s3.url}/run", storage_options=opts).checkpoints == [first]


def test_checkpoint_save_and_write_to_a_url(s3: S3Bucket) -> None:
    opts = s3.storage_options
    ckpt, v = _model(2.0)
    path = ckpt.save(f"{s3.url}/run/ckpt", storage_options=opts)
    assert path == f"{s3.url}/run/ckpt-1.h5"
    assert cv.latest_checkpoint(f"{s3.url}/run", storage_options=opts) == path
    written = ckpt.write(f"{s3.url}/other/weights.zarr", storage_options=opts)
    assert written == f"{s3.url}/other/weights.zarr"
    for url in (path, written):
        np.testing.assert_array_equal(cv.load(url, storage_options=opts)["v"], v.numpy())


@pytest.mark.parametrize("ext", ["h5", "zarr"])
def test_two_writers_race_for_one_step(s3: S3Bucket, ext: str) -> None:
    opts = s3.storage_options
    url = f"{s3.url}/run/ckpt-3.{ext}"
    barrier = threading.Barrier(2, timeout=30)
    results: dict[int, object] = {}

    def writer(i: int) -> None:
        arrays = {"w": np.full((256, 256), i, np.float32), "who": np.array(i)}
        barrier.wait()
        try:
            results[i] = cv.save(url, arrays, storage_options=opts)
        except cv.CheckpointExistsError as exc:
            results[i] = exc

    threads = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [i for i, r in results.items() if r == url]
    lost = [r for r in results.values() if isinstance(r, cv.CheckpointExistsError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "ckpt-3" in str(lost[0])
    loaded = cv.load(url, storage_options=opts)
    assert int(loaded["who"]) == won[0]
    np.testing.assert_array_equal(loaded["w"], np.full((256, 256), won[0], np.float32))
    loc = s3.location("run")
    assert loc.exists(marker_key(f"ckpt-3.{ext}"))
    if ext == "h5":  # the loser removed its own bytes (data and index objects)
        record = read_commit(loc, f"ckpt-3.{ext}")
        assert [o.key for o in loc.list()] == sorted(
            [f"ckpt-3.{ext}.commit", record.data, record.index]
        )


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_restore_from_a_url_writes_into_the_variables(s3: S3Bucket, fmt: str) -> None:
    opts = s3.storage_options
    ckpt, v = _model(5.0)
    run = f"{s3.url}/run"
    manager = cv.CheckpointManager(ckpt, run, format=fmt, storage_options=opts)
    saved = manager.save()
    v.assign(np.zeros((64, 32), np.float32))
    ckpt.restore(saved, storage_options=opts).assert_consumed()
    np.testing.assert_array_equal(v.numpy(), np.full((64, 32), 5.0, np.float32))

    fresh, w = _model(0.0)
    again = cv.CheckpointManager(fresh, run, format=fmt, storage_options=opts)
    assert again.restore_or_initialize() == saved
    np.testing.assert_array_equal(w.numpy(), np.full((64, 32), 5.0, np.float32))
    assert int(fresh.save_counter.numpy()) == 1


def test_background_save_to_a_url(s3: S3Bucket) -> None:
    opts = s3.storage_options
    ckpt, v = _model(4.0)
    manager = cv.CheckpointManager(
        ckpt, f"{s3.url}/run", max_to_keep=1, async_save=True, storage_options=opts
    )
    first = manager.save()
    v.assign(np.full((64, 32), 6.0, np.float32))  # the save holds its own snapshot
    second = manager.save()
    assert manager.checkpoints == [second]  # waits for the background save
    assert list_committed_steps(s3.location("run")) == ["ckpt-2.h5"]
    assert first.endswith("ckpt-1.h5")
    np.testing.assert_array_equal(cv.load(second, storage_options=opts)["v"], v.numpy())


@pytest.mark.parametrize(("saved", "opened"), [("zarr", "h5"), ("h5", "zarr")])
def test_a_manager_on_a_url_names_the_steps_of_another_format(
        s3: S3Bucket, saved: str, opened: str) -> None:
    """A run saved as Zarr on s3://, restarted by a manager left at h5, listed nothing and
    started from scratch without a word; now it says which steps it does not list, from
    the same listing."""
    opts = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, _ = _model(1.0)
    first = cv.CheckpointManager(ckpt, run, format=saved, storage_options=opts)
    first.save()
    first.save()
    with pytest.warns(UserWarning, match=rf"ckpt-2\.{saved}.*format='{saved}'") as said:
        restarted = cv.CheckpointManager(_model()[0], run, format=opened, storage_options=opts)
    assert said[0].filename == __file__  # the line that made the manager
    assert restarted.checkpoints == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own format's steps there too: quiet
        cv.CheckpointManager(_model()[0], run, format=saved, storage_options=opts)
        restarted.save()
        cv.CheckpointManager(_model()[0], run, format=opened, storage_options=opts)
