"""One checkpoint written by N processes to an object store, restored on M (real ``mpiexec``
against the session's moto S3 server); the rank-side code is tests/mpi/cloud_cases.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError
from ckptvar.locations import read_commit

from ._s3 import FaultProxy, S3Bucket, options_for
from .test_cloud_cli import _ckpt

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None,
                                reason=_mpi_skip_reason() or "")

CASES = str(Path(__file__).parent.parent / "mpi" / "cloud_cases.py")


def _run(s3: S3Bucket, n: int, *args: str) -> dict[str, dict[int, dict[str, Any]]]:
    proc, got, _ = run_mpi(n, CASES, *args, timeout=120,
                           env={"S3_OPTIONS": json.dumps(s3.storage_options)})
    assert got.get("crash") is None, got["crash"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return got


def _keys(s3: S3Bucket, prefix: str) -> list[str]:
    return sorted(o.key for o in s3.location().list(prefix))


def _expected(key: str) -> np.ndarray:
    shapes = {"w": ((37, 5), "float32"), "e": ((6, 10), "int64"), "z": ((3, 2), "float64")}
    shape, dtype = shapes[key]
    return (np.arange(int(np.prod(shape))) * 3 + 1).astype(dtype).reshape(shape)


def test_three_processes_save_to_s3_and_two_and_one_restore(s3: S3Bucket) -> None:
    got = _run(s3, 3, "save", s3.url)
    for suffix in (".h5", ".zarr"):
        paths = {r["path"] for r in got[f"save{suffix}"].values()}
        assert paths == {f"{s3.url}/n3/ckpt-1{suffix}"}  # a URL, the same on every rank
    # the step holds one object per process file, the index, and nothing else
    h5 = _keys(s3, "n3/ckpt-1.h5/")
    assert h5 == [f"n3/ckpt-1.h5/{n}" for n in
                  ("ckptvar-index.msgpack", "rank-00000.h5", "rank-00001.h5", "rank-00002.h5")]
    assert "n3/ckpt-1.h5.claim" not in _keys(s3, "n3/")  # released at the commit
    record = read_commit(s3.location("n3"), "ckpt-1.h5")
    assert record is not None and record.index_checksum.startswith("index-crc32c:")
    # M != N: every rank reads its own shard, both formats
    for m in (2, 1):
        restored = _run(s3, m, "restore", s3.url, "3")
        for suffix in (".h5", ".zarr"):
            ranks = restored[f"restore3{suffix}"]
            assert sorted(ranks) == list(range(m))
            assert all(r["ok"] and r["counter"] == 1 for r in ranks.values()), ranks
    # one process sees the logical values, lazily
    for suffix in (".h5", ".zarr"):
        url = f"{s3.url}/n3/ckpt-1{suffix}"
        values = cv.load(url, storage_options=s3.storage_options)
        for key in ("w", "e", "z"):
            assert np.array_equal(values[key], _expected(key)), (suffix, key)
        with cv.open(url, storage_options=s3.storage_options) as reader:
            assert np.array_equal(reader["w"][10:30, 2:4], _expected("w")[10:30, 2:4])
    assert cv.latest_checkpoint(f"{s3.url}/n3", storage_options=s3.storage_options) in {
        f"{s3.url}/n3/ckpt-1.h5", f"{s3.url}/n3/ckpt-1.zarr"}
    # the ckpt command sees one checkpoint, and checks every box against its checksum
    res = _ckpt(s3, "verify", f"{s3.url}/n3/ckpt-1.zarr")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout and "without a stored checksum" not in res.stdout
    res = _ckpt(s3, "inspect", f"{s3.url}/n3/ckpt-1.h5", "--json")
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert "3 processes" in json.dumps(shown) and '"w"' in res.stdout


def test_a_multiprocess_zarr_step_on_s3_is_a_plain_zarr_group(s3: S3Bucket) -> None:
    import obstore.store
    import zarr

    _run(s3, 2, "save", s3.url)
    store = obstore.store.S3Store(
        s3.name, prefix="n2/ckpt-1.zarr", endpoint=s3.endpoint, access_key_id="testing",
        secret_access_key="testing", region="us-east-1", client_options={"allow_http": True},
    )
    group = zarr.open_group(zarr.storage.ObjectStore(store, read_only=True), mode="r")
    assert group.attrs["ckptvar_sharded"] == {"index": "ckptvar-index.msgpack"}
    # each process's file is an ordinary ckptvar Zarr checkpoint: a group of its own
    for name in ("rank-00000.zarr", "rank-00001.zarr"):
        assert isinstance(group[name], zarr.Group)


def test_a_failing_rank_commits_nothing_on_s3(s3: S3Bucket) -> None:
    got = _run(s3, 3, "fault", s3.url)
    for rank in (0, 1, 2):
        r = got["fault"][rank]
        assert r["ok"], r
        assert "rank 1" in r["error"]
        assert r["good"] == f"{s3.url}/run/ckpt-1.h5"
    keys = _keys(s3, "run/")
    assert not [k for k in keys if k.startswith("run/ckpt-2")], keys  # no data, claim, marker
    opts = s3.storage_options
    assert cv.latest_checkpoint(f"{s3.url}/run", storage_options=opts) == f"{s3.url}/run/ckpt-1.h5"
    assert np.array_equal(cv.load(f"{s3.url}/run/ckpt-1.h5", storage_options=opts)["w"],
                          _expected("w"))


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_manager_saver_and_background_saves_of_three_processes_on_s3(s3: S3Bucket) -> None:
    got = _run(s3, 3, "manager", s3.url)
    for case in ("manager", "manager_restore", "saver", "background"):
        assert sorted(got[case]) == [0, 1, 2], case
        assert all(r["ok"] for r in got[case].values()), got[case]
    mgr = f"{s3.url}/mgr"
    for r in got["manager"].values():
        assert r["kept"] == [f"{mgr}/ckpt-2.h5", f"{mgr}/ckpt-3.h5"]
        assert r["latest"] == f"{mgr}/ckpt-3.h5"
    assert {r["counter"] for r in got["manager_restore"].values()} == {3}
    # pruned steps are gone entirely (marker, index, process files)
    assert not [k for k in _keys(s3, "mgr/") if k.startswith("mgr/ckpt-1")]
    # the Saver kept one step: the older one's objects are gone
    assert [k for k in _keys(s3, "saver/") if "model-6" in k] == []
    assert "saver/model-7.h5.commit" in _keys(s3, "saver/")


def test_a_damaged_index_on_s3_is_refused_naming_the_marker(s3: S3Bucket) -> None:
    _run(s3, 2, "save", s3.url)
    loc = s3.location("n2")
    index = bytearray(loc.read("ckpt-1.h5/ckptvar-index.msgpack"))
    index[-3] ^= 0xFF
    loc.put("ckpt-1.h5/ckptvar-index.msgpack", bytes(index))
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-1\.h5\.commit.*index-crc32c"):
        cv.load(f"{s3.url}/n2/ckpt-1.h5", storage_options=s3.storage_options)


def test_a_resharding_restore_from_s3_fetches_each_rank_share_once(
    s3: S3Bucket, proxy: FaultProxy
) -> None:
    """3 -> 2 through a counting proxy: within the temporary budget each rank reads its
    rows once, verified as they stream (the stored slab's edge blocks come with the run,
    in the same request); above it too, into a spool file then copied after the vote
    (before: a verify pass, then a read pass: 2.01x the bytes)."""
    got = _run(s3, 3, "reshard", s3.url, "save", "-")
    assert all(r["ok"] for r in got["reshard_save"].values())
    via = S3Bucket(s3.endpoint, s3.name, s3.url, options_for(proxy.endpoint))
    counts = {}
    for budget in ("-", str(1 << 20)):
        proxy.reset_counts()
        ranks = _run(via, 2, "reshard", s3.url, "restore", budget)["reshard_restore"]
        assert sorted(ranks) == [0, 1] and all(r["ok"] for r in ranks.values()), ranks
        need = sum(r["need"] for r in ranks.values())
        counts[budget] = (proxy.bytes_down, proxy.gets, need)
    print("bytes through the proxy, GETs, bytes needed:", counts)
    down, gets, need = counts["-"]
    # one pass: the rows plus the parts of the edge blocks outside them (fetched in the
    # same request as the run), the commit record, the index and the files' records
    assert down <= 1.05 * need, counts
    assert gets <= 24, counts  # 20 here (22 before: two more for the edge blocks)
    down, gets, need = counts[str(1 << 20)]
    assert down <= 1.05 * need, counts  # one pass through the spool (2.01x before)
    assert gets <= 24, counts  # as within the budget (26 before, 57 before that)


def test_ranks_saving_to_different_urls_raise_and_commit_nothing(s3: S3Bucket) -> None:
    """A collective save whose ranks name different destinations (URLs, a URL and a local
    path, local directories) is one error on every rank: never a step committed at rank
    0's URL without the other ranks' files, nor ranks told paths that hold nothing."""
    got = _run(s3, 2, "divergent", s3.url)
    for case in ("divergent-url", "divergent-local", "divergent-dirs"):
        for rank in range(2):
            assert got[case][rank]["ok"], got[case][rank]
    assert [k for k in _keys(s3, "") if k.endswith(".commit")] == []


def test_a_multiprocess_save_that_lost_the_network_does_not_block_its_retry(
    s3: S3Bucket, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Rank 1's upload and every delete fail: the save raises on every rank, rank 0's
    clean-up cannot delete, and still its claim never blocks the same step's next write."""
    import threading
    import time

    opts = {**s3.storage_options, "endpoint": proxy.endpoint, "timeout": "5s",
            "max_retries": 1, "retry_timeout": 2}
    proxy.drop_requests(rb"^PUT \S*rank-00001|^POST \S+\?delete|^DELETE ")

    def heal() -> None:
        for _ in range(600):
            if (tmp_path / "failed").exists():
                proxy.heal()
                (tmp_path / "healed").write_text("")
                return
            time.sleep(0.1)

    healer = threading.Thread(target=heal, daemon=True)
    healer.start()
    proc, got, _ = run_mpi(2, CASES, "netdrop", s3.url, timeout=120,
                           env={"S3_OPTIONS": json.dumps(opts), "FLAG_DIR": str(tmp_path)})
    assert got.get("crash") is None, got["crash"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        assert got["netdrop"][rank]["ok"], got["netdrop"][rank]
    got_w = cv.load(f"{s3.url}/nd/ckpt-1.h5", storage_options=s3.storage_options)["w"]
    np.testing.assert_array_equal(got_w, _expected("w"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["write", "commit"])
def test_a_rank_stopped_in_a_vote_of_a_save_to_s3_leaves_no_half_step(
    s3: S3Bucket, stage: str
) -> None:
    """Rank 1 stops in a vote of step 2 (tests/mpi/stall_cases.py): the others raise the
    coordinator's timeout naming the stage; before the commit nothing of step 2 is left
    (the claim released too), after it step 2 is committed whole, its claim released,
    and the errors of rank 0 and of rank 2 (which reads the marker) say so."""
    url = f"{s3.url}/run"
    cases = str(Path(CASES).parent / "stall_cases.py")
    proc, got, _ = run_mpi(3, cases, stage, url, timeout=90,
                           env={"S3_OPTIONS": json.dumps(s3.storage_options),
                                "STALL_TIMEOUT": "3"})
    results = got.get(stage, {})
    assert sorted(results) == [0, 1, 2], proc.stdout + proc.stderr
    for rank in (0, 2):
        r = results[rank]
        assert r["error"] == "DistributedTimeoutError", r
        assert f"vote:save:{url}/ckpt-2.h5:{stage}'" in r["message"] and r["ranks"] == [1]
    step2 = [k for k in _keys(s3, "run") if k.startswith("run/ckpt-2")]
    if stage == "commit":
        assert results[0]["latest"] == f"{url}/ckpt-2.h5" and results[0]["loaded"] == 2.0
        assert "run/ckpt-2.h5.commit" in step2 and not [k for k in step2 if "claim" in k], step2
        for rank in (0, 2):  # every rank that sees the marker says the step is whole
            assert f"{url}/ckpt-2.h5 was committed" in results[rank]["notes"], results[rank]
    else:
        assert results[0]["latest"] == f"{url}/ckpt-1.h5" and results[0]["loaded"] == 1.0
        assert step2 == [], step2
