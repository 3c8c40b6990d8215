"""Incremental steps on an object store (local S3 server): a Zarr step's unchanged values are
server-side copies of the previous step's chunk objects (no byte through the client, counted
by a TCP proxy), and the step stands alone once the older one is pruned; an HDF5 step's object
holds only the changed values and refers to the older steps' objects, which pruning keeps.
With several processes, each process's Zarr file is copied so (HDF5 with several
processes: tests/cloud/test_cloud_incremental_mpi.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv
from ckptvar.locations import list_committed_steps, open_location

from ._s3 import FaultProxy, S3Bucket
from .test_cloud_cli import _ckpt

FROZEN = (512, 1024)  # 2 MiB of float32: the unchanged value
HEAD = (16, 16)


def _model() -> tuple[cv.Checkpoint, cv.Variable, cv.Variable]:
    rng = np.random.default_rng(0)
    frozen = cv.Variable(rng.standard_normal(FROZEN).astype(np.float32), name="frozen")
    head = cv.Variable(np.zeros(HEAD, np.float32), name="head")
    return cv.Checkpoint(frozen=frozen, head=head), frozen, head


def test_unchanged_values_are_server_side_copies(s3: S3Bucket, proxy: FaultProxy) -> None:
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    run = f"{s3.url}/run"
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=1, format="zarr",
                                   storage_options=opts, incremental=True, pack_threshold=0)
    proxy.reset_counts()
    first = manager.save()
    full_up = proxy.bytes_up
    assert full_up > frozen.numpy().nbytes  # the first step is written whole

    head.assign_add(1.0)
    proxy.reset_counts()
    second = manager.save()
    step_up = proxy.bytes_up
    # the frozen value (2 MiB) is not sent again: only the head, documents, record, marker
    assert step_up < 64 * 1024, step_up
    assert step_up < full_up / 20

    # the older step is pruned (max_to_keep=1): the new one stands alone, bit-exact
    loc = s3.location("run")
    assert list_committed_steps(loc) == ["ckpt-2.zarr"]
    assert not any(o.key.startswith("ckpt-1.") for o in loc.list())
    assert manager.checkpoints == [second] and first != second
    got = cv.load(second, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["head"], head.numpy())
    with cv.open(second, storage_options=s3.storage_options) as r:
        for key in list(r.keys()):
            r.verify(key)  # every checksum holds (raises otherwise)

    # a plain zarr reader sees the copied value by name, as in any step
    zarr = pytest.importorskip("zarr")
    store = zarr.storage.ObjectStore(loc.zarr_store("ckpt-2.zarr"), read_only=True)
    group = zarr.open_group(store, mode="r")
    assert np.array_equal(np.asarray(group["frozen"][...]), frozen.numpy())


def test_changed_and_hashed_values_are_written(s3: S3Bucket, proxy: FaultProxy) -> None:
    """A changed variable is uploaded again; a new manager (no versions known) compares by
    checksums and copies what the base holds; the last step loads with the others gone."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    run = f"{s3.url}/run"
    nbytes = int(np.prod(FROZEN)) * 4
    ckpt, frozen, _ = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=None, format="zarr",
                                   storage_options=opts, incremental=True, pack_threshold=0)
    manager.save()
    frozen.assign(frozen.numpy() * 2)
    proxy.reset_counts()
    manager.save()
    assert proxy.bytes_up > nbytes  # changed: written
    restarted = cv.CheckpointManager(ckpt, run, max_to_keep=None, format="zarr",
                                     storage_options=opts, incremental=True, pack_threshold=0)
    proxy.reset_counts()
    last = restarted.save()
    assert proxy.bytes_up < nbytes / 20, proxy.bytes_up  # equal checksums: copied
    loc = s3.location("run")
    for name in ("ckpt-1.zarr", "ckpt-2.zarr"):  # the older steps gone, marker and data
        loc.delete([o.key for o in loc.list() if o.key.startswith(name)])
    assert list_committed_steps(loc) == ["ckpt-3.zarr"]
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy())


def test_hdf5_steps_refer_to_the_holders_objects(s3: S3Bucket, proxy: FaultProxy,
                                                 tmp_path: Path) -> None:
    """An incremental HDF5 step's object holds only the changed values: bytes uploaded per
    step ~ the changed bytes; the unchanged value is read from the holder's object by
    ranged GETs, bit-exact; pruning keeps the holder (committed, not listed) until no kept
    step refers to it; ``ckpt convert`` writes a standalone copy."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    run = f"{s3.url}/run"
    nbytes = int(np.prod(FROZEN)) * 4
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=2, format="h5",
                                   storage_options=opts, incremental=True)
    proxy.reset_counts()
    manager.save()
    assert proxy.bytes_up > nbytes  # the first step is written whole
    ups = []
    for _ in range(3):
        head.assign_add(1.0)
        proxy.reset_counts()
        last = manager.save()
        ups.append(proxy.bytes_up)
    # the head (1 KiB) plus the HDF5 structure, record, index, marker and the requests
    assert max(ups) < 48 * 1024, ups
    loc = s3.location("run")
    # steps 1 (holds frozen) and 2 are beyond max_to_keep: 2 is pruned, 1 is held
    assert list_committed_steps(loc) == ["ckpt-1.h5", "ckpt-3.h5", "ckpt-4.h5"]
    assert manager.checkpoints == [f"{run}/ckpt-3.h5", last]
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert reader.shared() == {"frozen": ["ckpt-1.h5"]}
        for key in list(reader.keys()):
            reader.verify(key)
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["head"], head.numpy())
    # a restarted manager knows the references too: it prunes nothing that is held
    again = cv.CheckpointManager(ckpt, run, max_to_keep=2, format="h5",
                                 storage_options=opts, incremental=True)
    assert again.checkpoints == manager.checkpoints
    _plain_h5py_sees(loc, tmp_path, frozen.numpy(), head.numpy())
    # ckpt convert writes a standalone copy (every value's bytes in the one file)
    out = tmp_path / "alone.h5"
    res = _ckpt(s3, "convert", last, str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    import h5py

    with h5py.File(out, "r") as f:
        assert isinstance(f.get("frozen", getlink=True), h5py.HardLink)
    assert np.array_equal(cv.load(out)["frozen"], frozen.numpy())
    res = _ckpt(s3, "inspect", last)  # which step holds each value's bytes
    assert res.returncode == 0 and "ckpt-1.h5" in res.stdout, res.stdout + res.stderr
    # once both values change, no kept step refers to steps 1 and 3 (nor 4): pruned
    frozen.assign_add(1.0)
    head.assign_add(1.0)
    again.save()
    head.assign_add(1.0)
    again.save()
    assert list_committed_steps(loc) == ["ckpt-5.h5", "ckpt-6.h5"]
    assert not any(o.key.startswith(("ckpt-1.", "ckpt-3.", "ckpt-4.")) for o in loc.list())
    got = cv.load(again.latest_checkpoint, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy())


def _plain_h5py_sees(loc: Any, tmp_path: Path, frozen: np.ndarray, head: np.ndarray) -> None:
    """Plain h5py on step 4's downloaded object: the head, and an external link to
    ckpt-1.h5 that resolves once that step's object is downloaded beside it."""
    import h5py

    def download(step: str) -> Path:
        data = [o.key for o in loc.list() if o.key.startswith(f"{step}.")
                and o.key.endswith(".data")]
        assert len(data) == 1, data
        (tmp_path / step).write_bytes(loc.read(data[0]))
        return tmp_path / step

    with h5py.File(download("ckpt-4.h5"), "r") as f:
        assert np.array_equal(f["head"][...], head)
        assert f.get("frozen", getlink=True).filename == "ckpt-1.h5"
        with pytest.raises(KeyError):
            f["frozen"]  # the holder is not downloaded yet
    download("ckpt-1.h5")
    with h5py.File(tmp_path / "ckpt-4.h5", "r") as f:
        assert np.array_equal(f["frozen"][...], frozen)


def test_hdf5_holder_deleted_behind_our_back(s3: S3Bucket) -> None:
    """The holder's objects deleted by another tool: reading the value that lives there is
    a ``CorruptCheckpointError`` naming the value and the object; the step's own values
    still read."""
    run = f"{s3.url}/run"
    ckpt, _, head = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=None, format="h5",
                                   storage_options=s3.storage_options, incremental=True)
    manager.save()
    head.assign_add(1.0)
    last = manager.save()
    loc = s3.location("run")
    loc.delete([o.key for o in loc.list() if o.key.startswith("ckpt-1.h5")])
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert np.array_equal(reader.read("head"), head.numpy())
        with pytest.raises(cv.CorruptCheckpointError, match=r"'frozen'.*ckpt-1\.h5"):
            reader.read("frozen")


def test_location_copy_on_the_server_and_locally(s3: S3Bucket, proxy: FaultProxy,
                                                 tmp_path: Path) -> None:
    """``Location.copy``: the bytes arrive at the new key; on S3 none pass the client."""
    data = np.random.default_rng(1).bytes(1 << 20)
    remote = s3.location(endpoint=proxy.endpoint)
    local = open_location(str(tmp_path))
    for loc in (remote, local):
        loc.put("a/x", data)
        proxy.reset_counts()
        loc.copy("a/x", "b/y")
        assert loc.read("b/y") == data
        with pytest.raises(cv.CheckpointNotFoundError):
            loc.copy("a/missing", "b/z")
    remote.put("c/x", data)
    proxy.reset_counts()
    remote.copy("c/x", "d/y")
    assert proxy.bytes_up < 4096 and proxy.bytes_down < 4096  # only the request itself


def test_background_saves_and_an_unreadable_base(s3: S3Bucket, proxy: FaultProxy,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Background saves build on the step committed before them; a base whose record
    cannot be read is logged and the step is written whole (never a copy of nothing)."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    nbytes = int(np.prod(FROZEN)) * 4
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/run", max_to_keep=1, format="zarr",
                                   storage_options=opts, incremental=True, pack_threshold=0,
                                   async_save=True)
    manager.save()
    head.assign_add(1.0)  # after step 1's snapshot: a change for step 2
    manager.wait_until_finished()
    proxy.reset_counts()
    manager.save()  # copies frozen from step 1
    manager.wait_until_finished()
    assert proxy.bytes_up < nbytes / 20, proxy.bytes_up
    loc = s3.location("run")
    loc.delete("ckpt-2.zarr/_ckptvar/record/c.0")  # the base's record is gone
    head.assign_add(1.0)
    proxy.reset_counts()
    with caplog.at_level(logging.WARNING, logger="ckptvar"):
        last = manager.save()
        manager.wait_until_finished()
    assert "cannot read the base" in caplog.text
    assert proxy.bytes_up > nbytes
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy()) and got["head"][0, 0] == 2
    for _ in range(2):  # back to back: each builds on the one before, pruned after it
        head.assign_add(1.0)
        last = manager.save()
    manager.wait_until_finished()
    assert manager.checkpoints == [last]
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy()) and got["head"][0, 0] == 4


def test_a_chunk_larger_than_one_copy_is_uploaded(s3: S3Bucket, proxy: FaultProxy,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 copies at most 5 GiB per request: a larger unchanged chunk is written again
    (shown with the limit lowered to 1 MiB), the step whole and bit-exact."""
    from ckptvar.storage import _zarr

    monkeypatch.setattr(_zarr, "COPY_LIMIT", 1 << 20)
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/run", max_to_keep=1, format="zarr",
                                   storage_options=opts, incremental=True, pack_threshold=0)
    manager.save()
    head.assign_add(1.0)
    proxy.reset_counts()
    last = manager.save()
    assert proxy.bytes_up > frozen.numpy().nbytes
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], frozen.numpy()) and got["head"][0, 0] == 1


def test_three_processes_copy_their_unchanged_values_on_the_server(
        s3: S3Bucket, proxy: FaultProxy) -> None:
    """``coordinator=`` on S3 (real ``mpiexec``, tests/mpi/incremental_cases.py): each
    process's Zarr file takes its unchanged values as server-side copies of its file in
    the base step; the new step stands alone once the base is pruned."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from test_distributed_mpi import _mpi_skip_reason, run_mpi

    if _mpi_skip_reason() is not None:
        pytest.skip(_mpi_skip_reason() or "")
    cases_file = Path(__file__).parent.parent / "mpi" / "incremental_cases.py"
    import importlib.util
    spec = importlib.util.spec_from_file_location("incremental_cases", cases_file)
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    run = f"{s3.url}/mp"
    up = []
    for step in (1, 2):  # two jobs: the second knows no versions, compares checksums
        proxy.reset_counts()
        proc, got, _ = run_mpi(3, str(cases_file), "step", run, "zarr", str(step),
                               timeout=150, env={"S3_OPTIONS": json.dumps(opts)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert {r["path"] for r in got["step"].values()} == {f"{run}/ckpt-{step}.zarr"}
        up.append(proxy.bytes_up)
    head = cases.expected(2)["head"].nbytes  # the only value that changed
    assert up[0] > sum(a.nbytes for a in cases.expected(1).values())
    assert up[1] < head + 256 * 1024, up  # the head, the records, index, marker, requests
    loc = s3.location("mp")
    assert list_committed_steps(loc) == ["ckpt-2.zarr"]  # the base was pruned
    got = cv.load(f"{run}/ckpt-2.zarr", storage_options=s3.storage_options)
    for key, want in cases.expected(2).items():
        assert np.array_equal(got[key], want), key


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_value_with_no_bytes_is_read_from_a_step_that_shares_it(s3: S3Bucket, fmt: str) -> None:
    """An empty table unchanged since the last step: the HDF5 step refers to it in the
    older step's object like any value, and it reads back (its empty range was refused)."""
    opts = s3.storage_options
    ckpt, frozen, head = _model()
    empty = cv.Variable(np.zeros((0, 4), np.float32), name="empty")
    ckpt.empty = empty
    manager = cv.CheckpointManager(ckpt, f"{s3.url}/run", format=fmt, storage_options=opts,
                                   incremental=True)
    manager.save()
    head.assign_add(1.0)
    step = manager.save()
    got = cv.load(step, storage_options=opts)
    assert got["empty"].shape == (0, 4) and np.array_equal(got["head"], head.numpy())
    assert np.array_equal(got["frozen"], frozen.numpy())
    res = _ckpt(s3, "verify", step)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_save_after_restore_or_initialize_skipped_the_newest_stands_alone(
        s3: S3Bucket) -> None:
    """The holder's objects gone: restore_or_initialize() skips the steps that read from
    it, and the next save (the same frozen value, found unchanged by its recorded
    checksum) must not refer to it again: it is written whole, and loads."""
    run, opts = f"{s3.url}/run", s3.storage_options
    ckpt, _, head = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=None, format="h5",
                                   storage_options=opts, incremental=True)
    manager.save()
    head.assign_add(1.0)
    manager.save()
    loc = s3.location("run")
    loc.delete([o.key for o in loc.list() if o.key.startswith("ckpt-1.h5")])
    ckpt, frozen, head = _model()
    manager = cv.CheckpointManager(ckpt, run, max_to_keep=None, format="h5",
                                   storage_options=opts, incremental=True)
    assert manager.restore_or_initialize() is None and manager.skipped
    head.assign_add(2.0)
    step = manager.save()
    got = cv.load(step, storage_options=opts)
    assert np.array_equal(got["frozen"], frozen.numpy())
    assert np.array_equal(got["head"], head.numpy())


@pytest.mark.slow  # 125 steps against moto: about 17 s
def test_pruned_hdf5_steps_held_only_by_other_pruned_steps_do_not_pile_up(
        s3: S3Bucket) -> None:
    """As on disk (tests/test_incremental_edges.py): the committed steps kept only for
    other pruned steps stay a few, and the latest step reads back."""
    opts = s3.storage_options
    table = cv.Variable(np.zeros((4096, 64), np.float32), name="table")
    other = cv.Variable(np.arange(300_000, dtype=np.float32), name="other")
    manager = cv.CheckpointManager(cv.Checkpoint(table=table, other=other),
                                   f"{s3.url}/run", max_to_keep=1, format="h5",
                                   storage_options=opts, incremental=True)
    loc = s3.location("run")
    counts = []
    for step in range(1, 126):
        table.scatter_update((np.arange(10) + 10 * step) % 4096,
                             np.full((10, 64), step, np.float32))
        if step % 10 == 0:
            other.assign_add(np.ones(300_000, np.float32))
        manager.save()
        if step > 75:
            counts.append(len(list_committed_steps(loc)))
    assert max(counts) <= 36, counts
    got = cv.load(manager.latest_checkpoint, storage_options=opts)
    assert np.array_equal(got["table"], table.numpy())
    assert np.array_equal(got["other"], other.numpy())
