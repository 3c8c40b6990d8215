"""Restart on an object store (local S3 server): a dead writer's claim never blocks, its
leftovers are reclaimed, and two live writers still never both commit a step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv
from ckptvar.errors import CheckpointExistsError
from ckptvar.locations import (
    CLAIM_SUFFIX,
    Claim,
    Holder,
    claim,
    list_committed_steps,
    read_claim,
    this_host,
)

from ._s3 import S3Bucket

TIERS_CASES = Path(__file__).parent.parent / "mpi" / "tiers_cases.py"


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    return int(proc.stdout)


def _holder(**kw: object) -> Holder:
    base = Holder.mine()
    return Holder(**{**base.__dict__, **kw})  # type: ignore[arg-type]


def _model(value: float) -> tuple[cv.Checkpoint, cv.Variable]:
    v = cv.Variable(np.full((32, 8), value, np.float32), name="v")
    return cv.Checkpoint(v=v), v


def test_a_claim_names_its_holder_and_is_released(s3: S3Bucket) -> None:
    loc = s3.location("run")
    held = claim(loc, "ckpt-1.zarr")
    exists, holder = read_claim(loc, "ckpt-1.zarr")
    assert exists and holder is not None
    assert (holder.host, holder.pid) == (this_host(), os.getpid()) and holder.lease > 0
    with pytest.raises(CheckpointExistsError, match=rf"host {this_host()}, pid {os.getpid()}"):
        claim(loc, "ckpt-1.zarr")  # a live writer: still refused
    held.release()
    assert read_claim(loc, "ckpt-1.zarr") == (False, None)


@pytest.mark.parametrize("fmt", ["zarr", "h5"])
def test_a_dead_jobs_claim_never_blocks_the_restarted_save(s3: S3Bucket, fmt: str) -> None:
    """A job killed mid-save left its claim and objects below step 2: the restarted job
    saves step 2, and nothing of the dead save is left afterwards."""
    opts = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, _ = _model(1.0)
    cv.CheckpointManager(ckpt, run, max_to_keep=3, format=fmt, storage_options=opts).save()
    loc = s3.location("run")
    dead = _holder(pid=_dead_pid(), job="4242")
    loc.put(f"ckpt-2.{fmt}{CLAIM_SUFFIX}", dead.to_json())
    loc.put(f"ckpt-2.{fmt}/rank-00000.h5", b"x" * 4096)  # a dead multi-process save's
    loc.put(f"ckpt-2.{fmt}.0123456789ab.data", b"y" * 2048)  # a dead single-file save's
    ckpt2, v2 = _model(0.0)
    mgr = cv.CheckpointManager(ckpt2, run, max_to_keep=3, format=fmt, storage_options=opts)
    assert mgr.restore_or_initialize() == f"{run}/ckpt-1.{fmt}"
    v2.assign(np.full((32, 8), 2.0, np.float32))
    assert mgr.save() == f"{run}/ckpt-2.{fmt}"
    np.testing.assert_array_equal(cv.load(f"{run}/ckpt-2.{fmt}", storage_options=opts)["v"],
                                  np.full((32, 8), 2.0, np.float32))
    keys = sorted(o.key for o in loc.list())
    assert not [k for k in keys if k.endswith(CLAIM_SUFFIX)], keys
    assert not [k for k in keys if "rank-00000" in k or "0123456789ab" in k], keys
    assert list_committed_steps(loc) == [f"ckpt-1.{fmt}", f"ckpt-2.{fmt}"]


def test_a_claim_from_another_host_holds_while_renewed_and_expires_after(
    s3: S3Bucket,
) -> None:
    loc = s3.location("run")
    # renewed by its (other host's) writer: refused once the renewal is seen
    other = _holder(host="node-elsewhere", lease=0.6)
    loc.put(f"ckpt-5.zarr{CLAIM_SUFFIX}", other.to_json())
    renewing = Claim(loc, "ckpt-5.zarr", other)
    try:
        with pytest.raises(CheckpointExistsError, match="node-elsewhere"):
            claim(loc, "ckpt-5.zarr")
    finally:
        renewing.release()
    # not renewed: taken over after its lease, with what it left below the step
    stale = _holder(host="node-elsewhere", lease=0.6)
    loc.put(f"ckpt-6.zarr{CLAIM_SUFFIX}", stale.to_json())
    loc.put("ckpt-6.zarr/zarr.json", b"{}")
    held = claim(loc, "ckpt-6.zarr")  # waits out the lease (0.6 s), then takes it over
    assert read_claim(loc, "ckpt-6.zarr")[1] == held.holder
    assert not loc.exists("ckpt-6.zarr/zarr.json")
    held.release()


def test_gc_at_a_url_keeps_an_object_named_without_the_step_dash(s3: S3Bucket) -> None:
    """A user's dup2.h5 beside committed steps was read as step 2, uncommitted and below
    the latest, and deleted by gc; a step is named PREFIX-N, so it is left alone."""
    opts = s3.storage_options
    run = f"{s3.url}/run"
    mgr = cv.CheckpointManager(_model(1.0)[0], run, storage_options=opts)
    mgr.save(checkpoint_number=5)
    loc = s3.location("run")
    loc.put("dup2.h5", b"the user's own")
    loc.put("ckpt-1.h5.abcdef012345.data", b"a" * 10)  # a dead save's: reclaimed
    removed = [left.path for left in cv.checkpoint.gc(run, storage_options=opts)]
    assert f"{run}/ckpt-1.h5.abcdef012345.data" in removed
    assert loc.read("dup2.h5") == b"the user's own"


def test_ckpt_gc_at_a_url_removes_dead_claims_and_uncommitted_objects(s3: S3Bucket) -> None:
    opts = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, _ = _model(1.0)
    mgr = cv.CheckpointManager(ckpt, run, format="zarr", storage_options=opts)
    mgr.save()
    mgr.save()
    loc = s3.location("run")
    loc.put("ckpt-1.zarr.abcdef012345.data", b"a" * 100)  # below the latest: dead
    loc.put(f"ckpt-3.zarr{CLAIM_SUFFIX}", _holder(pid=_dead_pid()).to_json())
    loc.put("ckpt-3.zarr/rank-00001.h5", b"b" * 300)
    live = claim(loc, "ckpt-4.zarr")  # a save in flight: never touched
    loc.put("ckpt-4.zarr/rank-00000.h5", b"c" * 50)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        cmd = [sys.executable, "-m", "ckptvar", "gc", run]
        for k, val in opts.items():
            cmd += ["--storage-option", f"{k}={val}"]
        proc = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True,
                              timeout=120, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "would remove" in proc.stdout and loc.exists("ckpt-3.zarr/rank-00001.h5")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert f"claim of a dead writer  {run}/ckpt-3.zarr{CLAIM_SUFFIX}" in out, out
        assert f"uncommitted object  {run}/ckpt-3.zarr  300 bytes" in out, out
        assert f"uncommitted object  {run}/ckpt-1.zarr.abcdef012345.data  100 bytes" in out
        keys = sorted(o.key for o in loc.list())
        assert "ckpt-4.zarr/rank-00000.h5" in keys and f"ckpt-4.zarr{CLAIM_SUFFIX}" in keys
        assert not [k for k in keys if k.startswith(("ckpt-3", "ckpt-1.zarr.abc"))], keys
        assert list_committed_steps(loc) == ["ckpt-1.zarr", "ckpt-2.zarr"]
    finally:
        live.release()


def test_two_live_writers_racing_for_a_dead_claim_commit_once(s3: S3Bucket) -> None:
    loc = s3.location("run")
    loc.put(f"ckpt-7.zarr{CLAIM_SUFFIX}", _holder(pid=_dead_pid()).to_json())
    got: dict[str, object] = {}
    go = threading.Barrier(2)

    def race(name: str) -> None:
        go.wait(timeout=30)
        try:
            got[name] = claim(loc, "ckpt-7.zarr")
        except CheckpointExistsError as exc:
            got[name] = exc

    threads = [threading.Thread(target=race, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    held = [c for c in got.values() if isinstance(c, Claim)]
    refused = [c for c in got.values() if isinstance(c, CheckpointExistsError)]
    assert len(held) == 1 and len(refused) == 1, got  # one takes the step over, one is refused
    held[0].check()
    assert read_claim(loc, "ckpt-7.zarr")[1] == held[0].holder
    held[0].release()
    assert not [o.key for o in loc.list() if o.key.startswith("ckpt-7")]


# --------------------------------------------------------------------------- crash harness

_ZERO = dict.fromkeys(("broken", "lost", "blocked", "leftovers", "not_latest"), 0)


def _mpi_or_skip() -> None:
    from test_distributed_mpi import _mpi_skip_reason

    if _mpi_skip_reason():
        pytest.skip(_mpi_skip_reason() or "")


def test_restart_after_kills_of_three_processes_saving_to_s3(s3: S3Bucket, tmp_path: Path) -> None:
    from test_crash import restart_harness

    _mpi_or_skip()
    counts = restart_harness(f"{s3.url}/run", "h5", processes=3, kills=1, seed=13,
                             work=tmp_path, opts=s3.storage_options)
    assert counts == {"kills": 1, **_ZERO}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 3])
def test_restart_after_100_kills_of_saves_to_s3(
    s3: S3Bucket, tmp_path: Path, processes: int
) -> None:
    from test_crash import restart_harness

    if processes > 1:
        _mpi_or_skip()
    counts = restart_harness(f"{s3.url}/run", "h5", processes=processes, kills=100,
                             seed=107 + processes, work=tmp_path, opts=s3.storage_options)
    assert counts == {"kills": 100, **_ZERO}


# --------------------------------------------------------------------------- tiers


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_a_local_tier_persisted_to_s3_restores_on_a_new_machine(
    s3: S3Bucket, tmp_path: Path, fmt: str
) -> None:
    opts = s3.storage_options
    run = f"{s3.url}/run"
    ckpt, v = _model(0.0)
    mgr = cv.CheckpointManager(ckpt, run, max_to_keep=2, format=fmt, storage_options=opts,
                               local_directory=tmp_path / "local", local_max_to_keep=1,
                               persistent_every=2)
    for step in range(1, 6):
        v.assign(np.full((32, 8), float(step), np.float32))
        mgr.save()
    mgr.wait_until_finished()
    assert list_committed_steps(s3.location("run")) == [f"ckpt-2.{fmt}", f"ckpt-4.{fmt}"]
    assert sorted(p.name for p in (tmp_path / "local").glob("ckpt-*")) == [f"ckpt-5.{fmt}"]
    shutil.rmtree(tmp_path / "local")  # a new machine
    ckpt2, v2 = _model(-1.0)
    again = cv.CheckpointManager(ckpt2, run, max_to_keep=2, format=fmt, storage_options=opts,
                                 local_directory=tmp_path / "local", local_max_to_keep=1,
                                 persistent_every=2)
    assert again.restore_or_initialize() == f"{run}/ckpt-4.{fmt}"
    np.testing.assert_array_equal(v2.numpy(), np.full((32, 8), 4.0, np.float32))
    again.save()
    again.save()
    again.wait_until_finished()
    assert list_committed_steps(s3.location("run")) == [f"ckpt-4.{fmt}", f"ckpt-6.{fmt}"]
    assert not [o.key for o in s3.location("run").list() if o.key.endswith(CLAIM_SUFFIX)]


_ENDS_PERSISTING = """
import json, sys
import numpy as np
import ckptvar as cv
run, local, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
v = cv.Variable(np.zeros((32, 8), np.float32), name="v")
mgr = cv.CheckpointManager(cv.Checkpoint(v=v), run, max_to_keep=1, format="zarr",
                           storage_options=opts, local_directory=local,
                           local_max_to_keep=1, async_save=True)
v.assign(np.full((32, 8), 2.0, np.float32))
mgr.save(2)  # ends the script with its copy to the object store queued
"""


def test_a_script_ending_with_a_copy_to_s3_queued_persists_it(
    s3: S3Bucket, tmp_path: Path
) -> None:
    run = f"{s3.url}/run"
    res = subprocess.run([sys.executable, "-c", _ENDS_PERSISTING, run,
                          str(tmp_path / "local"), json.dumps(s3.storage_options)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert list_committed_steps(s3.location("run")) == ["ckpt-2.zarr"]
    shutil.rmtree(tmp_path / "local")  # a new machine
    ckpt, v = _model(-1.0)
    again = cv.CheckpointManager(ckpt, run, max_to_keep=1, format="zarr",
                                 storage_options=s3.storage_options,
                                 local_directory=tmp_path / "local", local_max_to_keep=1)
    assert again.restore_or_initialize() == f"{run}/ckpt-2.zarr"
    np.testing.assert_array_equal(v.numpy(), np.full((32, 8), 2.0, np.float32))


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_restart_after_kills_of_tiered_saves_persisting_to_s3(s3: S3Bucket, tmp_path: Path) -> None:
    """Kills land in local saves and in the background uploads of their persistent copies."""
    from test_crash import restart_harness

    counts = restart_harness(f"{s3.url}/run", "h5", processes=1, kills=2, seed=17,
                             work=tmp_path, opts=s3.storage_options,
                             tier=str(tmp_path / "local"))
    assert counts == {"kills": 2, **_ZERO}


@pytest.mark.slow
def test_restart_after_100_kills_of_tiered_saves_persisting_to_s3(
    s3: S3Bucket, tmp_path: Path
) -> None:
    from test_crash import restart_harness

    counts = restart_harness(f"{s3.url}/run", "h5", processes=1, kills=100, seed=117,
                             work=tmp_path, opts=s3.storage_options,
                             tier=str(tmp_path / "local"))
    assert counts == {"kills": 100, **_ZERO}


@pytest.mark.parametrize(("kills", "seed"), [
    pytest.param(2, 19, id="2-kills"),
    pytest.param(50, 119, id="50-kills", marks=pytest.mark.slow),
])
def test_restart_after_kills_of_incremental_hdf5_saves_to_s3(
        s3: S3Bucket, tmp_path: Path, kills: int, seed: int) -> None:
    """Kills during incremental HDF5 saves to S3 (objects that refer to the first step's
    object) and their pruning: every committed step, held ones included, loads bit-exact
    and nothing of a dead save is left."""
    from test_crash import restart_harness

    counts = restart_harness(f"{s3.url}/run", "h5", processes=1, kills=kills, seed=seed,
                             work=tmp_path, opts=s3.storage_options, incremental=True)
    assert counts == {"kills": kills, **_ZERO}


def test_a_killed_writer_not_yet_reaped_is_gone(s3: S3Bucket) -> None:
    """A zombie (killed, its parent has not waited for it) holds no claim."""
    import signal

    from ckptvar.locations import process_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # the kernel makes it a zombie; nobody reaps it yet
            if not process_alive(child.pid):
                break
            time.sleep(0.01)
        assert not process_alive(child.pid)
        loc = s3.location("run")
        loc.put(f"ckpt-1.zarr{CLAIM_SUFFIX}", _holder(pid=child.pid).to_json())
        claim(loc, "ckpt-1.zarr").release()  # taken over, not refused
    finally:
        child.wait(timeout=60)


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_three_processes_with_a_shared_local_tier_persist_to_s3(
    s3: S3Bucket, tmp_path: Path, fmt: str
) -> None:
    run = f"{s3.url}/tiers"
    env = {"PERSISTENT": run, "S3_OPTIONS": json.dumps(s3.storage_options), "FORMAT": fmt}

    def case(name: str) -> dict[int, dict[str, Any]]:
        proc, got, _ = run_mpi(3, str(TIERS_CASES), str(tmp_path), name, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(got.get(name, {})) == [0, 1, 2], got
        return got[name]

    for r in case("save").values():
        assert r["local"] == [f"ckpt-5.{fmt}"], r
        assert r["listed"] == [f"tiers/ckpt-2.{fmt}", f"tiers/ckpt-4.{fmt}",
                               f"local/ckpt-5.{fmt}"], r
    assert list_committed_steps(s3.location("tiers")) == [f"ckpt-2.{fmt}", f"ckpt-4.{fmt}"]
    shutil.rmtree(tmp_path / "local")  # new machines: every process restores from S3
    for r in case("restore").values():
        assert r["restored"] == f"{run}/ckpt-4.{fmt}", r
        assert r["values"] == [4.0], r


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_per_node_local_tiers_persist_to_s3_and_restore_after_losing_a_node(
    s3: S3Bucket, tmp_path: Path, fmt: str
) -> None:
    """4 processes as 2 nodes (``mpiexec -n 4``), each node its own local directory: every
    process uploads its own part, rank 0 commits the step's marker after all uploads; a
    node's lost directory makes every process restore the newest step from S3."""
    from test_node_tiers import check_save_lose_restore

    run = f"{s3.url}/nodes"
    env = {"PERSISTENT": run, "S3_OPTIONS": json.dumps(s3.storage_options), "FORMAT": fmt}
    check_save_lose_restore(tmp_path, run, fmt, env)
    assert sorted(list_committed_steps(s3.location("nodes"))) == sorted(
        f"ckpt-{n}.{fmt}" for n in (2, 4, 14))
    loaded = cv.load(f"{run}/ckpt-14.{fmt}", storage_options=s3.storage_options)
    assert np.array_equal(loaded["b"], np.full(7, 140.0))


@pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
def test_a_process_killed_mid_persist_to_s3_commits_nothing_and_keeps_the_local_steps(
    s3: S3Bucket, tmp_path: Path
) -> None:
    """Per-node tiers (``mpiexec -n 4``, 2 nodes): rank 2 SIGKILLs itself once the copy of
    step 2 to S3 has begun. No marker, both nodes keep steps 1 and 2; the restarted job
    restores the local step 2 bit-exact, and its first persisted step leaves nothing of
    the dead copy (claim, objects)."""
    from test_node_tiers import node_case

    run = f"{s3.url}/killed"
    env = {"PERSISTENT": run, "S3_OPTIONS": json.dumps(s3.storage_options)}
    node_case(tmp_path, "kill", env, ok=False)
    loc = s3.location("killed")
    assert list_committed_steps(loc) == []
    assert [o.key for o in loc.list()], "the copy had begun"
    kill = tmp_path / "kill"
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (kill / "nodes" / node).glob("ckpt-*")) == [
            "ckpt-1.h5", "ckpt-2.h5"]
    for rank, r in node_case(kill, "next", env).items():
        here = kill / "nodes" / f"node{rank // 2}"
        assert r["restored"] == str(here / "ckpt-2.h5") and r["exact"], r
        assert r["saved"] == str(here / "ckpt-12.h5"), r
    assert list_committed_steps(loc) == ["ckpt-12.h5"]
    stray = [o.key for o in loc.list() if not o.key.startswith("ckpt-12.h5")]
    assert stray == [], stray
