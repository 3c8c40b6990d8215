"""The README's demo runs end to end (so the first set-up command never rots)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_shows_what_it_saved(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # in order: a variable, both formats saved, restore-as-init, a lazy read, ckpt inspect
    marks = ["<cv.Variable 'v'", "ckpt-1.h5", "final.zarr", "same output",
             "lazy read of one row", "KEY", "model/layers/1/bias"]
    positions = [out.find(m) for m in marks]
    assert all(p >= 0 for p in positions), out
    assert positions == sorted(positions), out
    assert (tmp_path / "runs" / "ckpt-1.h5").is_file()
    assert (tmp_path / "final.zarr" / "zarr.json").is_file()
