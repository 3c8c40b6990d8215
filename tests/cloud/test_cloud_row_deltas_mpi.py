"""Row deltas written by several processes on an object store (real ``mpiexec`` against
the session's moto S3 server; the rank-side code is tests/mpi/row_delta_s3_cases.py,
the model tests/mpi/row_delta_cases.py's): each process's box of a table trained by
``scatter_update`` is stored in its own object as a row delta on the same process's
object in the base step (Zarr: base and earlier patches server-side copies; HDF5:
referred to by byte range in the objects that wrote them), so a step uploads about its
changed rows (counted by the tests' TCP proxy); every step restores bit-exact on 3 and
on 2 processes and loads in one; pruning keeps the HDF5 steps a kept step refers to;
a process failing mid-save commits nothing and loses no row; ``ckpt
inspect/verify/convert`` read such steps unaware."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from ckpt_runs import ckpt_processes
from test_distributed_mpi import _mpi_skip_reason

import ckptvar as cv
from ckptvar.locations import list_committed_steps

from ._s3 import FaultProxy, S3Bucket, mpi_case, own_bucket

needs_mpi = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
#: Three processes on a local S3 server for every test (the server and the jobs take ~20 s):
#: the default suite keeps row deltas on S3 (test_cloud_row_deltas) and of several local
#: processes (test_row_deltas_mpi); these run with -m slow.
pytestmark = pytest.mark.slow

MPI = Path(__file__).parent.parent / "mpi"
CASES = str(MPI / "row_delta_s3_cases.py")
_spec = importlib.util.spec_from_file_location("row_delta_cases", MPI / "row_delta_cases.py")
assert _spec is not None and _spec.loader is not None
cases: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

ROW_BYTES = cases.WIDTH * 4
FORMATS = ("h5", "zarr")


def _run(s3: S3Bucket, n: int, mode: str, url: str) -> dict[int, dict[str, Any]]:
    return mpi_case(s3, n, CASES, mode, url, timeout=240)


@pytest.fixture(scope="module")
def saved(moto_endpoint: str) -> tuple[S3Bucket, str, dict[int, dict[str, Any]]]:
    """The 3-process job of tests/mpi/row_delta_s3_cases.py (``save``, both formats), run
    once in a bucket of its own: ``(bucket, run URL, what each rank reported)``."""
    name = "row-deltas-mpi"
    s3 = own_bucket(moto_endpoint, name)
    run = f"{s3.url}/rows"
    return s3, run, _run(s3, 3, "save", run)


def _changed(step: int, fmt: str) -> int:
    rows = cases.touched(step).size + (cases.part_touched(step).size if fmt == "h5" else 0)
    return rows * ROW_BYTES


def _check_saved(ranks: dict[int, dict[str, Any]], fmt: str) -> None:
    """What the save job reported for ``fmt``: bytes per step, the deltas, pruning, the
    failed save, the restores on 3 processes."""
    r0 = ranks[0][fmt]
    up = {int(k): v for k, v in r0["uploaded"].items()}
    full = cases.expected(1).nbytes + (cases.expected_part(1).nbytes if fmt == "h5" else 0)
    assert up[1] > full, (fmt, up)  # the first step is written whole
    for step in range(2, 7):  # the rows, and each process's record, structure, requests
        assert up[step] < _changed(step, fmt) + 3 * (32 << 10), (fmt, step, up)
        assert up[step] < full / 25, (fmt, step, up)
    print(fmt, "bytes uploaded per step:", up, "changed:",
          {s: _changed(s, fmt) for s in range(2, 7)})
    deltas = {int(k): v for k, v in r0["deltas"].items()}
    assert deltas[1] == {}
    for step in range(2, 7):  # every process's box is a delta on its own base
        table = deltas[step]["table"]
        assert table == {"base": f"ckpt-1.{fmt}", "patches": step - 1, "boxes": 3,
                         "rows": sum(cases.touched(s).size for s in range(2, step + 1))}
        if fmt == "h5":  # the partitioned variable: one box, in its writer's object
            assert deltas[step]["part"]["boxes"] == 1, deltas[step]
    # rank 1 failed while writing step 6: nothing of it committed or left; the save
    # again holds step 6's rows (the restores compare them)
    assert ranks[1][fmt]["failed"] == "OSError"
    assert {ranks[r][fmt]["failed"] for r in (0, 2)} == {"DistributedError"}
    assert r0["after_failure"] == {"listed": [f"ckpt-4.{fmt}", f"ckpt-5.{fmt}"],
                                   "left": []}
    assert r0["retried"] == f"ckpt-6.{fmt}"
    assert r0["listed"] == [f"ckpt-5.{fmt}", f"ckpt-6.{fmt}"]
    # pruning: HDF5 keeps the steps holding the base and the patches (committed, not
    # listed); a Zarr step copied them on the server, so the pruned steps are gone
    kept = range(1, 7) if fmt == "h5" else (5, 6)
    assert r0["committed"] == [f"ckpt-{s}.{fmt}" for s in kept]
    for r in ranks.values():
        assert r[fmt]["restored"] == dict.fromkeys(r0["committed"], True), (fmt, r)


@needs_mpi
def test_three_processes_write_row_deltas_to_s3(
        saved: tuple[S3Bucket, str, dict[int, dict[str, Any]]]) -> None:
    """Bytes per step, the deltas, pruning, a failing process; every committed step
    restores bit-exact on 3 and on 2 processes and loads in one."""
    s3, run, ranks = saved
    for fmt in FORMATS:
        _check_saved(ranks, fmt)

    # on 2 processes (resharding: each reads the parts of the boxes it needs)
    for r in _run(s3, 2, "restore", run).values():
        for fmt in FORMATS:
            assert r[fmt]["restored"] == dict.fromkeys(ranks[0][fmt]["committed"], True)
    so = s3.storage_options
    for fmt in FORMATS:  # ...and in one plain process
        for name in ranks[0][fmt]["committed"]:
            step = cv.checkpoint.parse_step_name(name).step
            got = cv.load(f"{run}/{fmt}/{name}", storage_options=so)
            assert np.array_equal(got["table"], cases.expected(step)), (fmt, name)
            if fmt == "h5":
                assert np.array_equal(got["part"], cases.expected_part(step)), name
        with cv.open(f"{run}/{fmt}/ckpt-6.{fmt}", storage_options=so) as reader:
            assert isinstance(reader, cv.storage.SupportsDeltas)
            assert reader.deltas()["table"]["boxes"] == 3
            # a slice across the boxes of processes 0 and 1, each delta assembled
            assert np.array_equal(reader["table"][5000:9000], cases.expected(6)[5000:9000])


@pytest.mark.slow
@needs_mpi
def test_ckpt_reads_row_deltas_of_several_processes_on_s3(
        saved: tuple[S3Bucket, str, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    """``ckpt inspect`` lists the row deltas, ``ckpt verify`` checks every box (a damaged
    patch is refused, named), ``ckpt convert`` writes every value whole, ``ckpt gc``
    keeps the steps held for the deltas; plain h5py sees a process object's delta."""
    s3, run, _ = saved
    opts = [a for k in ("endpoint", "access_key_id", "secret_access_key", "region")
            for a in ("--storage-option", f"{k}={s3.storage_options[k]}")]
    opts += ["--storage-option", "allow_http=true"]
    last = {fmt: f"{run}/{fmt}/ckpt-6.{fmt}" for fmt in FORMATS}
    standalone = {fmt: tmp_path / f"alone.{fmt}" for fmt in FORMATS}
    commands = [c for fmt in FORMATS for c in (
        ("inspect", last[fmt], *opts), ("inspect", last[fmt], "--json", *opts),
        ("verify", last[fmt], *opts), ("convert", last[fmt], standalone[fmt], *opts))]
    commands.append(("gc", f"{run}/h5", *opts))
    committed = list_committed_steps(s3.location("rows/h5"))
    done = ckpt_processes(*commands)  # at once: start-up dominates
    for res in done:
        assert res.returncode == 0, res.stdout + res.stderr
    # gc removes no committed step, the ones held for a kept step's deltas included
    assert list_committed_steps(s3.location("rows/h5")) == committed == [
        f"ckpt-{s}.h5" for s in range(1, 7)]
    for k, fmt in enumerate(FORMATS):
        inspected, as_json, verified, _ = done[4 * k: 4 * k + 4]
        assert (f"table  base in ckpt-1.{fmt}  5 patch(es)" in inspected.stdout
                and "in 3 box(es)" in inspected.stdout), inspected.stdout
        table = json.loads(as_json.stdout)["deltas"]["table"]
        assert table["base"] == f"ckpt-1.{fmt}" and table["boxes"] == 3
        assert "OK" in verified.stdout, verified.stdout
        with cv.open(standalone[fmt]) as reader:  # every value whole
            assert not reader.deltas()
            assert np.array_equal(reader.read("table"), cases.expected(6))

    # a flipped byte in process 1's own patch of the HDF5 step: refused, named
    loc = s3.location("rows/h5")
    own = "ckpt-6.h5/rank-00001.h5"
    with cv.open(f"{run}/h5/ckpt-6.h5", storage_options=s3.storage_options) as reader:
        assert "table" in reader.deltas()
    data = bytearray(loc.read(own))
    local = tmp_path / "rank-00001.h5"
    local.write_bytes(data)
    with cv.open(local) as sub:
        _, path, offset, n, _ = sub.record.deltas["table/.box/1"].patches[-1]
    with h5py.File(local, "r") as f:  # plain h5py: the base is the same process's object
        group = f["table/%2Ebox/1"]
        assert group.get("base", getlink=True).filename == "../ckpt-1.h5/rank-00001.h5"
        assert sorted(group) == ["base", *(f"patch-{j}" for j in range(5))]
    data[offset + 8 * n + 3] ^= 0xFF
    loc.put(own, bytes(data))
    with pytest.raises(cv.CorruptCheckpointError,
                       match=rf"'table/\.box/1' has a row patch '{path}'.*fails its checksum"):
        cv.load(f"{run}/h5/ckpt-6.h5", storage_options=s3.storage_options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_process_object_merges_its_patches_reading_them_from_the_store(
        s3: S3Bucket, proxy: FaultProxy, fmt: str) -> None:
    """The multi-process layout in one process (a coordinator and a sharded table): hot
    rows touched at every step pass the 25% limit at step 5, which merges: one patch of
    the rows changed since the whole copy, built from the earlier patches read back from
    the store, uploaded as about those rows; every step loads bit-exact."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    rng = np.random.default_rng(0)
    value = rng.random((4096, 64), dtype=np.float32)  # 1 MiB: 4,096 rows of 256 bytes
    table = cv.Variable(value.copy(), name="table",
                        shard=cv.Shard(full_shape=value.shape, offset=(0, 0)))
    manager = cv.CheckpointManager(
        cv.Checkpoint(table=table), f"{s3.url}/one", format=fmt, max_to_keep=2,
        incremental=True, coordinator=cv.distributed.SingleProcessCoordinator(),
        storage_options=opts)
    hot = np.sort(rng.choice(4096, 300, replace=False))  # 7.3% of the rows, every step
    patches, ups = [], []
    for step in range(1, 7):
        if step > 1:
            rows = np.full((hot.size, 64), step, np.float32)
            table.scatter_update(hot, rows)
            value[hot] = rows
        proxy.reset_counts()
        last = manager.save()
        ups.append(proxy.bytes_up)
        with cv.open(last, storage_options=s3.storage_options) as reader:
            patches.append(reader.deltas().get("table", {}).get("patches", 0))
        assert np.array_equal(cv.load(last, storage_options=s3.storage_options)["table"],
                              value), step
    assert patches == [0, 1, 2, 3, 1, 2], patches  # 4 x 300 rows > 25%: merged at step 5
    assert ups[0] > value.nbytes
    assert max(ups[1:]) < hot.size * 264 + (40 << 10), ups  # the rows, not the table
    # HDF5: the kept steps 5 (merged) and 6 refer to the whole copy and to 5's patch
    # alone, so the steps holding the earlier patches are freed; Zarr steps stand alone
    kept = ["ckpt-1.h5", "ckpt-5.h5", "ckpt-6.h5"] if fmt == "h5" else ["ckpt-5.zarr",
                                                                        "ckpt-6.zarr"]
    assert list_committed_steps(s3.location("one")) == kept
    # a restarted manager that restores (a new checkpoint over a new sharded variable)
    # knows its box unchanged since the restored step 6: the delta is carried over
    fresh = cv.Variable(np.zeros_like(value), name="table",
                        shard=cv.Shard(full_shape=value.shape, offset=(0, 0)))
    restarted = cv.CheckpointManager(
        cv.Checkpoint(table=fresh), f"{s3.url}/one", format=fmt, max_to_keep=2,
        incremental=True, coordinator=cv.distributed.SingleProcessCoordinator(),
        storage_options=opts)
    assert restarted.restore_or_initialize() == last
    proxy.reset_counts()
    last = restarted.save()
    assert last.endswith(f"/ckpt-7.{fmt}")
    assert proxy.bytes_up < 40 << 10, proxy.bytes_up
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert reader.deltas()["table"]["patches"] == 2  # step 6's, carried over
    assert np.array_equal(cv.load(last, storage_options=s3.storage_options)["table"], value)
    # a restarted manager (keeping one step) that does not restore cannot know the table
    # unchanged, and a delta verified by its parts has no checksum of the whole value to
    # compare with: it writes the table whole, and the steps that held step 7's base and
    # patches are freed
    again = cv.CheckpointManager(
        cv.Checkpoint(table=table), f"{s3.url}/one", format=fmt, max_to_keep=1,
        incremental=True, coordinator=cv.distributed.SingleProcessCoordinator(),
        storage_options=opts)
    last = again.save()  # its counter says 1: it continues past the kept step 7
    assert last.endswith(f"/ckpt-8.{fmt}")
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert "table" not in reader.deltas()
    assert list_committed_steps(s3.location("one")) == [f"ckpt-8.{fmt}"]
    assert again.checkpoints == [last]
    assert np.array_equal(cv.load(last, storage_options=s3.storage_options)["table"], value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_process_object_follows_the_managers_incremental_options(
        s3: S3Bucket, fmt: str) -> None:
    """``IncrementalOptions`` reach each process's object (the multi-process path on the
    store, in one process): with ``max_patched_rows=0.1`` 150 hot rows touched at every
    step merge at step 4 (the default would append up to 25%), and ``whole_every=5``
    writes step 6 whole; every step loads bit-exact."""
    so = s3.storage_options
    rng = np.random.default_rng(0)
    value = rng.random((4096, 64), dtype=np.float32)  # 1 MiB: 4,096 rows of 256 bytes
    table = cv.Variable(value.copy(), name="table",
                        shard=cv.Shard(full_shape=value.shape, offset=(0, 0)))
    manager = cv.CheckpointManager(
        cv.Checkpoint(table=table), f"{s3.url}/opts", format=fmt, max_to_keep=2,
        incremental=cv.IncrementalOptions(max_patched_rows=0.1, whole_every=5),
        coordinator=cv.distributed.SingleProcessCoordinator(), storage_options=so)
    hot = np.sort(rng.choice(4096, 150, replace=False))  # 3.7% of the rows, every step
    patches = []
    for step in range(1, 7):
        if step > 1:
            rows = np.full((hot.size, 64), step, np.float32)
            table.scatter_update(hot, rows)
            value[hot] = rows
        last = manager.save()
        with cv.open(last, storage_options=so) as reader:
            patches.append(reader.deltas().get("table", {}).get("patches", 0))
        assert np.array_equal(cv.load(last, storage_options=so)["table"], value), step
    # 450 rows > 10% at step 4: merged (the union, 150 rows, is under 5%); step 6 whole
    assert patches == [0, 1, 2, 1, 2, 0], patches
    # HDF5: step 6 stands alone, step 5 refers to step 1 (the whole copy) and 4's patch
    kept = ["ckpt-1.h5", "ckpt-4.h5", "ckpt-5.h5", "ckpt-6.h5"] if fmt == "h5" else [
        "ckpt-5.zarr", "ckpt-6.zarr"]
    assert list_committed_steps(s3.location("opts")) == kept
