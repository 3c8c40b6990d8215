"""Pytest entries for the fuzz harnesses in fuzz_targets.py.

- ``-m fuzz`` (opt-in): each target runs under atheris for a bounded number of
  iterations in a subprocess (skipped, with the reason, when atheris is missing).
- Default suite: each harness runs over its seeds and a few hundred deterministic
  single-byte mutations of them without atheris, so the harnesses themselves stay
  working and the allowed-outcomes property is checked on every run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fuzz_targets  # noqa: E402

TARGETS = sorted(fuzz_targets.TARGETS)
ATHERIS = importlib.util.find_spec("atheris") is not None
#: libFuzzer iterations per target in the opt-in run.
RUNS = int(os.environ.get("CKPTVAR_FUZZ_RUNS", "20000"))


@pytest.mark.fuzz
@pytest.mark.skipif(not ATHERIS, reason="atheris is not installed (pip install atheris)")
@pytest.mark.parametrize("target", TARGETS)
def test_atheris_target(target: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "fuzz_targets.py"), target, f"-runs={RUNS}",
         "-max_total_time=300", "-rss_limit_mb=2048", "-timeout=20",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


KNOWN: dict[str, str] = {}


@pytest.mark.parametrize("target", [
    pytest.param(t, marks=pytest.mark.xfail(reason=KNOWN[t], strict=True)) if t in KNOWN else t
    for t in TARGETS
])
def test_harness_on_seeds_and_mutations(target: str) -> None:
    seeds_fn, one = fuzz_targets.TARGETS[target]
    seeds = seeds_fn()
    if not seeds:
        pytest.skip(f"no seed files for {target} in this checkout")
    rng = random.Random(target)
    for seed in seeds:
        one(seed)
        for _ in range(60):
            data = bytearray(seed)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            one(bytes(data))
        one(seed[: rng.randrange(len(seed))])  # truncated
