"""Incremental steps written by several processes (``mpiexec``): each process's file and
each global Zarr chunk refers to the base step's bytes when unchanged; every step loads
on 3 processes, on 2 and in one plain process; ``ckpt verify`` passes; pruning keeps
what a kept step refers to; a process failing mid-save commits nothing.

The jobs are tests/mpi/incremental_cases.py (real processes, each run with a timeout).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import zarr

import ckptvar as cv
from ckpt_runs import ckpt_processes
from test_distributed_mpi import _mpi_skip_reason, run_mpi

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")

CASES = Path(__file__).parent / "mpi" / "incremental_cases.py"
_spec = importlib.util.spec_from_file_location("incremental_cases", CASES)
assert _spec is not None and _spec.loader is not None
cases: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def _run(n: int, mode: str, d: Path, fmt: str) -> dict[int, dict[str, Any]]:
    proc, got, _ = run_mpi(n, str(CASES), mode, str(d), fmt, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(got.get(mode, {})) == list(range(n)), (proc.stdout, proc.stderr)
    assert all(r["ok"] for r in got[mode].values())
    return got[mode]


@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_incremental_steps_of_three_processes(tmp_path: Path, fmt: str) -> None:
    d = tmp_path / "run"
    saved = _run(3, "save", d, fmt)
    suffix = f".{fmt}"
    r0 = saved[0]
    sizes = {int(k): v for k, v in r0["sizes"].items()}
    full = sum(a.nbytes for a in cases.expected(1).values())
    head = cases.expected(1)["head"].nbytes
    box = cases.expected(1)["frozen"].nbytes // 3
    assert sizes[1] > full  # the first step is written whole
    for step in (2, 3, 4):  # only the head changed: bytes written ~ bytes changed
        assert sizes[step] <= 1.10 * head, (step, sizes[step], head)
    assert sizes[5] <= 1.10 * (head + box), (sizes[5], head + box)  # + one process's box
    assert r0["listed"] == [f"ckpt-4{suffix}", f"ckpt-5{suffix}"]
    # rank 1 failed while writing step 6: nothing committed, no leftovers, step 5 intact
    assert saved[1]["failed"] == "OSError"
    assert {saved[r]["failed"] for r in (0, 2)} == {"DistributedError"}
    after = r0["after_failure"]
    assert after["listed"] == [f"ckpt-4{suffix}", f"ckpt-5{suffix}"]
    assert not [n for n in after["on_disk"] if "ckpt-6" in n or n.endswith(".partial")]
    assert r0["retried"] == f"ckpt-6{suffix}"
    # a new manager (no versions known): unchanged values found by their checksums
    # (global Zarr chunks by theirs), only the head written
    assert r0["fresh_size"] <= 1.10 * head, (r0["fresh_size"], head)
    for r in saved.values():  # every listed step restores bit-exact on 3 processes
        assert r["restored"] == {f"ckpt-6{suffix}": True, f"ckpt-7{suffix}": True}

    kept = [d / f"ckpt-6{suffix}", d / f"ckpt-7{suffix}"]
    for p in kept:  # ...in one plain process
        step = cv.checkpoint.parse_step_name(p.name).step
        got = cv.load(p)
        for key, want in cases.expected(step).items():
            assert np.array_equal(got[key], want), (p.name, key)
    standalone = tmp_path / f"standalone{suffix}"
    *verified, listed, converted = ckpt_processes(*(("verify", p) for p in kept), ("ls", d),
                                                  ("convert", kept[1], standalone))
    for proc in (*verified, listed, converted):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    if fmt == "h5":
        _check_h5_holder(d, kept, listed.stdout)
    else:
        _check_zarr_links(d, kept)

    # on 2 processes: every listed step restores bit-exact; a save with this layout
    # cannot refer to the 3-process steps: written whole, and the log says why
    two = _run(2, "restore", d, fmt)
    for r in two.values():
        assert r["restored"] == {f"ckpt-6{suffix}": True, f"ckpt-7{suffix}": True}
        assert r["full_save"] == f"ckpt-8{suffix}"
    assert "was written by 3 processes, this one by 2" in two[0]["said"][0]
    got = cv.load(d / f"ckpt-8{suffix}")
    for key, want in cases.expected(8).items():
        assert np.array_equal(got[key], want), key
    cv.storage.remove_path(d)  # `ckpt convert` wrote a standalone copy
    got = cv.load(standalone)
    for key, want in cases.expected(7).items():
        assert np.array_equal(got[key], want), key


@pytest.mark.slow
def test_a_file_deleted_from_the_latest_step_of_three_processes_is_not_built_on(
        tmp_path: Path) -> None:
    """A file deleted by hand from the latest multi-process Zarr step (an interrupted
    ``rm -r``): a chunk of a box in process 1's own file made every later save fail (process
    1 raised BaseFileLost on the file it linked, the others a DistributedError); now
    process 1 writes its own file of the next step whole and says so (a lost chunk of a
    global array is written again by its writer), the step loads, and the step after it
    refers to it again."""
    d = tmp_path / "run"
    got = _run(3, "lost", d, "zarr")
    for r in got.values():
        assert r["saved"] == ["ckpt-3.zarr", "ckpt-4.zarr"], r
        assert r["restored"] == {"ckpt-3.zarr": True, "ckpt-4.zarr": True}, r
    assert got[0]["said"] == got[2]["said"] == []
    (said,) = got[1]["said"]
    assert said.startswith("Step ckpt-3.zarr: process 1's file rank-00001.zarr is written "
                           "whole: "), said
    assert "ckpt-2.zarr" in said and "uneven/%2Ebox/1/c.0.0" in said, said
    for step in (3, 4):
        loaded = cv.load(d / f"ckpt-{step}.zarr")
        for key, want in cases.expected(step).items():
            assert np.array_equal(loaded[key], want), (step, key)
    box = "rank-00001.zarr/uneven/%2Ebox/1/c.0.0"  # written at 3, linked at 4
    assert (d / "ckpt-3.zarr" / box).stat().st_ino == (d / "ckpt-4.zarr" / box).stat().st_ino


def _check_h5_holder(d: Path, kept: list[Path], listed: str) -> None:
    """The base holds bytes the kept steps refer to (``uneven``, never written again):
    pruned from the list, kept on disk until no kept step refers to it; so does step 5
    (one process's box of ``frozen``), and what a held step refers to is held too."""
    base = d / "ckpt-1.h5"
    assert base.is_dir()
    state = json.loads((d / "checkpoint_state.json").read_text())
    pending = state["sections"]["ckpt"]["pending_delete"]
    held = {e["path"]: e["held_for"] for e in pending}
    assert held["ckpt-5.h5"] == [p.name for p in kept]  # box 1 of frozen, written at 5
    assert held[base.name] == ["ckpt-5.h5", *(p.name for p in kept)]  # held ones too
    with h5py.File(kept[1] / "rank-00001.h5", "r") as f:  # plain h5py follows the link
        link = f["uneven/%2Ebox"].get("1", getlink=True)  # its box 1
        assert link.filename == "../ckpt-1.h5/rank-00001.h5"
        lo, hi = cases.UNEVEN[0], sum(cases.UNEVEN[:2])
        assert np.array_equal(f["uneven/%2Ebox/1"][()], cases.expected(7)["uneven"][lo:hi])
    with cv.open(kept[1]) as reader:
        assert isinstance(reader, cv.storage.SupportsShared)
        assert reader.shared()["uneven"] == [base.name]
        assert reader.shared()["frozen"] == [base.name, "ckpt-5.h5"]  # by box: 1 changed at 5
    line = next(x for x in listed.splitlines() if " ckpt-1.h5 " in x)
    assert "(holds bytes of ckpt-5.h5, ckpt-6.h5, ckpt-7.h5)" in line, listed


def _check_zarr_links(d: Path, kept: list[Path]) -> None:
    """Hard links: the base was pruned and deleted, the kept steps still load (checked
    before); the frozen chunks of processes 0 and 2 are the same files in both steps."""
    assert not (d / "ckpt-1.zarr").exists()
    for chunk in ("frozen/c.0.0", "frozen/c.2.0"):
        assert (kept[0] / chunk).stat().st_ino == (kept[1] / chunk).stat().st_ino
    assert (kept[0] / "frozen/c.1.0").stat().st_nlink == 2  # written at 5, linked at 6, 7
    group = zarr.open_group(kept[1], mode="r")  # plain zarr-python sees the value
    assert np.array_equal(group["frozen"][:], cases.expected(7)["frozen"])


RESIZE = Path(__file__).parent / "mpi" / "incremental_resize_cases.py"


@pytest.mark.slow  # four mpiexec jobs
@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_incremental_steps_go_on_across_world_sizes(tmp_path: Path, fmt: str) -> None:
    """Steps saved by 2 processes, then by 3, 1 and 2 again in one directory, each job
    restoring the latest step (tests/mpi/incremental_resize_cases.py: row deltas of uneven
    boxes, a value changed on one process only, one with no rows on the last process):
    each new world size's first step is written whole (logged), every step on disk,
    listed or held, loads in one process after each save and restores on the job's."""
    d = tmp_path / "run"
    deltas: dict[int, list[str]] = {}
    for n, first, last in [(2, 1, 3), (3, 4, 6), (1, 7, 7), (2, 8, 9)]:
        proc, got, _ = run_mpi(n, str(RESIZE), "run", str(d), fmt, str(first), str(last),
                               timeout=150)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = got["run"]
        assert sorted(ranks) == list(range(n)), proc.stdout + proc.stderr
        for rank, r in ranks.items():
            assert r["restored_ok"] and r["wrong"] == {}, (n, rank, r)
            assert all(v is True for v in r["restores"].values()), (n, rank, r["restores"])
        if first > 1:
            assert any(f"ckpt-{first}.{fmt}: writing every value" in m
                       for m in ranks[0]["said"]), ranks[0]["said"]
        deltas.update({int(k): v for k, v in ranks[0]["deltas"].items()})
    # the table's boxes are patches of the same process's box, but for the first step of a
    # world size (and, in Zarr, where 2 processes' boxes form a grid: a global array)
    patched = {2, 3, 5, 6, 9} if fmt == "h5" else {5, 6}
    assert deltas == {s: ["table"] if s in patched else [] for s in range(1, 10)}, deltas
    assert ranks[0]["listed"] == [f"ckpt-8.{fmt}", f"ckpt-9.{fmt}"]
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("ckpt-")) == [
        f"ckpt-8.{fmt}", f"ckpt-9.{fmt}"]  # nothing of the other layouts is held any more
