"""Row deltas written by several processes (``mpiexec``): each process's box of a table
trained by ``scatter_update`` (and, in HDF5, a partitioned variable every process
holds, in its writer's file) is stored in its own file as a delta on the same process's
file in the base step; a step adds about its changed rows on disk; every step restores
bit-exact on the same number of processes and on another, and loads in one plain
process; ``ckpt inspect/verify/convert`` read it unaware; pruning keeps what a kept
step refers to; a process failing mid-save commits nothing and loses no row; a damaged
patch is refused, named.

The jobs are tests/mpi/row_delta_cases.py (real processes, each run with a timeout).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
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

CASES = Path(__file__).parent / "mpi" / "row_delta_cases.py"
_spec = importlib.util.spec_from_file_location("row_delta_cases", CASES)
assert _spec is not None and _spec.loader is not None
cases: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

ROW_BYTES = cases.WIDTH * 4
TABLE = cases.ROWS * ROW_BYTES


def _run(n: int, mode: str, d: Path, fmt: str) -> dict[int, dict[str, Any]]:
    proc, got, _ = run_mpi(n, str(CASES), mode, str(d), fmt, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(got.get(mode, {})) == list(range(n)), (proc.stdout, proc.stderr)
    assert all(r["ok"] for r in got[mode].values())
    return got[mode]


def _patches(n: int, step: int) -> list[int]:
    """The patches each process's box has at ``step`` (step 4 leaves process 2 of 3
    untouched: its delta is carried over, no patch of its own)."""
    return [step - 1 - (n == 3 and r == 2 and step >= 4) for r in range(n)]


@pytest.mark.parametrize("n, other", [(3, 2), pytest.param(2, 3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_row_deltas_of_several_processes(tmp_path: Path, fmt: str, n: int, other: int) -> None:
    d = tmp_path / "run"
    saved = _run(n, "save", d, fmt)
    suffix = f".{fmt}"
    r0 = saved[0]
    sizes = {int(k): v for k, v in r0["sizes"].items()}
    assert sizes[1] > TABLE  # the first step is written whole
    for step in (2, 3, 4, 5):  # a step adds about its changed rows, not the table
        changed = cases.touched(step).size * ROW_BYTES
        if fmt == "h5":
            changed += cases.part_touched(step).size * ROW_BYTES
        assert sizes[step] <= 1.10 * changed + n * (12 << 10), (step, sizes[step], changed)
        assert sizes[step] < TABLE / 30, (step, sizes[step])
        assert _split(r0["deltas"][str(step)], fmt, step) == {
            f"rank-{r:05d}{suffix}": {f"table/.box/{r}": p}
            for r, p in enumerate(_patches(n, step))}, step
    assert all(not keys for keys in r0["deltas"]["1"].values())
    # process 1 failed while writing step 6: nothing committed, nothing left over; the
    # save again is a delta whose patches hold step 6's rows (restored bit-exact below)
    assert saved[1]["failed"] == "OSError"
    assert {saved[r]["failed"] for r in range(n) if r != 1} == {"DistributedError"}
    after = r0["after_failure"]
    assert after["listed"] == [f"ckpt-4{suffix}", f"ckpt-5{suffix}"]
    assert not [x for x in after["on_disk"] if "ckpt-6" in x or x.endswith(".partial")]
    assert r0["retried"] == f"ckpt-6{suffix}"
    assert _split(r0["retried_deltas"], fmt, 6) == {
        f"rank-{r:05d}{suffix}": {f"table/.box/{r}": p} for r, p in enumerate(_patches(n, 6))}
    kept = [d / f"ckpt-5{suffix}", d / f"ckpt-6{suffix}"]
    for r in saved.values():  # every listed step restores bit-exact on these processes
        assert r["restored"] == {p.name: True for p in kept}
    _check_one_process(kept, fmt, n)
    _check_pruned(d, kept, fmt)
    _check_plain(kept[1], fmt)

    standalone = tmp_path / f"standalone{suffix}"
    damaged, named = _damage(kept[1], fmt)
    inspected, as_json, *verified, converted, refused = ckpt_processes(
        ("inspect", kept[1]), ("inspect", "--json", kept[1]), *(("verify", p) for p in kept),
        ("convert", kept[1], standalone), ("verify", damaged))
    for proc in (inspected, as_json, *verified, converted):
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert refused.returncode != 0 and named in refused.stdout, refused.stdout + refused.stderr
    assert (f"table  base in ckpt-1{suffix}  5 patch(es)" in inspected.stdout
            and f"in {n} box(es)" in inspected.stdout), inspected.stdout
    deltas = json.loads(as_json.stdout)["deltas"]
    assert deltas["table"]["base"] == f"ckpt-1{suffix}" and deltas["table"]["boxes"] == n
    assert deltas["table"]["rows"] == sum(cases.touched(s).size for s in range(2, 7))
    if fmt == "h5":  # the partitioned variable: one box, in its writer's file
        assert deltas["part"]["boxes"] == 1 and deltas["part"]["patches"] == 5

    # on another number of processes: every listed step restores bit-exact (resharded)
    for r in _run(other, "restore", d, fmt).values():
        assert r["restored"] == {p.name: True for p in kept}

    cv.storage.remove_path(d)  # `ckpt convert` wrote a standalone copy
    with cv.open(standalone) as reader:
        assert not reader.deltas()
        assert np.array_equal(reader.read("table"), cases.expected(6))
        if fmt == "h5":
            assert np.array_equal(reader.read("part"), cases.expected_part(6))


@pytest.mark.parametrize("fmt", ["h5", "zarr"])
def test_incremental_options_rule_each_processs_file(tmp_path: Path, fmt: str) -> None:
    """``IncrementalOptions(max_patches=2, whole_every=4)`` with a coordinator: each
    process's box merges its patches past two, and the fifth step is written whole in
    every process's file (no delta, nothing shared); the kept steps restore bit-exact."""
    got = _run(3, "options", tmp_path / "run", fmt)
    r0 = got[0]
    files = [f"rank-{r:05d}.{fmt}" for r in range(3)]
    boxes = {int(step): {f: {k: p for k, p in keys.items() if k.startswith("table/")}
                         for f, keys in per_file.items()}
             for step, per_file in r0["deltas"].items()}

    def each(*patches: int) -> dict[str, dict[str, int]]:
        return {f: ({f"table/.box/{r}": p} if p else {})
                for r, (f, p) in enumerate(zip(files, patches, strict=True))}

    assert boxes[1] == each(0, 0, 0)
    assert boxes[2] == each(1, 1, 1)
    assert boxes[3] == each(2, 2, 2)
    # a third patch is one too many: merged into one (process 2's box, untouched at
    # step 4, carries its two over)
    assert boxes[4] == each(1, 1, 2)
    assert boxes[5] == each(0, 0, 0)  # whole_every=4: the fifth save since the first
    assert r0["shared"]["1"] == {} and r0["shared"]["5"] == {}
    assert list(r0["shared"]["2"]) == files
    if fmt == "zarr":  # each process's file names the same process's file of the step
        # whose patch it links (a Zarr step names the step, an HDF5 one its file)
        assert r0["shared"]["3"] == {f: {f"table/.box/{r}": ["ckpt-2.zarr"]}
                                     for r, f in enumerate(files)}
    assert r0["listed"] == [f"ckpt-4.{fmt}", f"ckpt-5.{fmt}"]
    for r in got.values():
        assert r["restored"] == {f"ckpt-4.{fmt}": True, f"ckpt-5.{fmt}": True}


def _split(deltas: dict[str, dict[str, int]], fmt: str, step: int) -> dict[str, dict[str, int]]:
    """``deltas`` (per process file, key -> patches) without ``part``, checked apart: in
    HDF5 runs, the partitioned variable is a delta with a patch per step since the first
    in the one file that holds it (its writer's)."""
    holders = [f for f, keys in deltas.items() if "part/.box/0" in keys]
    if fmt == "h5":
        assert len(holders) == 1 and deltas[holders[0]]["part/.box/0"] == step - 1, deltas
    return {f: {k: p for k, p in keys.items() if k != "part/.box/0"}
            for f, keys in deltas.items()}


def _check_one_process(kept: list[Path], fmt: str, n: int) -> None:
    """Every kept step loads bit-exact in one plain process (``cv.load``), and ``cv.open``
    reads a slice across the boxes, each delta assembled."""
    for p in kept:
        step = cv.checkpoint.parse_step_name(p.name).step
        got = cv.load(p)
        assert np.array_equal(got["table"], cases.expected(step)), p.name
        if fmt == "h5":
            assert np.array_equal(got["part"], cases.expected_part(step)), p.name
    with cv.open(kept[1]) as reader:
        assert isinstance(reader, cv.storage.SupportsDeltas)
        assert reader.deltas()["table"]["boxes"] == n
        assert np.array_equal(reader["table"][5000:9000], cases.expected(6)[5000:9000])


def _check_pruned(d: Path, kept: list[Path], fmt: str) -> None:
    """HDF5: the steps holding the kept steps' bases and patches stay on disk (not
    listed) until no kept step refers to them; Zarr: the kept steps took their bases
    and patches by hard link, so the pruned steps are gone."""
    if fmt == "zarr":
        assert sorted(p.name for p in d.glob("ckpt-*")) == [p.name for p in kept]
        return
    state = json.loads((d / "checkpoint_state.json").read_text())
    held = {e["path"]: e["held_for"] for e in state["sections"]["ckpt"]["pending_delete"]}
    for old in ("ckpt-1.h5", "ckpt-2.h5", "ckpt-3.h5", "ckpt-4.h5"):  # base, patches 0-2
        assert set(held[old]) >= {p.name for p in kept}, (old, held)
        assert (d / old).is_dir()


def _check_plain(step: Path, fmt: str) -> None:
    """Plain h5py / zarr-python: process 1's box is a group holding ``base`` (HDF5: an
    external link to the base step's file of the same process) and ``patch-N``."""
    lo, hi = cases._box(1, len(list(step.glob("rank-*"))))
    original = cases.expected(1)[lo:hi]
    if fmt == "h5":
        with h5py.File(step / "rank-00001.h5", "r") as f:
            group = f["table/%2Ebox/1"]
            assert group.get("base", getlink=True).filename == "../ckpt-1.h5/rank-00001.h5"
            assert np.array_equal(group["base"][()], original)  # h5py follows the link
            assert sorted(group) == ["base", *(f"patch-{j}" for j in range(5))]
    else:
        group = zarr.open_group(step / "rank-00001.zarr", mode="r")["table/%2Ebox/1"]
        assert np.array_equal(group["base"][:], original)
        assert sorted(group.array_keys()) == ["base", *(f"patch-{j}" for j in range(5))]


def _damage(step: Path, fmt: str) -> tuple[Path, str]:
    """A copy of ``step`` beside it (so an HDF5 copy's links still resolve) with a byte
    flipped in process 1's own patch: ``cv.load`` refuses it, naming the value, the patch
    and the file. Returns the copy and how a refusal names the patch."""
    copy = step.parent / f"damaged.{fmt}"
    shutil.copytree(step, copy)
    own = copy / f"rank-00001.{fmt}"
    with cv.open(own) as r:
        f, path, offset, n, _ = r.record.deltas["table/.box/1"].patches[-1]
    assert f == ""  # the step's own patch
    if fmt == "h5":
        target, at, named = own, offset + 8 * n + 3, f"'{path}' in 'rank-00001.h5'"
    else:
        target, at, named = own / path / "c.0", 8 * n + 3, f"'{path}/c.0'"
    with open(target, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    said = rf"'table/.box/1' has a row patch {named} that fails its checksum"
    with pytest.raises(cv.CorruptCheckpointError, match=said) as err:
        cv.load(copy)
    assert str(own) in str(err.value)
    return copy, f"row patch {named} that fails its checksum"


@pytest.mark.parametrize("mode", ["restart", "restart_first"])
@pytest.mark.parametrize("fmt", ["h5", pytest.param("zarr", marks=pytest.mark.slow)])
def test_a_restarted_job_of_several_processes_saves_row_deltas(tmp_path: Path,
                                                               fmt: str, mode: str) -> None:
    """A job of 2 processes saves steps 1-3 and ends; a new job (new processes) restores
    with ``restore_or_initialize()`` (``restart_first``: ``ckpt.restore(latest,
    coordinator=)`` before the manager is built): each process's manager learns its own
    restored box, so step 4 adds about its touched rows (a patch on the same process's
    file in step 3's delta) and an unchanged step 5 carries the deltas over; both
    restore bit-exact."""
    d = tmp_path / "run"
    _run(2, "first", d, fmt)
    got = _run(2, mode, d, fmt)
    r0 = got[0]
    assert {r["from"] for r in got.values()} == {f"ckpt-3.{fmt}"}
    suffix = f".{fmt}"
    changed = cases.touched(4).size * ROW_BYTES
    if fmt == "h5":
        changed += cases.part_touched(4).size * ROW_BYTES
    sizes = r0["sizes"]
    assert sizes[f"ckpt-4{suffix}"] <= 1.10 * changed + 2 * (12 << 10), sizes
    assert sizes[f"ckpt-5{suffix}"] < 2 * (12 << 10), sizes
    for name in (f"ckpt-4{suffix}", f"ckpt-5{suffix}"):
        assert _split(r0["deltas"][name], fmt, 4) == {
            f"rank-{r:05d}{suffix}": {f"table/.box/{r}": 3} for r in range(2)}, name
    assert r0["restored"] == {f"ckpt-4{suffix}": True, f"ckpt-5{suffix}": True}
