"""The cloud benchmark runs (small) and reports every figure; the full 256 MiB run is manual:
``python -m ckptvar.storage.location.bench --size-mib 256``."""

from __future__ import annotations

import subprocess
import sys

from ckptvar.storage.location.bench import bench_checkpoints, bench_cloud


def test_bench_cloud_reports_ratios(moto_endpoint: str) -> None:
    figures = bench_cloud(moto_endpoint, size_mib=16, repeat=1)
    for name in ("read_ratio", "upload_ratio", "read_split_ratio"):
        assert figures[name] > 0
    assert figures["size_mib"] == 16


def test_bench_cloud_command_starts_its_own_server() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptvar.storage.location.bench",
            "--size-mib",
            "8",
            "--repeat",
            "1",
            "--no-split",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert "read   layer" in out.stdout and "upload layer" in out.stdout


def test_bench_checkpoints_reports_ratios_and_memory(moto_endpoint: str) -> None:
    figures = bench_checkpoints(moto_endpoint, size_mib=4, repeat=1)
    for name in ("save_ratio", "load_ratio", "save_gib_s", "load_gib_s"):
        assert figures[name] > 0
    # loading 4 MiB of values raises the peak resident set by at least that much
    assert figures["load_peak_extra_mib"] >= 4
