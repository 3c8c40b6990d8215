"""The README's demo runs end to end (so the first set-up command never rots)."""

from __future__ import annotations

import os
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


def test_demo_keeps_its_files_and_prints_commands_that_work(tmp_path: Path) -> None:
    """Without WORKDIR the demo keeps its temporary directory (the commands it prints
    next read it), and its int64 step counter is not trainable."""
    env = {"TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py")],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ckptvar-demo-")]
    assert len(kept) == 1 and (kept[0] / "runs" / "ckpt-1.h5").is_file(), proc.stdout
    assert f"the files stay in {kept[0]}" in proc.stdout
    assert "step                   int64    ()        8 B  no" in proc.stdout
    commands = [line.strip() for line in proc.stdout.splitlines()
                if line.startswith("  ckpt ")]
    assert len(commands) == 4, proc.stdout
    for command in commands:
        args = command.split()[1:]
        run = subprocess.run([sys.executable, "-m", "ckptvar", *args],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, (command, run.stderr)
