"""Incremental HDF5 steps of several processes on an object store (real ``mpiexec``
against the session's moto S3 server; the rank-side code is
tests/mpi/incremental_s3_cases.py): each process's object holds only its changed values
and refers to byte ranges of its object in the step that holds the others; bytes
uploaded per step ~ the changed bytes (counted by the tests' TCP proxy); every step
restores bit-exact on 3 and on 2 processes and loads in one; pruning keeps the steps a
kept step refers to, a restarted manager too; a process failing mid-save commits nothing;
``ckpt inspect/verify/convert/gc`` read such steps."""

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

MPI = Path(__file__).parent.parent / "mpi"
CASES = str(MPI / "incremental_s3_cases.py")
_spec = importlib.util.spec_from_file_location("incremental_cases", MPI / "incremental_cases.py")
assert _spec is not None and _spec.loader is not None
cases: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def _run(s3: S3Bucket, n: int, mode: str, url: str) -> dict[int, dict[str, Any]]:
    return mpi_case(s3, n, CASES, mode, url, timeout=180)


@pytest.fixture(scope="module")
def saved(moto_endpoint: str) -> tuple[S3Bucket, str, dict[int, dict[str, Any]]]:
    """The 3-process job of tests/mpi/incremental_s3_cases.py (``save``), run once in a
    bucket of its own: ``(bucket, run URL, what each rank reported)``."""
    name = "incremental-mpi-h5"
    s3 = own_bucket(moto_endpoint, name)
    run = f"{s3.url}/mph5"
    return s3, run, _run(s3, 3, "save", run)


def _loads(url: str, step: int, s3: S3Bucket) -> None:
    got = cv.load(url, storage_options=s3.storage_options)
    for key, want in cases.expected(step).items():
        assert np.array_equal(got[key], want), (url, key)


@needs_mpi
def test_three_processes_write_incremental_hdf5_steps_to_s3(
        saved: tuple[S3Bucket, str, dict[int, dict[str, Any]]]) -> None:
    """Bytes per step, pruning (and a restarted manager's), a failing process; every
    committed step restores bit-exact on 3 and on 2 processes and loads in one."""
    s3, run, ranks = saved
    r0 = ranks[0]
    up = {int(k): v for k, v in r0["uploaded"].items()}
    full = sum(a.nbytes for a in cases.expected(1).values())
    head = cases.expected(1)["head"].nbytes
    box = cases.expected(1)["frozen"].nbytes // 3
    overhead = 160 * 1024  # 3 files' HDF5 structure and records, the index, marker, requests
    assert up[1] > full, up  # the first step is written whole
    for step in (2, 3, 4, 6):  # only the head changed: uploaded ~ changed bytes
        assert up[step] < head + overhead, (step, up)
    assert up[5] < head + box + overhead, up  # + the middle process's box of frozen
    assert up[7] < head + overhead, up  # a restarted manager: found by checksums
    assert up[2] < full / 5, up
    print("bytes uploaded per step:", up, "full state:", full)

    # pruning (max_to_keep=2) keeps what a kept step refers to: step 1 holds `uneven` and
    # two boxes of `frozen` for every later step, step 5 the box written there
    assert r0["listed"] == ["ckpt-4.h5", "ckpt-5.h5"]
    assert r0["committed_after_5"] == ["ckpt-1.h5", "ckpt-4.h5", "ckpt-5.h5"]
    # rank 1 failed while writing step 6: nothing of it committed or left, 4 and 5 intact
    assert ranks[1]["failed"] == "OSError"
    assert {ranks[r]["failed"] for r in (0, 2)} == {"DistributedError"}
    assert r0["after_failure"] == {"listed": ["ckpt-4.h5", "ckpt-5.h5"], "left": []}
    assert r0["retried"] == "ckpt-6.h5"
    # the restarted manager read the references from the steps' records: 4 is pruned,
    # 1 and 5 are held (committed, not listed)
    assert r0["listed_after_7"] == ["ckpt-6.h5", "ckpt-7.h5"]
    held = ["ckpt-1.h5", "ckpt-5.h5"]
    assert r0["committed"] == [*held, "ckpt-6.h5", "ckpt-7.h5"]
    for r in ranks.values():  # every committed step restores bit-exact on 3 processes
        assert r["restored"] == dict.fromkeys(r0["committed"], True), r

    # on 2 processes (resharding: the referenced ranges are read from the holders)
    for r in _run(s3, 2, "restore", run).values():
        assert r["restored"] == dict.fromkeys(r0["committed"], True), r
    for name in r0["committed"]:  # ...and in one plain process
        _loads(f"{run}/{name}", cv.checkpoint.parse_step_name(name).step, s3)
    # which step holds each value's bytes (a value's boxes may each have another)
    with cv.open(f"{run}/ckpt-7.h5", storage_options=s3.storage_options) as reader:
        assert isinstance(reader, cv.storage.SupportsShared)
        shared = {"bias": ["ckpt-1.h5"], "frozen": held, "uneven": ["ckpt-1.h5"]}
        assert reader.shared() == shared
        lo, hi = cases.UNEVEN[0], sum(cases.UNEVEN[:2])
        assert np.array_equal(reader["uneven"][lo:hi], cases.expected(7)["uneven"][lo:hi])


@pytest.mark.slow
@needs_mpi
def test_readers_of_incremental_hdf5_steps_of_several_processes_on_s3(
        saved: tuple[S3Bucket, str, dict[int, dict[str, Any]]], tmp_path: Path) -> None:
    """``cv.open`` and ``ckpt inspect`` name the holders, ``ckpt verify`` checks every box,
    ``ckpt convert`` writes a standalone copy, ``ckpt gc`` removes no step; plain h5py on
    downloaded objects; a holder deleted behind our back fails only its values."""
    s3, run, ranks = saved
    held = ["ckpt-1.h5", "ckpt-5.h5"]
    last = f"{run}/ckpt-7.h5"
    shared = {"bias": ["ckpt-1.h5"], "frozen": held, "uneven": ["ckpt-1.h5"]}

    # ckpt: inspect shows the holders, verify checks every box, convert writes a
    # standalone copy, gc removes nothing a step needs
    standalone = tmp_path / "alone.h5"
    opts = [a for k in ("endpoint", "access_key_id", "secret_access_key", "region")
            for a in ("--storage-option", f"{k}={s3.storage_options[k]}")]
    opts += ["--storage-option", "allow_http=true"]
    inspected, verified, converted, collected = ckpt_processes(  # at once: start-up dominates
        ("inspect", last, "--json", *opts), ("verify", last, *opts),
        ("convert", last, standalone, *opts), ("gc", run, *opts))
    for res in (inspected, verified, converted, collected):
        assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(inspected.stdout)["shared"] == shared
    assert "OK" in verified.stdout, verified.stdout
    with h5py.File(standalone, "r") as f:
        assert isinstance(f.get("frozen", getlink=True), h5py.HardLink)
    loc = s3.location("mph5")
    assert list_committed_steps(loc) == ranks[0]["committed"]
    _loads(last, 7, s3)
    _plain_h5py_sees(loc, tmp_path / "plain")
    # a holder deleted behind our back: its values fail naming it, the others still read
    loc.delete("ckpt-5.h5.commit")
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert np.array_equal(reader.read("head"), cases.expected(7)["head"])
        with pytest.raises(cv.CorruptCheckpointError,
                           match=r"'frozen'.*rank-00001\.h5.*ckpt-5\.h5\.commit is gone"):
            reader.read("frozen")
    loc.delete([o.key for o in loc.list()])  # the copy stands alone
    got = cv.load(standalone)
    for key, want in cases.expected(7).items():
        assert np.array_equal(got[key], want), key


def _plain_h5py_sees(loc: Any, where: Path) -> None:
    """Plain h5py on process 1's downloaded object of step 7: its changed value, and an
    external link to the same process's object of step 1, which resolves once that is
    downloaded beside it (the step directories side by side)."""
    def download(step: str) -> Path:
        (where / step).mkdir(parents=True)
        (where / step / "rank-00001.h5").write_bytes(loc.read(f"{step}/rank-00001.h5"))
        return where / step / "rank-00001.h5"

    lo, hi = cases.UNEVEN[0], sum(cases.UNEVEN[:2])
    with h5py.File(download("ckpt-7.h5"), "r") as f:
        assert np.array_equal(f["head/%2Ebox/1"][()], cases.expected(7)["head"][30_000:60_000])
        assert f["uneven/%2Ebox"].get("1", getlink=True).filename == "../ckpt-1.h5/rank-00001.h5"
        with pytest.raises(KeyError):
            f["uneven/%2Ebox/1"]  # the holder is not downloaded yet
    download("ckpt-1.h5")
    with h5py.File(where / "ckpt-7.h5" / "rank-00001.h5", "r") as f:
        assert np.array_equal(f["uneven/%2Ebox/1"][()], cases.expected(7)["uneven"][lo:hi])


def test_a_process_file_whose_base_cannot_be_read_is_written_whole(
        s3: S3Bucket, proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The multi-process layout in one process (a coordinator and a sharded variable):
    the process's object refers to its base's; once the base's object is damaged, the
    next step says so and writes every value of that process, bit-exact."""
    opts = {**s3.storage_options, "endpoint": proxy.endpoint}
    rng = np.random.default_rng(0)
    big = rng.random((256, 1024), dtype=np.float32)  # 1 MiB, never changed
    frozen = cv.Variable(big.copy(), name="frozen",
                         shard=cv.Shard(full_shape=big.shape, offset=(0, 0)))
    head = cv.Variable(np.zeros(1024, np.float32), name="head")
    manager = cv.CheckpointManager(
        cv.Checkpoint(frozen=frozen, head=head), f"{s3.url}/one", format="h5",
        incremental=True, coordinator=cv.distributed.SingleProcessCoordinator(),
        storage_options=opts)
    ups = []
    for _ in range(3):
        head.assign_add(1.0)
        proxy.reset_counts()
        last = manager.save()
        ups.append(proxy.bytes_up)
        if len(ups) == 2:  # the base of the next step: its process object damaged
            loc = s3.location("one")
            loc.put("ckpt-2.h5/rank-00000.h5", b"not an HDF5 file")
    assert ups[0] > big.nbytes and ups[1] < 64 * 1024, ups  # step 2 refers to step 1
    assert "cannot read" in caplog.text and "rank-00000.h5" in caplog.text
    assert ups[2] > big.nbytes, ups  # written whole
    with cv.open(last, storage_options=s3.storage_options) as reader:
        assert isinstance(reader, cv.storage.SupportsShared)
        assert reader.shared() == {}
    got = cv.load(last, storage_options=s3.storage_options)
    assert np.array_equal(got["frozen"], big) and got["head"][0] == 3
