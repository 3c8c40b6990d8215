"""Host memory, blocking and errors of multi-process saves (real ``mpiexec``, 3 ranks).

The rank code is tests/mpi/save_memory_cases.py: each rank holds a 16 MiB shard.
A blocking save allocates at most 5% of the shard beyond it; background saves through
a manager hold at most one snapshot (a second save waits for the first before taking
its own), and a background failure surfaces on every rank at the next save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed_mpi import _mpi_skip_reason, run_mpi

pytestmark = pytest.mark.skipif(_mpi_skip_reason() is not None, reason=_mpi_skip_reason() or "")

CASES = str(Path(__file__).parent / "mpi" / "save_memory_cases.py")


def test_peak_host_memory_per_rank_and_background_errors(tmp_path: Path) -> None:
    proc, got, _ = run_mpi(3, CASES, str(tmp_path), timeout=120)
    assert "crash" not in got, got["crash"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for case in ("blocking", "background", "bgfail"):
        assert sorted(got[case]) == [0, 1, 2], case
    for r in got["blocking"].values():
        assert r["peak"] <= 0.05 * r["shard"], r  # nothing beyond the shard itself
    for r in got["background"].values():
        assert r["ok"], r  # each save holds the values of its own snapshot
        assert r["peak"] <= 1.05 * r["shard"], r  # one snapshot, never two
    for r in got["bgfail"].values():
        assert r["ok"], r
        assert "rank 1" in r["error"] and "No space left" in r["error"]
        # the failed step's number is given back on every rank: the next save takes it
        assert r["after"].endswith("ckpt-5.h5")
        assert "ckpt-5.h5" in r["kept"] and "ckpt-6.h5" not in r["kept"]
