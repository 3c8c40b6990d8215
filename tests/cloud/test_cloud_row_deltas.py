"""Row deltas on an object store (local S3 server, one process): a changed ``cv.Variable``
table with a few rows touched uploads about those rows (counted by a TCP proxy), not the
table. Zarr: the delta's base and earlier patches are server-side copies of the base
step's objects, so the step stands alone once the older one is pruned; HDF5: the step's
object holds only its patch and refers to the objects holding the base and the earlier
patches, which pruning keeps. Every reader reads such a step, and damage of a patch or of
the base is a ``CorruptCheckpointError`` naming it, with nothing restored."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import list_committed_steps

from ._s3 import FaultProxy, S3Bucket
from .test_cloud_cli import _ckpt

ROWS, COLS = 8192, 64  # 2 MiB of float32: 8,192 rows of 256 bytes
TOUCHED = np.array([7, 900, 4096])
FORMATS = ["zarr", "h5"]


def _table() -> tuple[cv.Checkpoint, cv.Variable]:
    rng = np.random.default_rng(0)
    table = cv.Variable(rng.random((ROWS, COLS), dtype=np.float32), name="table")
    return cv.Checkpoint(table=table), table


def _manager(ckpt: cv.Checkpoint, run: str, fmt: str, opts: dict[str, Any],
             keep: int | None = 1, *, incremental: bool | cv.IncrementalOptions = True
             ) -> cv.CheckpointManager:
    return cv.CheckpointManager(ckpt, run, max_to_keep=keep, format=fmt,
                                storage_options=opts, incremental=incremental)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_step_of_three_changed_rows_uploads_the_rows_and_reads_everywhere(
        s3: S3Bucket, proxy: FaultProxy, fmt: str, tmp_path: Path) -> None:
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    manager = _manager(ckpt, run, fmt, opts)
    proxy.reset_counts()
    manager.save()
    full_up = proxy.bytes_up
    assert full_up > table.numpy().nbytes  # the first step is written whole

    table.scatter_add(TOUCHED, np.ones((3, COLS), np.float32))
    proxy.reset_counts()
    step = manager.save()
    # three rows (768 bytes and their indices), the record, documents, marker, requests
    assert proxy.bytes_up < 48 * 1024, proxy.bytes_up
    want = table.numpy().copy()

    loc = s3.location("run")
    if fmt == "zarr":  # the base was copied on the server: pruned, the step stands alone
        assert list_committed_steps(loc) == ["ckpt-2.zarr"]
        assert not any(o.key.startswith("ckpt-1.") for o in loc.list())
    else:  # the base's object holds the whole copy: kept (committed, not listed)
        assert list_committed_steps(loc) == ["ckpt-1.h5", "ckpt-2.h5"]
    assert manager.checkpoints == [step]

    assert np.array_equal(cv.load(step, storage_options=so)["table"], want)
    with cv.open(step, storage_options=so) as reader:
        assert reader.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 1,
                                             "rows": 3}}
        assert np.array_equal(reader["table"][900], want[900])  # a slice: ranged GETs
        assert np.array_equal(reader["table"][4000:4100], want[4000:4100])
        reader.verify("table")
    fresh = cv.Variable(np.zeros((ROWS, COLS), np.float32), name="table")
    cv.Checkpoint(table=fresh).restore(step, storage_options=so).assert_consumed()
    assert np.array_equal(fresh.numpy(), want)

    _ckpt_reads(s3, step, fmt, want, tmp_path)
    if fmt == "zarr":
        _plain_zarr_reads(loc, want)


def _ckpt_reads(s3: S3Bucket, step: str, fmt: str, want: np.ndarray, tmp_path: Path) -> None:
    """``ckpt`` (a subprocess): inspect lists the delta, verify passes, convert writes a
    standalone copy."""
    res = _ckpt(s3, "inspect", "--json", step)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["deltas"]["table"]["base"] == f"ckpt-1.{fmt}"
    res = _ckpt(s3, "verify", step)
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / f"alone.{fmt}"
    res = _ckpt(s3, "convert", step, str(out))  # a standalone copy: every value whole
    assert res.returncode == 0, res.stdout + res.stderr
    with cv.open(out) as reader:
        assert reader.deltas() == {}
    assert np.array_equal(cv.load(out)["table"], want)


def _plain_zarr_reads(loc: Any, want: np.ndarray) -> None:
    """A plain zarr reader sees the base and the patch by name: the value is the base
    with the patch's rows assigned."""
    zarr = pytest.importorskip("zarr")
    store = zarr.storage.ObjectStore(loc.zarr_store("ckpt-2.zarr"), read_only=True)
    group = zarr.open_group(store, mode="r")
    base = np.asarray(group["table/base"][...]).view(np.float32).reshape(ROWS, COLS)
    patch = np.asarray(group["table/patch-0"][...])
    rows = patch[:24].view("<u8")
    assert rows.tolist() == TOUCHED.tolist()
    base[rows] = patch[24:].view(np.float32).reshape(3, COLS)
    assert np.array_equal(base, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_patches_accumulate_merge_and_carry_over(s3: S3Bucket, fmt: str) -> None:
    """Each step adds its patch; past the patch limit (``IncrementalOptions(max_patches=3)``)
    one merged patch of every row since
    the base (read back from the store) replaces them; an unchanged table carries the
    delta over, and so does a restarted manager that restores; one that does not
    restore cannot know it unchanged and writes it whole.
    Every step, pruned or kept, loads bit-exact; HDF5 steps holding patches of
    a kept step stay committed until the merge frees them."""
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    three = cv.IncrementalOptions(max_patches=3)
    manager = _manager(ckpt, run, fmt, so, keep=1, incremental=three)
    manager.save()
    seen = []
    for i in range(4):
        table.scatter_update(np.array([10 * i, 5000 + i]), np.full((2, COLS), i, np.float32))
        step = manager.save()
        assert np.array_equal(cv.load(step, storage_options=so)["table"], table.numpy())
        with cv.open(step, storage_options=so) as reader:
            seen.append(reader.deltas()["table"]["patches"])
    assert seen == [1, 2, 3, 1]  # the fourth step merged: 8 rows in one patch
    with cv.open(step, storage_options=so) as reader:
        assert reader.deltas()["table"]["rows"] == 8
    step = manager.save()  # unchanged: the delta carried over, no patch of its own
    with cv.open(step, storage_options=so) as reader:
        assert reader.deltas()["table"] == {"base": f"ckpt-1.{fmt}", "patches": 1, "rows": 8}
    assert np.array_equal(cv.load(step, storage_options=so)["table"], table.numpy())
    kept = list_committed_steps(s3.location("run"))
    # HDF5: the base's step and the merged patch's step stay; the others were freed
    assert kept == (["ckpt-6.zarr"] if fmt == "zarr" else ["ckpt-1.h5", "ckpt-5.h5",
                                                           "ckpt-6.h5"])
    if fmt == "h5":  # `ckpt ls` says why the older steps are still there
        res = _ckpt(s3, "ls", run, "--json")
        assert res.returncode == 0, res.stderr
        rows = {r["path"].rsplit("/", 1)[-1]: r for r in json.loads(res.stdout)["checkpoints"]}
        assert rows["ckpt-1.h5"]["referred_by"] == ["ckpt-5.h5", "ckpt-6.h5"]  # the base
        assert rows["ckpt-5.h5"]["referred_by"] == ["ckpt-6.h5"]  # the merged patch
        assert "referred_by" not in rows["ckpt-6.h5"]
        res = _ckpt(s3, "ls", run)
        assert "(holds bytes of ckpt-6.h5)" in res.stdout, res.stdout
    # A restarted manager that restores (a new checkpoint over a new variable) knows the
    # table unchanged since the restored step: the delta is carried over again.
    again, fresh = _table()
    restarted = _manager(again, run, fmt, so, keep=1, incremental=three)
    assert restarted.restore_or_initialize() == step
    step = restarted.save()
    with cv.open(step, storage_options=so) as reader:
        assert reader.deltas()["table"] == {"base": f"ckpt-1.{fmt}", "patches": 1, "rows": 8}
    assert np.array_equal(cv.load(step, storage_options=so)["table"], fresh.numpy())
    # One that does not restore cannot know the table unchanged, and a delta verified by
    # its parts has no checksum of the whole value to compare with: written whole once,
    # and the steps that held the delta's base and patch are freed.
    step = _manager(ckpt, run, fmt, so, keep=1, incremental=three).save()
    with cv.open(step, storage_options=so) as reader:
        assert "table" not in reader.deltas()
    assert np.array_equal(cv.load(step, storage_options=so)["table"], table.numpy())
    assert list_committed_steps(s3.location("run")) == [f"ckpt-8.{fmt}"]


@pytest.mark.parametrize("order", ["manager first", "restore first"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_restarted_manager_uploads_only_the_rows_written_since_its_restore(
        s3: S3Bucket, proxy: FaultProxy, fmt: str, order: str) -> None:
    """A new process (a new checkpoint over new variables) restores the latest step with
    ``restore_or_initialize()`` (or ``ckpt.restore(url)`` before its manager is built)
    and touches two rows: its first step uploads about those rows, a patch on the
    restored step's delta, and reads back bit-exact."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    manager = _manager(ckpt, run, fmt, opts)
    manager.save()
    table.scatter_add(TOUCHED, np.ones((3, COLS), np.float32))
    manager.save()
    again, fresh = _table()
    fresh.assign(np.zeros((ROWS, COLS), np.float32))
    if order == "restore first":
        again.restore(manager.latest_checkpoint, storage_options=opts).assert_consumed()
        restarted = _manager(again, run, fmt, opts)
    else:
        restarted = _manager(again, run, fmt, opts)
        assert restarted.restore_or_initialize() == manager.latest_checkpoint
    fresh.scatter_update(np.array([1, 8000]), np.full((2, COLS), 3.0, np.float32))
    proxy.reset_counts()
    step = restarted.save()
    assert proxy.bytes_up < 48 * 1024, proxy.bytes_up  # two rows, not the 2 MiB table
    with cv.open(step, storage_options=so) as reader:
        assert reader.deltas() == {"table": {"base": f"ckpt-1.{fmt}", "patches": 2,
                                             "rows": 5}}
    assert np.array_equal(cv.load(step, storage_options=so)["table"], fresh.numpy())


@pytest.mark.parametrize("fmt", FORMATS)
def test_incremental_options_rule_the_steps_on_the_store(s3: S3Bucket, fmt: str) -> None:
    """``IncrementalOptions`` on an object store: a low share of rows writes the table
    whole where the default would append, and ``whole_every`` makes a standalone step
    (no delta, nothing read from another step's objects), after which pruning frees the
    older steps; every step loads bit-exact."""
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    frozen = cv.Variable(np.arange(300_000, dtype=np.float32), name="frozen")
    ckpt.frozen = frozen  # 1.2 MiB, never written
    options = cv.IncrementalOptions(max_patched_rows=0.02, whole_every=3)  # 163 rows
    manager = _manager(ckpt, run, fmt, so, keep=2, incremental=options)
    seen: list[Any] = []
    for rows in (None, np.arange(60), np.arange(70), None, np.arange(100), np.arange(100)):
        if rows is not None:
            table.scatter_update(rows, np.full((rows.size, COLS), rows.size, np.float32))
        step = manager.save()
        with cv.open(step, storage_options=so) as reader:
            d = reader.deltas().get("table")
            seen.append(d["patches"] if d else "whole")
            if len(seen) == 4:  # step 4: written whole, standalone
                assert reader.deltas() == {} and reader.shared() == {}
        assert np.array_equal(cv.load(step, storage_options=so)["table"], table.numpy())
    # step 3: 130 rows, under 2%; step 4: whole_every; step 6: 200 rows past 2%, their
    # union (100) past half of it: the table whole (the frozen value still shared)
    assert seen == ["whole", 1, 2, "whole", 1, "whole"]
    kept = list_committed_steps(s3.location("run"))
    # HDF5: steps 5 and 6 read the frozen value from step 4: kept; 1-3 freed
    assert kept == ([f"ckpt-{i}.h5" for i in (4, 5, 6)] if fmt == "h5"
                    else ["ckpt-5.zarr", "ckpt-6.zarr"])
    with cv.open(manager.latest_checkpoint, storage_options=so) as reader:
        assert np.array_equal(reader["frozen"].read(), frozen.numpy())


def _flip(loc: Any, key: str, at: int) -> None:
    data = bytearray(loc.read(key))
    data[at] ^= 0xFF
    loc.put(key, bytes(data))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("part", ["patch", "base", "gone"])
def test_damage_of_a_patch_or_the_base_is_named_and_nothing_is_restored(
        s3: S3Bucket, fmt: str, part: str) -> None:
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    manager = _manager(ckpt, run, fmt, so, keep=None)
    manager.save()
    table.scatter_add(TOUCHED, np.ones((3, COLS), np.float32))
    step = manager.save()
    loc = s3.location("run")
    with cv.open(step, storage_options=so) as reader:
        d = reader.record.deltas["table"]
    if part == "gone":  # the patch's object (Zarr), the base's step (HDF5) deleted
        doomed = ("ckpt-2.zarr/table/patch-0/" if fmt == "zarr" else "ckpt-1.h5")
        loc.delete([o.key for o in loc.list() if o.key.startswith(doomed)])
        named = "patch-0/c.0" if fmt == "zarr" else "ckpt-1.h5"
    elif fmt == "zarr":
        key = "ckpt-2.zarr/table/" + ("patch-0/c.0" if part == "patch" else "base/c.0.0")
        _flip(loc, key, 8 * 3 + 5 if part == "patch" else 100)
        named = key.rpartition("/")[0].rpartition("/")[2]
    else:
        holder = "ckpt-2.h5" if part == "patch" else "ckpt-1.h5"
        data = [o.key for o in loc.list()
                if o.key.startswith(f"{holder}.") and o.key.endswith(".data")]
        offset = d.patches[0][2] + 30 if part == "patch" else d.base[2] + 100
        _flip(loc, data[0], offset)
        named = "patch-0" if part == "patch" else "ckpt-1.h5"
    with pytest.raises(cv.CorruptCheckpointError, match=rf"'table'.*{named}"):
        cv.load(step, storage_options=so)
    fresh = cv.Variable(np.zeros((ROWS, COLS), np.float32), name="table")
    with pytest.raises(cv.CorruptCheckpointError, match=rf"'table'.*{named}"):
        cv.Checkpoint(table=fresh).restore(step, storage_options=so)
    assert not fresh.numpy().any()  # nothing the user had changed
    with cv.open(step, storage_options=so) as reader:  # what `ckpt verify` reports
        [(key, reason)] = reader.verify_all()
        assert key == "table" and named in reason


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_delta_without_its_bases_checksums_is_checked_assembled(
        s3: S3Bucket, fmt: str, older_delta_writer: Any) -> None:
    """A record from before the base's checksums (written here as that writer did): the
    patched rows are laid as the base's bytes stream in, and the assembled bytes are
    hashed, read into a buffer or only verified; damage in the base is caught so."""
    older_delta_writer()
    so = s3.storage_options
    ckpt, table = _table()
    manager = _manager(ckpt, f"{s3.url}/run", fmt, so, keep=None)
    manager.save()
    table.scatter_add(np.array([0, 4095, 4096, ROWS - 1]), np.ones((4, COLS), np.float32))
    step = manager.save()
    want = table.numpy().copy()
    for verify in (True, False):
        assert np.array_equal(cv.load(step, storage_options=so, verify=verify)["table"], want)
    with cv.open(step, storage_options=so) as reader:
        assert reader.record.deltas["table"].base_checksum is None
        assert reader.verify_all() == []
    loc = s3.location("run")
    if fmt == "zarr":
        _flip(loc, "ckpt-2.zarr/table/base/c.0.0", 5000)
    else:
        with cv.open(step, storage_options=so) as reader:
            at = reader.record.deltas["table"].base[2] + 5000
        _flip(loc, next(o.key for o in loc.list()
                        if o.key.startswith("ckpt-1.h5.") and o.key.endswith(".data")), at)
    with pytest.raises(cv.CorruptCheckpointError, match=r"'table' fails its checksum .*its base"):
        cv.load(step, storage_options=so)
    with cv.open(step, storage_options=so) as reader:
        [(key, _)] = reader.verify_all()
        assert key == "table"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_merge_that_cannot_read_the_base_patches_names_the_steps_urls(
        s3: S3Bucket, fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    """A restarted manager's merge reads the base's patches from the store; when they are
    damaged the table is written whole and the log said so naming local staging paths
    (``/tmp/ckptvar-upload-.../ckpt-3.zarr``); it names the steps' URLs."""
    so = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, table = _table()
    one = cv.IncrementalOptions(max_patches=1)
    manager = _manager(ckpt, run, fmt, so, keep=None, incremental=one)
    manager.save()
    table.scatter_add(TOUCHED, np.ones((3, COLS), np.float32))
    step = manager.save()
    with cv.open(step, storage_options=so) as reader:
        d = reader.record.deltas["table"]
    again, fresh = _table()
    restarted = _manager(again, run, fmt, so, keep=None, incremental=one)
    assert restarted.restore_or_initialize() == step
    loc = s3.location("run")  # the base's patch damaged after the restore
    if fmt == "zarr":
        _flip(loc, "ckpt-2.zarr/table/patch-0/c.0", 8 * 3 + 5)
    else:
        [data] = [o.key for o in loc.list()
                  if o.key.startswith("ckpt-2.h5.") and o.key.endswith(".data")]
        _flip(loc, data, d.patches[0][2] + 30)
    fresh.scatter_update(np.array([1]), np.full((1, COLS), 3.0, np.float32))
    with caplog.at_level(logging.WARNING, logger="ckptvar"):
        step = restarted.save()
    said = [r.getMessage() for r in caplog.records if "row patches" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].startswith(f"Incremental save of {run}/ckpt-3.{fmt}: cannot read the "
                              f"row patches of 'table' in {run}/ckpt-2.{fmt} "), said
    assert "ckptvar-upload-" not in said[0].partition(" (")[0], said
    with cv.open(step, storage_options=so) as reader:
        assert "table" not in reader.deltas()
    assert np.array_equal(cv.load(step, storage_options=so)["table"], fresh.numpy())
