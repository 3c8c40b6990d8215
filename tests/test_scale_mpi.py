"""One checkpoint written by N processes, restored on M (real ``mpiexec``), and its faults.

The rank-side code is tests/mpi/scale_cases.py. Saves run with N = 1..4 in both
formats; restores with M = 1..4 read every one of them (each rank checks its own
shard of an uneven row split, a column split, a value with a zero-size shard and a
replicated value).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

import ckptvar as cv
from ckptvar.errors import CorruptCheckpointError

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")

CASES = str(Path(__file__).parent / "mpi" / "scale_cases.py")


def _run(n: int, *args: str, timeout: float = 90) -> dict[str, dict[int, dict]]:
    _proc, got, _ = run_mpi(n, CASES, *args, timeout=timeout)
    crash = got.get("crash")
    assert crash is None, crash
    return got


@pytest.fixture(scope="module")
def saved() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptvar-scale-") as d:
        for n in (1, 2, 3, 4):
            got = _run(n, "save", d)
            for suffix in (".h5", ".zarr"):
                assert sorted(got[f"save{suffix}"]) == list(range(n))
                assert all(r["ok"] for r in got[f"save{suffix}"].values())
        yield Path(d)


@pytest.mark.parametrize("m", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow)])
def test_restore_every_n_on_m(saved: Path, m: int) -> None:
    got = _run(m, "restore", str(saved), "1", "2", "3", "4")
    for n in (1, 2, 3, 4):
        for suffix in (".h5", ".zarr"):
            ranks = got[f"restore{n}{suffix}"]
            assert sorted(ranks) == list(range(m))
            for r in ranks.values():
                assert r["ok"], (n, m, suffix, r)
                assert r["counter"] == 1


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_one_process_sees_the_logical_values(saved: Path, suffix: str) -> None:
    path = saved / "n4" / f"ckpt-1{suffix}"
    values = cv.load(path)
    assert values["w"].shape == (37, 5) and values["z"].shape == (3, 2)
    # bfloat16 keeps its name through the plan and the index (not a bare 2-byte void)
    assert values["h"].dtype == ml_dtypes.bfloat16
    h = (np.arange(36) * 3 + 1).astype(ml_dtypes.bfloat16).reshape(9, 4)
    assert np.array_equal(values["h"].view("u2"), h.view("u2"))
    expected = (np.arange(37 * 5) * 3 + 1).astype("float32").reshape(37, 5)
    assert np.array_equal(values["w"], expected)
    assert np.array_equal(values["b"], np.arange(4, dtype="float32") + 0.5)
    with cv.open(path) as reader:
        assert np.array_equal(reader["w"][5:30, 1:3], expected[5:30, 1:3])
    # the replicated value is written by one process only
    index_boxes = [k for k in reader.stored_boxes("b")]
    assert len(index_boxes) == 1


def test_missing_and_damaged_slice_files_name_variable_and_file(saved: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ckpt-1.h5"
    shutil.copytree(saved / "n2" / "ckpt-1.h5", copy)
    (copy / "rank-00001.h5").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank-00001\.h5") as info:
        cv.load(copy)
    assert "Variable" in str(info.value)
    shutil.rmtree(copy)
    shutil.copytree(saved / "n2" / "ckpt-1.h5", copy)
    data = bytearray((copy / "rank-00000.h5").read_bytes())
    ref = cv.load(saved / "n2" / "ckpt-1.h5")
    needle = ref["w"][:18].tobytes()[:64]
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 8] ^= 0xFF
    (copy / "rank-00000.h5").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*rank-00000\.h5"):
        cv.load(copy)


@pytest.mark.parametrize("kind", [  # a slow rank: test_distributed_mpi's default test
    "raise", pytest.param("slow", marks=pytest.mark.slow), "bgraise"])
def test_a_failing_rank_fails_every_rank_and_commits_nothing(tmp_path: Path, kind: str) -> None:
    got = _run(3, "fault", str(tmp_path), kind, timeout=60)
    results = got["fault"]
    expected = [0, 2] if kind == "slow" else [0, 1, 2]
    assert sorted(set(results) & set(expected)) == expected
    for rank in expected:
        r = results[rank]
        assert r["ok"], r
        assert "rank 1" in r["error"]
        if kind == "slow":
            assert r["timeout"] and r["seconds"] < 5
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_state.json", "ckpt-1.h5"]
    assert not [p for p in run.iterdir() if p.name.endswith(".partial")]
    assert cv.latest_checkpoint(run) == str(run / "ckpt-1.h5")
    values = cv.load(run / "ckpt-1.h5")
    assert np.array_equal(values["w"], (np.arange(37 * 5) * 3 + 1).astype("float32").reshape(37, 5))


def test_a_rank_killed_mid_write_hangs_nobody_and_commits_nothing(tmp_path: Path) -> None:
    # mpich usually ends the survivors itself; a survivor left alive raises within 2 s
    proc, got, _ = run_mpi(3, CASES, "fault", str(tmp_path), "kill", timeout=60)
    assert proc.returncode != 0
    for r in got.get("fault", {}).values():
        assert r["ok"] and "rank 1" in r["error"], r
    run = tmp_path / "run"
    assert not [p for p in run.iterdir() if p.name.startswith("ckpt-2")]
    assert cv.latest_checkpoint(run) == str(run / "ckpt-1.h5")
    assert sorted(cv.load(run / "ckpt-1.h5")) == ["b", "e", "h", "save_counter", "w", "z"]


@pytest.mark.parametrize("kind", ["uncovered", "missing"])
def test_a_restore_failing_on_one_rank_changes_nothing_anywhere(saved: Path, kind: str) -> None:
    got = _run(2, "badrestore", str(saved), kind)
    for rank in (0, 1):
        r = got["bad"][rank]
        assert r["ok"], r
        assert "rank 1" in r["error"]


def test_restore_reads_only_the_overlapping_bytes(tmp_path: Path) -> None:
    _run(4, "big", str(tmp_path))
    for m in (3, 1):
        got = _run(m, "bigread", str(tmp_path))
        for r in got["bigread"].values():
            assert r["ok"], r
            assert r["read"] <= 1.05 * r["needed"] + (1 << 20), r


def test_manager_saver_and_background_saves_on_three_processes(tmp_path: Path) -> None:
    got = _run(3, "manager", str(tmp_path))
    for case in ("manager", "manager_restore", "saver", "background"):
        assert sorted(got[case]) == [0, 1, 2], case
        assert all(r["ok"] for r in got[case].values()), got[case]
    for r in got["manager"].values():
        assert r["kept"] == ["ckpt-2.h5", "ckpt-3.h5"]
        assert r["latest"] == str(tmp_path / "mgr" / "ckpt-3.h5")
        assert [n for n in r["listed"] if n.startswith("ckpt")] == ["ckpt-2.h5", "ckpt-3.h5"]
    assert {r["counter"] for r in got["manager_restore"].values()} == {3}
    assert cv.latest_checkpoint(tmp_path / "saver") == str(tmp_path / "saver" / "model-7.h5")


@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_ckpt_verify_counts_every_box_checked(saved: Path, suffix: str) -> None:
    import subprocess
    import sys

    path = saved / "n4" / f"ckpt-1{suffix}"
    proc = subprocess.run([sys.executable, "-m", "ckptvar.cli", "verify", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    assert "without a stored checksum" not in proc.stdout  # every box has its checksum
