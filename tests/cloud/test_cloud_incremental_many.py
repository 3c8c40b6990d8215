"""Incremental steps on an object store against what users and jobs do to them: objects
deleted by hand from the latest step, a job restarted on another number of processes, a
process killed (``SIGKILL``) in a save or in its pruning, then ``ckpt gc`` and a restart.
Real processes (``mpiexec``, torch.distributed gloo) where the layout is many processes;
the cases are tests/mpi/incremental_resize_cases.py and incremental_kill_cases.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_runs import ckpt_processes
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv
from ckptvar.locations import list_committed_steps

from ._s3 import S3Bucket

needs_mpi = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed")

CASES = str(Path(__file__).parent.parent / "mpi" / "incremental_resize_cases.py")


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


def _continue(s3: S3Bucket, url: str, fmt: str, runs: list[tuple[int, int, int]]
              ) -> list[dict[int, dict[str, Any]]]:
    """Jobs of ``(processes, first step, last step)`` in turn, each restoring the latest
    step and saving on (tests/mpi/incremental_resize_cases.py): every committed step, held
    ones too, loads in one process after each save and restores on the job's processes."""
    got = []
    for n, first, last in runs:
        proc, out, _ = run_mpi(n, CASES, "run", url, fmt, str(first), str(last), timeout=180,
                               env={"S3_OPTIONS": json.dumps(s3.storage_options)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = out["run"]
        assert sorted(ranks) == list(range(n)), proc.stdout + proc.stderr
        for rank, r in ranks.items():
            assert r["restored_ok"], (n, rank, r)
            assert r["wrong"] == {}, (n, rank, r["wrong"])
            assert all(v is True for v in r["restores"].values()), (n, rank, r["restores"])
        got.append(ranks)
    return got


@pytest.mark.slow  # four mpiexec jobs against moto
@needs_mpi
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_incremental_steps_go_on_across_world_sizes(s3: S3Bucket, fmt: str) -> None:
    """Steps saved by 2 processes, then by 3, 1 and 2 again, each job restoring the latest
    step: a table trained at a few rows (row deltas of uneven boxes), a value changed on
    one process only, one with no rows on the last process. The first step of a new world
    size refers to nothing of the other layout (written whole, logged), the next ones are
    incremental again; every step, listed or held, loads and restores bit-exact."""
    url = f"{s3.url}/resize"
    jobs = _continue(s3, url, fmt, [(2, 1, 3), (3, 4, 6), (1, 7, 7), (2, 8, 9)])
    for ranks, (step, before, now) in zip(jobs[1:], [(4, 2, 3), (7, 3, 1), (8, 1, 2)],
                                           strict=True):
        said = ranks[0]["said"]
        assert any(f"ckpt-{step}.{fmt}: writing every value: the earlier step "
                   f"ckpt-{step - 1}.{fmt} was written by {before} "
                   f"{'process' if before == 1 else 'processes'}, this one by {now}" in m
                   for m in said), said
    deltas = {int(k): v for job in jobs for k, v in job[0]["deltas"].items()}
    assert deltas == {1: [], 2: ["table"], 3: ["table"], 4: [], 5: ["table"], 6: ["table"],
                      7: [], 8: [], 9: ["table"]}, deltas  # each process's box a patch
    assert jobs[-1][0]["listed"] == [f"ckpt-8.{fmt}", f"ckpt-9.{fmt}"]
    with cv.open(f"{url}/ckpt-9.{fmt}", storage_options=s3.storage_options) as reader:
        assert isinstance(reader, cv.storage.SupportsShared)
        if fmt == "h5":  # step 9 refers to step 8's objects, and to nothing older
            assert set().union(*reader.shared().values()) == {"ckpt-8.h5"}, reader.shared()
        else:  # server-side copies: nothing shared
            assert reader.shared() == {}


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _gc(url: str, s3: S3Bucket) -> str:
    opts = [a for k in ("endpoint", "access_key_id", "secret_access_key", "region")
            for a in ("--storage-option", f"{k}={s3.storage_options[k]}")]
    (done,) = ckpt_processes(("gc", url, *opts, "--storage-option", "allow_http=true"))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # a torch job of 3 processes, ckpt gc and an mpiexec job against moto
@needs_mpi
@needs_torch
@pytest.mark.parametrize(("when", "fmt"), [
    ("write", "h5"), ("write", "zarr"), ("write0", "h5"), ("prune", "h5"), ("prune", "zarr")])
def test_a_process_killed_in_an_incremental_save_or_its_pruning(
        s3: S3Bucket, when: str, fmt: str) -> None:
    """Three gloo processes save steps incrementally; in step 4 one is killed
    (``SIGKILL``): process 1 once its object is uploaded, or process 0 (the store's host)
    as it writes; or in step 5 process 0 while it prunes after the commit (a marker
    deleted, the objects not). The others raise DistributedError at once; nothing is
    committed half (before the commit: nothing; in the pruning: step 5 whole, and said,
    the step pruned no longer committed, the steps kept ones refer to kept); ``ckpt gc``
    removes what is left and no byte a committed step needs; a restarted job of 3
    processes restores the latest step and goes on incrementally."""
    from test_distributed_torch import launch

    url = f"{s3.url}/killed"
    proc, got = launch(3, when, url, fmt, env={
        "CASES_MODULE": "incremental_kill_cases", "MASTER_PORT": _free_port(),
        "S3_OPTIONS": json.dumps(s3.storage_options)})
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    killed = 0 if when in ("write0", "prune") else 1
    step = 5 if when == "prune" else 4
    ranks = got.get(when, {})
    assert sorted(ranks) == sorted({0, 1, 2} - {killed}), output
    for rank, r in ranks.items():
        assert r.get("error") == "DistributedError", (rank, r, output)
        assert f"save:{url}/ckpt-{step}.{fmt}:" in r["message"], r
        assert "rank 1 was killed" in r["message"] or "c10d store failed" in r["message"], r
        if when == "prune":  # rank 0 died after the commit: the step is whole, and said
            assert f"{url}/ckpt-{step}.{fmt} was committed" in r["notes"], r
    loc = s3.location("killed")
    names = list_committed_steps(loc)
    latest = step if when == "prune" else step - 1
    assert f"ckpt-{latest}.{fmt}" in names and f"ckpt-{latest + 1}.{fmt}" not in names, names
    said = _gc(url, s3)
    assert list_committed_steps(loc) == names, said  # gc removes no committed step
    left = {o.key.split("/")[0] for o in loc.list()}
    assert left == {n for name in names for n in (name, f"{name}.commit")}, (left, said)
    _continue(s3, url, fmt, [(3, latest + 1, latest + 2)])
