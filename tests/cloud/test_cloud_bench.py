"""The cloud workload (``python -m benchmarks.cloud``, or ``scripts/bench.py --only cloud``)
runs in quick mode, starting its own moto server, and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_cloud_workload_reports_every_figure() -> None:
    pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cloud", "--quick", "--json"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    )
    f = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("save_ratio", "load_ratio", "save_gib_s", "load_gib_s", "put_gib_s",
                 "get_ranges_gib_s"):
        assert f[name] > 0, name
    # the lazy read of one value moves that value and little else, in one GET
    assert f["lazy_read_gets"] == 1 and f["lazy_read_other"] == 0
    assert f["lazy_value_mib"] <= f["lazy_read_mib"] <= f["lazy_value_mib"] + 1 / 16
    assert f["load_peak_extra_mib"] > 0 and f["save_peak_extra_mib"] >= 0


def test_scripts_bench_runs_the_cloud_workload() -> None:
    pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    out = subprocess.run(
        [sys.executable, "scripts/bench.py", "--quick", "--only", "cloud"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    )
    assert "cloud:" in out.stdout and "lazy" in out.stdout and "load" in out.stdout


@pytest.mark.slow
def test_the_incremental_workload_on_s3_reports_uploaded_bytes(tmp_path: Path) -> None:
    """``python -m benchmarks.incremental --quick --s3 --json``: the rows on a moto server
    it starts; a Zarr frozen-backbone step uploads about what changed (server-side copies),
    an HDF5 one too (its object holds only the changed values)."""
    pytest.importorskip("moto.server", reason="needs moto[server] (test extra)")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental", "--quick", "--s3", "--json",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=True, cwd=ROOT,
    )
    rows = {(r["format"], r["workload"]): r for r in json.loads(out.stdout)}
    assert len(rows) == 8 and all(r["place"] == "s3" for r in rows.values())
    zarr, h5 = rows["zarr", "frozen"], rows["h5", "frozen"]
    assert zarr["written_over_changed"] <= 1.10, zarr
    assert h5["written_over_changed"] <= 1.10, h5  # the object holds only what changed
    for r in rows.values():
        assert r["full"]["written"] >= r["state"] and r["restore_ratio"] > 0
