"""Commit by marker, on a local directory and on a real local S3 server (moto)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ckptvar as cv
from ckptvar.errors import CheckpointExistsError
from ckptvar.locations import (
    LocalLocation,
    Location,
    clean_uncommitted,
    commit,
    is_committed,
    latest_committed_step,
    list_committed_steps,
    marker_key,
    prune,
    read_commit,
    step_number,
)

from ._s3 import S3Bucket


@pytest.fixture(params=["local", "s3"])
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "local":
        return LocalLocation(tmp_path / "root")
    return request.getfixturevalue("s3").location()


def _write_step(loc: Location, step: str, payload: bytes) -> None:
    """A two-object step (data then index), like a directory checkpoint."""
    loc.put(f"{step}/data.bin", payload)
    loc.put(f"{step}/index.json", b'{"n": %d}' % len(payload))


def test_step_number() -> None:
    assert step_number("run/ckpt-12.h5") == 12
    assert step_number("step_00000003") is None  # a step is named PREFIX-N: the dash
    assert step_number("ckpt-3.h5.0a1b2c") == 3
    assert step_number("notes.txt") is None


def test_only_committed_steps_are_listed(loc: Location) -> None:
    _write_step(loc, "run/ckpt-1.zarr", b"one")
    _write_step(loc, "run/ckpt-2.zarr", b"two")
    loc.put("run/ckpt-10.h5", b"ten")
    assert list_committed_steps(loc, "run") == []
    commit(loc, "run/ckpt-1.zarr", "crc32c:00000001")
    commit(loc, "run/ckpt-10.h5", "crc32c:0000000a")
    assert list_committed_steps(loc, "run") == ["run/ckpt-1.zarr", "run/ckpt-10.h5"]
    assert latest_committed_step(loc, "run") == "run/ckpt-10.h5"
    assert is_committed(loc, "run/ckpt-1.zarr", "crc32c:00000001")
    assert not is_committed(loc, "run/ckpt-2.zarr")
    with pytest.raises(cv.CorruptCheckpointError, match=r"ckpt-1\.zarr.*crc32c:00000001"):
        is_committed(loc, "run/ckpt-1.zarr", "crc32c:ffffffff")
    record = read_commit(loc, "run/ckpt-10.h5")
    assert record is not None and record.data == "run/ckpt-10.h5"


def test_commit_needs_data_first(loc: Location) -> None:
    with pytest.raises(cv.CkptError, match=r"no data at .*ckpt-4\.h5"):
        commit(loc, "ckpt-4.h5", "crc32c:0")
    assert not loc.exists(marker_key("ckpt-4.h5"))


def test_second_commit_of_a_step_raises_naming_it(loc: Location) -> None:
    loc.put("ckpt-5.h5", b"data")
    first = commit(loc, "ckpt-5.h5", "crc32c:1")
    with pytest.raises(CheckpointExistsError, match=r"ckpt-5\.h5 is already committed"):
        commit(loc, "ckpt-5.h5", "crc32c:2")
    assert read_commit(loc, "ckpt-5.h5") == first
    # The same writer retrying (its first response lost) finds its own marker: success.
    assert commit(loc, "ckpt-5.h5", "crc32c:1", writer=first.writer) == first


def test_prune_deletes_marker_then_data(loc: Location) -> None:
    _write_step(loc, "ckpt-1.zarr", b"one")
    commit(loc, "ckpt-1.zarr", "c1")
    loc.put("ckpt-2.h5.attempt-b", b"two")
    commit(loc, "ckpt-2.h5", "c2", data="ckpt-2.h5.attempt-b")
    prune(loc, "ckpt-1.zarr")
    prune(loc, "ckpt-2.h5")
    assert loc.list() == [] and list_committed_steps(loc) == []


def test_damaged_marker_is_corrupt(loc: Location) -> None:
    loc.put("ckpt-1.h5", b"x")
    loc.put(marker_key("ckpt-1.h5"), b"{not json")
    with pytest.raises(cv.CorruptCheckpointError, match=r"ckpt-1\.h5\.commit"):
        is_committed(loc, "ckpt-1.h5")


def test_clean_uncommitted_older_than_latest(loc: Location) -> None:
    _write_step(loc, "ckpt-1.zarr", b"failed save")  # leftover, older than latest
    loc.put("ckpt-2.h5", b"committed")
    commit(loc, "ckpt-2.h5", "c2")
    loc.put("ckpt-3.h5.attempt-a", b"committed elsewhere")
    commit(loc, "ckpt-3.h5", "c3", data="ckpt-3.h5.attempt-a")
    loc.put("ckpt-3.h5.attempt-b", b"a loser's leftover, same step")
    _write_step(loc, "ckpt-4.zarr", b"a save in flight")
    loc.put("README", b"not a step")
    removed = clean_uncommitted(loc)
    # the loser's bytes at the latest step go too: no save can commit that step any more
    assert removed == ["ckpt-1.zarr", "ckpt-3.h5.attempt-b"]
    keys = {o.key for o in loc.list()}
    assert "ckpt-4.zarr/data.bin" in keys and "ckpt-3.h5.attempt-a" in keys and "README" in keys
    assert not any(k.startswith("ckpt-1.zarr") for k in keys)
    assert list_committed_steps(loc) == ["ckpt-2.h5", "ckpt-3.h5"]


def _racer(
    loc: Location, step: str, name: str, results: dict[str, object], go: threading.Barrier
) -> None:
    data = f"{step}.attempt-{name}"
    loc.put(data, name.encode() * 1000)  # each writer's bytes under its own key
    go.wait(timeout=30)
    try:
        results[name] = commit(loc, step, f"crc32c:{name}", data=data, writer=name)
    except CheckpointExistsError as exc:
        results[name] = exc
        loc.delete(data)  # the loser removes its own bytes


def test_commit_race_threads(s3: S3Bucket) -> None:
    loc = s3.location()
    for round_ in range(5):
        step = f"ckpt-{round_}.h5"
        results: dict[str, object] = {}
        go = threading.Barrier(2)
        threads = [
            threading.Thread(target=_racer, args=(loc, step, n, results, go)) for n in ("a", "b")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errors = [r for r in results.values() if isinstance(r, CheckpointExistsError)]
        winners = [n for n, r in results.items() if not isinstance(r, Exception)]
        assert len(winners) == 1 and len(errors) == 1, results
        assert step in str(errors[0])
        record = read_commit(loc, step)
        assert record is not None and record.writer == winners[0]
        assert loc.read(record.data) == winners[0].encode() * 1000
    assert [o.key for o in loc.list() if "attempt" in o.key] == [
        read_commit(loc, f"ckpt-{i}.h5").data
        for i in range(5)  # type: ignore[union-attr]
    ]


_PROCESS_RACER = r"""
import sys, time
from ckptvar.locations import open_location, commit
from ckptvar.errors import CheckpointExistsError
url, name, start_at, endpoint = sys.argv[1:5]
opts = {"endpoint": endpoint, "access_key_id": "t", "secret_access_key": "t",
        "region": "us-east-1", "allow_http": True, "timeout": "30s"}
loc = open_location(url, storage_options=opts)
loc.put(f"ckpt-7.h5.attempt-{name}", name.encode() * 100)
while time.time() < float(start_at):
    time.sleep(0.001)
try:
    commit(loc, "ckpt-7.h5", f"crc32c:{name}", data=f"ckpt-7.h5.attempt-{name}", writer=name)
    print("WON")
except CheckpointExistsError as e:
    print("LOST", e)
"""


def test_commit_race_processes(s3: S3Bucket) -> None:
    import time

    start_at = str(time.time() + 4.0)  # both processes are up and have written their data
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS_RACER, s3.url, name, start_at, s3.endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        for name in ("p", "q")
    ]
    outs = {}
    for name, p in zip(("p", "q"), procs, strict=True):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs[name] = out.strip()
    assert sorted(o.split()[0] for o in outs.values()) == ["LOST", "WON"], outs
    winner = next(n for n, o in outs.items() if o == "WON")
    loser_msg = next(o for o in outs.values() if o.startswith("LOST"))
    assert "ckpt-7.h5 is already committed" in loser_msg and f"writer {winner}" in loser_msg
    record = read_commit(s3.location(), "ckpt-7.h5")
    assert record is not None and record.writer == winner
    assert s3.location().read(record.data) == winner.encode() * 100
